//! The response store's side of the state store ([`crate::state`]): a turn as the record the
//! store keeps ([`ResponseStore::record`]), a record brought back into memory
//! ([`ResponseStore::restore`]), and a conversation read back from the store when this gateway
//! does not hold it ([`ResponseStore::fill_from`]: it restarted, or another replica answered
//! the earlier turns).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::store::{MAX_TURNS, Owner, Packed, ResponseStore, StoredTurn, turn_bytes};
use crate::state::{State, StateError, TurnRecord, unix_ms};

impl ResponseStore {
    /// Turn `id` as the state store keeps it, if held.
    pub fn record(&self, id: &str) -> Option<TurnRecord> {
        let s = self.lock();
        let t = s.turns.get(id)?;
        Some(TurnRecord {
            owner: t.owner.0.map(hex::encode),
            parent: t.parent.as_deref().map(str::to_owned),
            items: t.packed.items(),
            inputs: t.inputs,
            response: t.packed.response(),
            held: t.held,
            stored_unix_ms: unix_ms().saturating_sub(t.stored_at.elapsed().as_millis() as u64),
        })
    }

    /// Brings `record` back as turn `id`, unless a turn of that id is held already or the
    /// record is past the age limit (or unreadable). Returns the ids evicted to make room.
    pub fn restore(&self, id: &str, record: TurnRecord) -> Vec<Arc<str>> {
        let age = Duration::from_millis(unix_ms().saturating_sub(record.stored_unix_ms));
        let owner = match record.owner.as_deref().map(hex::decode) {
            None => Owner::NOBODY,
            Some(Ok(b)) => match <[u8; 32]>::try_from(b) {
                Ok(b) => Owner(Some(b)),
                Err(_) => return Vec::new(),
            },
            Some(Err(_)) => return Vec::new(),
        };
        let Some(stored_at) = Instant::now().checked_sub(age) else {
            return Vec::new();
        };
        if age > self.ttl || record.inputs > record.items.len() {
            return Vec::new();
        }
        let packed = Packed::new(&record.items, &record.response);
        let bytes = turn_bytes(id, record.parent.as_deref(), &packed);
        let mut s = self.lock();
        if s.turns.contains_key(id) || bytes > self.max_bytes {
            return Vec::new();
        }
        s.stamp += 1;
        let turn = StoredTurn {
            owner,
            parent: record.parent.map(Arc::from),
            packed,
            inputs: record.inputs,
            held: record.held,
            bytes,
            stored_at,
            stamp: s.stamp,
        };
        s.insert(Arc::from(id), turn);
        let mut evicted = Vec::new();
        while s.bytes > self.max_bytes {
            let Some(victim) = s.victim() else { break };
            s.remove(&victim);
            evicted.push(victim);
        }
        evicted
    }

    /// Reads turn `id` and the turns it continues from `state` into memory, where memory lacks
    /// them (walking back from `id` until a turn memory holds, a first turn, or one the store
    /// lacks). Returns how many came back.
    ///
    /// # Errors
    /// [`StateError`] when the store does not answer.
    pub async fn fill_from(&self, state: &State, id: &str) -> Result<usize, StateError> {
        let mut at = id.to_owned();
        let mut restored = 0;
        for _ in 0..MAX_TURNS {
            let parent = match self.parent_in_memory(&at) {
                Some(parent) => parent,
                None => {
                    let Some(record) = state.turn(&at).await? else {
                        break;
                    };
                    let parent = record.parent.clone();
                    self.restore(&at, record);
                    restored += 1;
                    parent
                }
            };
            match parent {
                Some(p) => at = p,
                None => break,
            }
        }
        Ok(restored)
    }

    /// Forgets these turns in memory only (another gateway deleted them from the store).
    pub fn forget(&self, ids: &[String]) {
        let mut s = self.lock();
        for id in ids {
            s.remove(id);
        }
    }

    /// `Some(parent)` of turn `id` when memory holds it; `None` when it does not.
    fn parent_in_memory(&self, id: &str) -> Option<Option<String>> {
        let s = self.lock();
        s.turns
            .get(id)
            .map(|t| t.parent.as_deref().map(str::to_owned))
    }
}

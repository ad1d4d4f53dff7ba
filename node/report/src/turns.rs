//! The conversation turns a decode node retains (`--kv-retain-after-decode`), reported so that
//! every gateway indexes them ([`RetainedTurns`], read through
//! [`StateSource::subscribe_turns`](crate::StateSource::subscribe_turns)), and how they travel
//! (`pd.registry.v1.RetainedTurns`: bounded resync chunks and deltas).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pd_rpc::registry as pb;
use tokio::sync::broadcast;

/// Most turns one node reports (a gateway indexes at most this many per node).
pub const MAX_RETAINED_TURNS: usize = 65_536;
/// Largest `kv_transfer_params` of one reported turn, in bytes (a longer one is not reported).
pub const MAX_TURN_PARAMS_BYTES: usize = 64 << 10;
/// Most turns in one `RetainedTurns` message.
pub const MAX_TURNS_PER_MESSAGE: usize = 256;
/// Most bytes of params in one `RetainedTurns` message.
pub const MAX_TURN_BYTES_PER_MESSAGE: usize = 1 << 20;

/// One retained turn, as reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetainedTurn {
    /// `remote_lease_id` of the params: names the turn.
    pub lease_id: String,
    /// `remote_last_block_hash` of the params.
    pub last_block_hash: u64,
    /// The `kv_transfer_params` JSON object, as the answer carried it.
    pub params: String,
    /// The chained hash of the prompt's last whole block and the tokens up to it (0, 0: none).
    pub prompt_key: (u64, u32),
}

impl RetainedTurn {
    fn to_pb(&self) -> pb::RetainedTurn {
        pb::RetainedTurn {
            kv_transfer_params: self.params.clone(),
            prompt_last_block_hash: self.prompt_key.0,
            prompt_tokens: self.prompt_key.1,
        }
    }

    fn ended(&self) -> pb::RetainedTurnEnded {
        pb::RetainedTurnEnded {
            lease_id: self.lease_id.clone(),
            last_block_hash: self.last_block_hash,
        }
    }
}

/// One change to the set of retained turns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnEvent {
    /// The node retains this turn now.
    Added(Arc<RetainedTurn>),
    /// This turn's lease ended.
    Removed(Arc<RetainedTurn>),
}

/// Every turn retained at one moment and the changes after it; the same contract as
/// [`crate::BlockSubscription`] (a lagged receiver must take a fresh subscription).
#[derive(Debug)]
pub struct TurnSubscription {
    /// Every turn retained at the moment of subscribing.
    pub turns: Vec<Arc<RetainedTurn>>,
    /// What changed after that moment, in order.
    pub events: broadcast::Receiver<TurnEvent>,
}

/// The turns a node retains, with a bounded change feed for any number of readers: the model is
/// [`crate::StoredBlocks`]. The node calls [`add`](Self::add) when it answers a retained turn
/// and [`remove`](Self::remove) when its lease ends; both take a short mutex and never wait for a
/// reader. At most [`MAX_RETAINED_TURNS`] turns are kept: past it (or for params over
/// [`MAX_TURN_PARAMS_BYTES`]) a turn is not reported.
#[derive(Debug)]
pub struct RetainedTurns {
    turns: Mutex<HashMap<String, Arc<RetainedTurn>>>,
    feed: broadcast::Sender<TurnEvent>,
    cap: usize,
}

impl RetainedTurns {
    /// Default feed capacity: events a reader may fall behind before it must resync.
    pub const DEFAULT_CAPACITY: usize = 4096;

    /// An empty set holding at most [`MAX_RETAINED_TURNS`].
    pub fn new() -> Self {
        Self::with_limits(Self::DEFAULT_CAPACITY, MAX_RETAINED_TURNS)
    }

    /// An empty set whose feed holds `capacity` events and which holds at most `cap` turns.
    pub fn with_limits(capacity: usize, cap: usize) -> Self {
        let (feed, _) = broadcast::channel(capacity.max(1));
        Self {
            turns: Mutex::new(HashMap::new()),
            feed,
            cap,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<RetainedTurn>>> {
        // One insert or remove at a time: a poisoned lock is still consistent.
        self.turns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a retained turn; false when it was already there, is over the bounds, or the
    /// set is full.
    pub fn add(&self, turn: RetainedTurn) -> bool {
        if turn.params.len() > MAX_TURN_PARAMS_BYTES || turn.lease_id.is_empty() {
            return false;
        }
        let mut turns = self.lock();
        if turns.len() >= self.cap || turns.contains_key(&turn.lease_id) {
            return false;
        }
        let turn = Arc::new(turn);
        turns.insert(turn.lease_id.clone(), turn.clone());
        let _ = self.feed.send(TurnEvent::Added(turn));
        true
    }

    /// Records that the lease `lease_id` ended; false when no such turn was recorded.
    pub fn remove(&self, lease_id: &str) -> bool {
        let mut turns = self.lock();
        let Some(turn) = turns.remove(lease_id) else {
            return false;
        };
        let _ = self.feed.send(TurnEvent::Removed(turn));
        true
    }

    /// The lease ids of every turn recorded now.
    pub fn lease_ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Turns recorded now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The snapshot and its feed, taken under the lock the writers publish under.
    pub fn subscribe(&self) -> TurnSubscription {
        let turns = self.lock();
        TurnSubscription {
            turns: turns.values().cloned().collect(),
            events: self.feed.subscribe(),
        }
    }
}

impl Default for RetainedTurns {
    fn default() -> Self {
        Self::new()
    }
}

/// `turns` as a resync: at least one message (the first with `resync`), each within
/// [`MAX_TURNS_PER_MESSAGE`] and [`MAX_TURN_BYTES_PER_MESSAGE`].
pub(crate) fn resync_messages(turns: &[Arc<RetainedTurn>]) -> Vec<pb::RetainedTurns> {
    let mut out = vec![pb::RetainedTurns {
        resync: true,
        ..Default::default()
    }];
    let mut bytes = 0;
    for t in turns {
        let last = out.last_mut().expect("one message at least");
        if last.added.len() >= MAX_TURNS_PER_MESSAGE
            || (bytes + t.params.len() > MAX_TURN_BYTES_PER_MESSAGE && !last.added.is_empty())
        {
            out.push(pb::RetainedTurns::default());
            bytes = 0;
        }
        bytes += t.params.len();
        out.last_mut().expect("pushed").added.push(t.to_pb());
    }
    out
}

/// `first` and up to `max - 1` events already waiting behind it, as deltas in order, within the
/// message bounds; a turn added and removed in one batch is split so each message commutes.
/// Never waits; a lag is left in the feed for the caller's next `recv`.
pub(crate) fn turn_deltas(
    first: TurnEvent,
    events: &mut broadcast::Receiver<TurnEvent>,
    max: usize,
) -> Vec<pb::RetainedTurns> {
    let mut out = vec![pb::RetainedTurns::default()];
    let mut names = std::collections::HashSet::new();
    let mut bytes = 0;
    let mut next = Some(first);
    let mut taken = 0;
    while let Some(event) = next.take() {
        let (turn, added) = match &event {
            TurnEvent::Added(t) => (t, true),
            TurnEvent::Removed(t) => (t, false),
        };
        let size = if added { turn.params.len() } else { 0 };
        let last = out.last_mut().expect("one message at least");
        let full = last.added.len() + last.removed.len() >= MAX_TURNS_PER_MESSAGE
            || (bytes + size > MAX_TURN_BYTES_PER_MESSAGE && !last.added.is_empty());
        if full || names.contains(&turn.lease_id) {
            out.push(pb::RetainedTurns::default());
            names.clear();
            bytes = 0;
        }
        names.insert(turn.lease_id.clone());
        bytes += size;
        let last = out.last_mut().expect("pushed");
        if added {
            last.added.push(turn.to_pb());
        } else {
            last.removed.push(turn.ended());
        }
        taken += 1;
        if taken < max {
            next = events.try_recv().ok();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::broadcast::error::TryRecvError;

    fn turn(lease: &str, bytes: usize) -> RetainedTurn {
        RetainedTurn {
            lease_id: lease.into(),
            last_block_hash: lease.len() as u64,
            params: "x".repeat(bytes),
            prompt_key: (7, 16),
        }
    }

    #[test]
    fn the_set_is_bounded_and_its_feed_starts_after_the_snapshot() {
        let set = RetainedTurns::with_limits(16, 2);
        assert!(set.add(turn("a", 10)));
        assert!(!set.add(turn("a", 10)), "a turn is added once");
        assert!(!set.add(turn("big", MAX_TURN_PARAMS_BYTES + 1)));
        let mut sub = set.subscribe();
        assert_eq!(sub.turns.len(), 1);
        assert!(set.add(turn("b", 10)));
        assert!(!set.add(turn("c", 10)), "full");
        assert!(set.remove("a"));
        assert!(!set.remove("a"));
        assert!(matches!(sub.events.try_recv(), Ok(TurnEvent::Added(t)) if t.lease_id == "b"));
        assert!(matches!(sub.events.try_recv(), Ok(TurnEvent::Removed(t)) if t.lease_id == "a"));
        assert_eq!(sub.events.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(set.lease_ids(), vec!["b".to_string()]);
    }

    #[test]
    fn a_resync_is_split_within_the_bounds_and_only_the_first_says_resync() {
        assert_eq!(
            resync_messages(&[]).len(),
            1,
            "an empty resync still goes out"
        );
        let many: Vec<_> = (0..600)
            .map(|i| Arc::new(turn(&format!("l{i}"), 10)))
            .collect();
        let msgs = resync_messages(&many);
        assert_eq!(
            msgs.iter().map(|m| m.added.len()).collect::<Vec<_>>(),
            vec![256, 256, 88]
        );
        assert!(msgs[0].resync && !msgs[1].resync && !msgs[2].resync);
        let big: Vec<_> = (0..40)
            .map(|i| Arc::new(turn(&format!("l{i}"), 60 << 10)))
            .collect();
        for m in resync_messages(&big) {
            let bytes: usize = m.added.iter().map(|t| t.kv_transfer_params.len()).sum();
            assert!(bytes <= MAX_TURN_BYTES_PER_MESSAGE, "{bytes}");
        }
    }

    #[test]
    fn deltas_keep_order_and_never_name_a_turn_twice_in_one_message() {
        let set = RetainedTurns::new();
        let mut sub = set.subscribe();
        set.add(turn("a", 10));
        set.add(turn("b", 10));
        set.remove("a");
        set.add(turn("c", 10));
        let first = sub.events.try_recv().unwrap();
        let msgs = turn_deltas(first, &mut sub.events, 64);
        let shape: Vec<(usize, usize)> = msgs
            .iter()
            .map(|m| (m.added.len(), m.removed.len()))
            .collect();
        assert_eq!(shape, vec![(2, 0), (1, 1)]);
        assert_eq!(msgs[1].removed[0].lease_id, "a");
        assert_eq!(msgs[0].added[0].prompt_tokens, 16);
        // At most `max` events per call: the rest stays in the feed.
        for i in 0..10 {
            set.add(turn(&format!("m{i}"), 10));
        }
        let first = sub.events.try_recv().unwrap();
        let msgs = turn_deltas(first, &mut sub.events, 4);
        assert_eq!(msgs.iter().map(|m| m.added.len()).sum::<usize>(), 4);
        assert!(sub.events.try_recv().is_ok());
    }
}

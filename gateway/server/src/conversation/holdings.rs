//! [`Holdings`]: which node keeps which finished turn's KV under a retained lease, found by
//! the longest match of a prompt's block hashes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pd_wire::KvTransferParams;

/// A finished turn's KV that a node keeps under a retained lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    /// The node holding it (`remote_engine_id`).
    pub engine_id: Arc<str>,
    /// That node's incarnation (`remote_engine_epoch`; 0 when it did not say): a node restarted
    /// since holds nothing of it.
    pub epoch: u64,
    /// Tokens the blocks hold (`remote_num_tokens`): whole blocks of prompt and answer.
    pub tokens: u32,
    /// Chain hash of the last block held (`remote_last_block_hash`): the key.
    pub last_hash: u64,
    /// When the lease ends (`remote_blocks_expiry_time`).
    pub expires: SystemTime,
    /// The object as the node answered it (`do_remote_decode: true`): what a prefill node is
    /// sent to pull the turn first.
    pub params: KvTransferParams,
    /// Chain hash of the last whole block of the prompt the turn answered, and the tokens up to
    /// it (the partial key; set by the gateway, which hashed that prompt).
    pub prompt_key: Option<(u64, u32)>,
}

/// A holding found for a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    /// Leading blocks of the prompt it covers.
    pub blocks: usize,
    /// Tokens of the prompt it covers.
    pub tokens: u32,
    /// The prompt continues every block held (pullable), not just the answered prompt's.
    pub exact: bool,
    /// The holding.
    pub holding: Holding,
}

impl Holding {
    /// Reads a retained turn's `kv_transfer_params`; `None` for anything else (a handoff to a
    /// decode node, a node too old to name its last block hash).
    pub fn from_params(params: &KvTransferParams) -> Option<Self> {
        if !params.do_remote_decode {
            return None;
        }
        let engine_id: Arc<str> = Arc::from(params.remote_engine_id.as_deref()?);
        let tokens = params.remote_num_tokens?;
        let last_hash = params.remote_last_block_hash?.0;
        let expiry = params.remote_blocks_expiry_time?;
        if tokens == 0 || !expiry.is_finite() || expiry <= 0.0 {
            return None;
        }
        let expires = UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(expiry).ok()?)?;
        params.remote_lease_id.as_ref()?;
        Some(Self {
            engine_id,
            epoch: params.remote_engine_epoch.map_or(0, |e| e.0),
            tokens,
            last_hash,
            expires,
            params: params.clone(),
            prompt_key: None,
        })
    }

    /// Milliseconds until the lease ends (0 once it has), saturated to `u32`.
    pub fn expiry_ms(&self, now: SystemTime) -> u32 {
        let left = self.expires.duration_since(now).unwrap_or(Duration::ZERO);
        u32::try_from(left.as_millis()).unwrap_or(u32::MAX)
    }

    /// The params for a node that pulls this turn and decodes itself (a `whole` route): the
    /// same object as a pull request (`do_remote_prefill: true`). On the holder itself nothing
    /// moves: its prefix cache has the blocks, and it releases its own lease.
    pub fn as_pull(&self) -> KvTransferParams {
        self.params.to_pull()
    }

    /// The params for a prefill node that pulls this turn first, then hands the whole prompt to
    /// `consumers` decode nodes.
    pub fn for_prefill(&self, consumers: u32) -> KvTransferParams {
        let mut p = self.params.to_produce();
        p.num_consumers = (consumers > 1).then_some(consumers);
        p
    }
}

/// Retained turns by the chain hash of their last block, bounded by count (oldest first).
#[derive(Debug)]
pub struct Holdings {
    inner: Mutex<HoldingsInner>,
    cap: usize,
}

#[derive(Debug, Default)]
struct HoldingsInner {
    /// Under its last held block's hash (exact) and its prompt's last block's (partial).
    by_hash: HashMap<u64, Entry>,
    /// Insertion order, with the generation each entry was inserted at (a stale entry of a
    /// removed or replaced hash is skipped).
    order: VecDeque<(u64, u64)>,
    generation: u64,
    /// Holdings (exact keys) indexed.
    holdings: usize,
}

impl Holdings {
    /// An index of at most `cap` holdings.
    pub fn new(cap: usize) -> Self {
        Self {
            inner: Mutex::default(),
            cap: cap.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HoldingsInner> {
        // Plain maps: no invariant a panic elsewhere could break.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holdings indexed now.
    pub fn len(&self) -> usize {
        self.lock().holdings
    }

    /// Whether none is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Indexes `h` (under its last block's hash, and its prompt's last block's when it has
    /// one); returns what it displaced: a holding under the same key, and those evicted to stay
    /// within the bound.
    pub fn insert(&self, h: Holding) -> Vec<Holding> {
        self.insert_as(h, false)
    }

    fn insert_as(&self, h: Holding, reported: bool) -> Vec<Holding> {
        let mut s = self.lock();
        s.generation += 1;
        let generation = s.generation;
        let mut out = Vec::new();
        let mut keys = vec![(h.last_hash, h.tokens, true)];
        if let Some((k, tokens)) = h.prompt_key
            && k != h.last_hash
            && tokens > 0
        {
            keys.push((k, tokens, false));
        }
        let h = Arc::new(h);
        for (key, tokens, exact) in keys {
            let entry = Entry {
                holding: Arc::clone(&h),
                generation,
                tokens,
                exact,
                reported,
            };
            s.holdings += usize::from(exact);
            if let Some(old) = s.by_hash.insert(key, entry)
                && old.exact
            {
                s.holdings -= 1;
                s.unlink(&old.holding, key);
                out.push(Arc::unwrap_or_clone(old.holding));
            }
            s.order.push_back((key, generation));
        }
        while s.holdings > self.cap {
            let Some((k, g)) = s.order.pop_front() else {
                break;
            };
            if s.by_hash
                .get(&k)
                .is_some_and(|e| e.generation == g && e.exact)
                && let Some(old) = s.remove_holding(k)
            {
                out.push(old);
            }
        }
        // Stale order entries (removed keys) are dropped once they outnumber the live ones.
        if s.order.len() > 2 * s.by_hash.len() + 64 {
            let HoldingsInner { by_hash, order, .. } = &mut *s;
            order.retain(|(k, g)| by_hash.get(k).is_some_and(|e| e.generation == *g));
        }
        out
    }

    /// The holding covering the most leading blocks of `hashes` (a prompt's chained block
    /// hashes), and how many expired holdings met on the way were dropped.
    pub fn longest(&self, hashes: &[u64], now: SystemTime) -> (Option<Found>, u32) {
        let mut s = self.lock();
        let mut expired = 0;
        if s.by_hash.is_empty() {
            return (None, 0);
        }
        for (i, h) in hashes.iter().enumerate().rev() {
            let Some(e) = s.by_hash.get(h) else {
                continue;
            };
            if e.holding.expires > now {
                let found = Found {
                    blocks: i + 1,
                    tokens: e.tokens,
                    exact: e.exact,
                    holding: Holding::clone(&e.holding),
                };
                return (Some(found), expired);
            }
            let last = e.holding.last_hash;
            expired += u32::from(s.remove_holding(last).is_some());
            if s.by_hash.get(h).is_some_and(|e| e.holding.expires <= now) {
                s.by_hash.remove(h);
            }
        }
        (None, expired)
    }

    /// Takes the holding keyed `last_hash` out of the index (its turn was used or superseded).
    pub fn remove(&self, last_hash: u64) -> Option<Holding> {
        self.lock().remove_holding(last_hash)
    }

    /// Indexes a turn a node reported (`registry.proto`, `RetainedTurns`) as [`insert`] does,
    /// unless the index already holds that very turn (same key, same lease: captured from the
    /// answer, or reported by the node to this gateway before): one entry per turn, the one
    /// indexed first kept (a captured turn indexed later replaces a reported one: it is then
    /// this gateway's own). Returns what it displaced.
    ///
    /// [`insert`]: Self::insert
    pub fn insert_reported(&self, h: Holding) -> Vec<Holding> {
        {
            let s = self.lock();
            if s.by_hash
                .get(&h.last_hash)
                .is_some_and(|e| e.exact && same_lease(&e.holding, &h))
            {
                return Vec::new();
            }
        }
        self.insert_as(h, true)
    }

    /// Takes the holding keyed `last_hash` out of the index if it is the turn under lease
    /// `lease_id` and, with `reported_only`, known only from a node's report (not captured from
    /// an answer this gateway relayed): a node said that lease ended (`false`: whichever way
    /// it was learned), or it left the view or resynced (`true`: a turn this gateway captured
    /// stays, checked by expiry and epoch as before). Another turn under the same key stays.
    pub fn remove_lease(
        &self,
        last_hash: u64,
        lease_id: &str,
        reported_only: bool,
    ) -> Option<Holding> {
        let mut s = self.lock();
        let e = s.by_hash.get(&last_hash)?;
        if !e.exact
            || e.holding.params.remote_lease_id.as_deref() != Some(lease_id)
            || (reported_only && !e.reported)
        {
            return None;
        }
        s.remove_holding(last_hash)
    }
}

/// The same turn: one node, one lease.
fn same_lease(a: &Holding, b: &Holding) -> bool {
    a.engine_id == b.engine_id
        && a.epoch == b.epoch
        && a.params.remote_lease_id.is_some()
        && a.params.remote_lease_id == b.params.remote_lease_id
}

/// One key of a holding.
#[derive(Debug)]
struct Entry {
    /// Shared by the holding's two keys (exact and partial): one copy of its params.
    holding: Arc<Holding>,
    generation: u64,
    /// Tokens of a prompt that reaches this key.
    tokens: u32,
    /// The holding's own last block (not its prompt's).
    exact: bool,
    /// Known only from a node's report ([`Holdings::insert_reported`]).
    reported: bool,
}

impl HoldingsInner {
    /// Removes the holding whose last block hash is `last_hash`, under both its keys.
    fn remove_holding(&mut self, last_hash: u64) -> Option<Holding> {
        let e = self.by_hash.remove(&last_hash)?;
        if !e.exact {
            // A partial key that is some other holding's: put it back.
            self.by_hash.insert(last_hash, e);
            return None;
        }
        self.holdings -= 1;
        self.unlink(&e.holding, last_hash);
        Some(Arc::unwrap_or_clone(e.holding))
    }

    /// Drops `h`'s partial key if it still names `h` (its exact key `exact_key` is gone).
    fn unlink(&mut self, h: &Holding, exact_key: u64) {
        if let Some((k, _)) = h.prompt_key
            && k != exact_key
            && self
                .by_hash
                .get(&k)
                .is_some_and(|e| !e.exact && e.holding.last_hash == h.last_hash)
        {
            self.by_hash.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn params(engine: &str, tokens: u64, hash: u64, expiry: f64) -> KvTransferParams {
        KvTransferParams::from_value(&raw_params(engine, tokens, hash, expiry)).unwrap()
    }

    fn raw_params(engine: &str, tokens: u64, hash: u64, expiry: f64) -> Value {
        json!({
            "do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": engine, "remote_engine_epoch": "00000000000000ab",
            "remote_block_ids": [1, 2], "remote_request_id": "cmpl-1",
            "remote_host": "127.0.0.1", "remote_port": 7000,
            "remote_num_tokens": tokens, "remote_lease_id": "0123456789abcdef0123456789abcdef",
            "remote_lease_generation": 1, "remote_blocks_expiry_time": expiry,
            "remote_last_block_hash": format!("{hash:016x}"),
        })
    }

    fn in_a_minute() -> f64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            + 60.0
    }

    #[test]
    fn reads_a_retained_turn_and_nothing_else() {
        let h = Holding::from_params(&params("d1", 32, 0xfeed, in_a_minute())).unwrap();
        assert_eq!(&*h.engine_id, "d1");
        assert_eq!((h.tokens, h.last_hash, h.epoch), (32, 0xfeed, 0xab));
        assert!(h.expiry_ms(SystemTime::now()) > 50_000);
        let handoff = params("p1", 32, 1, in_a_minute()).to_pull();
        assert_eq!(Holding::from_params(&handoff), None);
        let mut old_node = params("d1", 32, 1, in_a_minute());
        old_node.remote_last_block_hash = None;
        assert_eq!(Holding::from_params(&old_node), None);
        // The pull forms keep every field and flip the direction.
        assert!(h.as_pull().do_remote_prefill);
        assert_eq!(h.as_pull().remote_lease_id, h.params.remote_lease_id);
        assert_eq!(h.for_prefill(3).to_value()["num_consumers"], 3);
        assert_eq!(h.for_prefill(1).to_value().get("num_consumers"), None);
    }

    #[test]
    fn the_longest_unexpired_holding_wins() {
        let idx = Holdings::new(8);
        let now = SystemTime::now();
        idx.insert(Holding::from_params(&params("d1", 8, 20, in_a_minute())).unwrap());
        idx.insert(Holding::from_params(&params("d2", 16, 40, in_a_minute())).unwrap());
        // A prompt whose chain passes through 20 (block 2) and 40 (block 4).
        let f = idx.longest(&[10, 20, 30, 40, 50], now).0.unwrap();
        assert_eq!(
            (f.blocks, f.tokens, f.exact, &*f.holding.engine_id),
            (4, 16, true, "d2")
        );
        let f = idx.longest(&[10, 20, 31], now).0.unwrap();
        assert_eq!((f.blocks, &*f.holding.engine_id), (2, "d1"));
        assert_eq!(idx.longest(&[11, 21], now), (None, 0));
        // Expired: dropped when met.
        idx.insert(Holding::from_params(&params("d3", 8, 60, 1.0)).unwrap());
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.longest(&[60], now), (None, 1));
        assert_eq!(idx.len(), 2);
        assert_eq!(idx.remove(40).map(|h| h.tokens), Some(16));
        assert_eq!(idx.longest(&[10, 20, 30, 40], now).0.unwrap().blocks, 2);
    }

    #[test]
    fn a_history_that_re_encodes_differently_meets_the_prompt_part() {
        let idx = Holdings::new(8);
        let now = SystemTime::now();
        // The turn's prompt ended at block hash 20 (2 blocks, 32 tokens); its answer filled
        // blocks up to hash 40 (64 tokens held).
        let mut h = Holding::from_params(&params("d1", 64, 40, in_a_minute())).unwrap();
        h.prompt_key = Some((20, 32));
        idx.insert(h);
        assert_eq!(idx.len(), 1);
        // Resent exactly: all 64 tokens, pullable.
        let f = idx.longest(&[10, 20, 30, 40, 50], now).0.unwrap();
        assert_eq!((f.tokens, f.exact), (64, true));
        // The answer re-encoded to other ids: only the prompt part matches, not pullable.
        let f = idx.longest(&[10, 20, 33, 44, 55], now).0.unwrap();
        assert_eq!((f.blocks, f.tokens, f.exact), (2, 32, false));
        // Removing the holding removes both keys.
        assert!(idx.remove(40).is_some());
        assert_eq!(idx.longest(&[10, 20, 33], now), (None, 0));
        // An expired holding met by its partial key is gone under both.
        let mut old = Holding::from_params(&params("d1", 64, 41, 1.0)).unwrap();
        old.prompt_key = Some((21, 32));
        idx.insert(old);
        assert_eq!(idx.longest(&[10, 21], now), (None, 1));
        assert_eq!(idx.longest(&[10, 21, 30, 41], now), (None, 0));
        assert!(idx.is_empty());
    }

    #[test]
    fn the_index_keeps_the_newest_within_its_bound() {
        let idx = Holdings::new(2);
        for k in 0..5u64 {
            let displaced =
                idx.insert(Holding::from_params(&params("d1", 8, 100 + k, in_a_minute())).unwrap());
            assert_eq!(displaced.len(), usize::from(k >= 2), "insert {k}");
        }
        assert_eq!(idx.len(), 2);
        let now = SystemTime::now();
        assert!(idx.longest(&[102], now).0.is_none());
        assert!(idx.longest(&[103], now).0.is_some());
        assert!(idx.longest(&[104], now).0.is_some());
        // Re-keying the same hash displaces the old holding, and is not evicted by its stale
        // order entry.
        let again = idx.insert(Holding::from_params(&params("d2", 8, 104, in_a_minute())).unwrap());
        assert_eq!(again.len(), 1);
        assert_eq!(&*again[0].engine_id, "d1");
        assert_eq!(idx.len(), 2);
        assert_eq!(
            &*idx
                .longest(&[104], SystemTime::now())
                .0
                .unwrap()
                .holding
                .engine_id,
            "d2"
        );
    }
}

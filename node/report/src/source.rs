//! What the reporter reads from the node: counters ([`NodeStateSnapshot`]) and the set of stored
//! block hashes with its change feed ([`BlockSubscription`]), both behind [`StateSource`].
//! [`StoredBlocks`] is a ready-made, never-blocking implementation of the block half.

use std::collections::HashSet;
use std::sync::Mutex;

use tokio::sync::broadcast;

/// The node's load at one moment, as the reporter sends it (`pd.registry.v1.NodeState`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeStateSnapshot {
    /// Blocks in the KV pool.
    pub total_blocks: u64,
    /// Blocks an allocation can take now, cached-but-unreferenced blocks included.
    pub free_blocks: u64,
    /// Requests queued, not yet scheduled.
    pub waiting: u64,
    /// Requests being prefilled or decoded.
    pub running: u64,
    /// Requests parked until their KV arrives from another node.
    pub waiting_remote_kv: u64,
    /// The KV owner side's lease counters.
    pub leases: LeaseCounters,
    /// Blocks held by live leases (KV kept for another node to pull).
    pub leased_blocks: u64,
    /// Prompt tokens computed per second, a moving average (0: not measured yet).
    pub prefill_tokens_per_s: u32,
    /// Megabytes per second of the node's KV pulls, a moving average (0: not measured yet).
    pub pull_mb_per_s: u32,
    /// The node is shutting down and takes no new work (it finishes what it has).
    pub draining: bool,
}

impl NodeStateSnapshot {
    /// Whether `other` differs from this in anything but the rates: the reporter sends a state
    /// at once when its load changes, and the rates (which move at every prefill step) ride
    /// along with that or with the periodic state.
    pub fn same_load(&self, other: &Self) -> bool {
        let strip = |s: &Self| Self {
            prefill_tokens_per_s: 0,
            pull_mb_per_s: 0,
            ..*s
        };
        strip(self) == strip(other)
    }
}

/// Lease counters, cumulative since process start except [`live`](Self::live).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseCounters {
    /// Leases granted.
    pub granted: u64,
    /// Renewals accepted.
    pub renewed: u64,
    /// Leases released by their holder.
    pub released: u64,
    /// Leases that ran out before a release.
    pub expired: u64,
    /// Leases live now.
    pub live: u64,
}

/// One change to the set of block hashes a node can serve from its prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockEvent {
    /// The node can now serve this hash (a full block was registered in the prefix cache).
    Stored(u64),
    /// The node can no longer serve this hash (the block was evicted or invalidated).
    Removed(u64),
}

impl BlockEvent {
    /// The block hash the event is about.
    pub fn hash(self) -> u64 {
        match self {
            Self::Stored(h) | Self::Removed(h) => h,
        }
    }
}

/// Every hash stored at one moment, and the events after that moment.
///
/// The contract between [`stored`](Self::stored) and [`events`](Self::events): applying the
/// events, in order, to the snapshot gives the set at any later moment — no event that happened
/// before the snapshot is in the feed, and none after it is missing — *unless* the receiver
/// reports [`broadcast::error::RecvError::Lagged`]. A lagged receiver has lost events (the feed
/// is bounded and the node never waits for a reader); the reader must then take a fresh
/// subscription (a resync). A closed feed means the node will send no more events; the snapshot
/// then stays valid.
#[derive(Debug)]
pub struct BlockSubscription {
    /// Every hash stored at the moment of subscribing, in no particular order.
    pub stored: Vec<u64>,
    /// What changed after that moment, in order.
    pub events: broadcast::Receiver<BlockEvent>,
}

/// What the node lets the reporter read. Implemented by the node over its engine; the reporter
/// only calls it, from async code, and never holds anything the node waits for.
pub trait StateSource: Send + Sync + 'static {
    /// The current counters. Called about every 100 ms per connected reporter: must be cheap and
    /// must not block (read atomics or a copy the engine publishes; do not ask the engine thread
    /// and wait for the answer).
    fn state(&self) -> NodeStateSnapshot;

    /// A snapshot of every stored block hash and the feed of later changes, taken atomically in
    /// the sense of [`BlockSubscription`]. Called once per connection and again after the feed
    /// lagged; must not block for long (copying a set of up to `num_blocks` hashes is fine).
    /// [`StoredBlocks::subscribe`] implements it.
    fn subscribe_blocks(&self) -> BlockSubscription;

    /// The conversation turns the node retains and the feed of later changes
    /// ([`RetainedTurns::subscribe`](crate::RetainedTurns::subscribe)), taken atomically in the
    /// sense of [`BlockSubscription`]; `None` (the default): the node retains none and sends no
    /// `RetainedTurns`. Called once per connection and again after the feed lagged.
    fn subscribe_turns(&self) -> Option<crate::TurnSubscription> {
        None
    }
}

/// The set of block hashes a node can serve, plus a bounded change feed for any number of
/// readers. The node's engine calls [`insert`](Self::insert) and [`remove`](Self::remove) as
/// blocks enter and leave its prefix cache; [`StateSource::subscribe_blocks`] returns
/// [`subscribe`](Self::subscribe).
///
/// Writers never wait for readers and memory stays bounded: the set holds at most one entry per
/// cached block, and the feed is a `tokio::sync::broadcast` ring of fixed capacity. A reader that
/// falls more than `capacity` events behind (a slow gateway stream) gets `Lagged` and resyncs
/// from a new snapshot instead of making the node buffer for it; a disconnected reporter holds no
/// subscription at all. Both methods take a short mutex (also taken by `subscribe` while it
/// copies the set), never an async lock, so they may be called from the engine thread.
#[derive(Debug)]
pub struct StoredBlocks {
    set: Mutex<HashSet<u64>>,
    feed: broadcast::Sender<BlockEvent>,
}

impl StoredBlocks {
    /// Default feed capacity: events a reader may fall behind before it must resync.
    pub const DEFAULT_CAPACITY: usize = 8192;

    /// An empty set whose feed holds [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY) events.
    pub fn new() -> Self {
        Self::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// An empty set whose feed holds `capacity` events (at least 1).
    pub fn with_capacity(capacity: usize) -> Self {
        let (feed, _) = broadcast::channel(capacity.max(1));
        Self {
            set: Mutex::new(HashSet::new()),
            feed,
        }
    }

    /// Records that `hash` can be served; publishes [`BlockEvent::Stored`] and returns true
    /// unless it was already stored.
    pub fn insert(&self, hash: u64) -> bool {
        let mut set = self.lock();
        let added = set.insert(hash);
        if added {
            // No receiver is not an error: nobody is listening right now.
            let _ = self.feed.send(BlockEvent::Stored(hash));
        }
        added
    }

    /// Records that `hash` can no longer be served; publishes [`BlockEvent::Removed`] and returns
    /// true unless it was not stored.
    pub fn remove(&self, hash: u64) -> bool {
        let mut set = self.lock();
        let removed = set.remove(&hash);
        if removed {
            let _ = self.feed.send(BlockEvent::Removed(hash));
        }
        removed
    }

    /// Is `hash` stored now?
    pub fn contains(&self, hash: u64) -> bool {
        self.lock().contains(&hash)
    }

    /// Hashes stored now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Is nothing stored?
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The snapshot and its feed. The set is copied and the receiver created under the same lock
    /// that [`insert`](Self::insert) and [`remove`](Self::remove) publish under, so the feed
    /// starts exactly after the snapshot.
    pub fn subscribe(&self) -> BlockSubscription {
        let set = self.lock();
        BlockSubscription {
            stored: set.iter().copied().collect(),
            events: self.feed.subscribe(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        // A panic while holding the lock cannot leave the set half-updated (one insert or remove),
        // so a poisoned lock is still consistent.
        self.set
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Default for StoredBlocks {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::broadcast::error::TryRecvError;

    #[test]
    fn feed_starts_after_the_snapshot() {
        let blocks = StoredBlocks::new();
        assert!(blocks.insert(1));
        assert!(!blocks.insert(1), "a second insert is not an event");
        let mut sub = blocks.subscribe();
        assert_eq!(sub.stored, vec![1]);
        assert!(blocks.insert(2));
        assert!(blocks.remove(1));
        assert!(!blocks.remove(1), "removing an absent hash is not an event");
        assert_eq!(sub.events.try_recv(), Ok(BlockEvent::Stored(2)));
        assert_eq!(sub.events.try_recv(), Ok(BlockEvent::Removed(1)));
        assert_eq!(sub.events.try_recv(), Err(TryRecvError::Empty));
        assert!(blocks.contains(2) && !blocks.contains(1));
        assert_eq!(blocks.len(), 1);
    }

    #[test]
    fn a_reader_that_falls_behind_lags_and_the_writer_never_waits() {
        let blocks = StoredBlocks::with_capacity(4);
        let mut sub = blocks.subscribe();
        for h in 0..100 {
            blocks.insert(h);
        }
        assert!(matches!(
            sub.events.try_recv(),
            Err(TryRecvError::Lagged(_))
        ));
        let fresh = blocks.subscribe();
        assert_eq!(fresh.stored.len(), 100);
    }
}

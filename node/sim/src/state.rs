//! A simulated node's load and leases, read by its registry reporter ([`StateSource`]).
//!
//! Leases live in one table per process ([`Leases`]), so a decode node of the same fleet that
//! pulls releases the prefill node's lease at once, as a real pull does; a lease nobody pulls
//! (its decode node in another process, or the request failed) ends at its expiry.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use pd_report::{BlockSubscription, LeaseCounters, NodeStateSnapshot, StateSource, StoredBlocks};

/// One node's counters. Every field is read without a lock by the reporter.
#[derive(Debug)]
pub struct NodeLoad {
    total_blocks: u64,
    running: AtomicU64,
    waiting: AtomicU64,
    granted: AtomicU64,
    released: AtomicU64,
    expired: AtomicU64,
    leased_blocks: AtomicU64,
    /// When set, every read of the state differs from the last (a `renewed` count that ticks),
    /// so the reporter sends a state message on every change poll: the registry's load at
    /// its highest rate.
    churn: std::sync::atomic::AtomicBool,
    ticks: AtomicU64,
    draining: std::sync::atomic::AtomicBool,
    blocks: StoredBlocks,
    /// Stored hashes, oldest first: the prefix cache evicts from the front past `total_blocks`.
    cached: Mutex<VecDeque<u64>>,
}

impl NodeLoad {
    /// A node with `total_blocks` KV blocks; `churn` as described on the field.
    pub fn new(total_blocks: u64, churn: bool) -> Self {
        Self {
            total_blocks,
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            released: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            leased_blocks: AtomicU64::new(0),
            churn: std::sync::atomic::AtomicBool::new(churn),
            ticks: AtomicU64::new(0),
            draining: std::sync::atomic::AtomicBool::new(false),
            blocks: StoredBlocks::new(),
            cached: Mutex::new(VecDeque::new()),
        }
    }

    /// A request started; the guard ends it.
    pub fn start(self: &Arc<Self>) -> Running {
        self.running.fetch_add(1, Ordering::Relaxed);
        Running(Arc::clone(self))
    }

    /// Sets the reported `waiting` count (benchmarks mark a node with it to time how fast the
    /// gateway sees a change).
    pub fn set_waiting(&self, waiting: u64) {
        self.waiting.store(waiting, Ordering::Relaxed);
    }

    /// Turns churn (see the field) on or off.
    pub fn set_churn(&self, churn: bool) {
        self.churn.store(churn, Ordering::Relaxed);
    }

    /// Reports the node as shutting down (draining) or not.
    pub fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
    }

    /// Requests being served now.
    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    /// Leases granted and not yet released or expired.
    pub fn live_leases(&self) -> u64 {
        let ended = self.released.load(Ordering::Relaxed) + self.expired.load(Ordering::Relaxed);
        self.granted.load(Ordering::Relaxed).saturating_sub(ended)
    }

    /// Records the prompt's full blocks in the prefix cache (reported as block events).
    pub fn store_blocks(&self, hashes: &[u64]) {
        let mut cached = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        for &h in hashes {
            if self.blocks.insert(h) {
                cached.push_back(h);
            }
        }
        while cached.len() as u64 > self.total_blocks {
            if let Some(old) = cached.pop_front() {
                self.blocks.remove(old);
            }
        }
    }
}

/// A request being served: counted in `running` until dropped.
#[derive(Debug)]
pub struct Running(Arc<NodeLoad>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl StateSource for NodeLoad {
    fn state(&self) -> NodeStateSnapshot {
        let leased = self.leased_blocks.load(Ordering::Relaxed);
        let running = self.running.load(Ordering::Relaxed);
        let renewed = if self.churn.load(Ordering::Relaxed) {
            self.ticks.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        NodeStateSnapshot {
            total_blocks: self.total_blocks,
            free_blocks: self.total_blocks.saturating_sub(leased + running),
            waiting: self.waiting.load(Ordering::Relaxed),
            running,
            waiting_remote_kv: 0,
            leases: LeaseCounters {
                granted: self.granted.load(Ordering::Relaxed),
                renewed,
                released: self.released.load(Ordering::Relaxed),
                expired: self.expired.load(Ordering::Relaxed),
                live: self.live_leases(),
            },
            leased_blocks: leased,
            prefill_tokens_per_s: 0,
            pull_mb_per_s: 0,
            draining: self.draining.load(Ordering::Relaxed),
        }
    }

    fn subscribe_blocks(&self) -> BlockSubscription {
        self.blocks.subscribe()
    }
}

/// A lease a prefill node granted.
#[derive(Debug)]
struct Lease {
    owner: Arc<NodeLoad>,
    blocks: u64,
    deadline: Instant,
}

/// Every lease of the process's fleet, by id.
#[derive(Debug, Default)]
pub struct Leases {
    table: Mutex<HashMap<u128, Lease>>,
    next: AtomicU64,
}

impl Leases {
    /// Grants a lease on `blocks` blocks of `owner` for `duration`; returns its id.
    pub fn grant(&self, owner: &Arc<NodeLoad>, blocks: u64, duration: Duration) -> u128 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = (u128::from(rand::random::<u64>()) << 64) | u128::from(n);
        owner.granted.fetch_add(1, Ordering::Relaxed);
        owner.leased_blocks.fetch_add(blocks, Ordering::Relaxed);
        self.lock().insert(
            id,
            Lease {
                owner: Arc::clone(owner),
                blocks,
                deadline: Instant::now() + duration,
            },
        );
        id
    }

    /// Ends a lease that was pulled or released; false when it is not live (unknown, expired,
    /// already released).
    pub fn release(&self, id: u128) -> bool {
        let Some(lease) = self.lock().remove(&id) else {
            return false;
        };
        lease.owner.released.fetch_add(1, Ordering::Relaxed);
        lease
            .owner
            .leased_blocks
            .fetch_sub(lease.blocks, Ordering::Relaxed);
        true
    }

    /// The lease's deadline when it is live.
    pub fn deadline(&self, id: u128) -> Option<Instant> {
        self.lock().get(&id).map(|l| l.deadline)
    }

    /// Ends every lease past its deadline (counted `expired`); returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let mut table = self.lock();
        let before = table.len();
        table.retain(|_, l| {
            let live = l.deadline > now;
            if !live {
                l.owner.expired.fetch_add(1, Ordering::Relaxed);
                l.owner.leased_blocks.fetch_sub(l.blocks, Ordering::Relaxed);
            }
            live
        });
        before - table.len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u128, Lease>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_ends_once_released_or_expired() {
        let node = Arc::new(NodeLoad::new(100, false));
        let leases = Leases::default();
        let a = leases.grant(&node, 4, Duration::from_secs(60));
        let b = leases.grant(&node, 2, Duration::ZERO);
        assert_eq!(node.live_leases(), 2);
        assert_eq!(node.state().leased_blocks, 6);
        assert!(leases.release(a));
        assert!(!leases.release(a), "released once");
        assert_eq!(leases.expire(Instant::now() + Duration::from_millis(1)), 1);
        assert!(!leases.release(b), "expired");
        let s = node.state();
        assert_eq!(
            (s.leases.granted, s.leases.released, s.leases.expired),
            (2, 1, 1)
        );
        assert_eq!((s.leases.live, s.leased_blocks, s.free_blocks), (0, 0, 100));
    }

    #[test]
    fn churn_makes_every_read_a_change_and_the_cache_is_bounded() {
        let node = Arc::new(NodeLoad::new(3, true));
        assert!(!node.state().same_load(&node.state()));
        let quiet = NodeLoad::new(3, false);
        assert!(quiet.state().same_load(&quiet.state()));
        quiet.store_blocks(&[1, 2, 3, 4, 5]);
        let sub = quiet.subscribe_blocks();
        let mut held = sub.stored.clone();
        held.sort_unstable();
        assert_eq!(held, vec![3, 4, 5], "the oldest were evicted");
        let r = node.start();
        assert_eq!(node.running(), 1);
        drop(r);
        assert_eq!(node.running(), 0);
    }
}

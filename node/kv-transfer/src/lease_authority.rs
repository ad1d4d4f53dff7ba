//! Who decides about leases on the owning node, as seen by the side channel.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pd_kv_pool::{
    BlockAllocator, BlockId, Lease, LeaseContents, LeaseCounts, LeaseError, LeaseId, LeaseTable,
};

/// Pool and lease counters reported to peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Blocks in the pool.
    pub total_blocks: usize,
    /// Blocks nobody references.
    pub free_blocks: usize,
    /// Live leases.
    pub live_leases: usize,
    /// Lifetime counters.
    pub counts: LeaseCounts,
}

/// What the side channel needs from the owner of the blocks. In a node this is the engine; a
/// standalone pool uses [`LocalBlocks`]. Methods must not block for long: they run on the async
/// reactor.
pub trait LeaseAuthority: Send + Sync + 'static {
    /// Extends a live lease; returns its new deadline.
    ///
    /// # Errors
    /// [`LeaseError`] when the lease is not live for `peer`.
    fn renew(&self, id: LeaseId, generation: u64, peer: &str) -> Result<SystemTime, LeaseError>;
    /// Whether the lease is live now; returns its deadline and what its blocks hold.
    ///
    /// # Errors
    /// [`LeaseError`] when it is not.
    fn confirm(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
    ) -> Result<(SystemTime, LeaseContents), LeaseError>;
    /// Whether every one of `blocks` is a block of the lease, live now for `peer`: what that
    /// peer may read of the pool ([`crate::tcp_data`]). Does not count as a confirmation.
    ///
    /// # Errors
    /// [`LeaseError`] when the lease is not live for `peer`.
    fn covers(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        blocks: &[BlockId],
    ) -> Result<bool, LeaseError>;
    /// Ends the lease and drops its references.
    ///
    /// # Errors
    /// [`LeaseError`] when it was not live.
    fn release(&self, id: LeaseId, generation: u64, peer: &str) -> Result<(), LeaseError>;
    /// Current counters.
    fn stats(&self) -> PoolStats;
}

/// Converts a monotonic deadline to wall-clock time (for peers in other processes), reading
/// both clocks now.
pub fn to_system_time(deadline: Instant) -> SystemTime {
    pd_kv_pool::deadline_on_wall_clock(deadline, Instant::now(), SystemTime::now())
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A block allocator and its lease table behind one mutex: the owner of a pool that no engine
/// thread owns (tools, tests, benchmarks). Expiry runs whenever any method is called and from
/// [`LocalBlocks::expire`].
#[derive(Debug)]
pub struct LocalBlocks {
    inner: Mutex<(BlockAllocator, LeaseTable)>,
}

impl LocalBlocks {
    /// A pool of `num_blocks` free blocks whose leases last `lease_duration`.
    pub fn new(num_blocks: usize, lease_duration: Duration, seed: [u8; 32]) -> Self {
        Self {
            inner: Mutex::new((
                BlockAllocator::new(num_blocks),
                LeaseTable::new(lease_duration, seed),
            )),
        }
    }

    /// Runs `f` on the allocator and lease table (after expiring due leases).
    pub fn with<R>(&self, f: impl FnOnce(&mut BlockAllocator, &mut LeaseTable) -> R) -> R {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (alloc, leases) = &mut *g;
        free_leased(alloc, &leases.expire(Instant::now()));
        f(alloc, leases)
    }

    /// Grants `peer` a lease on `blocks` (which the caller references); the lease takes its own
    /// reference on each.
    pub fn grant(&self, blocks: Vec<BlockId>, peer: &str) -> Lease {
        self.with(|a, l| {
            for &b in &blocks {
                a.share(b);
            }
            l.grant(blocks, LeaseContents::default(), peer, Instant::now())
        })
    }

    /// Ends due leases; returns how many.
    pub fn expire(&self) -> usize {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (alloc, leases) = &mut *g;
        let gone = leases.expire(Instant::now());
        free_leased(alloc, &gone);
        gone.len()
    }
}

/// Drops the references of ended leases.
fn free_leased(alloc: &mut BlockAllocator, leases: &[Lease]) {
    for l in leases {
        for &b in &l.blocks {
            alloc.free(b);
        }
    }
}

impl LeaseAuthority for LocalBlocks {
    fn renew(&self, id: LeaseId, generation: u64, peer: &str) -> Result<SystemTime, LeaseError> {
        self.with(|_, l| l.renew(id, generation, peer, Instant::now()))
            .map(to_system_time)
    }

    fn confirm(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
    ) -> Result<(SystemTime, LeaseContents), LeaseError> {
        self.with(|_, l| {
            l.check(id, generation, peer, Instant::now())
                .map(|x| (to_system_time(x.deadline), x.contents))
        })
    }

    fn covers(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        blocks: &[BlockId],
    ) -> Result<bool, LeaseError> {
        self.with(|_, l| {
            l.check(id, generation, peer, Instant::now())
                .map(|lease| pd_kv_pool::lease_covers(&lease.blocks, blocks))
        })
    }

    fn release(&self, id: LeaseId, generation: u64, peer: &str) -> Result<(), LeaseError> {
        self.with(|a, l| {
            let lease = l.release(id, generation, peer, Instant::now())?;
            free_leased(a, std::slice::from_ref(&lease));
            Ok(())
        })
    }

    fn stats(&self) -> PoolStats {
        self.with(|a, l| PoolStats {
            total_blocks: a.num_total(),
            free_blocks: a.num_free(),
            live_leases: l.live(),
            counts: l.counts(),
        })
    }
}

//! What confines a guest beyond fuel and its deadline: its WASI context and its memory and
//! table limits.
//!
//! A guest that imports WASI (a Go guest always does) gets a context built on its first WASI
//! call: no preopens, environment, arguments or network, stdin empty, stdout and stderr
//! discarded, a wall clock frozen at the Unix epoch, a monotonic clock that advances 1 µs per
//! read from 0, and random bytes from a generator seeded with the request's `seq` (while the
//! component is instantiated, before any request: with [`INSTANTIATE_SEED`]): the same request
//! and view give the same decision, so a recorded decision replays exactly.
//!
//! Each linear memory is capped at the spec's limit ([`Limiter`]); growing past it is a typed
//! trap ([`MemoryLimitHit`]), so the host tells "out of memory" from other traps.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use wasmtime::ResourceLimiter;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{
    Deterministic, HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView,
};

use super::host::HostState;

/// The seed of the WASI randomness a guest draws while it is instantiated (a runtime's start-up:
/// Go's hash seeds). Fixed, so that an instance made ahead of a request starts exactly as one
/// made inline; the call itself draws from the request's `seq`.
pub(super) const INSTANTIATE_SEED: u64 = 0;

/// Bytes the WASI random generators cycle through (a guest asks for a few: hash seeds).
const RANDOM_BYTES: usize = 4096;

/// Table elements a guest's table may reach (the pool's `table_elements`).
const MAX_TABLE_ELEMENTS: usize = 20_000;

/// A guest's WASI context and its resources.
pub(super) struct WasiState {
    pub(super) ctx: WasiCtx,
    table: ResourceTable,
}

/// A policy's WASI context: no preopens, environment, arguments or sockets; stdin empty,
/// stdout and stderr discarded; clocks and randomness reproducible (see the module docs).
pub(super) fn wasi_ctx(seed: u64, clock: Arc<AtomicU64>) -> WasiCtx {
    WasiCtx::builder()
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .wall_clock(FrozenWallClock)
        .monotonic_clock(StepClock(clock))
        .secure_random(seeded_random(seed))
        .insecure_random(seeded_random(seed ^ 0x5851_f42d_4c95_7f2d))
        .insecure_random_seed(u128::from(seed))
        .build()
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        let (seed, clock) = (self.seed, &self.clock);
        let w = self.wasi.get_or_insert_with(|| WasiState {
            ctx: wasi_ctx(seed, clock.clone()),
            table: ResourceTable::new(),
        });
        WasiCtxView {
            ctx: &mut w.ctx,
            table: &mut w.table,
        }
    }
}

/// `wasi:clocks/wall-clock` of a policy: always the Unix epoch.
struct FrozenWallClock;

impl HostWallClock for FrozenWallClock {
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

/// `wasi:clocks/monotonic-clock` of a policy: 0, then 1 µs more at every read (time passes,
/// so a guest that waits for it ends, but the same calls see the same times).
struct StepClock(Arc<AtomicU64>);

impl HostMonotonicClock for StepClock {
    fn resolution(&self) -> u64 {
        1_000
    }
    fn now(&self) -> u64 {
        self.0.fetch_add(1_000, Ordering::Relaxed)
    }
}

/// A generator whose bytes depend only on `seed` (splitmix64 over 4 KiB, cycled).
fn seeded_random(seed: u64) -> Deterministic {
    let mut x = seed;
    let bytes = (0..RANDOM_BYTES / 8)
        .flat_map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)).to_le_bytes()
        })
        .collect();
    Deterministic::new(bytes)
}

/// The guest tried to grow a memory past its limit.
#[derive(Debug, thiserror::Error)]
#[error("memory limit: a memory tried to grow to {desired} bytes, limit {limit}")]
pub(super) struct MemoryLimitHit {
    pub(super) desired: usize,
    pub(super) limit: usize,
}

/// Caps each linear memory at the spec's limit and turns any failed growth into a typed
/// trap ([`MemoryLimitHit`]), so the host tells "out of memory" from other traps.
pub(super) struct Limiter {
    memory_limit: usize,
    last_desired: usize,
    /// The largest size any memory was granted (its creation counts as growth from 0).
    largest: usize,
    /// `largest` when the instantiation ended.
    largest_at_start: usize,
}

impl Limiter {
    pub(super) fn new(memory_limit: usize) -> Self {
        Limiter {
            memory_limit,
            last_desired: 0,
            largest: 0,
            largest_at_start: 0,
        }
    }

    /// The instantiation ended: what the guest's memories hold now is its starting size.
    pub(super) fn instantiated(&mut self) {
        self.largest_at_start = self.largest;
    }

    /// A memory grew past half of the room it had after instantiation. A warm instance that
    /// did (a guest whose allocator never frees, like `policies/guest-rt`'s bump allocator,
    /// grows a little every call) is retired before a call of it would fail at the limit.
    pub(super) fn worn(&self) -> bool {
        let room = self.memory_limit.saturating_sub(self.largest_at_start);
        self.largest > self.largest_at_start + room / 2
    }
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.last_desired = desired;
        let limit = maximum.map_or(self.memory_limit, |m| m.min(self.memory_limit));
        if desired > limit {
            return Err(wasmtime::Error::new(MemoryLimitHit { desired, limit }));
        }
        self.largest = self.largest.max(desired);
        Ok(true)
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        Err(wasmtime::Error::new(MemoryLimitHit {
            desired: self.last_desired,
            limit: self.memory_limit,
        }))
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(maximum.is_none_or(|m| desired <= m) && desired <= MAX_TABLE_ELEMENTS)
    }

    fn instances(&self) -> usize {
        64
    }

    fn tables(&self) -> usize {
        16
    }

    fn memories(&self) -> usize {
        4
    }
}

//! The WASM policy host: one [`PolicyEngine`] per gateway, one [`WasmPolicy`] per loaded
//! component, a fresh [`Store`] per call.
//!
//! Built once ([`PolicyEngine::new`], here): the wasmtime [`Engine`] (pooling allocator, fuel,
//! epoch interruption), the [`Linker`] with the `pd:policy/host` imports (`host.rs`) and a
//! locked-down WASI p2 (`sandbox.rs`), and the thread that advances the epoch (`epoch.rs`).
//!
//! At load ([`PolicyEngine::load`], here, off the request path): compile (`compile.rs`: cached
//! in memory by the sha256 of the bytes, and on disk when the engine has a cache directory:
//! `precompiled.rs`), `instantiate_pre` (all import resolution and type checking), `decide`'s
//! type checked against each world the gateway hosts, newest first (`world.rs`: the one that
//! matches is the policy's contract), then a smoke test (`smoke.rs`).
//!
//! Per call ([`WasmPolicy::decide`], `call.rs`): a store that has seen one instantiation and no
//! call, either made ahead on the `pd-policy-spare` thread (`spare.rs`) or made now (for a
//! component that declares itself stateless, `stateless.rs`: a warm one that answered earlier
//! calls, when one is ready), the call's per-request data set in it (node names, the WASI seed, the time `now-ns` reads), a new epoch
//! deadline, `decide` through the bindings of the policy's world, then [`validate`].
//!
//! What a guest reads is reproducible: its WASI clocks and randomness (`sandbox.rs`) and the
//! host's `now-ns` (`host.rs`: the time the gateway recorded for the request) depend only on
//! the request and the time passed with it, so a recorded decision replays exactly.
//!
//! [`validate`]: fn@crate::validate

mod call;
mod compile;
mod host;
mod sandbox;
mod smoke;
mod world;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{HasSelf, Linker};
use wasmtime::{
    Config, Enabled, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig, Store,
};

pub use call::{CallStats, WasmPolicy};
pub use compile::CompiledFrom;
pub use host::NodeNames;

use crate::PolicyError;
use crate::epoch::EpochClock;
use crate::precompiled::DiskCache;
use crate::spare::SpareWorker;
use crate::wit::Policy;
use call::Core;
use compile::CompileCache;
use host::HostState;
use world::Pre;

/// The largest [`PolicySpec::memory_limit`] the host accepts (the pool's per-memory size).
pub const MAX_MEMORY_LIMIT: usize = 256 << 20;

/// Calls that can run at once across all policies of one engine (pool slots, which spare
/// instances also hold: [`PolicySpec::spares`]); a call beyond that fails with
/// [`PolicyError::Instantiate`].
pub const MAX_CONCURRENT_CALLS: u32 = 128;

/// The default [`PolicySpec::spares`]: one per HTTP worker thread of a small gateway.
pub const DEFAULT_SPARES: usize = 2;

/// The largest [`PolicySpec::spares`] the host accepts.
pub const MAX_SPARES: usize = 8;

/// Default [`PolicySpec::fuel`], on the order of a millisecond of guest code: a 64-node
/// prefix-aware decision by the Rust guest uses about 3% of it, instantiation included (see
/// `tests/limits.rs`, `fuel_budget_headroom`). Interpreted guests (Python, JS) need more.
pub const DEFAULT_FUEL: u64 = 1_000_000;

/// How a policy runs: its name, its operator configuration and its limits.
#[derive(Debug, Clone)]
pub struct PolicySpec {
    /// The operator's name for the policy (logs, metrics).
    pub name: String,
    /// What the guest reads with `host.config(key)`.
    pub config: BTreeMap<String, String>,
    /// Wall-clock budget of one call, and separately of the instantiation before it (which may
    /// run ahead of the call: `spares`); a backstop to `fuel`, enforced with epochs
    /// (`epoch.rs`), so a runaway call stops between `deadline` and `deadline + TICK`
    /// (250 µs), or up to 1 ms later when it started while the epoch dozed between calls. A
    /// call whose thread waited for a core rather than computing runs on past it until it has
    /// computed for `deadline` (estimated from its fuel), up to 10 deadlines (`epoch::Watch`).
    /// Default: 1 ms.
    pub deadline: Duration,
    /// Largest size in bytes any one linear memory of the guest may reach. At most
    /// [`MAX_MEMORY_LIMIT`]. Default: 16 MiB.
    pub memory_limit: usize,
    /// Deterministic CPU budget of one call, in wasmtime fuel (about one unit per wasm
    /// instruction), instantiation included. Default: [`DEFAULT_FUEL`].
    pub fuel: u64,
    /// Instances made ahead of calls, off the request path (`spare.rs`), at most
    /// [`MAX_SPARES`]; each holds a pool slot and its memory. 0: every call instantiates on
    /// the request path. Default: 2.
    pub spares: usize,
}

impl Default for PolicySpec {
    fn default() -> Self {
        PolicySpec {
            name: "policy".to_string(),
            config: BTreeMap::new(),
            deadline: Duration::from_millis(1),
            memory_limit: 16 << 20,
            fuel: DEFAULT_FUEL,
            spares: DEFAULT_SPARES,
        }
    }
}

/// The gateway's WASM policy host. Cheap to clone (shared inside).
#[derive(Clone)]
pub struct PolicyEngine {
    inner: Arc<EngineInner>,
}

impl std::fmt::Debug for PolicyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEngine").finish_non_exhaustive()
    }
}

/// What every policy of one engine shares.
struct EngineInner {
    engine: Engine,
    linker: Linker<HostState>,
    /// Compiled components, in memory and (with a cache directory) on disk.
    compiled: CompileCache,
    clock: Arc<EpochClock>,
    ticker: Option<JoinHandle<()>>,
    /// Makes spare instances and drops used stores, off the request path (`spare.rs`).
    spares: Arc<SpareWorker<Core, Store<HostState>>>,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        self.spares.stop();
        self.clock.stop();
        if let Some(t) = self.ticker.take() {
            // The epoch thread only sleeps and bumps the epoch; it cannot panic.
            let _ = t.join();
        }
    }
}

fn engine_err(e: wasmtime::Error) -> PolicyError {
    PolicyError::Engine {
        source: e.into_boxed_dyn_error(),
    }
}

impl PolicyEngine {
    /// Builds the engine, the linker and the epoch thread (`epoch.rs`).
    ///
    /// # Errors
    ///
    /// [`PolicyError::Engine`] when wasmtime rejects the configuration (for example, the
    /// pooling allocator cannot reserve its address space) or the epoch's timer or thread cannot
    /// start.
    pub fn new() -> Result<Self, PolicyError> {
        Self::build(None)
    }

    /// [`PolicyEngine::new`], with compiled components also kept in `dir` (created with mode
    /// 0700 when missing), so a restart or a second push of the same component does not compile
    /// it again.
    ///
    /// # Errors
    ///
    /// As [`PolicyEngine::new`], and [`PolicyError::CacheDir`] when `dir` cannot be created or
    /// is not a private directory of this user.
    pub fn with_disk_cache(dir: &Path) -> Result<Self, PolicyError> {
        Self::build(Some(dir))
    }

    /// The on-disk cache directory, if any.
    pub fn disk_cache(&self) -> Option<&Path> {
        self.inner.compiled.disk_dir()
    }

    fn build(disk_dir: Option<&Path>) -> Result<Self, PolicyError> {
        let engine = Engine::new(&config()).map_err(engine_err)?;
        let disk = disk_dir.map(|d| DiskCache::open(d, &engine)).transpose()?;

        let mut linker = Linker::<HostState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(engine_err)?;
        // The contract's world: its types and the host imports.
        Policy::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(engine_err)?;

        let spares = SpareWorker::start().map_err(|e| PolicyError::Engine {
            source: Box::new(e),
        })?;
        let clock = Arc::new(EpochClock::new().map_err(|e| {
            spares.stop();
            PolicyError::Engine {
                source: Box::new(e),
            }
        })?);
        let ticker = {
            let engine = engine.clone();
            let clock = clock.clone();
            let for_ticker = spares.clone();
            std::thread::Builder::new()
                .name("pd-policy-epoch".to_string())
                .spawn(move || {
                    clock.run(|| {
                        engine.increment_epoch();
                        for_ticker.pass_wake();
                    });
                })
                .map_err(|e| {
                    spares.stop();
                    PolicyError::Engine {
                        source: Box::new(e),
                    }
                })?
        };
        Ok(PolicyEngine {
            inner: Arc::new(EngineInner {
                engine,
                linker,
                compiled: CompileCache::new(disk),
                clock,
                ticker: Some(ticker),
                spares,
            }),
        })
    }

    /// Compiles `wasm` (a component; cached by sha256), checks it against the `policy`
    /// world, and smoke-tests it: `decide` on a synthetic view of 2 prefill, 2 decode and 1
    /// standalone nodes, with `n = 1` and `n = 3`, under `spec`'s limits (a call that times
    /// out is tried up to twice more: the deadline is wall-clock time). A policy that fails
    /// any of this is not loaded. Compiling takes milliseconds to seconds: call this off the
    /// request path (a blocking thread).
    ///
    /// # Errors
    ///
    /// [`PolicyError::MemoryLimitTooLarge`] for a `spec.memory_limit` above
    /// [`MAX_MEMORY_LIMIT`]; [`PolicyError::Compile`] when `wasm` is not a valid component;
    /// [`PolicyError::Instantiate`] when its imports or exports do not match the world;
    /// [`PolicyError::SmokeTest`] (with the call's error inside) when a smoke-test call traps,
    /// runs out of time, fuel or memory, or answers an invalid decision.
    pub fn load(&self, wasm: &[u8], spec: PolicySpec) -> Result<WasmPolicy, PolicyError> {
        if spec.memory_limit > MAX_MEMORY_LIMIT {
            return Err(PolicyError::MemoryLimitTooLarge {
                requested: spec.memory_limit,
                max: MAX_MEMORY_LIMIT,
            });
        }
        if spec.spares > MAX_SPARES {
            return Err(PolicyError::TooManySpares {
                requested: spec.spares,
                max: MAX_SPARES,
            });
        }
        let digest: [u8; 32] = Sha256::digest(wasm).into();
        let sha256 = hex::encode(digest);
        let started = Instant::now();
        let (component, compiled_from) =
            self.inner
                .compiled
                .get(&self.inner.engine, &spec.name, digest, &sha256, wasm)?;
        let compile_time = started.elapsed();
        let instantiate_err = |source| PolicyError::Instantiate {
            name: spec.name.clone(),
            source,
        };
        let pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| instantiate_err(e.into_boxed_dyn_error()))?;
        // Type-checks the `decide` export against each world the gateway hosts, once.
        let pre = Pre::new(pre).map_err(|e| instantiate_err(Box::new(e)))?;
        let reuse = crate::stateless::declares_stateless(wasm);
        let core = Core::new(self.inner.clone(), pre, spec, &sha256, reuse);
        let policy = WasmPolicy::new(core, sha256, compiled_from, compile_time);
        smoke::test(&policy)?;
        tracing::info!(
            policy = %policy.spec().name,
            version = %&policy.sha256()[..12],
            ?compiled_from,
            ?compile_time,
            reuses_instances = policy.reuses_instances(),
            "policy loaded"
        );
        policy.refill_spares();
        Ok(policy)
    }
}

/// The engine's configuration: the component model, fuel, epoch interruption, and a pooling
/// allocator sized for [`MAX_CONCURRENT_CALLS`] calls of [`MAX_MEMORY_LIMIT`] each.
fn config() -> Config {
    let mut pool = PoolingAllocationConfig::new();
    pool.total_component_instances(MAX_CONCURRENT_CALLS)
        .total_core_instances(MAX_CONCURRENT_CALLS * 16)
        .total_memories(MAX_CONCURRENT_CALLS * 2)
        .total_tables(MAX_CONCURRENT_CALLS * 4)
        .max_core_instances_per_component(64)
        .max_memories_per_component(4)
        .max_tables_per_component(16)
        .max_memory_size(MAX_MEMORY_LIMIT)
        .table_elements(20_000)
        .max_unused_warm_slots(MAX_CONCURRENT_CALLS);
    // After each call the pool resets the guest's memory. By default that is an madvise,
    // and the next call page-faults everything back in: about 5 µs per call. Instead keep
    // the pages mapped and reset them in place: with PAGEMAP_SCAN (Linux ≥ 6.7) only the
    // pages the guest dirtied, up to 2 MiB; without it, a memset of the first 256 KiB
    // (a Rust guest built like `policies/` touches less than 128 KiB), which is still
    // cheaper than the madvise. Memory beyond that is madvised as usual.
    if PoolingAllocationConfig::is_pagemap_scan_available() {
        pool.linear_memory_keep_resident(2 << 20)
            .table_keep_resident(64 << 10)
            .pagemap_scan(Enabled::Yes);
    } else {
        pool.linear_memory_keep_resident(256 << 10)
            .table_keep_resident(16 << 10);
    }
    let mut config = Config::new();
    config
        .wasm_component_model(true)
        .epoch_interruption(true)
        .consume_fuel(true)
        .cranelift_opt_level(OptLevel::Speed)
        .parallel_compilation(true)
        .memory_init_cow(true)
        .max_wasm_stack(512 << 10)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    config
}

//! The WASM policy host: one [`PolicyEngine`] per gateway, one [`WasmPolicy`] per loaded
//! component, a fresh [`Store`] per call.
//!
//! Built once ([`PolicyEngine::new`]): the wasmtime [`Engine`] (pooling allocator, fuel, epoch
//! interruption), the [`Linker`] with the `pd:policy/host` imports and a locked-down WASI p2
//! (no files, no network, no environment, no arguments; stdout/stderr go nowhere), and the
//! thread that advances the epoch (`epoch.rs`).
//!
//! At load ([`PolicyEngine::load`], off the request path): compile (cached in memory by the
//! sha256 of the bytes, and on disk when the engine has a cache directory: see
//! `precompiled.rs`), `instantiate_pre` (all import resolution and type checking), `decide`'s
//! type checked against the `pd:policy@0.2.0` world, else the `0.1.0` one (the one that
//! matches is the policy's contract), then a smoke test.
//!
//! A guest that imports WASI (a Go guest always does) gets a context built on its first WASI
//! call: no preopens, environment, arguments or network, stdin empty, stdout and stderr
//! discarded, a wall clock frozen at the Unix epoch, a monotonic clock that advances 1 µs per
//! read from 0, and random bytes from a generator seeded with the request's `seq` (while the
//! component is instantiated, before any request: with a fixed seed): the same request and view
//! give the same decision, so a recorded decision replays exactly.
//!
//! Per call ([`WasmPolicy::decide`]): a store that has seen one instantiation and no call,
//! either made ahead on the `pd-policy-spare` thread (`spare.rs`; [`PolicySpec::spares`] per
//! policy, replaced as they are used) or, when none is ready, made now: the spec's memory
//! limit and fuel set, the component instantiated from the pre-instantiated component (pooled,
//! copy-on-write memory) under the epoch deadline, with WASI randomness seeded by a fixed seed
//! during instantiation. The call then sets the caller's node names (shared, not copied), the
//! request's seed and a new epoch deadline, and calls `decide` through the bindings `bindgen!`
//! generated from the WIT (no hand-written lowering; a 0.2.0 policy gets the view as columns,
//! built by `columns.rs`); the result is validated, and the store goes to the spare thread to
//! be dropped (its pooled memory reset there). A store that trapped is never reused. Both ways
//! give the same decision and use the same fuel (`tests/sandbox.rs`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use std::path::Path;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Config, Enabled, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig,
    ResourceLimiter, Store, Trap, UpdateDeadline,
};
use wasmtime_wasi::{
    Deterministic, HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView,
};

use crate::bindings::v1::pd::policy::host::Level;
use crate::bindings::{v1, v2, v3};
use crate::columns::{Measured, Rates, columns, indexed};
use crate::epoch::{EpochClock, Watch};
use crate::precompiled::DiskCache;
use crate::spare::{Refill, SpareWorker};
use crate::validate::lift_v3;
use crate::{Api, Decision, InvalidDecision, Node, PolicyError, Request, Role, View, validate};

/// Engine ids of a view's nodes (`names[i]` names `view.nodes[i]`), shared with the caller:
/// the host's `node-name` import reads them, nothing copies them per call.
pub type NodeNames = Arc<[Arc<str>]>;

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

/// Log lines a guest may write per call; later ones are dropped (the last kept line says so).
const MAX_LOG_LINES_PER_CALL: u32 = 32;

/// Bytes of a guest log line kept; the rest is cut.
const MAX_LOG_LINE: usize = 1024;

/// Extra tries a smoke-test call gets when it times out (and only then).
const SMOKE_TIMEOUT_RETRIES: u32 = 2;

/// Compiled components kept in memory, by sha256 of their bytes.
const COMPILE_CACHE_ENTRIES: usize = 16;

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

/// What one call cost the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallStats {
    /// Fuel consumed, instantiation included.
    pub fuel_used: u64,
    /// The call ran in an instance made ahead of it, off the request path
    /// ([`PolicySpec::spares`]); else it instantiated on the request path.
    pub spare: bool,
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

struct EngineInner {
    engine: Engine,
    linker: Linker<HostState>,
    cache: Mutex<Vec<([u8; 32], Component)>>,
    /// Compiled components on disk, when the engine has a cache directory.
    disk: Option<DiskCache>,
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
        self.inner.disk.as_ref().map(DiskCache::dir)
    }

    fn build(disk_dir: Option<&Path>) -> Result<Self, PolicyError> {
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
        let engine = Engine::new(&config).map_err(engine_err)?;
        let disk = disk_dir.map(|d| DiskCache::open(d, &engine)).transpose()?;

        let mut linker = Linker::<HostState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(engine_err)?;
        // 0.1.0's world (its types and host imports), and the one new interface of each of
        // 0.2.0 and 0.3.0: both use 0.1.0's types and host imports, so one linker serves all.
        v1::Policy::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(engine_err)?;
        v2::pd::policy0_2_0::cluster::add_to_linker::<HostState, HasSelf<HostState>>(
            &mut linker,
            |s| s,
        )
        .map_err(engine_err)?;
        v3::pd::policy0_3_0::cluster::add_to_linker::<HostState, HasSelf<HostState>>(
            &mut linker,
            |s| s,
        )
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
                cache: Mutex::new(Vec::new()),
                disk,
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
        let (component, compiled_from) = self.compile(&spec.name, digest, &sha256, wasm)?;
        let compile_time = started.elapsed();
        let instantiate_err = |e: wasmtime::Error| PolicyError::Instantiate {
            name: spec.name.clone(),
            source: e.into_boxed_dyn_error(),
        };
        let pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(instantiate_err)?;
        // Type-checks the `decide` export against each world the gateway hosts, once: the
        // newest that matches is the policy's contract.
        let pre = match v3::PolicyPre::new(pre.clone()) {
            Ok(p) => Pre::V3(p),
            Err(e3) => match v2::PolicyPre::new(pre.clone()) {
                Ok(p) => Pre::V2(p),
                Err(e2) => match v1::PolicyPre::new(pre) {
                    Ok(p) => Pre::V1(p),
                    Err(e1) => {
                        return Err(instantiate_err(e1.context(format!(
                            "the component matches none of pd:policy@0.1.0, \
                             pd:policy@0.2.0 and pd:policy@0.3.0 (against 0.2.0: {e2:#}; \
                             against 0.3.0: {e3:#})"
                        ))));
                    }
                },
            },
        };
        let guest = Arc::new(GuestMeta {
            name: spec.name.clone(),
            version: sha256[..12].to_string(),
            config: spec.config.clone(),
        });
        let policy = WasmPolicy {
            core: Arc::new(Core {
                engine: self.inner.clone(),
                pre,
                guest,
                spec,
                spares: Mutex::new(Vec::new()),
            }),
            sha256,
            loaded_at: SystemTime::now(),
            compiled_from,
            compile_time,
        };
        policy.check_instantiate()?;
        // Rates on some nodes, not all: a 0.2.0 policy must cope with both.
        let smoke_measured = Measured {
            rates: vec![
                Rates {
                    prefill_tokens_per_s: 2_500,
                    pull_mb_per_s: 0,
                },
                Rates::default(),
                Rates {
                    prefill_tokens_per_s: 0,
                    pull_mb_per_s: 1_800,
                },
            ],
            kv_bytes_per_token: 23_040,
        };
        for (case, request, view, names) in smoke_cases() {
            // A timeout can be the machine's fault (the thread was descheduled, the pool slot
            // was cold): refuse only a policy that times out every time.
            let mut timeouts = 0;
            loop {
                match policy.decide_measured(&request, &view, &smoke_measured, &names) {
                    Ok(_) => break,
                    Err(PolicyError::Timeout { .. }) if timeouts < SMOKE_TIMEOUT_RETRIES => {
                        timeouts += 1;
                    }
                    Err(e) => {
                        return Err(PolicyError::SmokeTest {
                            name: policy.core.spec.name.clone(),
                            case,
                            source: Box::new(e),
                        });
                    }
                }
            }
        }
        tracing::info!(
            policy = %policy.core.spec.name,
            version = %policy.core.guest.version,
            compiled_from = ?policy.compiled_from,
            compile_time = ?policy.compile_time,
            "policy loaded"
        );
        if policy.core.spec.spares > 0 {
            self.inner.spares.refill_now(&policy.core);
        }
        Ok(policy)
    }

    fn compile(
        &self,
        name: &str,
        digest: [u8; 32],
        sha256: &str,
        wasm: &[u8],
    ) -> Result<(Component, CompiledFrom), PolicyError> {
        let cached = |cache: &Vec<([u8; 32], Component)>| {
            cache
                .iter()
                .find(|(d, _)| *d == digest)
                .map(|(_, c)| c.clone())
        };
        if let Some(c) = cached(&self.cache()) {
            return Ok((c, CompiledFrom::Memory));
        }
        let engine = &self.inner.engine;
        let compile_err = |e: wasmtime::Error| PolicyError::Compile {
            name: name.to_string(),
            source: e.into_boxed_dyn_error(),
        };
        let started = Instant::now();
        let (component, from) = match &self.inner.disk {
            Some(disk) => match disk.load(engine, sha256) {
                Some(c) => (c, CompiledFrom::Disk),
                None => (
                    disk.compile_and_store(engine, sha256, wasm)
                        .map_err(compile_err)?,
                    CompiledFrom::Compiled,
                ),
            },
            None => (
                Component::new(engine, wasm).map_err(compile_err)?,
                CompiledFrom::Compiled,
            ),
        };
        tracing::debug!(policy = %name, ?from, elapsed = ?started.elapsed(), "policy compiled");
        let mut cache = self.cache();
        if cached(&cache).is_none() {
            if cache.len() >= COMPILE_CACHE_ENTRIES {
                cache.remove(0);
            }
            cache.push((digest, component.clone()));
        }
        Ok((component, from))
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Vec<([u8; 32], Component)>> {
        // The cache holds no invariant a panic could break: use it even if poisoned.
        self.inner.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The synthetic calls of the load-time smoke test: 2 prefill + 2 decode + 1 standalone nodes,
/// with `n = 1` and `n = 3`.
fn smoke_cases() -> Vec<(&'static str, Request, View, NodeNames)> {
    let node = |role: Role, waiting: u32| Node {
        role,
        free_blocks: 900,
        total_blocks: 1024,
        leased_blocks: 4,
        waiting,
        running: 2,
        waiting_remote_kv: 1,
        draining: false,
        conversation_tokens: 0,
        conversation_expiry_ms: 0,
    };
    let view = View {
        nodes: vec![
            node(Role::Prefill, 1),
            node(Role::Prefill, 0),
            node(Role::Decode, 3),
            node(Role::Decode, 2),
            node(Role::Standalone, 0),
        ],
    };
    let names: Arc<[Arc<str>]> = (0..view.nodes.len())
        .map(|i| Arc::from(format!("smoke-{i}")))
        .collect();
    let request = |seq: u64, n: u32| Request {
        seq,
        api: Api::ChatCompletions,
        prompt_tokens: 40,
        block_size: 16,
        block_hashes: vec![0x9e37_79b9_7f4a_7c15, 0xc2b2_ae3d_27d4_eb4f],
        prefix_blocks: vec![2, 0, 0, 1, 0],
        n,
        max_tokens: Some(16),
        stream: false,
        conversation_key: None,
    };
    vec![
        ("n=1", request(0, 1), view.clone(), names.clone()),
        ("n=3", request(1, 3), view, names),
    ]
}

/// Where a loaded policy's machine code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompiledFrom {
    /// Compiled by this load.
    Compiled,
    /// The engine's in-memory cache (the same bytes were loaded before by this process).
    Memory,
    /// The on-disk cache (compiled by an earlier load, maybe by an earlier process).
    Disk,
}

/// A component pre-instantiated against the world it exports, `decide`'s type checked.
enum Pre {
    /// `pd:policy/policy@0.1.0`: the view as records.
    V1(v1::PolicyPre<HostState>),
    /// `pd:policy/policy@0.2.0`: the view as columns, with the nodes' rates.
    V2(v2::PolicyPre<HostState>),
    /// `pd:policy/policy@0.3.0`: 0.2.0's view with roles as index lists; decode targets as
    /// two lists.
    V3(v3::PolicyPre<HostState>),
}

/// A loaded, smoke-tested policy component, ready to decide. Shared across threads; each
/// call runs in its own store.
pub struct WasmPolicy {
    core: Arc<Core>,
    sha256: String,
    loaded_at: SystemTime,
    compiled_from: CompiledFrom,
    compile_time: Duration,
}

/// What a call needs to make a store and run the guest; shared with the spare thread, which
/// keeps `spares` topped up (`spare.rs`).
pub(crate) struct Core {
    engine: Arc<EngineInner>,
    pre: Pre,
    guest: Arc<GuestMeta>,
    spec: PolicySpec,
    /// Stores instantiated ahead and never called, at most `spec.spares`.
    spares: Mutex<Vec<Fresh>>,
}

/// A store with the component instantiated in it and nothing called yet: the spec's memory
/// limit and fuel set (instantiation spent some of the fuel, as it would inline), the
/// instantiation's WASI randomness seeded with [`INSTANTIATE_SEED`], no node names.
struct Fresh {
    store: Store<HostState>,
    bound: Bound,
}

/// The instantiated component, through the bindings of the world it exports.
enum Bound {
    V1(v1::Policy),
    V2(v2::Policy),
    V3(v3::Policy),
}

/// The seed of the WASI randomness a guest draws while it is instantiated (a runtime's start-up:
/// Go's hash seeds). Fixed, so that an instance made ahead of a request starts exactly as one
/// made inline; the call itself draws from the request's `seq`.
const INSTANTIATE_SEED: u64 = 0;

impl std::fmt::Debug for WasmPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmPolicy")
            .field("spec", &self.core.spec)
            .field("sha256", &self.sha256)
            .field("loaded_at", &self.loaded_at)
            .finish_non_exhaustive()
    }
}

impl WasmPolicy {
    /// Hex sha256 of the component's bytes.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The spec it was loaded with.
    pub fn spec(&self) -> &PolicySpec {
        &self.core.spec
    }

    /// When it was loaded.
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }

    /// Where its machine code came from, and how long getting it took (compiling, or reading
    /// the cache).
    pub fn compiled(&self) -> (CompiledFrom, Duration) {
        (self.compiled_from, self.compile_time)
    }

    /// The contract version the component exports: `"0.1.0"`, `"0.2.0"` or `"0.3.0"`.
    pub fn contract(&self) -> &'static str {
        match self.core.pre {
            Pre::V1(_) => "0.1.0",
            Pre::V2(_) => "0.2.0",
            Pre::V3(_) => "0.3.0",
        }
    }

    /// Instances made ahead of calls and ready now (at most [`PolicySpec::spares`]).
    pub fn spares_ready(&self) -> usize {
        self.core.lock_spares().len()
    }

    /// [`WasmPolicy::decide_measured`] with no rates measured.
    pub fn decide(
        &self,
        request: &Request,
        view: &View,
        node_names: &Arc<[Arc<str>]>,
    ) -> Result<Decision, PolicyError> {
        self.decide_with_stats(request, view, &Measured::default(), node_names)
            .0
    }

    /// Decides where `request` goes: a fresh store (one made ahead by the spare thread when
    /// one is ready, else made now), the spec's limits, the guest's `decide`, then
    /// [`validate`]. `node_names[i]` names `view.nodes[i]` for the guest's `host.node-name`
    /// (logs only); `measured` is what the nodes report beyond the 0.1.0 view (a 0.2.0 policy
    /// sees it).
    ///
    /// # Errors
    ///
    /// [`PolicyError::Timeout`], [`PolicyError::OutOfFuel`], [`PolicyError::MemoryLimit`] or
    /// [`PolicyError::Trap`] when the guest breaks a limit or traps;
    /// [`PolicyError::Instantiate`] when no pool slot is free; [`PolicyError::Call`] when the
    /// guest's answer cannot be read; [`PolicyError::Invalid`] for an invalid decision. The
    /// policy stays usable after any of these.
    pub fn decide_measured(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        node_names: &Arc<[Arc<str>]>,
    ) -> Result<Decision, PolicyError> {
        self.decide_with_stats(request, view, measured, node_names)
            .0
    }

    /// [`WasmPolicy::decide_measured`], also returning what the call cost (for metrics).
    pub fn decide_with_stats(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        node_names: &Arc<[Arc<str>]>,
    ) -> (Result<Decision, PolicyError>, CallStats) {
        let core = &self.core;
        let spare = core.lock_spares().pop();
        let from_spare = spare.is_some();
        let fresh = match spare {
            Some(f) => Ok(f),
            None => core.instantiate(),
        };
        let (result, stats) = match fresh {
            Err((e, stats)) => (Err(e), stats),
            Ok(mut fresh) => {
                let fuel = fresh.store.get_fuel().unwrap_or(0);
                let active = core.engine.clock.enter(core.spec.deadline);
                let state = fresh.store.data_mut();
                state.begin_call(request.seq, node_names.clone());
                state.watch = Watch::new(&active, core.spec.deadline, fuel);
                fresh.store.set_epoch_deadline(1);
                let result = fresh.call(request, view, measured);
                drop(active);
                let result = result
                    .map_err(|e| core.call_error(e, false))
                    .and_then(|lifted| lifted.map_err(PolicyError::Invalid));
                let stats = CallStats {
                    spare: from_spare,
                    ..core.stats(&fresh.store)
                };
                // Dropping the store resets its pooled memory: the spare thread does it, and
                // makes this policy a new spare.
                if core.spec.spares > 0 {
                    core.engine.spares.recycle(fresh.store, core);
                }
                (result, stats)
            }
        };
        let result = result.and_then(|d| {
            validate(&d, request, view)?;
            Ok(d)
        });
        if let Err(e) = &result {
            tracing::debug!(policy = %core.spec.name, reason = e.reason(), error = %e, "policy call failed");
        }
        (result, stats)
    }

    /// The first smoke test: an instance can be created at all (a memory limit below the
    /// guest's initial memory, say, fails here).
    fn check_instantiate(&self) -> Result<(), PolicyError> {
        match self.core.instantiate() {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(PolicyError::SmokeTest {
                name: self.core.spec.name.clone(),
                case: "instantiate",
                source: Box::new(e),
            }),
        }
    }
}

impl Core {
    fn lock_spares(&self) -> std::sync::MutexGuard<'_, Vec<Fresh>> {
        // A list of stores holds no invariant a panic could break.
        self.spares.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new store with the spec's memory limit, fuel and epoch deadline set, the component
    /// instantiated in it (under the deadline: a guest whose start-up loops is stopped).
    fn instantiate(&self) -> Result<Fresh, (PolicyError, CallStats)> {
        let state = HostState {
            guest: self.guest.clone(),
            names: Arc::from([]),
            limiter: Limiter {
                memory_limit: self.spec.memory_limit,
                last_desired: 0,
            },
            log_lines: 0,
            seed: INSTANTIATE_SEED,
            clock: Arc::default(),
            wasi: None,
            watch: Watch::IDLE,
        };
        let mut store = Store::new(&self.engine.engine, state);
        store.limiter(|s| &mut s.limiter);
        if let Err(e) = store.set_fuel(self.spec.fuel) {
            return Err((engine_err(e), CallStats::default()));
        }
        // Each store checks its own call's deadline whenever the epoch advances (`epoch.rs`).
        store.epoch_deadline_callback(|mut ctx| {
            let fuel = ctx.get_fuel().unwrap_or(0);
            if ctx.data_mut().watch.expired(fuel) {
                Err(Trap::Interrupt.into())
            } else {
                Ok(UpdateDeadline::Continue(1))
            }
        });
        let active = self.engine.clock.enter(self.spec.deadline);
        store.data_mut().watch = Watch::new(&active, self.spec.deadline, self.spec.fuel);
        store.set_epoch_deadline(1);
        let bound = match &self.pre {
            Pre::V1(pre) => pre.instantiate(&mut store).map(Bound::V1),
            Pre::V2(pre) => pre.instantiate(&mut store).map(Bound::V2),
            Pre::V3(pre) => pre.instantiate(&mut store).map(Bound::V3),
        };
        drop(active);
        match bound {
            Ok(bound) => Ok(Fresh { store, bound }),
            Err(e) => Err((self.call_error(e, true), self.stats(&store))),
        }
    }

    fn stats(&self, store: &Store<HostState>) -> CallStats {
        CallStats {
            fuel_used: self.spec.fuel.saturating_sub(store.get_fuel().unwrap_or(0)),
            spare: false,
        }
    }

    /// Maps a failed instantiation or call to its typed error.
    fn call_error(&self, e: wasmtime::Error, instantiating: bool) -> PolicyError {
        if let Some(hit) = e.chain().find_map(|c| c.downcast_ref::<MemoryLimitHit>()) {
            return PolicyError::MemoryLimit {
                limit: hit.limit,
                desired: hit.desired,
            };
        }
        match e.chain().find_map(|c| c.downcast_ref::<Trap>()).copied() {
            Some(Trap::Interrupt) => PolicyError::Timeout {
                deadline: self.spec.deadline,
            },
            Some(Trap::OutOfFuel) => PolicyError::OutOfFuel {
                fuel: self.spec.fuel,
            },
            Some(trap) => PolicyError::Trap {
                trap,
                detail: format!("{e:?}"),
            },
            None if instantiating => PolicyError::Instantiate {
                name: self.spec.name.clone(),
                source: e.into_boxed_dyn_error(),
            },
            None => PolicyError::Call {
                source: e.into_boxed_dyn_error(),
            },
        }
    }
}

impl Refill for Core {
    fn refill(&self) {
        while self.lock_spares().len() < self.spec.spares {
            match self.instantiate() {
                Ok(fresh) => self.lock_spares().push(fresh),
                Err((e, _)) => {
                    tracing::debug!(policy = %self.spec.name, error = %e, "spare instance not made");
                    return;
                }
            }
        }
    }
}

impl Fresh {
    /// Calls `decide` through the generated bindings of the component's world (a 0.2.0 policy
    /// gets the view as columns, a 0.3.0 one with roles as index lists) and lifts the answer
    /// into 0.1.0's decision (a 0.3.0 decision can be malformed on the way: the inner error).
    fn call(
        &mut self,
        request: &Request,
        view: &View,
        measured: &Measured,
    ) -> wasmtime::Result<Result<Decision, InvalidDecision>> {
        Ok(match &self.bound {
            Bound::V1(policy) => Ok(policy.call_decide(&mut self.store, request, view)?),
            Bound::V2(policy) => {
                Ok(policy.call_decide(&mut self.store, request, &columns(view, measured))?)
            }
            Bound::V3(policy) => {
                lift_v3(policy.call_decide(&mut self.store, request, &indexed(view, measured))?)
            }
        })
    }
}

/// What the guest's host imports read: shared by all calls of one policy.
#[derive(Debug)]
struct GuestMeta {
    name: String,
    version: String,
    config: BTreeMap<String, String>,
}

/// Store data of one call.
struct HostState {
    guest: Arc<GuestMeta>,
    /// `names[i]` names `view.nodes[i]` (shared with the caller, never copied).
    names: Arc<[Arc<str>]>,
    limiter: Limiter,
    log_lines: u32,
    /// Seeds the WASI random generators: [`INSTANTIATE_SEED`] while the component is
    /// instantiated, then the request's `seq`.
    seed: u64,
    /// The guest's WASI monotonic clock (ns): it runs on across [`HostState::begin_call`].
    clock: Arc<AtomicU64>,
    /// Built on the guest's first WASI call: most policies never make one.
    wasi: Option<WasiState>,
    /// The running call's (or instantiation's) deadline, which the store's epoch callback
    /// checks ([`Watch::expired`]).
    watch: Watch,
}

impl HostState {
    /// The instance is about to serve request `seq`, whose view's nodes `names` names. A WASI
    /// context built while instantiating is rebuilt, its randomness seeded with `seq` (its
    /// resources and its monotonic clock carry on), so a decision draws the same bytes whether
    /// its instance was made ahead or just now.
    fn begin_call(&mut self, seq: u64, names: Arc<[Arc<str>]>) {
        self.names = names;
        self.seed = seq;
        self.log_lines = 0;
        if let Some(w) = &mut self.wasi {
            w.ctx = wasi_ctx(seq, self.clock.clone());
        }
    }
}

struct WasiState {
    ctx: WasiCtx,
    table: ResourceTable,
}

/// A policy's WASI context: no preopens, environment, arguments or sockets; stdin empty,
/// stdout and stderr discarded; clocks and randomness reproducible (see the module docs).
fn wasi_ctx(seed: u64, clock: Arc<AtomicU64>) -> WasiCtx {
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

/// Bytes the WASI random generators cycle through (a guest asks for a few: hash seeds).
const RANDOM_BYTES: usize = 4096;

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

impl v1::pd::policy::types::Host for HostState {}

impl v2::pd::policy0_2_0::cluster::Host for HostState {}
impl v3::pd::policy0_3_0::cluster::Host for HostState {}

impl v1::pd::policy::host::Host for HostState {
    fn log(&mut self, level: Level, mut message: String) {
        self.log_lines += 1;
        if self.log_lines > MAX_LOG_LINES_PER_CALL {
            return;
        }
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        if self.log_lines == MAX_LOG_LINES_PER_CALL {
            message.push_str(" (log limit reached: further lines of this call are dropped)");
        }
        let (policy, version) = (&self.guest.name, &self.guest.version);
        match level {
            Level::Debug => {
                tracing::debug!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
            Level::Info => {
                tracing::info!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
            Level::Warn => {
                tracing::warn!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
            Level::Error => {
                tracing::error!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
        }
    }

    fn now_ns(&mut self) -> u64 {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        let origin = *ORIGIN.get_or_init(Instant::now);
        u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn config(&mut self, key: String) -> Option<String> {
        self.guest.config.get(&key).cloned()
    }

    fn node_name(&mut self, index: u32) -> Option<String> {
        self.names.get(index as usize).map(|n| n.to_string())
    }
}

/// The guest tried to grow a memory past its limit.
#[derive(Debug, thiserror::Error)]
#[error("memory limit: a memory tried to grow to {desired} bytes, limit {limit}")]
struct MemoryLimitHit {
    desired: usize,
    limit: usize,
}

/// Caps each linear memory at the spec's limit and turns any failed growth into a typed
/// trap ([`MemoryLimitHit`]), so the host tells "out of memory" from other traps.
struct Limiter {
    memory_limit: usize,
    last_desired: usize,
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
        Ok(maximum.is_none_or(|m| desired <= m) && desired <= 20_000)
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

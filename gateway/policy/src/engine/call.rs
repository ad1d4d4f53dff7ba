//! The per-call path: [`WasmPolicy`] and the store each call runs in.
//!
//! Per call ([`WasmPolicy::decide_at`]): a store that has seen one instantiation and no call,
//! either made ahead on the `pd-policy-spare` thread (`spare.rs`; [`PolicySpec::spares`] per
//! policy, replaced as they are used) or, when none is ready, made now: the spec's memory
//! limit and fuel set, the component instantiated from the pre-instantiated component (pooled,
//! copy-on-write memory) under the epoch deadline, with WASI randomness seeded by a fixed seed
//! during instantiation. The call then sets the caller's node names (shared, not copied), the
//! request's seed, the time `now-ns` reads and a new epoch deadline, and calls `decide`
//! through the bindings `bindgen!` generated from the WIT (`world.rs`; no hand-written
//! lowering); the result is validated, and the store goes to the spare thread to be dropped
//! (its pooled memory reset there). A store that trapped is never reused. Both ways give the
//! same decision and use the same fuel (`tests/sandbox.rs`).
//!
//! A policy whose component declares itself stateless (`stateless.rs`) keeps the stores that
//! answered a valid decision, warm, in the same ready list (at most `max(spares, 1)`), and the
//! next call takes one: no cold copy-on-write pages, no runtime start-up, which is most of an
//! interpreted guest's call (docs/bench-log/policy-decisions.md, 2026-12-02). Each call still
//! gets its own store (a call pops it; concurrent calls each take or make one), the whole
//! fuel budget, a new deadline, and the per-request data above, the WASI clock set back to
//! where instantiation left it, so its decision and record are those of a fresh store. A call
//! that fails in any way drops its store: a trapped instance is never called again.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use wasmtime::{Store, Trap, UpdateDeadline};

use super::host::{GuestMeta, HostState, NodeNames};
use super::sandbox::MemoryLimitHit;
use super::world::{Bound, Pre};
use super::{CompiledFrom, EngineInner, PolicySpec, engine_err};
use crate::Measured;
use crate::epoch::Watch;
use crate::spare::Refill;
use crate::{Decision, PolicyError, Request, View, validate};

/// What one call cost the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallStats {
    /// Fuel consumed, instantiation included.
    pub fuel_used: u64,
    /// The call ran in an instance made ahead of it, off the request path
    /// ([`PolicySpec::spares`]); else it instantiated on the request path.
    pub spare: bool,
    /// The call ran in a warm instance that had served earlier calls (a policy that declares
    /// itself stateless: [`WasmPolicy::reuses_instances`]); its fuel is the call's alone.
    pub warm: bool,
}

/// A loaded, smoke-tested policy component, ready to decide. Shared across threads; each
/// call runs in its own store.
pub struct WasmPolicy {
    pub(super) core: Arc<Core>,
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
    pub(super) spec: PolicySpec,
    /// The component declares itself stateless (`stateless.rs`): a store that answered a
    /// call goes back to `spares` as a warm instance instead of being dropped.
    reuse: bool,
    /// Stores instantiated ahead: never called, at most `spec.spares`; for a policy that
    /// reuses instances also warm ones that answered calls, at most [`Core::ready_cap`].
    spares: Mutex<Vec<Fresh>>,
}

/// A store with the component instantiated in it and nothing called yet: the spec's memory
/// limit and fuel set (instantiation spent some of the fuel, as it would inline), the
/// instantiation's WASI randomness seeded with the fixed instantiation seed, no node names.
/// Reused (a stateless policy), it is also a store that answered calls, none of which failed.
pub(super) struct Fresh {
    store: Store<HostState>,
    bound: Bound,
    /// Calls it answered.
    calls: u64,
}

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
    /// A policy of `core` loaded now, from a component whose hex sha256 is `sha256`.
    pub(super) fn new(
        core: Core,
        sha256: String,
        compiled_from: CompiledFrom,
        compile_time: Duration,
    ) -> Self {
        WasmPolicy {
            core: Arc::new(core),
            sha256,
            loaded_at: SystemTime::now(),
            compiled_from,
            compile_time,
        }
    }

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

    /// The contract version the component exports (`"1.0.0"`).
    pub fn contract(&self) -> &'static str {
        self.core.pre.contract()
    }

    /// Instances made ahead of calls and ready now (at most [`PolicySpec::spares`]; for a
    /// policy that [reuses instances](WasmPolicy::reuses_instances), warm ones included).
    pub fn spares_ready(&self) -> usize {
        self.core.lock_spares().len()
    }

    /// The component declares itself stateless ([`crate::STATELESS_SECTION`]), so calls run
    /// in warm instances reused across calls (one per concurrent call, at most
    /// `max(spares, 1)` kept); an instance whose call failed in any way is dropped, never
    /// reused. Else every call runs in a fresh store.
    pub fn reuses_instances(&self) -> bool {
        self.core.reuse
    }

    /// Asks the spare thread to make this policy's spares now (none when `spares` is 0).
    pub(super) fn refill_spares(&self) {
        if self.core.spec.spares > 0 {
            self.core.engine.spares.refill_now(&self.core);
        }
    }

    /// [`WasmPolicy::decide_measured`] with no rates measured.
    pub fn decide(
        &self,
        request: &Request,
        view: &View,
        node_names: &NodeNames,
    ) -> Result<Decision, PolicyError> {
        self.decide_with_stats(request, view, &Measured::default(), node_names)
            .0
    }

    /// [`WasmPolicy::decide_at`] with no time recorded for the request: the guest's `now-ns`
    /// reads 0.
    ///
    /// # Errors
    ///
    /// As [`WasmPolicy::decide_at`].
    pub fn decide_measured(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        node_names: &NodeNames,
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
        node_names: &NodeNames,
    ) -> (Result<Decision, PolicyError>, CallStats) {
        self.decide_at_with_stats(request, view, measured, node_names, 0)
    }

    /// Decides where `request` goes: a fresh store (one made ahead by the spare thread when
    /// one is ready, else made now), the spec's limits, the guest's `decide`, then
    /// [`validate`](fn@validate). `node_names[i]` names `view.nodes[i]` for the guest's
    /// `host.node-name` (logs only); `measured` is what the nodes report beside the view
    /// (the policy sees it in its view's columns); `time_ms` is when the gateway took the request, in
    /// milliseconds since the Unix epoch (a decision record's `time-ms`): every `now-ns` of the
    /// call reads it, in nanoseconds, so a replay that passes the record's `time-ms` gives the
    /// guest the same clock.
    ///
    /// # Errors
    ///
    /// [`PolicyError::Timeout`], [`PolicyError::OutOfFuel`], [`PolicyError::MemoryLimit`] or
    /// [`PolicyError::Trap`] when the guest breaks a limit or traps;
    /// [`PolicyError::Instantiate`] when no pool slot is free; [`PolicyError::Call`] when the
    /// guest's answer cannot be read; [`PolicyError::Invalid`] for an invalid decision. The
    /// policy stays usable after any of these.
    pub fn decide_at(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        node_names: &NodeNames,
        time_ms: u64,
    ) -> Result<Decision, PolicyError> {
        self.decide_at_with_stats(request, view, measured, node_names, time_ms)
            .0
    }

    /// [`WasmPolicy::decide_at`], also returning what the call cost (for metrics).
    pub fn decide_at_with_stats(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        node_names: &NodeNames,
        time_ms: u64,
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
                let warm = fresh.calls > 0;
                if warm {
                    // The call gets the whole budget: instantiation was paid by an earlier one.
                    if let Err(e) = fresh.store.set_fuel(core.spec.fuel) {
                        return (Err(engine_err(e)), CallStats::default());
                    }
                }
                let fuel = fresh.store.get_fuel().unwrap_or(0);
                let active = core.engine.clock.enter(core.spec.deadline);
                let state = fresh.store.data_mut();
                state.begin_call(request.seq, node_names.clone(), time_ms);
                state.watch = Watch::new(&active, core.spec.deadline, fuel);
                fresh.store.set_epoch_deadline(1);
                let result = fresh
                    .bound
                    .decide(&mut fresh.store, request, view, measured);
                drop(active);
                let result = result
                    .map_err(|e| core.call_error(e, false))
                    .and_then(|lifted| lifted.map_err(PolicyError::Invalid))
                    .and_then(|d| {
                        validate(&d, request, view)?;
                        Ok(d)
                    });
                let stats = CallStats {
                    spare: from_spare,
                    warm,
                    ..core.stats(&fresh.store, warm)
                };
                fresh.calls += 1;
                core.put_back(fresh, result.is_ok());
                (result, stats)
            }
        };
        if let Err(e) = &result {
            tracing::debug!(policy = %core.spec.name, reason = e.reason(), error = %e, "policy call failed");
        }
        (result, stats)
    }
}

impl Core {
    /// What a call of the component `pre` (whose hex sha256 is `sha256`) under `spec` needs.
    /// `reuse`: the component declares itself stateless (`stateless.rs`).
    pub(super) fn new(
        engine: Arc<EngineInner>,
        pre: Pre,
        spec: PolicySpec,
        sha256: &str,
        reuse: bool,
    ) -> Self {
        let guest = Arc::new(GuestMeta {
            name: spec.name.clone(),
            version: sha256[..12].to_string(),
            config: spec.config.clone(),
        });
        Core {
            engine,
            pre,
            guest,
            spec,
            reuse,
            spares: Mutex::new(Vec::new()),
        }
    }

    /// Instances a policy that reuses them keeps ready, warm or not: one per concurrent call
    /// up to `spares`, and at least one, so that a policy with no spares still stays warm.
    fn ready_cap(&self) -> usize {
        self.spec.spares.max(1)
    }

    /// After a call in `used`: a policy that reuses instances keeps it warm when the call
    /// succeeded (`ok`), its memory did not grow past half its room (`Limiter::worn`: a guest
    /// that leaks gets a new instance before a call fails at the limit) and fewer than
    /// [`Core::ready_cap`] are ready. Otherwise (a trap,
    /// fuel, memory or deadline, or an invalid or unreadable answer: the instance may be
    /// broken; or a policy that never reuses) the store is dropped, on the spare thread when
    /// the policy has spares (which also makes a new one), else here.
    fn put_back(self: &Arc<Self>, mut used: Fresh, ok: bool) {
        if self.reuse && ok && !used.store.data().limiter.worn() {
            let mut ready = self.lock_spares();
            if ready.len() < self.ready_cap() {
                ready.push(used);
                return;
            }
            // Full: the spare thread topped the list up while this call ran. Keep the warm
            // instance and give up a never-called one (at the front) instead.
            if ready.first().is_some_and(|f| f.calls == 0) {
                used = std::mem::replace(&mut ready[0], used);
                ready.rotate_left(1);
            }
        }
        // Dropping the store resets its pooled memory: the spare thread does it, and makes
        // this policy a new spare.
        if self.spec.spares > 0 {
            self.engine.spares.recycle(used.store, self);
        }
    }

    fn lock_spares(&self) -> MutexGuard<'_, Vec<Fresh>> {
        // A list of stores holds no invariant a panic could break.
        self.spares.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new store with the spec's memory limit, fuel and epoch deadline set, the component
    /// instantiated in it (under the deadline: a guest whose start-up loops is stopped).
    pub(super) fn instantiate(&self) -> Result<Fresh, (PolicyError, CallStats)> {
        let state = HostState::new(self.guest.clone(), self.spec.memory_limit);
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
        let bound = self.pre.instantiate(&mut store);
        drop(active);
        match bound {
            Ok(bound) => {
                store.data_mut().instantiated();
                Ok(Fresh {
                    store,
                    bound,
                    calls: 0,
                })
            }
            Err(e) => Err((self.call_error(e, true), self.stats(&store, false))),
        }
    }

    /// What the call (with its instantiation, unless `warm`) cost.
    fn stats(&self, store: &Store<HostState>, warm: bool) -> CallStats {
        CallStats {
            fuel_used: self.spec.fuel.saturating_sub(store.get_fuel().unwrap_or(0)),
            spare: false,
            warm,
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
                // A policy that reuses instances takes the warmest first (from the end):
                // new ones queue behind the warm ones, for concurrent calls.
                Ok(fresh) if self.reuse => self.lock_spares().insert(0, fresh),
                Ok(fresh) => self.lock_spares().push(fresh),
                Err((e, _)) => {
                    tracing::debug!(policy = %self.spec.name, error = %e, "spare instance not made");
                    return;
                }
            }
        }
    }
}

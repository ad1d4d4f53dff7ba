//! What serves decisions now, swapped without blocking readers.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::SystemTime;

use arc_swap::{ArcSwap, ArcSwapOption, Guard};

use crate::native::NativePolicy;
use crate::{Decision, Measured, PolicyError, Request, View, WasmPolicy, validate};

/// When this process first asked for a native policy's load time: native policies are built
/// in, so they count as loaded from (about) process start.
static NATIVE_LOADED_AT: LazyLock<SystemTime> = LazyLock::new(SystemTime::now);

/// A policy ready to serve.
#[derive(Debug)]
pub enum Installed {
    /// A built-in policy ([`crate::native`]), by name: `least-loaded`, `round-robin`,
    /// `prefix-aware`.
    Native {
        /// Its name.
        name: String,
    },
    /// A loaded WASM component.
    Wasm(WasmPolicy),
}

impl Installed {
    /// The policy's name: the native name, or the WASM spec's name.
    pub fn name(&self) -> &str {
        match self {
            Installed::Native { name } => name,
            Installed::Wasm(p) => &p.spec().name,
        }
    }

    /// `native` for a native policy; for WASM, the first 12 hex digits of the sha256.
    pub fn version(&self) -> String {
        match self {
            Installed::Native { .. } => "native".to_string(),
            Installed::Wasm(p) => p.sha256()[..12].to_string(),
        }
    }

    /// The component's hex sha256; none for a native policy.
    pub fn sha256(&self) -> Option<&str> {
        match self {
            Installed::Native { .. } => None,
            Installed::Wasm(p) => Some(p.sha256()),
        }
    }

    /// The operator's config the policy reads (`host.config`); none for a native policy.
    pub fn config(&self) -> Option<&std::collections::BTreeMap<String, String>> {
        match self {
            Installed::Native { .. } => None,
            Installed::Wasm(p) => Some(&p.spec().config),
        }
    }

    /// When the WASM policy was loaded; for a native one, about when the process started.
    pub fn loaded_at(&self) -> SystemTime {
        match self {
            Installed::Native { .. } => *NATIVE_LOADED_AT,
            Installed::Wasm(p) => p.loaded_at(),
        }
    }

    /// [`Installed::decide_at`] with no time recorded for the request (a WASM guest's
    /// `now-ns` reads 0).
    ///
    /// # Errors
    ///
    /// As [`Installed::decide_at`].
    pub fn decide(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        node_names: &Arc<[Arc<str>]>,
    ) -> Result<Decision, PolicyError> {
        self.decide_at(request, view, measured, node_names, 0)
    }

    /// Decides with this policy, and validates the decision (see
    /// [`WasmPolicy::decide_at`]). `time_ms` is when the gateway took the request (ms since
    /// the Unix epoch; what a WASM guest's `now-ns` reads, and a decision record's `time-ms`:
    /// a replay passes the record's again). A native policy reads no clock.
    ///
    /// # Errors
    ///
    /// [`PolicyError::UnknownNative`] for a native name that is not one of
    /// [`NativePolicy::ALL`]; [`PolicyError::Invalid`] for an invalid native decision; the
    /// errors of [`WasmPolicy::decide_at`].
    pub fn decide_at(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        node_names: &Arc<[Arc<str>]>,
        time_ms: u64,
    ) -> Result<Decision, PolicyError> {
        match self {
            Installed::Native { name } => {
                let d = NativePolicy::from_name(name)?.decide_measured(request, view, measured);
                validate(&d, request, view)?;
                Ok(d)
            }
            Installed::Wasm(p) => p.decide_at(request, view, measured, node_names, time_ms),
        }
    }
}

/// The installed policy plus the one before it, for rollback. Readers never block: a reader
/// holds the whole policy it loaded until it drops it, even across a swap.
#[derive(Debug)]
pub struct PolicySlot {
    current: ArcSwap<Installed>,
    previous: ArcSwapOption<Installed>,
    /// Serializes writers, so `current` and `previous` change together.
    writer: Mutex<()>,
}

impl PolicySlot {
    /// A slot serving `initial`, with nothing to roll back to.
    pub fn new(initial: Installed) -> Self {
        PolicySlot {
            current: ArcSwap::from_pointee(initial),
            previous: ArcSwapOption::empty(),
            writer: Mutex::new(()),
        }
    }

    /// A slot serving `current` that rolls back to `previous`: the slot a restarted gateway
    /// rebuilds from its state store.
    pub fn restored(current: Installed, previous: Option<Installed>) -> Self {
        PolicySlot {
            current: ArcSwap::from_pointee(current),
            previous: ArcSwapOption::new(previous.map(Arc::new)),
            writer: Mutex::new(()),
        }
    }

    /// The policy serving now (cheap; hold it only for one decision).
    pub fn current(&self) -> Guard<Arc<Installed>> {
        self.current.load()
    }

    /// The policy serving now, as an owned `Arc` (to keep across an await or a thread hop).
    pub fn current_arc(&self) -> Arc<Installed> {
        self.current.load_full()
    }

    /// The policy a [`PolicySlot::rollback`] would go back to.
    pub fn previous(&self) -> Option<Arc<Installed>> {
        self.previous.load_full()
    }

    /// Serves `policy` from now on; the one it replaces becomes the rollback target.
    pub fn install(&self, policy: Installed) {
        let _w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.current.swap(Arc::new(policy));
        tracing::info!(from = %old.name(), to = %self.current.load().name(), "policy installed");
        self.previous.store(Some(old));
    }

    /// Serves `current` with `previous` as the rollback target, as another gateway saved them
    /// (a shared state store).
    pub fn replace(&self, current: Installed, previous: Option<Installed>) {
        let _w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.current.swap(Arc::new(current));
        tracing::info!(from = %old.name(), to = %self.current.load().name(), "policy replaced");
        self.previous.store(previous.map(Arc::new));
    }

    /// Goes back to the previous policy. The one rolled back from becomes the new rollback
    /// target, so a second rollback undoes the first.
    ///
    /// # Errors
    ///
    /// [`PolicyError::NothingToRollBack`] when nothing was installed before.
    pub fn rollback(&self) -> Result<(), PolicyError> {
        let _w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let previous = self
            .previous
            .load_full()
            .ok_or(PolicyError::NothingToRollBack)?;
        let old = self.current.swap(previous);
        tracing::info!(from = %old.name(), to = %self.current.load().name(), "policy rolled back");
        self.previous.store(Some(old));
        Ok(())
    }
}

//! Routing policies for `pd-gateway`: the WASM policy host, the native policies, and the
//! hot-swappable slot that serves decisions.
//!
//! This crate owns the host side of the policy contract (`wit/policy.wit`, `pd:policy@1.0.0`,
//! world `policy`) and the gateway's routing types ([`Request`], [`View`] of [`Node`]s,
//! [`Measured`], [`Decision`], [`Route`]: `model.rs`). The contract's generated bindings are
//! private to `wit.rs`, which converts once per call at the edge: the gateway's view into the
//! contract's columns, the guest's answer back into a [`Decision`]. The WASM host is
//! `engine/`, one file per concern:
//!
//! - `engine/mod.rs`: the [`PolicyEngine`] (wasmtime configuration and pooling allocator,
//!   linker, epoch thread) and [`PolicyEngine::load`]; [`PolicySpec`] and the host's limits;
//! - `engine/compile.rs`: compiling, with the in-memory cache in front of the on-disk one
//!   (`precompiled.rs`, [`PolicyEngine::with_disk_cache`]);
//! - `engine/world.rs`: type-checking a component against the contract's world, and calling
//!   `decide` through its bindings (`wit.rs`);
//! - `engine/smoke.rs`: the smoke test a policy passes before it is loaded;
//! - `engine/call.rs`: [`WasmPolicy`] and the per-call path ([`WasmPolicy::decide_at`]: a
//!   fresh or spare store (`spare.rs`), or a warm one for a policy that declares itself
//!   stateless (`stateless.rs`: [`declare_stateless`]), under memory, fuel and deadline limits
//!   (`epoch.rs`), typed call errors, [`CallStats`]);
//! - `engine/sandbox.rs`: the guest's locked-down, reproducible WASI and its memory limiter;
//! - `engine/host.rs`: the host imports (`log`, `now-ns` = the request's recorded time,
//!   `config`, `node-name`) and the store data they read.
//!
//! Beside it: checking decisions ([`validate`](fn@validate)), the native policies that share
//! the guests' rules ([`native`]: `least-loaded` serves by default until a policy is pushed;
//! `prefix-aware` decides when a pushed one fails), the [`PolicySlot`] that swaps and rolls
//! back policies while requests read it, and decision records in the WIT's own names
//! ([`record`]: the decision log's, test cases' and replay's format; a record's `time-ms` is
//! what the guest's `now-ns` read, so a replay is exact).
//!
//! This crate does not speak HTTP, run an async runtime (no tokio: calls are synchronous and
//! take microseconds; the gateway decides where they run), or touch models (no candle). It
//! does not build guest policies: `scripts/build-policies.sh` does.

#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod engine;
mod epoch;
mod error;
mod model;
pub mod native;
mod precompiled;
pub mod record;
mod slot;
mod spare;
mod stateless;
mod validate;
mod wit;

pub use engine::{
    CallStats, CompiledFrom, DEFAULT_FUEL, DEFAULT_SPARES, MAX_CONCURRENT_CALLS, MAX_MEMORY_LIMIT,
    MAX_SPARES, NodeNames, PolicyEngine, PolicySpec, WasmPolicy,
};
pub use epoch::TICK as EPOCH_TICK;
pub use error::{CALL_FAILURE_REASONS, PolicyError};
pub use model::{
    Api, Decision, DecodeTarget, Measured, Node, Rates, Rejection, Request, ReversePull, Role,
    Route, Split, View,
};
pub use precompiled::{CacheDirError, default_cache_dir};
pub use record::{Record, RecordError, WIT_VERSION};
pub use slot::{Installed, PolicySlot};
pub use stateless::{STATELESS_SECTION, declare_stateless, declares_stateless};
pub use validate::{InvalidDecision, Slot, validate};
/// The trap codes of [`PolicyError::Trap`], re-exported so callers need no wasmtime dependency.
pub use wasmtime::Trap;

/// For the crate's benches only, not part of the API: the host's own share of a call,
/// without a guest.
#[doc(hidden)]
pub mod bench_support {
    use crate::{Decision, Measured, Request, View};

    /// What the host does per call besides lowering, the guest and lifting: converts
    /// `request` and `view` into the contract's types (the columns a call lowers) and
    /// validates `decision`. Returns a figure of the columns so nothing is optimized away.
    pub fn host_side(
        request: &Request,
        view: &View,
        measured: &Measured,
        decision: &Decision,
    ) -> usize {
        let r = crate::wit::request(request);
        let v = crate::wit::view(view, measured);
        let valid = crate::validate(decision, request, view).is_ok();
        r.prefix_blocks.len() + v.free_blocks.len() + v.decode.len() + usize::from(valid)
    }
}

//! The one `bindgen!` of the policy contract (`wit/policy.wit`, world `policy`).
//!
//! Host imports (`pd:policy/host`) are plain, non-trappable functions implemented on the
//! store's state in `engine.rs`. The generated types get `PartialEq`/`Eq` so decisions can
//! be compared (tests, replay).

#![allow(missing_docs, unreachable_pub, missing_debug_implementations)]

wasmtime::component::bindgen!({
    path: "../../wit",
    world: "policy",
    additional_derives: [PartialEq, Eq],
});

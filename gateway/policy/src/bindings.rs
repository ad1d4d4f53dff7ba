//! The `bindgen!`s of the policy contract: one per package version the gateway hosts.
//!
//! - [`v1`]: `pd:policy@0.1.0` (`wit/policy.wit`), world `policy`: the request, the decision,
//!   the host imports, and the view as a list of `node` records.
//! - [`v2`]: `pd:policy@0.2.0` (`wit/0.2.0/policy.wit`), world `policy`: 0.1.0's request,
//!   decision and host imports (mapped onto [`v1`]'s generated types with `with`, so both
//!   worlds share them), and the view as columns with the nodes' measured rates.
//! - [`v3`]: `pd:policy@0.3.0` (`wit/0.3.0/policy.wit`), world `policy`: 0.1.0's request and
//!   host imports (mapped onto [`v1`]'s types the same way), 0.2.0's view with roles as three
//!   index lists, and its own decision (a split's decode targets as two lists), which
//!   `validate.rs` lifts into [`v1`]'s decision.
//!
//! Host imports (`pd:policy/host@0.1.0`) are plain, non-trappable functions implemented on
//! the store's state in `engine/host.rs`. The generated types get `PartialEq`/`Eq` so
//! decisions can be compared (tests, replay).

#![allow(missing_docs, unreachable_pub, missing_debug_implementations)]

pub mod v1 {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "pd:policy/policy@0.1.0",
        additional_derives: [PartialEq, Eq],
    });
}

pub mod v2 {
    wasmtime::component::bindgen!({
        path: "../../wit/0.2.0",
        world: "pd:policy/policy@0.2.0",
        additional_derives: [PartialEq, Eq],
        with: {
            "pd:policy/types@0.1.0": super::v1::pd::policy::types,
            "pd:policy/host@0.1.0": super::v1::pd::policy::host,
        },
    });
}

pub mod v3 {
    wasmtime::component::bindgen!({
        path: "../../wit/0.3.0",
        world: "pd:policy/policy@0.3.0",
        additional_derives: [PartialEq, Eq],
        with: {
            "pd:policy/types@0.1.0": super::v1::pd::policy::types,
            "pd:policy/host@0.1.0": super::v1::pd::policy::host,
        },
    });
}

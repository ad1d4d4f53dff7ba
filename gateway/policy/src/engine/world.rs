//! Version dispatch: which world of the contract a component exports, found once at load, and
//! each call made through that world's generated bindings (`bindings.rs`), its answer lifted
//! into 0.1.0's [`Decision`].

use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::host::HostState;
use crate::bindings::{v1, v2, v3};
use crate::columns::{Measured, columns, indexed};
use crate::validate::lift_v3;
use crate::{Decision, InvalidDecision, Request, View};

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A component pre-instantiated against the world it exports, `decide`'s type checked.
pub(super) enum Pre {
    /// `pd:policy/policy@0.1.0`: the view as records.
    V1(v1::PolicyPre<HostState>),
    /// `pd:policy/policy@0.2.0`: the view as columns, with the nodes' rates.
    V2(v2::PolicyPre<HostState>),
    /// `pd:policy/policy@0.3.0`: 0.2.0's view with roles as index lists; decode targets as
    /// two lists.
    V3(v3::PolicyPre<HostState>),
}

/// The component's `decide` matches none of the worlds the gateway hosts.
#[derive(Debug, thiserror::Error)]
#[error(
    "the component matches none of pd:policy@0.1.0, pd:policy@0.2.0 and pd:policy@0.3.0 \
     (against 0.2.0: {against_v2:#}; against 0.3.0: {against_v3:#})"
)]
pub(super) struct NoMatchingWorld {
    /// Why it is not a 0.1.0 policy.
    #[source]
    against_v1: BoxError,
    /// Why it is not a 0.2.0 policy.
    against_v2: wasmtime::Error,
    /// Why it is not a 0.3.0 policy.
    against_v3: wasmtime::Error,
}

impl Pre {
    /// Type-checks the `decide` export against each world the gateway hosts, newest first:
    /// the newest that matches is the policy's contract.
    pub(super) fn new(pre: InstancePre<HostState>) -> Result<Pre, NoMatchingWorld> {
        let against_v3 = match v3::PolicyPre::new(pre.clone()) {
            Ok(p) => return Ok(Pre::V3(p)),
            Err(e) => e,
        };
        let against_v2 = match v2::PolicyPre::new(pre.clone()) {
            Ok(p) => return Ok(Pre::V2(p)),
            Err(e) => e,
        };
        match v1::PolicyPre::new(pre) {
            Ok(p) => Ok(Pre::V1(p)),
            Err(e) => Err(NoMatchingWorld {
                against_v1: e.into_boxed_dyn_error(),
                against_v2,
                against_v3,
            }),
        }
    }

    /// The contract version: `"0.1.0"`, `"0.2.0"` or `"0.3.0"`.
    pub(super) fn contract(&self) -> &'static str {
        match self {
            Pre::V1(_) => "0.1.0",
            Pre::V2(_) => "0.2.0",
            Pre::V3(_) => "0.3.0",
        }
    }

    /// Instantiates the component in `store`.
    pub(super) fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Bound> {
        match self {
            Pre::V1(pre) => pre.instantiate(store).map(Bound::V1),
            Pre::V2(pre) => pre.instantiate(store).map(Bound::V2),
            Pre::V3(pre) => pre.instantiate(store).map(Bound::V3),
        }
    }
}

/// The instantiated component, through the bindings of the world it exports.
pub(super) enum Bound {
    V1(v1::Policy),
    V2(v2::Policy),
    V3(v3::Policy),
}

impl Bound {
    /// Calls `decide` through the generated bindings of the component's world (a 0.2.0 policy
    /// gets the view as columns, a 0.3.0 one with roles as index lists) and lifts the answer
    /// into 0.1.0's decision (a 0.3.0 decision can be malformed on the way: the inner error).
    pub(super) fn decide(
        &self,
        store: &mut Store<HostState>,
        request: &Request,
        view: &View,
        measured: &Measured,
    ) -> wasmtime::Result<Result<Decision, InvalidDecision>> {
        Ok(match self {
            Bound::V1(policy) => Ok(policy.call_decide(store, request, view)?),
            Bound::V2(policy) => {
                Ok(policy.call_decide(store, request, &columns(view, measured))?)
            }
            Bound::V3(policy) => {
                lift_v3(policy.call_decide(store, request, &indexed(view, measured))?)
            }
        })
    }
}

//! The contract's world: a component type-checked against `pd:policy/policy@1.0.0` once at
//! load, and each call made through its generated bindings, converted at the edge (`wit.rs`).

use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::host::HostState;
use crate::wit::{self, CONTRACT, Policy, PolicyPre};
use crate::{Decision, InvalidDecision, Measured, Request, View};

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A component pre-instantiated against the contract's world, `decide`'s type checked.
pub(super) struct Pre(PolicyPre<HostState>);

/// The component's `decide` is not the contract's.
#[derive(Debug, thiserror::Error)]
#[error("the component does not export pd:policy@{CONTRACT}'s `decide`: {source:#}")]
pub(super) struct NoMatchingWorld {
    #[source]
    source: BoxError,
}

impl Pre {
    /// Type-checks the `decide` export against the contract's world.
    pub(super) fn new(pre: InstancePre<HostState>) -> Result<Pre, NoMatchingWorld> {
        PolicyPre::new(pre).map(Pre).map_err(|e| NoMatchingWorld {
            source: e.into_boxed_dyn_error(),
        })
    }

    /// The contract version the component exports.
    pub(super) fn contract(&self) -> &'static str {
        CONTRACT
    }

    /// Instantiates the component in `store`.
    pub(super) fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Bound> {
        self.0.instantiate(store).map(Bound)
    }
}

/// The instantiated component.
pub(super) struct Bound(Policy);

impl Bound {
    /// Calls `decide` with `request`, `view` and `measured` converted into the contract's types
    /// and lifts the answer into the gateway's [`Decision`] (a split whose two lists differ in
    /// length is invalid on the way: the inner error).
    pub(super) fn decide(
        &self,
        store: &mut Store<HostState>,
        request: &Request,
        view: &View,
        measured: &Measured,
    ) -> wasmtime::Result<Result<Decision, InvalidDecision>> {
        let answer =
            self.0
                .call_decide(store, &wit::request(request), &wit::view(view, measured))?;
        Ok(wit::decision(answer))
    }
}

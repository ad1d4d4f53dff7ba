//! Applying what other gateways change in a shared store ([`super::Change`]): the policy slot
//! (within the notification's round trip: well under a second), the drains, and stored
//! responses another replica deleted.

use std::sync::Arc;

use pd_policy::PolicyEngine;
use tokio::sync::broadcast;
use tracing::{info, warn};

use super::Change;
use super::policy::{PolicyKeeper, restore};
use crate::cluster::Cluster;
use crate::conversation::ResponseStore;
use crate::route::Router;

/// What a gateway changes when another one announces a change.
#[derive(Debug, Clone)]
pub struct Follower {
    /// Saves and applies the policy slot.
    pub keeper: PolicyKeeper,
    /// Loads stored policies.
    pub engine: Arc<PolicyEngine>,
    /// The slot.
    pub router: Arc<Router>,
    /// The drains.
    pub cluster: Arc<Cluster>,
    /// The responses in memory.
    pub responses: Arc<ResponseStore>,
}

impl Follower {
    /// Applies every change `changes` receives until the store is gone; a receiver that fell
    /// behind reads everything again.
    pub async fn follow(self, mut changes: broadcast::Receiver<Change>) {
        loop {
            match changes.recv().await {
                Ok(c) => self.apply(c).await,
                Err(broadcast::error::RecvError::Lagged(_)) => self.apply(Change::Resync).await,
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    }

    /// Applies one change.
    pub async fn apply(&self, change: Change) {
        match change {
            Change::Policy => self.policy().await,
            Change::Drains => self.drains().await,
            Change::Turns(ids) => self.responses.forget(&ids),
            Change::Resync => {
                self.policy().await;
                self.drains().await;
            }
        }
    }

    /// Serves the stored policy slot if it is newer than what serves here.
    async fn policy(&self) {
        let _held = self.keeper.lock().await;
        let state = self.keeper.state();
        let record = match state.policy().await {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                warn!(error = %e, "reading the stored policy after a change failed");
                return;
            }
        };
        if record.generation <= self.keeper.applied() {
            return;
        }
        match restore(state, &self.engine, &record).await {
            Ok((current, previous)) => {
                info!(policy = %current.name(), version = %current.version(),
                      generation = record.generation, "policy changed by another gateway: installed");
                self.router.slot().replace(current, previous);
                self.router.publish_info();
                self.keeper.set_applied(record.generation);
            }
            Err(e) => warn!(error = %e, "another gateway's policy does not load here"),
        }
    }

    /// Takes the stored drains as the operator's.
    async fn drains(&self) {
        match self.keeper.state().drains().await {
            Ok(d) => self.cluster.replace_drains(d),
            Err(e) => warn!(error = %e, "reading the drains after a change failed"),
        }
    }
}

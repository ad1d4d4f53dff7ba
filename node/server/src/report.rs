//! What this node tells the gateway (`--gateway`): its registration, its load and leases, and the
//! block hashes of its prefix cache, read from the engine without ever making it wait.
//!
//! [`EngineSource`] is the [`pd_report::StateSource`] over an [`EngineHandle`]: counters come from
//! the engine's gauges and lease book; block hashes from a [`StoredBlocks`] set kept in step with
//! the engine's prefix-cache events by [`mirror_cache`]. The reporter itself (connect, backoff,
//! resync) is `pd_report`'s.

use std::collections::HashSet;
use std::sync::Arc;

use pd_engine::EngineHandle;
use pd_kv_pool::CacheEvent;
use pd_report::{BlockSubscription, LeaseCounters, NodeStateSnapshot, StateSource, StoredBlocks};
use tokio::sync::broadcast::error::RecvError;

use crate::KvRole;
use crate::drain::Drain;

/// The engine as the reporter reads it.
#[derive(Debug)]
pub struct EngineSource {
    engine: EngineHandle,
    stored: Arc<StoredBlocks>,
    /// The moving average of this node's pull bandwidth (bytes/s), from its transfer metrics.
    pull_rate: prometheus::Gauge,
    /// Set once the node drains (`SIGTERM`): sent as `NodeState.draining`.
    drain: Arc<Drain>,
}

impl EngineSource {
    /// Reads `engine` (and the pull bandwidth average `pull_rate`, bytes/s, and whether the node
    /// drains); starts mirroring its prefix cache (needs a tokio runtime).
    pub fn new(engine: EngineHandle, pull_rate: prometheus::Gauge, drain: Arc<Drain>) -> Self {
        let stored = Arc::new(StoredBlocks::new());
        tokio::spawn(mirror_cache(engine.clone(), stored.clone()));
        Self {
            engine,
            stored,
            pull_rate,
            drain,
        }
    }
}

impl StateSource for EngineSource {
    fn state(&self) -> NodeStateSnapshot {
        let m = self.engine.metrics();
        let leases = self.engine.lease_stats();
        let n = |g: &prometheus::IntGauge| g.get().max(0) as u64;
        NodeStateSnapshot {
            total_blocks: self.engine.info().num_blocks as u64,
            free_blocks: self.engine.free_blocks() as u64,
            waiting: n(&m.waiting),
            running: n(&m.running),
            waiting_remote_kv: n(&m.waiting_remote_kv),
            leases: LeaseCounters {
                granted: leases.counts.granted,
                renewed: leases.counts.renewed,
                released: leases.counts.released,
                expired: leases.counts.expired,
                live: leases.live as u64,
            },
            leased_blocks: leases.leased_blocks as u64,
            prefill_tokens_per_s: m.prefill_tokens_per_second.get().round() as u32,
            pull_mb_per_s: (self.pull_rate.get() / 1e6).round() as u32,
            draining: self.drain.is_draining(),
        }
    }

    fn subscribe_blocks(&self) -> BlockSubscription {
        self.stored.subscribe()
    }
}

/// Keeps `stored` equal to the engine's prefix cache: a snapshot, then its changes; after
/// falling behind, a fresh snapshot. Ends when the engine stops.
pub async fn mirror_cache(engine: EngineHandle, stored: Arc<StoredBlocks>) {
    loop {
        let Ok(mut sub) = engine.subscribe_cache().await else {
            return;
        };
        let now: HashSet<u64> = sub.cached.iter().map(|h| h.0).collect();
        for h in stored.subscribe().stored {
            if !now.contains(&h) {
                stored.remove(h);
            }
        }
        for h in now {
            stored.insert(h);
        }
        loop {
            match sub.events.recv().await {
                Ok(CacheEvent::Stored(h)) => {
                    stored.insert(h.0);
                }
                Ok(CacheEvent::Removed(h)) => {
                    stored.remove(h.0);
                }
                Err(RecvError::Lagged(n)) => {
                    tracing::debug!(missed = n, "prefix-cache mirror fell behind; resyncing");
                    break;
                }
                Err(RecvError::Closed) => return,
            }
        }
    }
}

/// The registry's name for a role.
pub fn role(role: KvRole) -> pd_report::Role {
    match role {
        KvRole::Standalone => pd_report::Role::Standalone,
        KvRole::Producer => pd_report::Role::Producer,
        KvRole::Consumer => pd_report::Role::Consumer,
        KvRole::Both => pd_report::Role::Both,
    }
}

//! What this node tells the gateway (`--gateway`): its registration, its load and leases, and the
//! block hashes of its prefix cache, read from the engine without ever making it wait.
//!
//! [`EngineSource`] is the [`pd_report::StateSource`] over an [`EngineHandle`]: counters come from
//! the engine's gauges and lease book; block hashes from a [`StoredBlocks`] set kept in step with
//! the engine's prefix-cache events by [`mirror_cache`]; the conversation turns it retains from a
//! [`RetainedTurns`] set the HTTP layer fills as it answers them and [`forget_ended_turns`]
//! empties as their leases end. The reporters themselves (one per
//! gateway address: connect, backoff, resync, merging what the gateways say) are
//! `pd_report`'s; [`report_to_gateways`] starts them, adopts the cluster token they agree on,
//! and releases a gateway's leases when its stream ends ([`release_leases_of_gateways_left`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use pd_engine::EngineHandle;
use pd_kv_pool::CacheEvent;
use pd_report::{
    BlockSubscription, GatewayLeft, Gateways, LeaseCounters, NodeStateSnapshot, Registration,
    ReportError, RetainedTurns, StateSource, StoredBlocks, TurnSubscription,
};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{mpsc, watch};

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
    /// The conversation turns this node retains, when it reports them.
    turns: Option<Arc<RetainedTurns>>,
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
            turns: None,
        }
    }

    /// Reports the retained turns `turns` too (the HTTP layer adds them as it answers them),
    /// and starts taking out those whose lease ended ([`forget_ended_turns`]).
    pub fn with_turns(mut self, turns: Option<Arc<RetainedTurns>>) -> Self {
        if let Some(t) = &turns {
            tokio::spawn(forget_ended_turns(
                self.engine.clone(),
                Arc::downgrade(t),
                TURN_SWEEP,
            ));
        }
        self.turns = turns;
        self
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

    fn subscribe_turns(&self) -> Option<TurnSubscription> {
        self.turns.as_ref().map(|t| t.subscribe())
    }
}

/// How often the reported turns are checked against the lease book.
pub const TURN_SWEEP: Duration = Duration::from_millis(100);

/// Takes out of `turns`, every `every`, the turns whose retained lease ended (released by a
/// gateway or a reader, pulled, expired, revoked for blocks): the gateways then forget them.
/// One short lock on the lease book per sweep, never the engine thread. Ends with `turns`.
pub async fn forget_ended_turns(
    engine: EngineHandle,
    turns: std::sync::Weak<RetainedTurns>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(turns) = turns.upgrade() else {
            return;
        };
        let mut ids = Vec::new();
        for id in turns.lease_ids() {
            match id.parse::<pd_kv_pool::LeaseId>() {
                Ok(l) => ids.push(l),
                Err(_) => {
                    turns.remove(&id);
                }
            }
        }
        // One short lock on the lease book for all of them.
        for ended in engine.leases().ended(&ids) {
            turns.remove(&ended.to_string());
        }
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

/// The `event` label of `pd_kv_leases_total` counting leases released because the gateway
/// they were granted for left.
pub const GATEWAY_LEFT_EVENT: &str = "gateway_left";

/// Where and how [`report_to_gateways`] reports.
#[derive(Debug)]
pub struct GatewaysConfig {
    /// `--gateway` entries.
    pub entries: Vec<String>,
    /// `--gateway-resolve-ms`.
    pub resolve_every: Duration,
    /// The cluster's TLS (`--tls-*`).
    pub tls: Option<pd_tls::ClusterTls>,
}

/// Starts reporting `registration` and `source` to every gateway of `config` on the current
/// runtime. The cluster token the gateways hand out (when the node has none of its own) goes
/// to `cluster_token`; when a gateway's stream ends, the leases granted for its requests are
/// released and counted in `gateway_left` (`pd_kv_leases_total{event="gateway_left"}`).
///
/// # Errors
/// A `--gateway` entry that is not `host:port`.
pub fn report_to_gateways(
    config: GatewaysConfig,
    registration: Registration,
    source: Arc<dyn StateSource>,
    engine: EngineHandle,
    cluster_token: watch::Sender<Option<String>>,
    gateway_left: prometheus::IntCounter,
) -> Result<Gateways, ReportError> {
    let options = pd_report::GatewaysOptions {
        reporter: pd_report::ReporterOptions {
            tls: config.tls,
            ..pd_report::ReporterOptions::default()
        },
        resolve_every: config.resolve_every,
        ..pd_report::GatewaysOptions::default()
    };
    let mut gateways = Gateways::spawn(&config.entries, registration, source, options)?;
    tracing::info!(gateways = ?config.entries, "reporting to the gateways");
    // The gateways' token (configured there, or minted) becomes the side channel's.
    let mut from_gateways = gateways.cluster_token();
    tokio::spawn(async move {
        loop {
            let t = from_gateways.borrow_and_update().clone();
            if t.as_deref().is_some_and(|t| !t.is_empty()) {
                cluster_token.send_replace(t);
            }
            if from_gateways.changed().await.is_err() {
                return;
            }
        }
    });
    if let Some(left) = gateways.take_gateways_left() {
        tokio::spawn(release_leases_of_gateways_left(left, engine, gateway_left));
    }
    Ok(gateways)
}

/// For each gateway that left, releases the leases this node granted for the requests it
/// sent (`x-pd-gateway-id`): nobody will hand them to a decode node any more. Counted in
/// `released`. Retained turns, untagged leases and other gateways' stay. Ends with the feed.
pub async fn release_leases_of_gateways_left(
    mut left: mpsc::UnboundedReceiver<GatewayLeft>,
    engine: EngineHandle,
    released: prometheus::IntCounter,
) {
    while let Some(GatewayLeft { gateway_id, addr }) = left.recv().await {
        let n = engine.release_gateway_leases(&gateway_id);
        released.inc_by(n as u64);
        if n > 0 {
            tracing::warn!(gateway = %addr, gateway_id = %gateway_id, leases = n, "the gateway's stream ended: released the leases granted for its requests");
        } else {
            tracing::debug!(gateway = %addr, gateway_id = %gateway_id, "the gateway's stream ended; it held no lease here");
        }
    }
}

//! Shutting down without losing work: what a node does between `SIGTERM` and its exit.
//!
//! A rolling restart sends each process `SIGTERM` and waits for it to leave. A node that stopped
//! at once would cut the streams it decodes, refuse requests the gateway had just routed to it,
//! and — as a prefill node — close its KV side channel under decode nodes that have P's answer
//! but have not pulled its blocks yet: with `--kv-load-failure-policy fail` each of those is a
//! failed request, with `recompute` a wasted prefill. So a node *drains* instead, in this order
//! (driven by `main.rs`, up to `--drain-timeout` in all):
//!
//! 1. [`Drain::begin`]: the flag the reporter sends as `NodeState.draining`, so the gateway
//!    routes no new work here; the node still serves everything that comes.
//! 2. [`engine_quiet`]: wait until nothing is queued, running or waiting for KV, for a settle
//!    time longer than the reporter's change poll (a request the gateway routed just before it
//!    saw the flag arrives within it).
//! 3. The HTTP server stops accepting and finishes its open requests (axum's graceful shutdown).
//! 4. [`leases_pulled`]: wait until every lease granted to a decode node is released or expired
//!    (a retained conversation turn is not waited for: its next turn recomputes, as after any
//!    restart of its holder).
//! 5. The KV side channel and the reporter stop (the gateway drops the node), and it exits.
//!
//! A second signal ends the process at once. This module holds the flag and the waits; it does
//! not own the servers it stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pd_engine::EngineHandle;
use tokio::time::Instant;

/// How often the waits below look at the engine.
const POLL: Duration = Duration::from_millis(20);
/// How long the engine must stay idle before a draining node stops accepting connections:
/// longer than the reporter's change poll (100 ms), so the gateway has seen the flag first.
pub const SETTLE: Duration = Duration::from_millis(300);

/// Whether this node is draining: shared by the signal handler and the reporter.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
}

impl Drain {
    /// Marks the node as draining (idempotent).
    pub fn begin(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether [`Drain::begin`] was called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

/// Requests the engine holds: queued, running, or parked until their KV arrives.
fn engine_load(engine: &EngineHandle) -> i64 {
    let m = engine.metrics();
    m.waiting.get() + m.running.get() + m.waiting_remote_kv.get()
}

/// Waits until the engine has held no request for `settle` in a row, or until `deadline`;
/// whether it got quiet.
pub async fn engine_quiet(engine: &EngineHandle, settle: Duration, deadline: Instant) -> bool {
    let mut quiet_since = None;
    loop {
        let now = Instant::now();
        if engine_load(engine) > 0 {
            quiet_since = None;
        } else if now.duration_since(*quiet_since.get_or_insert(now)) >= settle {
            return true;
        }
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(POLL.min(deadline - now)).await;
    }
}

/// Leases live for decode nodes (retained conversation turns not counted).
fn handoff_leases(engine: &EngineHandle) -> usize {
    let s = engine.lease_stats();
    s.live.saturating_sub(s.retained)
}

/// Waits until no lease granted to a decode node is live, or until `deadline`; whether they
/// all ended.
pub async fn leases_pulled(engine: &EngineHandle, deadline: Instant) -> bool {
    loop {
        if handoff_leases(engine) == 0 {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            tracing::warn!(
                leases = handoff_leases(engine),
                "drain timeout: leases still unpulled; their decode nodes will not find them"
            );
            return false;
        }
        tokio::time::sleep(POLL.min(deadline - now)).await;
    }
}

//! Asking the policy: the current policy (hot-swapped in a [`PolicySlot`]) decides; when it
//! fails (trap, timeout, limit, an invalid decision) the built-in native prefix-aware decides
//! instead (at the thresholds the failed policy's config sets under prefix-aware's keys, the
//! defaults elsewhere, with what the nodes measured), or the request fails
//! with 503 if the operator chose so. Either way the failure is logged with the policy's
//! version and counted.
//!
//! **Decided:** the fallback is prefix-aware, not least-loaded. A failed call on a
//! conversation's turn then still sends it to the node holding the history (or has P pull it
//! back); least-loaded knows no holders, and the turn's history was recomputed (a 19.5 s turn
//! on the VM, docs/bench-log/multi-turn.md, "Reservations are not work"). For a request
//! without a holder it is least-loaded weighed against cached prefix blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pd_policy::{Decision, Installed, Measured, PolicySlot, Record, Request, Route, View, native};
use tracing::warn;

use crate::decision_log::DecisionLog;
use crate::error::{GatewayError, InternalError};
use crate::metrics::Metrics;

/// The policy label of decisions the built-in fallback made.
pub const FALLBACK: &str = "fallback-prefix-aware";

/// What a policy failure does to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnPolicyFailure {
    /// The built-in prefix-aware policy decides instead (the request is served).
    Fallback,
    /// The request fails with 503.
    Fail,
}

/// The policy slot plus what every decision needs.
#[derive(Debug)]
pub struct Router {
    slot: PolicySlot,
    seq: AtomicU64,
    on_failure: OnPolicyFailure,
    metrics: Metrics,
    log: Arc<DecisionLog>,
}

/// A decision and who made it.
#[derive(Debug)]
pub struct Decided {
    /// The decision (validated).
    pub decision: Decision,
    /// The policy that served it (the fallback's name when it stepped in).
    pub policy: String,
    /// Its version.
    pub version: String,
}

impl Router {
    /// A router over `slot`, sampling its decisions into `log`.
    pub fn new(
        slot: PolicySlot,
        on_failure: OnPolicyFailure,
        metrics: Metrics,
        log: Arc<DecisionLog>,
    ) -> Self {
        let r = Self {
            slot,
            seq: AtomicU64::new(0),
            on_failure,
            metrics,
            log,
        };
        r.publish_info();
        r
    }

    /// The slot, for the admin API.
    pub fn slot(&self) -> &PolicySlot {
        &self.slot
    }

    /// The decision log, for the admin API.
    pub fn log(&self) -> &DecisionLog {
        &self.log
    }

    /// Refreshes the `policy_info` gauge after a swap, and starts the new policy's decision
    /// and failure counters at 0 (a dashboard shows the version serving before its first
    /// decision, and each failure reason as 0 rather than no data).
    pub fn publish_info(&self) {
        let p = self.slot.current();
        let (name, version) = (p.name(), p.version());
        self.metrics.policy_info.reset();
        self.metrics
            .policy_info
            .with_label_values(&[name, &version, p.sha256().unwrap_or("")])
            .set(1);
        self.metrics.decisions.with_label_values(&[name, &version]);
        for reason in pd_policy::CALL_FAILURE_REASONS {
            self.metrics
                .policy_failures
                .with_label_values(&[name, &version, reason]);
        }
    }

    /// The next request sequence number.
    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Decides where `request` goes.
    ///
    /// # Errors
    /// 503 when the policy failed and the operator chose to fail, or the fallback could not
    /// decide either.
    pub fn decide(
        &self,
        request: &Request,
        view: &View,
        measured: &Measured,
        names: &Arc<[Arc<str>]>,
    ) -> Result<Decided, GatewayError> {
        let installed = self.slot.current();
        let version = installed.version();
        // The time the policy's `now-ns` reads, recorded with the decision so replay gives the
        // guest the same.
        let time_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .and_then(|d| u64::try_from(d.as_millis()).ok())
            .unwrap_or(0);
        let start = Instant::now();
        let outcome = installed.decide_at(request, view, measured, names, time_ms);
        let elapsed = start.elapsed();
        let took = elapsed.as_secs_f64();
        let decided = self.settle(
            &installed,
            version,
            outcome,
            took,
            (request, view, measured),
        )?;
        let route = match decided.decision.route {
            Route::Split(_) => "split",
            Route::Whole(_) => "whole",
            Route::Reject(_) => "reject",
        };
        self.metrics.routes.with_label_values(&[route]).inc();
        if self.log.sample() {
            let mut record = Record::new(request.clone(), view.clone(), decided.decision.clone());
            record.measured = measured.clone();
            record.node_names = names.iter().map(|n| n.to_string()).collect();
            record.fallback = decided.policy == FALLBACK;
            record.policy = Some(installed.name().to_owned());
            record.policy_sha256 = installed.sha256().map(str::to_owned);
            record.time_ms = Some(time_ms);
            record.latency_ns = u64::try_from(elapsed.as_nanos()).ok();
            self.log.record(&record);
        }
        Ok(decided)
    }

    /// Turns the policy's outcome into the decision served: the policy's, or the fallback's.
    fn settle(
        &self,
        installed: &Installed,
        version: String,
        outcome: Result<Decision, pd_policy::PolicyError>,
        took: f64,
        (request, view, measured): (&Request, &View, &Measured),
    ) -> Result<Decided, GatewayError> {
        match outcome {
            Ok(decision) => {
                self.metrics
                    .decision
                    .with_label_values(&[installed.name(), &version])
                    .observe(took);
                self.metrics
                    .decisions
                    .with_label_values(&[installed.name(), &version])
                    .inc();
                Ok(Decided {
                    decision,
                    policy: installed.name().to_owned(),
                    version,
                })
            }
            Err(e) => {
                let reason = e.reason();
                warn!(policy = installed.name(), version = %version, reason, "policy failed: {e}");
                self.metrics
                    .policy_failures
                    .with_label_values(&[installed.name(), &version, reason])
                    .inc();
                if self.on_failure == OnPolicyFailure::Fail {
                    return Err(GatewayError::PolicyFailed {
                        policy: installed.name().to_owned(),
                        version,
                        error: e,
                    });
                }
                self.metrics.fallbacks.with_label_values(&[reason]).inc();
                self.metrics
                    .decisions
                    .with_label_values(&[FALLBACK, "native"])
                    .inc();
                // The failed policy's config, where it sets prefix-aware's keys.
                let thresholds = installed.config().map_or_else(
                    native::prefix_aware::Thresholds::default,
                    |c| {
                        native::prefix_aware::Thresholds::from_config(|k| {
                            c.get(k).map(String::as_str)
                        })
                    },
                );
                let decision =
                    native::prefix_aware::prefix_aware_with(request, view, measured, &thresholds);
                pd_policy::validate(&decision, request, view).map_err(InternalError::from)?;
                Ok(Decided {
                    decision,
                    policy: FALLBACK.to_owned(),
                    version: "native".to_owned(),
                })
            }
        }
    }
}

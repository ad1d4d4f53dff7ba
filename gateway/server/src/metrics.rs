//! The gateway's Prometheus metrics, in their own registry (no global state), served on
//! `GET /metrics`.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric the gateway exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Requests by `api` and `outcome` (ok, client_error, node_error, timeout, rejected,
    /// internal_error, state_unavailable, aborted, overloaded).
    pub requests: IntCounterVec,
    /// Seconds from arrival to the last byte, by `api`.
    pub e2e: HistogramVec,
    /// Seconds from arrival to the first byte of the answer, by `api`.
    pub ttft: HistogramVec,
    /// Seconds the gateway itself spent on a request (parsing, tokenizing, the policy, rewriting
    /// bodies, the P→D handoff), by `api`: end-to-end time minus time waiting on nodes.
    pub added: HistogramVec,
    /// The gateway's own time by `phase` (`read` the client's body, `tokenize`, `view`, `policy`,
    /// `respond`: everything after the first node was called that is not waiting on nodes).
    pub phase: HistogramVec,
    /// Seconds one policy decision took (the whole host path), by `policy` and `version`.
    pub decision: HistogramVec,
    /// Decisions served, by `policy` and `version`.
    pub decisions: IntCounterVec,
    /// Policy failures by `policy`, `version` and `reason` (trap, timeout, out_of_fuel, memory,
    /// invalid_decision, ...).
    pub policy_failures: IntCounterVec,
    /// Decisions made by the built-in fallback after a policy failure, by `reason` (each of
    /// [`pd_policy::CALL_FAILURE_REASONS`] starts at 0).
    pub fallbacks: IntCounterVec,
    /// Decisions served (the policy's or the fallback's), by `route`: `split` (prefill on one
    /// node, decode on another), `whole` (one node serves it alone), `reject` (each starts at 0).
    pub routes: IntCounterVec,
    /// The policy serving now: 1 for its `name`, `version`, `sha256`.
    pub policy_info: IntGaugeVec,
    /// Live nodes by `role`.
    pub nodes_up: IntGaugeVec,
    /// Prompt tokens the chosen first node already held, summed over decisions.
    pub prefix_hit_tokens: IntCounter,
    /// Client requests whose `kv_transfer_params` were stripped (untrusted client).
    pub kv_params_stripped: IntCounter,
    /// `/v1/` calls refused for a missing or wrong API key (`--api-key`).
    pub unauthorized: IntCounter,
    /// Generation requests refused by admission (`--max-concurrent-requests`), by `reason`
    /// (`queue_full`, `queue_timeout`; each starts at 0).
    pub admission_refused: IntCounterVec,
    /// Node registrations refused, by `reason` (`engine_id_taken`: another live node holds the
    /// engine id; `unreachable_address`: a loopback address from another machine; `token`;
    /// `invalid`; `incompatible`: tokenizer, hash key or kind of node differs from the model's).
    pub registrations_refused: IntCounterVec,
    /// Generation requests being served now (set on scrape; 0 without a limit).
    pub in_flight: IntGauge,
    /// Generation requests waiting for a slot now (set on scrape).
    pub queued: IntGauge,
    /// Seconds a generation request waited for a slot, admitted or not (with a limit set; most
    /// find one at once).
    pub queue_wait: Histogram,
    /// Candidates given up for the next one, by `stage` (prefill, decode, whole: each starts
    /// at 0; others as they happen).
    pub failovers: IntCounterVec,
    /// P leases the gateway released itself (the client left, or a decode node failed).
    pub leases_released: IntCounterVec,
    /// Requests whose `n` children were spread over this many decode requests, by `groups`.
    pub spread: IntCounterVec,
    /// Requests whose prompt continues a retained turn, by `how` the turn's KV was used:
    /// `prefill_pulls` (P pulled it, then P→D), `holder` (a whole request on the node holding
    /// it, or a split whose prefill node holds it: served from that node's own blocks),
    /// `decode_pulls` (a whole request on another node, which pulled it), `partial` (asked
    /// for, but the prompt continues only the turn's prompt, not its answer as the model wrote
    /// it: a lease is pulled whole, so the history is recomputed), `not_used` (the policy did not
    /// ask for it: recomputed or served from a prefix cache). Each starts at 0.
    pub reverse_pulls: IntCounterVec,
    /// Seconds from arrival to the first byte of a request continuing a retained turn, by
    /// `how` the turn's KV was used (as in `reverse_pulls`): what route-to-holder and reverse
    /// pull buy against a recompute, on live traffic.
    pub continued_ttft: HistogramVec,
    /// Finished turns a node kept under a retained lease, indexed for the next turn.
    pub retained_turns: IntCounter,
    /// Node answers whose retained-turn `kv_transfer_params` were removed before the client
    /// (untrusted client).
    pub retained_params_hidden: IntCounter,
    /// Retained turns dropped from the index before a next turn could use them, by `why`
    /// (`expired`: the lease ran out; `holder_restarted`: the node came back with another epoch,
    /// its pool empty).
    pub conversation_dropped: IntCounterVec,
    /// Retained turns indexed now.
    pub conversation_holdings: IntGauge,
    /// Retained turns the nodes reported on their registry streams, by `event`: `added`
    /// (indexed), `removed` (their lease ended, or the node resynced or left), `refused`
    /// (unreadable, another node's, over the bounds).
    pub reported_turns: IntCounterVec,
    /// Bytes of `/v1/responses` turns kept for `previous_response_id`.
    pub responses_stored_bytes: IntGauge,
    /// `/v1/responses` turns dropped to stay within the store's bytes.
    pub responses_evicted: IntCounter,
    /// Calls to the state store (`--state-dir`), by operation and outcome (`ok`, `error`).
    pub state_calls: IntCounterVec,
    /// Endpoint Picker (`--ext-proc-port`) picks, by `route` (`split`, `whole`, `any`: a
    /// request without a generation body) and `outcome` (`picked`, or the immediate response's
    /// class: `rejected`, `unavailable`, `client_error`).
    pub picks: IntCounterVec,
    /// What the data plane reported as the endpoint that served a picked request, by `as`:
    /// `picked` (the primary), `fallback` (one of the fallbacks), `other`, `unreported`.
    pub picker_served: IntCounterVec,
    /// Time the picker took to answer a request's body (tokenize, view, policy).
    pub pick_duration: Histogram,
}

/// `how` label values of [`Metrics::reverse_pulls`].
const REVERSE_PULL_HOWS: [&str; 5] = [
    "prefill_pulls",
    "holder",
    "decode_pulls",
    "partial",
    "not_used",
];

/// `route` label values of [`Metrics::routes`].
pub const ROUTES: [&str; 3] = ["split", "whole", "reject"];

const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];
const DECISION_BUCKETS: &[f64] = &[
    0.000_001, 0.000_002, 0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_25, 0.000_5,
    0.001, 0.005,
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates the metrics in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone())).expect("unique metric name");
            c
        }
        let counters = |name: &str, help: &str, labels: &[&str]| {
            reg(
                &registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let histograms = |name: &str, help: &str, labels: &[&str], buckets: &[f64]| {
            reg(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                    labels,
                )
                .expect("valid metric"),
            )
        };
        let gauges = |name: &str, help: &str, labels: &[&str]| {
            reg(
                &registry,
                IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let counter = |name: &str, help: &str| {
            reg(
                &registry,
                IntCounter::with_opts(Opts::new(name, help)).expect("valid metric"),
            )
        };
        let m = Self {
            requests: counters(
                "pd_gateway_requests_total",
                "Requests by API and outcome.",
                &["api", "outcome"],
            ),
            e2e: histograms(
                "pd_gateway_request_duration_seconds",
                "Arrival to last byte.",
                &["api"],
                LATENCY_BUCKETS,
            ),
            ttft: histograms(
                "pd_gateway_time_to_first_byte_seconds",
                "Arrival to the first byte of the answer (first token when streaming).",
                &["api"],
                LATENCY_BUCKETS,
            ),
            added: histograms(
                "pd_gateway_added_latency_seconds",
                "Time the gateway itself spent on a request (end to end minus waiting on nodes).",
                &["api"],
                LATENCY_BUCKETS,
            ),
            phase: histograms(
                "pd_gateway_phase_seconds",
                "The gateway's own time on a request, by phase.",
                &["phase"],
                DECISION_BUCKETS,
            ),
            decision: histograms(
                "pd_gateway_policy_decision_seconds",
                "One policy decision, whole host path.",
                &["policy", "version"],
                DECISION_BUCKETS,
            ),
            decisions: counters(
                "pd_gateway_policy_decisions_total",
                "Decisions served by each policy version.",
                &["policy", "version"],
            ),
            policy_failures: counters(
                "pd_gateway_policy_failures_total",
                "Policy failures by reason.",
                &["policy", "version", "reason"],
            ),
            fallbacks: counters(
                "pd_gateway_policy_fallbacks_total",
                "Decisions made by the built-in fallback after a policy failure.",
                &["reason"],
            ),
            routes: counters(
                "pd_gateway_routes_total",
                "Decisions served, by route (split: prefill and decode on two nodes; whole: one node; reject).",
                &["route"],
            ),
            policy_info: gauges(
                "pd_gateway_policy_info",
                "The policy serving now.",
                &["name", "version", "sha256"],
            ),
            nodes_up: gauges("pd_gateway_nodes_up", "Live nodes by role.", &["role"]),
            prefix_hit_tokens: counter(
                "pd_gateway_prefix_hit_tokens_total",
                "Prompt tokens the first chosen node already held in its prefix cache.",
            ),
            kv_params_stripped: counter(
                "pd_gateway_kv_params_stripped_total",
                "Client requests whose kv_transfer_params were stripped (untrusted client).",
            ),
            unauthorized: counter(
                "pd_gateway_unauthorized_total",
                "/v1/ calls refused for a missing or wrong API key (--api-key).",
            ),
            admission_refused: counters(
                "pd_gateway_admission_refused_total",
                "Generation requests refused by admission (--max-concurrent-requests), by reason.",
                &["reason"],
            ),
            registrations_refused: counters(
                "pd_gateway_registrations_refused_total",
                "Node registrations refused, by reason (engine_id_taken, unreachable_address, token, invalid, incompatible).",
                &["reason"],
            ),
            in_flight: reg(
                &registry,
                IntGauge::with_opts(Opts::new(
                    "pd_gateway_requests_in_flight",
                    "Generation requests being served now (0 without --max-concurrent-requests).",
                ))
                .expect("valid metric"),
            ),
            queued: reg(
                &registry,
                IntGauge::with_opts(Opts::new(
                    "pd_gateway_requests_queued",
                    "Generation requests waiting for a slot now.",
                ))
                .expect("valid metric"),
            ),
            queue_wait: reg(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "pd_gateway_queue_wait_seconds",
                        "Time a generation request waited for a slot (--max-concurrent-requests).",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                )
                .expect("valid metric"),
            ),
            failovers: counters(
                "pd_gateway_failovers_total",
                "Candidates given up for the next one.",
                &["stage"],
            ),
            leases_released: counters(
                "pd_gateway_leases_released_total",
                "Prefill leases the gateway released itself, by why.",
                &["why"],
            ),
            spread: counters(
                "pd_gateway_decode_spread_total",
                "Split requests whose children went to more than one decode request, by how many.",
                &["groups"],
            ),
            reverse_pulls: counters(
                "pd_gateway_reverse_pulls_total",
                "Requests continuing a retained turn, by how its KV was used.",
                &["how"],
            ),
            continued_ttft: histograms(
                "pd_gateway_continued_turn_ttfb_seconds",
                "Arrival to first byte of requests continuing a retained turn, by how its KV was used.",
                &["how"],
                LATENCY_BUCKETS,
            ),
            retained_turns: counter(
                "pd_gateway_retained_turns_total",
                "Finished turns a node kept under a retained lease, indexed for the next turn.",
            ),
            retained_params_hidden: counter(
                "pd_gateway_retained_params_hidden_total",
                "Node answers whose retained-turn kv_transfer_params were removed (untrusted client).",
            ),
            conversation_dropped: counters(
                "pd_gateway_conversation_dropped_total",
                "Retained turns dropped from the index unused, by why.",
                &["why"],
            ),
            reported_turns: counters(
                "pd_gateway_reported_turns_total",
                "Retained turns the nodes reported on their registry streams, by event.",
                &["event"],
            ),
            conversation_holdings: reg(
                &registry,
                IntGauge::with_opts(Opts::new(
                    "pd_gateway_conversation_holdings",
                    "Retained turns indexed now.",
                ))
                .expect("valid metric"),
            ),
            responses_stored_bytes: reg(
                &registry,
                IntGauge::with_opts(Opts::new(
                    "pd_gateway_responses_stored_bytes",
                    "Bytes of /v1/responses turns kept for previous_response_id.",
                ))
                .expect("valid metric"),
            ),
            responses_evicted: counter(
                "pd_gateway_responses_evicted_total",
                "/v1/responses turns dropped to stay within the store's bytes.",
            ),
            state_calls: counters(
                "pd_gateway_state_calls_total",
                "Calls to the gateway's state store, by operation and outcome (ok, error).",
                &["op", "outcome"],
            ),
            picks: counters(
                "pd_gateway_picker_picks_total",
                "Endpoint Picker picks, by route and outcome.",
                &["route", "outcome"],
            ),
            picker_served: counters(
                "pd_gateway_picker_served_total",
                "Picked requests by how the endpoint the data plane reported as serving relates to the pick.",
                &["as"],
            ),
            pick_duration: reg(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "pd_gateway_picker_pick_duration_seconds",
                        "Time the Endpoint Picker took to pick for a request's body.",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                )
                .expect("valid metric"),
            ),
            registry,
        };
        // Closed label sets start at 0, so a dashboard or an alert reads 0, not "no data",
        // before the first event.
        for reason in pd_policy::CALL_FAILURE_REASONS {
            m.fallbacks.with_label_values(&[reason]);
        }
        for route in ROUTES {
            m.routes.with_label_values(&[route]);
        }
        for reason in ["queue_full", "queue_timeout"] {
            m.admission_refused.with_label_values(&[reason]);
        }
        for stage in ["prefill", "decode", "whole"] {
            m.failovers.with_label_values(&[stage]);
        }
        for how in REVERSE_PULL_HOWS {
            m.reverse_pulls.with_label_values(&[how]);
        }
        for route in ["split", "whole", "any"] {
            m.picks.with_label_values(&[route, "picked"]);
        }
        for outcome in [
            "overloaded",
            "rejected",
            "unavailable",
            "client_error",
            "error",
        ] {
            m.picks.with_label_values(&["none", outcome]);
        }
        for how in ["picked", "fallback", "other", "unreported"] {
            m.picker_served.with_label_values(&[how]);
        }
        m
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Closed label sets are exported at 0 before their first event: a dashboard's rate reads
    /// 0, not "no data".
    #[test]
    fn closed_label_sets_start_at_zero() {
        let text = String::from_utf8(Metrics::new().render()).expect("utf-8");
        for sample in [
            r#"pd_gateway_routes_total{route="split"} 0"#,
            r#"pd_gateway_routes_total{route="whole"} 0"#,
            r#"pd_gateway_routes_total{route="reject"} 0"#,
            r#"pd_gateway_policy_fallbacks_total{reason="trap"} 0"#,
            r#"pd_gateway_policy_fallbacks_total{reason="timeout"} 0"#,
            r#"pd_gateway_admission_refused_total{reason="queue_full"} 0"#,
            r#"pd_gateway_failovers_total{stage="decode"} 0"#,
            r#"pd_gateway_reverse_pulls_total{how="holder"} 0"#,
        ] {
            assert!(text.contains(sample), "no {sample} in:\n{text}");
        }
    }
}

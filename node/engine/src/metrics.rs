//! Prometheus metrics of one engine: queue sizes, KV usage, prefix-cache hits, latencies, tokens.

use std::time::Instant;

use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use crate::FinishReason;

/// All metrics the engine exports, registered in their own [`Registry`] (no global state).
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    registry: Registry,
    /// Sequences currently scheduled (prefilling or decoding).
    pub running: IntGauge,
    /// Sequences waiting to be scheduled (new or preempted).
    pub waiting: IntGauge,
    /// Sequences waiting for their KV to arrive from another node.
    pub waiting_remote_kv: IntGauge,
    /// Blocks in the pool (`pd_node_kv_blocks_capacity`: a gauge, so no `_total`).
    pub kv_blocks_capacity: IntGauge,
    /// Blocks not referenced by any sequence (includes cached, evictable ones).
    pub kv_blocks_free: IntGauge,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: IntCounter,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits: IntCounter,
    /// Sequences preempted (their KV dropped, to be recomputed).
    pub preemptions: IntCounter,
    /// Prompt tokens whose KV was pulled from a prefill node instead of computed.
    pub kv_pulled_tokens: IntCounter,
    /// Finished completions whose blocks were kept for the next turn (`kv_retain_after_decode`).
    pub kv_retained: IntCounter,
    /// Blocks copied from the compute pool to the transfer pool before a lease (staged KV:
    /// a GPU node, or `--kv-staged`).
    pub kv_staged_down: IntCounter,
    /// Blocks copied from the transfer pool to the compute pool after a pull (staged KV).
    pub kv_staged_up: IntCounter,
    /// Time of one staging copy to the transfer pool (all of a lease's blocks).
    pub kv_staging_down_seconds: Histogram,
    /// Time of one staging copy from the transfer pool (all of a pull's blocks).
    pub kv_staging_up_seconds: Histogram,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: IntCounter,
    /// Generated tokens.
    pub generation_tokens: IntCounter,
    /// Requests finished, any reason.
    pub requests_finished: IntCounter,
    /// Seconds from arrival to first generated token.
    pub time_to_first_token: Histogram,
    /// Seconds between consecutive tokens of one child.
    pub inter_token_latency: Histogram,
    /// Seconds from arrival to the last child finishing.
    pub e2e_latency: Histogram,
    /// Children finished, by `finished_reason` (`stop`, `length`, `abort`): each child counts
    /// as one request, as in vLLM V1 (which runs each child as its own request).
    pub request_success: IntCounterVec,
    /// Prompt tokens of each finished child.
    pub request_prompt_tokens: Histogram,
    /// Tokens each finished child generated.
    pub request_generation_tokens: Histogram,
    /// Seconds from arrival to the request's first admission to run, per finished child.
    pub request_queue_time: Histogram,
    /// Seconds from admission to the first token, per finished child.
    pub request_prefill_time: Histogram,
    /// Seconds from the first token to the child's last, per finished child.
    pub request_decode_time: Histogram,
    /// Seconds from admission to the child's last token, per finished child.
    pub request_inference_time: Histogram,
    /// Prefill requests for decode nodes refused because leases held their cap of the pool.
    pub lease_capacity_refusals: IntCounter,
    /// Requests admitted with a structured-output constraint.
    pub structured_requests: IntCounter,
    /// Structured requests that failed mid-generation (the matcher hit one of its limits or
    /// allowed no token): each answered with an error, never with text outside the constraint.
    pub structured_failures: IntCounter,
    /// Prompt tokens computed per second: a moving average over steps that computed at least
    /// [`PREFILL_RATE_MIN_TOKENS`] prompt tokens (0 until one did). Reported to the gateway, so
    /// a policy can weigh recomputing a prefix against pulling it.
    pub prefill_tokens_per_second: Gauge,
}

/// Steps computing fewer prompt tokens than this do not move the prefill-rate average (their
/// time is mostly the decode rows beside them).
pub(crate) const PREFILL_RATE_MIN_TOKENS: usize = 32;

/// Weight of the newest sample in the moving averages of rates.
pub(crate) const RATE_EWMA_WEIGHT: f64 = 0.2;

/// Moves `gauge`, a moving average, towards `sample` (the first sample sets it).
pub(crate) fn ewma(gauge: &Gauge, sample: f64) {
    if !sample.is_finite() || sample <= 0.0 {
        return;
    }
    let old = gauge.get();
    gauge.set(if old > 0.0 {
        old + RATE_EWMA_WEIGHT * (sample - old)
    } else {
        sample
    });
}

/// Token counts: 1, 2, 5, 10, 20, 50, … up to 100 000 (vLLM's 1-2-5 series).
fn token_buckets() -> Vec<f64> {
    (0..5)
        .flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e)))
        .chain([100_000.0])
        .collect()
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl EngineMetrics {
    /// Records a child that finished with `reason` after `generated` tokens: its reason and
    /// token counts, and, when it ran, how long it queued, prefilled and decoded (vLLM V1's
    /// per-request histograms: `scheduled` is its first admission, `first_token` its first
    /// token; a child aborted before either records neither).
    pub(crate) fn observe_finished(
        &self,
        reason: FinishReason,
        prompt_tokens: usize,
        generated: usize,
        arrival: Instant,
        scheduled: Option<Instant>,
        first_token: Option<Instant>,
    ) {
        let now = Instant::now();
        self.request_success
            .with_label_values(&[reason.as_str()])
            .inc();
        self.request_prompt_tokens.observe(prompt_tokens as f64);
        self.request_generation_tokens.observe(generated as f64);
        let Some(scheduled) = scheduled else { return };
        let secs = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
        self.request_queue_time.observe(secs(arrival, scheduled));
        self.request_inference_time.observe(secs(scheduled, now));
        if let Some(first) = first_token {
            self.request_prefill_time.observe(secs(scheduled, first));
            self.request_decode_time.observe(secs(first, now));
        }
    }

    /// Creates the metrics and registers them in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::with_opts(Opts::new(name, help)).expect("valid metric name");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric name");
            g
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::with_opts(Opts::new(name, help)).expect("valid metric name");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric name");
            c
        };
        let histogram_in = |name: &str, help: &str, buckets: Vec<f64>| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .expect("valid metric name");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric name");
            h
        };
        let histogram = |name: &str, help: &str| histogram_in(name, help, LATENCY_BUCKETS.to_vec());
        let request_success = IntCounterVec::new(
            Opts::new(
                "pd_node_request_success_total",
                "Children finished, by finished_reason (stop, length, abort)",
            ),
            &["finished_reason"],
        )
        .expect("valid metric name");
        registry
            .register(Box::new(request_success.clone()))
            .expect("unique metric name");
        for reason in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Abort,
        ] {
            request_success.with_label_values(&[reason.as_str()]);
        }
        Self {
            running: gauge(
                "pd_node_requests_running",
                "Sequences being prefilled or decoded",
            ),
            waiting: gauge(
                "pd_node_requests_waiting",
                "Sequences waiting to be scheduled",
            ),
            waiting_remote_kv: gauge(
                "pd_node_requests_waiting_remote_kv",
                "Sequences waiting for KV from another node",
            ),
            kv_blocks_capacity: gauge("pd_node_kv_blocks_capacity", "Blocks in the KV pool"),
            kv_blocks_free: gauge(
                "pd_node_kv_blocks_free",
                "KV blocks not referenced by any sequence",
            ),
            prefix_cache_queries: counter(
                "pd_node_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_cache_hits: counter(
                "pd_node_prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache",
            ),
            preemptions: counter(
                "pd_node_preemptions_total",
                "Sequences preempted for recompute",
            ),
            kv_pulled_tokens: counter(
                "pd_node_kv_pulled_tokens_total",
                "Prompt tokens whose KV was pulled from a prefill node instead of computed",
            ),
            kv_retained: counter(
                "pd_node_kv_retained_total",
                "Finished completions whose KV was kept under a lease for the next turn",
            ),
            kv_staged_down: counter(
                "pd_node_kv_staged_blocks_down_total",
                "Blocks copied from the compute pool (GPU) to the transfer pool before a lease",
            ),
            kv_staged_up: counter(
                "pd_node_kv_staged_blocks_up_total",
                "Blocks copied from the transfer pool to the compute pool (GPU) after a pull",
            ),
            kv_staging_down_seconds: histogram(
                "pd_node_kv_staging_down_seconds",
                "One copy of a lease's blocks from the compute pool (GPU) to the transfer pool",
            ),
            kv_staging_up_seconds: histogram(
                "pd_node_kv_staging_up_seconds",
                "One copy of a pull's blocks from the transfer pool to the compute pool (GPU)",
            ),
            prompt_tokens: counter(
                "pd_node_prompt_tokens_total",
                "Prompt tokens of admitted requests",
            ),
            generation_tokens: counter("pd_node_generation_tokens_total", "Generated tokens"),
            requests_finished: counter("pd_node_requests_finished_total", "Requests finished"),
            time_to_first_token: histogram(
                "pd_node_time_to_first_token_seconds",
                "Seconds from arrival to first generated token",
            ),
            inter_token_latency: histogram(
                "pd_node_inter_token_latency_seconds",
                "Seconds between consecutive tokens of one sequence",
            ),
            e2e_latency: histogram(
                "pd_node_e2e_request_latency_seconds",
                "Seconds from arrival to finish",
            ),
            request_success,
            request_prompt_tokens: histogram_in(
                "pd_node_request_prompt_tokens",
                "Prompt tokens of each finished child",
                token_buckets(),
            ),
            request_generation_tokens: histogram_in(
                "pd_node_request_generation_tokens",
                "Tokens each finished child generated",
                token_buckets(),
            ),
            request_queue_time: histogram(
                "pd_node_request_queue_time_seconds",
                "Seconds from arrival to first admission to run, per finished child",
            ),
            request_prefill_time: histogram(
                "pd_node_request_prefill_time_seconds",
                "Seconds from admission to the first token, per finished child",
            ),
            request_decode_time: histogram(
                "pd_node_request_decode_time_seconds",
                "Seconds from the first token to the last, per finished child",
            ),
            request_inference_time: histogram(
                "pd_node_request_inference_time_seconds",
                "Seconds from admission to the last token, per finished child",
            ),
            structured_requests: counter(
                "pd_node_structured_requests_total",
                "Requests admitted with a structured-output constraint (JSON schema, regex, choice, grammar)",
            ),
            structured_failures: counter(
                "pd_node_structured_failures_total",
                "Structured requests failed mid-generation (matcher limit reached or no token allowed)",
            ),
            lease_capacity_refusals: counter(
                "pd_node_kv_lease_capacity_refusals_total",
                "Prefills for decode nodes refused: leases held --kv-max-leased-fraction of the pool",
            ),
            prefill_tokens_per_second: {
                let g = Gauge::with_opts(Opts::new(
                    "pd_node_prefill_tokens_per_second",
                    "Prompt tokens computed per second (moving average over prefill steps)",
                ))
                .expect("valid metric name");
                registry
                    .register(Box::new(g.clone()))
                    .expect("unique metric name");
                g
            },
            registry,
        }
    }

    /// The registry holding every metric above, for the `/metrics` endpoint.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self::new()
    }
}

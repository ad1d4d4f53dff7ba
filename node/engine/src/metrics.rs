//! Prometheus metrics of one engine: queue sizes, KV usage, prefix-cache hits, latencies, tokens.

use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, Opts, Registry};

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
    /// Total blocks in the pool.
    pub kv_blocks_total: IntGauge,
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

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl EngineMetrics {
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
        let histogram = |name: &str, help: &str| {
            let h = Histogram::with_opts(
                HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
            )
            .expect("valid metric name");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric name");
            h
        };
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
            kv_blocks_total: gauge("pd_node_kv_blocks_total", "Blocks in the KV pool"),
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

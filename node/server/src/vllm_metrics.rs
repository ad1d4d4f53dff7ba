//! vLLM's names for the node's metrics, so what reads a vLLM server's `/metrics` reads a
//! `pd-node` too: Kubernetes' inference gateway and llm-d's endpoint picker (which route on
//! `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, and size their prefix index from
//! `vllm:cache_config_info`), autoscalers keyed on the queue, and vLLM's Grafana dashboards.
//!
//! Nothing here is counted twice: at each scrape the engine's own families (`pd_node_*`) are
//! copied under vLLM's name with vLLM's labels (`engine`, `model_name`), and the two gauges vLLM
//! derives (the queue including requests waiting for remote KV, the KV cache's used fraction)
//! are derived the same way from the engine's gauges. So a `vllm:` sample always equals the
//! `pd_node_` one beside it in the same scrape.
//!
//! Semantics, and where they differ from vLLM V1's:
//! - a block counts as used while a sequence or a lease holds it (cached blocks nobody
//!   references are free, as in vLLM's block pool); token counters count tokens;
//! - `request_success_total` and the `request_*` histograms count children (vLLM V1 runs each
//!   of `n` children as its own request), with the request's first token for every child's
//!   prefill and decode times; TTFT, end-to-end latency and `prompt_tokens_total` count each
//!   request once, and the queue gauges count sequences (an `n > 1` request waits as one until
//!   it is admitted and forked, where vLLM queues `n`);
//! - on a decode node the queue time runs until the pulled KV has landed (vLLM schedules a
//!   request before it waits for remote KV);
//! - a request the engine fails (shutdown, a compute fault) is under no `finished_reason`.

use prometheus::proto::{Gauge, LabelPair, Metric, MetricFamily, MetricType};

/// vLLM's name for each of the engine's families that means the same thing.
const RENAMED: [(&str, &str); 16] = [
    ("pd_node_requests_running", "vllm:num_requests_running"),
    ("pd_node_prompt_tokens_total", "vllm:prompt_tokens_total"),
    (
        "pd_node_generation_tokens_total",
        "vllm:generation_tokens_total",
    ),
    ("pd_node_preemptions_total", "vllm:num_preemptions_total"),
    (
        "pd_node_prefix_cache_queries_total",
        "vllm:prefix_cache_queries_total",
    ),
    (
        "pd_node_prefix_cache_hits_total",
        "vllm:prefix_cache_hits_total",
    ),
    (
        "pd_node_time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds",
    ),
    (
        "pd_node_inter_token_latency_seconds",
        "vllm:inter_token_latency_seconds",
    ),
    (
        "pd_node_e2e_request_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ),
    (
        "pd_node_request_success_total",
        "vllm:request_success_total",
    ),
    (
        "pd_node_request_prompt_tokens",
        "vllm:request_prompt_tokens",
    ),
    (
        "pd_node_request_generation_tokens",
        "vllm:request_generation_tokens",
    ),
    (
        "pd_node_request_queue_time_seconds",
        "vllm:request_queue_time_seconds",
    ),
    (
        "pd_node_request_prefill_time_seconds",
        "vllm:request_prefill_time_seconds",
    ),
    (
        "pd_node_request_decode_time_seconds",
        "vllm:request_decode_time_seconds",
    ),
    (
        "pd_node_request_inference_time_seconds",
        "vllm:request_inference_time_seconds",
    ),
];

/// Older names vLLM still documents (and older endpoint pickers and dashboards read), each an
/// alias of a name above: V0's `gpu_cache_usage_perc` became V1's `kv_cache_usage_perc`, and
/// `time_per_output_token_seconds` became `inter_token_latency_seconds`.
const ALIASES: [(&str, &str); 2] = [
    ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
];

/// What the vLLM families say about the node besides its metrics.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServedModel<'a> {
    /// The served model name (`model_name` label).
    pub(crate) name: &'a str,
    /// Tokens per KV block.
    pub(crate) block_size: usize,
    /// Blocks in the pool.
    pub(crate) num_blocks: usize,
    /// The KV cache's element type (`f32`, `f16`, `bf16`).
    pub(crate) cache_dtype: &'a str,
}

/// The `vllm:` families for one scrape, derived from the engine's gathered `own` families.
/// A family the engine did not gather is left out rather than made up.
pub(crate) fn families(own: &[MetricFamily], model: ServedModel<'_>) -> Vec<MetricFamily> {
    let find = |name: &str| own.iter().find(|f| f.name() == name);
    let gauge_value = |name: &str| {
        find(name)
            .and_then(|f| f.get_metric().first())
            .map(|m| m.get_gauge().get_value())
    };
    let mut out = Vec::new();
    for (ours, theirs) in RENAMED {
        if let Some(family) = find(ours) {
            out.push(renamed(family, theirs, model.name));
        }
    }
    if let (Some(waiting), Some(remote)) = (
        gauge_value("pd_node_requests_waiting"),
        gauge_value("pd_node_requests_waiting_remote_kv"),
    ) {
        out.push(gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled, including those waiting for KV from another node.",
            model.name,
            waiting + remote,
            &[],
        ));
    }
    if let (Some(free), Some(total)) = (
        gauge_value("pd_node_kv_blocks_free"),
        gauge_value("pd_node_kv_blocks_capacity"),
    ) && total > 0.0
    {
        out.push(gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: the fraction of blocks held by sequences or leases (1 = 100%).",
            model.name,
            (1.0 - free / total).clamp(0.0, 1.0),
            &[],
        ));
    }
    out.push(gauge(
        "vllm:cache_config_info",
        "Information of the KV cache's configuration.",
        model.name,
        1.0,
        &[
            ("block_size", model.block_size.to_string()),
            ("cache_dtype", model.cache_dtype.to_owned()),
            ("num_gpu_blocks", model.num_blocks.to_string()),
        ],
    ));
    for (name, alias) in ALIASES {
        if let Some(family) = out.iter().find(|f| f.name() == name) {
            let mut copy = family.clone();
            copy.set_name(alias.to_owned());
            copy.set_help(format!("{} (deprecated name of {name})", family.help()));
            out.push(copy);
        }
    }
    out
}

/// `family` under vLLM's `name`, each sample labelled with vLLM's `engine` and `model_name`.
fn renamed(family: &MetricFamily, name: &str, model: &str) -> MetricFamily {
    let mut copy = family.clone();
    copy.set_name(name.to_owned());
    for metric in copy.mut_metric() {
        let mut labels = vllm_labels(model);
        labels.extend(metric.take_label());
        metric.set_label(labels);
    }
    copy
}

/// A one-sample gauge family with vLLM's labels and `extra` ones after them.
fn gauge(
    name: &str,
    help: &str,
    model: &str,
    value: f64,
    extra: &[(&str, String)],
) -> MetricFamily {
    let mut labels = vllm_labels(model);
    labels.extend(extra.iter().map(|(k, v)| label(k, v)));
    let mut sample = Gauge::default();
    sample.set_value(value);
    let mut metric = Metric::from_label(labels);
    metric.set_gauge(sample);
    let mut family = MetricFamily::default();
    family.set_name(name.to_owned());
    family.set_help(help.to_owned());
    family.set_field_type(MetricType::GAUGE);
    family.set_metric(vec![metric]);
    family
}

/// The labels vLLM puts on every sample: the engine's index (one engine per node: `0`) and
/// the served model name.
fn vllm_labels(model: &str) -> Vec<LabelPair> {
    vec![label("engine", "0"), label("model_name", model)]
}

fn label(name: &str, value: &str) -> LabelPair {
    let mut pair = LabelPair::default();
    pair.set_name(name.to_owned());
    pair.set_value(value.to_owned());
    pair
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_engine::EngineMetrics;

    const MODEL: ServedModel<'static> = ServedModel {
        name: "tiny",
        block_size: 16,
        num_blocks: 200,
        cache_dtype: "f16",
    };

    fn scrape(metrics: &EngineMetrics) -> String {
        let own = metrics.registry().gather();
        let mut all = own.clone();
        all.extend(families(&own, MODEL));
        prometheus::TextEncoder::new()
            .encode_to_string(&all)
            .expect("encodes")
    }

    /// The value of the one sample of `name` with exactly `labels`, read back from the text.
    fn sample(text: &str, name: &str, labels: &str) -> f64 {
        let head = format!("{name}{{{labels}}} ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&head))
            .unwrap_or_else(|| panic!("no sample {head:?} in:\n{text}"));
        line[head.len()..].parse().expect("a number")
    }

    const LABELS: &str = r#"engine="0",model_name="tiny""#;

    #[test]
    fn every_vllm_sample_equals_the_engines_own() {
        let m = EngineMetrics::new();
        m.running.set(3);
        m.waiting.set(2);
        m.waiting_remote_kv.set(4);
        m.kv_blocks_capacity.set(200);
        m.kv_blocks_free.set(150);
        m.prompt_tokens.inc_by(640);
        m.generation_tokens.inc_by(17);
        m.preemptions.inc_by(1);
        m.prefix_cache_queries.inc_by(640);
        m.prefix_cache_hits.inc_by(320);
        m.time_to_first_token.observe(0.02);
        m.time_to_first_token.observe(0.3);
        m.inter_token_latency.observe(0.004);
        m.request_success.with_label_values(&["length"]).inc_by(2);
        m.request_prompt_tokens.observe(7.0);
        let text = scrape(&m);

        assert_eq!(sample(&text, "vllm:num_requests_running", LABELS), 3.0);
        // vLLM's waiting queue holds the requests waiting for remote KV too.
        assert_eq!(sample(&text, "vllm:num_requests_waiting", LABELS), 6.0);
        assert_eq!(sample(&text, "vllm:kv_cache_usage_perc", LABELS), 0.25);
        assert_eq!(sample(&text, "vllm:gpu_cache_usage_perc", LABELS), 0.25);
        assert_eq!(sample(&text, "vllm:prompt_tokens_total", LABELS), 640.0);
        assert_eq!(sample(&text, "vllm:generation_tokens_total", LABELS), 17.0);
        assert_eq!(sample(&text, "vllm:num_preemptions_total", LABELS), 1.0);
        assert_eq!(
            sample(&text, "vllm:prefix_cache_queries_total", LABELS),
            640.0
        );
        assert_eq!(sample(&text, "vllm:prefix_cache_hits_total", LABELS), 320.0);
        assert_eq!(
            sample(&text, "vllm:time_to_first_token_seconds_count", LABELS),
            2.0
        );
        assert_eq!(
            sample(&text, "vllm:time_to_first_token_seconds_sum", LABELS),
            0.32
        );
        // Buckets keep their bounds, after vLLM's labels.
        assert_eq!(
            sample(
                &text,
                "vllm:time_to_first_token_seconds_bucket",
                &format!(r#"{LABELS},le="0.025""#)
            ),
            1.0
        );
        for name in [
            "vllm:inter_token_latency_seconds_count",
            "vllm:time_per_output_token_seconds_count",
        ] {
            assert_eq!(sample(&text, name, LABELS), 1.0, "{name}");
        }
        assert_eq!(
            sample(
                &text,
                "vllm:cache_config_info",
                &format!(r#"{LABELS},block_size="16",cache_dtype="f16",num_gpu_blocks="200""#)
            ),
            1.0
        );
        // A family's own labels follow vLLM's; every reason is there from the start.
        for (reason, n) in [("stop", 0.0), ("length", 2.0), ("abort", 0.0)] {
            assert_eq!(
                sample(
                    &text,
                    "vllm:request_success_total",
                    &format!(r#"{LABELS},finished_reason="{reason}""#)
                ),
                n,
                "{reason}"
            );
        }
        assert_eq!(
            sample(
                &text,
                "vllm:request_prompt_tokens_bucket",
                &format!(r#"{LABELS},le="10""#)
            ),
            1.0
        );
        assert_eq!(
            sample(
                &text,
                "vllm:request_prompt_tokens_bucket",
                &format!(r#"{LABELS},le="5""#)
            ),
            0.0
        );
        // Typed as vLLM types them, so a scraper reads counters and histograms as such.
        for (name, kind) in [
            ("vllm:num_requests_waiting", "gauge"),
            ("vllm:kv_cache_usage_perc", "gauge"),
            ("vllm:prompt_tokens_total", "counter"),
            ("vllm:e2e_request_latency_seconds", "histogram"),
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name} {kind}"
            );
        }
        // The engine's own names are still there, unchanged.
        assert_eq!(sample_plain(&text, "pd_node_requests_waiting"), 2.0);
    }

    fn sample_plain(text: &str, name: &str) -> f64 {
        let head = format!("{name} ");
        let line = text.lines().find(|l| l.starts_with(&head)).expect("sample");
        line[head.len()..].parse().expect("a number")
    }

    #[test]
    fn an_empty_pool_is_not_a_division_by_zero() {
        let m = EngineMetrics::new();
        let text = scrape(&m);
        assert!(!text.contains("vllm:kv_cache_usage_perc"), "{text}");
        assert!(!text.contains("NaN"), "{text}");
        assert_eq!(sample(&text, "vllm:num_requests_waiting", LABELS), 0.0);
    }
}

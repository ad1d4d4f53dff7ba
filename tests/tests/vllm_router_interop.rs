//! Interop: vLLM's own router (`vllm-router --vllm-pd-disaggregation`, the NIXL connector's
//! protocol) drives our prefill and decode nodes as it drives vLLM's: the `openai` package
//! through it gets one node's tokens on chat and completions, streamed and not, greedy and
//! seeded n=3, with the prompt's KV pulled from P (usage and the nodes' counters).

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Node, Role, TestCluster, tiny_model};
use pd_cluster_tests::process::WorkDir;
use pd_cluster_tests::vllm_router::VllmRouter;
use pd_cluster_tests::{eventually, python};
use serde_json::Value;

use super::openai_token_exact::{hermes, specs};

/// Each answer against the reference's, token for token; returns the KV tokens each answer says
/// D pulled: all of the prompt, or all but its last token when D computes that one itself for
/// its logits (vllm-router asks P for its one token with parameters of its own; D takes P's
/// token only when the way P picked it equals its own).
fn compare(specs: &[Value], want: &[Value], got: &[Value]) -> Vec<u64> {
    let mut pulled_each = Vec::new();
    for ((spec, w), g) in specs.iter().zip(want).zip(got) {
        for key in [
            "token_ids",
            "texts",
            "finish_reasons",
            "tool_calls",
            "prompt_tokens",
        ] {
            assert_eq!(
                g[key], w[key],
                "{key} differ from the reference: {spec}: {g}"
            );
        }
        let prompt = g["prompt_tokens"].as_u64().expect("usage");
        let pulled = g["kv_pulled_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no kv_pulled_tokens: {spec}: {g}"));
        assert!(
            pulled == prompt || pulled + 1 == prompt,
            "KV pulled from P: {pulled} of {prompt}: {spec}: {g}"
        );
        pulled_each.push(pulled);
    }
    pulled_each
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_router_drives_our_prefill_and_decode_nodes_token_exact() {
    let python = python::interpreter();
    // vllm-router routes chat and completions in P/D mode.
    let specs: Vec<Value> = specs()
        .into_iter()
        .filter(|s| s["api"] != "responses")
        .collect();
    let want = {
        let dir = WorkDir::new("vllm-router-reference");
        let model = tiny_model(&dir);
        let reference = Node::reference_with(&dir, &model, &hermes());
        python::run_specs(&python, &reference.http, &specs).await
    };
    // Nodes as vLLM runs them under vllm-router: no registry, D allowed to pull from P.
    let c = TestCluster::start_static(
        "vllm-router-interop",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            node_args: hermes(),
            ..ClusterSpec::default()
        },
    )
    .await;
    let urls = |role: Role| -> Vec<String> { c.role(role).map(|n| n.http.clone()).collect() };
    let router = VllmRouter::start(c.dir().path(), &urls(Role::Prefill), &urls(Role::Decode)).await;
    let got = python::run_specs(&python, &router.http, &specs).await;
    let pulled = compare(&specs, &want, &got);
    eprintln!(
        "vllm-router: {} answers token-identical to one node; {} prompt tokens pulled P→D",
        got.len(),
        pulled.iter().sum::<u64>()
    );
    let requests = specs.len() as f64;
    eventually(
        "every P lease released",
        Duration::from_secs(10),
        async || c.sum_over(Role::Prefill, "pd_kv_leases_live", &[]).await == 0.0,
    )
    .await;
    assert_eq!(
        c.sum_over(Role::Prefill, "pd_kv_leases_total", &[("event", "granted")])
            .await,
        requests,
        "one P lease per request"
    );
    assert_eq!(
        c.sum_over(Role::Decode, "pd_node_kv_pulled_tokens_total", &[])
            .await,
        pulled.iter().sum::<u64>() as f64
    );
    for metric in ["pd_kv_transfer_failures_total", "pd_kv_recompute_total"] {
        assert_eq!(c.sum_over(Role::Decode, metric, &[]).await, 0.0, "{metric}");
    }
    // The gateway beside them (scraping them as static nodes) carried nothing.
    let g = c.gateway_metrics().await;
    assert_eq!(g.sum("pd_gateway_requests_total", &[]), 0.0);
}

//! Hot-swapping the policy under load: 8 streaming clients loop requests through a gateway +
//! 2P + 1D while the operator pushes 100 policies, alternating the round-robin and least-loaded
//! guest components (which rank the two prefill nodes differently). No request fails, no
//! policy fails or falls back, and both versions served decisions.

use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ClusterSpec, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::load::{Load, LoadOutcome};

const CLIENTS: usize = 8;
const SWAPS: usize = 100;
/// Each client stops after this many requests whatever happens.
const MAX_PER_CLIENT: usize = 400;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_policy_swaps_under_streaming_load_fail_nothing() {
    let least_loaded = bins::policy("least-loaded");
    let round_robin = bins::policy("round-robin");
    let c = TestCluster::start(
        "hot-swap",
        ClusterSpec {
            prefill: 2,
            decode: 1,
            // Pushed policies inherit this deadline: one a loaded 2-core debug build always
            // meets (the test asserts zero fallbacks; the 1 ms default is for release builds).
            gateway_args: args(&[
                "--policy",
                least_loaded.to_str().expect("a UTF-8 path"),
                "--policy-deadline-ms",
                "50",
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let current = c.policy().await;
    assert_eq!(current["current"]["name"], "least-loaded", "{current}");

    let load = Load::start(
        &c.gateway.http,
        CLIENTS,
        MAX_PER_CLIENT,
        "Swapping policies under load.",
    );

    let mut versions = std::collections::BTreeMap::new();
    for swap in 0..SWAPS {
        let (file, name) = if swap % 2 == 0 {
            (&round_robin, "round-robin")
        } else {
            (&least_loaded, "least-loaded")
        };
        // Let at least one request through per installed policy.
        let seen = load.done();
        let (status, v) = c.push_policy(file, name, &[]).await;
        assert_eq!(status, 200, "push {swap} ({name}): {v}");
        assert_eq!(v["current"]["name"], name, "{v}");
        let version = v["current"]["version"]
            .as_str()
            .unwrap_or_else(|| panic!("no version: {v}"))
            .to_owned();
        versions.insert(name, version);
        eventually(
            "a request through the new policy",
            Duration::from_secs(30),
            async || load.done() > seen,
        )
        .await;
    }
    let LoadOutcome { ok, failed } = load.stop().await;
    assert!(
        failed.is_empty(),
        "{} failed requests: {failed:#?}",
        failed.len()
    );
    assert!(ok >= SWAPS, "{ok} requests over {SWAPS} swaps");

    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        ok as f64,
        "{}",
        g.show("pd_gateway_requests_total")
    );
    assert_eq!(
        g.sum_except("pd_gateway_requests_total", "outcome", "ok"),
        0.0
    );
    for metric in [
        "pd_gateway_policy_fallbacks_total",
        "pd_gateway_policy_failures_total",
        "pd_gateway_failovers_total",
    ] {
        assert_eq!(g.sum(metric, &[]), 0.0, "{}", g.show(metric));
    }
    assert_ne!(versions["round-robin"], versions["least-loaded"]);
    for (name, version) in &versions {
        let n = g.sum(
            "pd_gateway_policy_decisions_total",
            &[("policy", name), ("version", version)],
        );
        assert!(
            n > 0.0,
            "{name} {version} decided nothing: {}",
            g.show("pd_gateway_policy_decisions_total")
        );
    }
    assert_eq!(
        g.sum("pd_gateway_policy_decisions_total", &[]),
        ok as f64,
        "every request was decided by one of the two"
    );
    let last = c.policy().await;
    assert_eq!(last["current"]["name"], "least-loaded", "{last}");
    eprintln!(
        "{ok} streamed requests over {SWAPS} swaps; {}",
        g.show("pd_gateway_policy_decisions_total").trim()
    );
}

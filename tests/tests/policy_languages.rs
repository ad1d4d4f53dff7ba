//! Policies in every language, through a running gateway (gateway + 2P + 1D, real processes):
//! each language's least-loaded build is pushed live while streaming clients loop requests, and
//! nothing fails: no failed request, no policy failure or fallback, every pushed version
//! decided requests, and `GET /admin/policy` shows the one pushed last. A push whose deadline
//! the policy cannot make is refused.

use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ClusterSpec, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::load::{Load, LoadOutcome};

const CLIENTS: usize = 4;
/// Each client stops after this many requests whatever happens.
const MAX_PER_CLIENT: usize = 2000;
/// Requests each pushed policy must decide before the next push.
const PER_POLICY: u64 = 10;

/// (build under `target/policies`, push limits: deadline ms, fuel, memory MiB). Interpreted
/// guests start a language runtime in every fresh instance: they get the limits
/// `pd-gateway policy new` suggests for them, with the deadline (wall-clock) raised for a debug
/// build sharing two cores with the rest of the suite: Python decisions (an interpreter per
/// fresh instance) ran past 200 ms there while the cross-host tests started their clusters.
const PUSHES: [(&str, &str, &str, &str); 5] = [
    ("python/least-loaded", "1000", "1000000000", "64"),
    ("js/least-loaded", "1000", "1000000000", "64"),
    ("go/least-loaded", "500", "200000000", "64"),
    ("c/least-loaded", "50", "1000000", "16"),
    ("least-loaded", "50", "1000000", "16"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_language_pushed_live_under_load_fails_nothing() {
    let files: Vec<_> = PUSHES.iter().map(|p| bins::policy(p.0)).collect();
    let c = TestCluster::start(
        "policy-languages",
        ClusterSpec {
            prefill: 2,
            decode: 1,
            gateway_args: args(&["--policy-deadline-ms", "50"]),
            ..ClusterSpec::default()
        },
    )
    .await;

    let load = Load::start(
        &c.gateway.http,
        CLIENTS,
        MAX_PER_CLIENT,
        "Policies in any language.",
    );

    // The deadline is the policy's own, set at push: a Python policy pushed with a deadline it
    // cannot make (100 µs: it starts an interpreter per call) is refused by the push's smoke
    // test, not installed to fall back on every request.
    let before = c.policy().await;
    let (status, v) = c
        .push_policy(
            &files[0],
            "too-slow",
            &[
                ("deadline_ms", "0.1"),
                ("fuel", "1000000000"),
                ("memory_mib", "64"),
            ],
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v.to_string().contains("timed out") || v.to_string().contains("deadline"),
        "{v}"
    );
    assert_eq!(c.policy().await["current"], before["current"]);

    let mut versions = Vec::new();
    for ((build, deadline, fuel, memory), file) in PUSHES.iter().zip(&files) {
        let name = build.replace('/', "-");
        let (status, v) = c
            .push_policy(
                file,
                &name,
                &[
                    ("deadline_ms", deadline),
                    ("fuel", fuel),
                    ("memory_mib", memory),
                ],
            )
            .await;
        assert_eq!(status, 200, "push {build}: {v}");
        assert_eq!(v["current"]["name"], name.as_str(), "{v}");
        let version = v["current"]["version"]
            .as_str()
            .unwrap_or_else(|| panic!("no version: {v}"))
            .to_owned();
        eprintln!(
            "pushed {build} ({version}): compiled {}",
            v["current"]["compiled"]
        );
        let seen = load.done();
        eventually(
            "requests through the new policy",
            Duration::from_secs(60),
            async || load.done() >= seen + PER_POLICY,
        )
        .await;
        versions.push((name, version));
    }
    let shown = c.policy().await;
    let (last_name, last_version) = versions.last().expect("pushed");
    assert_eq!(shown["current"]["name"], last_name.as_str(), "{shown}");
    assert_eq!(
        shown["current"]["version"],
        last_version.as_str(),
        "{shown}"
    );
    let LoadOutcome { ok, failed } = load.stop().await;
    assert!(failed.is_empty(), "{} failed: {failed:#?}", failed.len());
    let g = c.gateway_metrics().await;
    for metric in [
        "pd_gateway_policy_fallbacks_total",
        "pd_gateway_policy_failures_total",
    ] {
        assert_eq!(g.sum(metric, &[]), 0.0, "{}", g.show(metric));
    }
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
    eprintln!(
        "{ok} streamed requests over {} pushes; {}",
        versions.len(),
        g.show("pd_gateway_policy_decisions_total").trim()
    );
}

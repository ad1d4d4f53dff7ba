//! Misbehaving policies are contained end to end (gateway + 1P + 1D, started with the
//! round-robin guest):
//!
//! 1. A push of a policy that traps, loops or eats memory on every call (`config.mode=always`)
//!    is refused by the admin API's smoke test (400), and the serving policy stays and serves.
//! 2. A policy that passes the smoke test but misbehaves on some requests (the test guests do so
//!    for `n = 7`) is installed; such a request is still answered 200 — the built-in
//!    prefix-aware decides instead — and the failure is counted with its reason.
//! 3. Rollback and a native policy push work after all that.

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ClusterSpec, TestCluster, args};
use pd_cluster_tests::openai::{self, Api};
use serde_json::json;

/// A completions request for `n` seeded children; `tag` starts the prompt, so distinct tags
/// share no cached block (D then pulls the whole prompt but its last token).
async fn one_request(c: &TestCluster, tag: &str, n: u32) -> openai::Answer {
    let api = Api::Completions;
    let mut body = api.body(
        &format!("{tag} n={n}: a bad policy must not fail requests."),
        4,
    );
    body["n"] = json!(n);
    body["seed"] = json!(3);
    body["temperature"] = json!(0.7);
    let a = openai::send(&c.client, &c.gateway.http, api, &body, None)
        .await
        .ok();
    assert_eq!(a.texts.len(), n as usize, "{}", a.body);
    a
}

async fn decisions(c: &TestCluster, policy: &str) -> f64 {
    c.gateway_metrics()
        .await
        .sum("pd_gateway_policy_decisions_total", &[("policy", policy)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_policies_are_refused_or_contained() {
    let round_robin = bins::policy("round-robin");
    let c = TestCluster::start(
        "contained",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: args(&["--policy", round_robin.to_str().expect("a UTF-8 path")]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let serving = c.policy().await["current"].clone();
    assert_eq!(serving["name"], "round-robin", "{serving}");
    assert_eq!(serving["kind"], "wasm", "{serving}");
    assert_eq!(serving["contract"], "pd:policy@1.0.0", "{serving}");
    one_request(&c, "ok", 1).await;
    assert_eq!(decisions(&c, "round-robin").await, 1.0);

    // 1. Refused at push: the smoke test hits the misbehaviour.
    for guest in ["trapping", "looping", "hungry", "lying"] {
        let (status, v) = c
            .push_policy(&bins::policy(guest), guest, &[("config.mode", "always")])
            .await;
        assert_eq!(status, 400, "{guest} with mode=always must be refused: {v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("smoke test"), "{guest}: {v}");
        assert_eq!(
            c.policy().await["current"],
            serving,
            "{guest}: the serving policy stays"
        );
        let before = decisions(&c, "round-robin").await;
        one_request(&c, "ok", 1).await;
        assert_eq!(decisions(&c, "round-robin").await, before + 1.0, "{guest}");
    }
    let g = c.gateway_metrics().await;
    assert_eq!(g.sum("pd_gateway_policy_failures_total", &[]), 0.0);

    // 2. Installed, misbehaving on n=7 only: contained per request.
    let mut failures = 0.0;
    for (guest, reasons) in [
        ("trapping", &["trap"][..]),
        ("looping", &["timeout", "out_of_fuel"][..]),
        ("hungry", &["memory", "out_of_fuel"][..]),
        ("lying", &["invalid_decision"][..]),
    ] {
        let (status, v) = c.push_policy(&bins::policy(guest), guest, &[]).await;
        assert_eq!(status, 200, "{guest} passes the smoke test: {v}");
        // A well-behaved call: the guest decides (every node as a whole-request candidate).
        one_request(&c, "ok", 1).await;
        assert_eq!(decisions(&c, guest).await, 1.0, "{guest}");
        // The misbehaving call: served all the same, by the built-in policy (P/D split: on an
        // idle cluster, so the keep rule does not keep it on P).
        c.wait_view_idle(std::time::Duration::from_secs(5)).await;
        let a = one_request(&c, guest, 7).await;
        let prompt = a.prompt_tokens.expect("usage");
        assert_eq!(
            a.pulled_tokens,
            Some(prompt - 1),
            "{guest}: the fallback split the request: {}",
            a.body
        );
        failures += 1.0;
        let g = c.gateway_metrics().await;
        let counted: f64 = reasons
            .iter()
            .map(|r| {
                g.sum(
                    "pd_gateway_policy_failures_total",
                    &[("policy", guest), ("reason", r)],
                )
            })
            .sum();
        assert_eq!(
            counted,
            1.0,
            "{guest}: {}",
            g.show("pd_gateway_policy_failures_total")
        );
        assert_eq!(g.sum("pd_gateway_policy_failures_total", &[]), failures);
        assert_eq!(g.sum("pd_gateway_policy_fallbacks_total", &[]), failures);
    }

    // 3. Back to the previous policy, then a native one.
    let resp = c
        .client
        .post(format!("{}/admin/policy/rollback", c.gateway.admin))
        .bearer_auth(pd_cluster_tests::cluster::ADMIN_TOKEN)
        .send()
        .await
        .expect("POST rollback");
    assert_eq!(resp.status(), 200);
    assert_eq!(c.policy().await["current"]["name"], "hungry");
    let (status, v) = c
        .put_policy(&[("native", "prefix-aware")], Vec::new())
        .await;
    assert_eq!(status, 200, "{v}");
    // On an idle view, so prefix-aware's keep rule (on by default) does not keep it on P: a
    // decode node still reported running the last request split it whole onto P.
    c.wait_view_idle(std::time::Duration::from_secs(5)).await;
    let a = one_request(&c, "native", 1).await;
    let prompt = a.prompt_tokens.expect("usage");
    // One completion: D takes P's (sampled) first token with the KV, all of the prompt pulled.
    assert_eq!(a.pulled_tokens, Some(prompt), "{}", a.body);
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum(
            "pd_gateway_policy_decisions_total",
            &[("policy", "prefix-aware"), ("version", "native")]
        ),
        1.0,
        "{}",
        g.show("pd_gateway_policy_decisions_total")
    );
    assert_eq!(
        g.sum_except("pd_gateway_requests_total", "outcome", "ok"),
        0.0,
        "no request failed: {}",
        g.show("pd_gateway_requests_total")
    );
}

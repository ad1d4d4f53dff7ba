//! P and D cut off from each other (nftables on P's harness host drops every packet to and from
//! D; the registry and HTTP stay up), D under `--kv-load-failure-policy recompute`:
//!
//! 1. The first request's pull runs into its deadline and D computes the prompt: the answer is
//!    token-exact, `pd_kv_transfer_failures_total{reason="deadline"}` counts it.
//! 2. The next requests do not wait out the deadline again: D remembers it could not reach P
//!    and computes their prompts at once (`pd_kv_recompute_total{reason="peer_suspect"}`), each
//!    answered well within the pull timeout, token-exact, no further failed pull.
//!    D names P in `x-pd-kv-unreachable` on its answers, and the gateway releases the leases
//!    P granted for those requests (D's own releases cannot get through): P does not hold one
//!    per request until they expire (before, P's lease cap filled and it refused prefills).
//! 3. Healed, once the cool-off passed, one request probes P, pulls, and clears it: the next
//!    requests pull again (`kv_pulled_tokens` in their usage).
//!
//! Before D remembered, every request during the partition waited the whole pull timeout (the
//! chaos suite's `partition P↔D only` row: 28 requests in 11 s, each ≥ 2 s).

use std::time::{Duration, Instant};

use pd_cluster_tests::chaos::faults::partition;
use pd_cluster_tests::cluster::{ClusterSpec, Hosting, Node, Role, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};

const PULL_TIMEOUT_S: u64 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_d_cannot_reach_is_not_waited_for_again_until_it_can_be() {
    let c = TestCluster::start(
        "kv-partition",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            decode_args: args(&[
                "--kv-load-failure-policy",
                "recompute",
                "--kv-pull-timeout",
                &PULL_TIMEOUT_S.to_string(),
            ]),
            hosts: Some(Hosting::default()),
            ..ClusterSpec::default()
        },
    )
    .await;
    let reference = Node::reference(c.dir(), &c.model);
    let api = Api::Chat;
    let ask = async |i: usize| {
        let body = api.body(&format!("{i}: P and D cannot reach each other."), 4);
        let start = Instant::now();
        let got = openai::send(&c.client, &c.gateway.http, api, &body, None)
            .await
            .ok();
        let took = start.elapsed();
        let want = openai::send(&c.client, &reference.http, api, &body, None)
            .await
            .ok();
        assert_eq!(got.texts, want.texts, "request {i}");
        (got, took)
    };
    let d = c.role(Role::Decode).next().expect("D");
    let p = c.role(Role::Prefill).next().expect("P");
    let (warm, _) = ask(0).await;
    assert!(warm.pulled_tokens.is_some_and(|t| t > 0), "{}", warm.body);

    let d_addr = d.host.as_ref().expect("on a host").addr;
    let cut = partition(p.host.as_ref().expect("on a host"), &[d_addr]);
    let (_, first) = ask(1).await;
    assert!(
        first >= Duration::from_secs(PULL_TIMEOUT_S),
        "the first pull waits its deadline: {first:?}"
    );
    let mut slowest = Duration::ZERO;
    for i in 2..7 {
        let (a, took) = ask(i).await;
        assert_eq!(
            a.pulled_tokens.unwrap_or(0),
            0,
            "request {i} pulled: {}",
            a.body
        );
        slowest = slowest.max(took);
    }
    let m = d.metrics(&c.client).await;
    eprintln!("first request {first:?}; the next five at most {slowest:?}");
    assert!(
        slowest < Duration::from_secs(PULL_TIMEOUT_S) / 2,
        "a request waited for the unreachable producer again: {slowest:?}\n{}",
        m.show("pd_kv_recompute_total")
    );
    assert_eq!(
        m.sum("pd_kv_transfer_failures_total", &[("reason", "deadline")]),
        1.0,
        "{}",
        m.show("pd_kv_transfer_failures_total")
    );
    assert_eq!(
        m.sum("pd_kv_recompute_total", &[("reason", "peer_suspect")]),
        5.0,
        "{}",
        m.show("pd_kv_recompute_total")
    );

    // D names P as unreachable on its answers ...
    let named = reqwest::get(format!("{}/health", d.http))
        .await
        .expect("D's health")
        .headers()
        .get("x-pd-kv-unreachable")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let p_side = format!("http://{}", p.host.as_ref().expect("on a host").addr);
    assert!(
        named.as_deref().is_some_and(|n| n.starts_with(&p_side)),
        "D names {named:?}, not P ({p_side})"
    );
    // ... so the gateway, which can reach P, released the leases D could not: all six (each
    // answer's head came after D found P unreachable: they are not streamed). P holds none,
    // rather than one per request until they expire (which filled P's lease cap in the chaos
    // suite).
    eventually(
        "the gateway to release the leases D could not",
        Duration::from_secs(5),
        async || {
            c.gateway_metrics().await.sum(
                "pd_gateway_leases_released_total",
                &[("why", "unreachable_from_decode")],
            ) == 6.0
        },
    )
    .await;
    let live = p.metrics(&c.client).await.sum("pd_kv_leases_live", &[]);
    assert_eq!(live, 0.0, "P's live leases during the partition");

    cut.heal();
    tokio::time::sleep(Duration::from_secs(PULL_TIMEOUT_S)).await;
    let mut pulled = 0;
    for i in 7..10 {
        let (a, _) = ask(i).await;
        pulled += usize::from(a.pulled_tokens.is_some_and(|t| t > 0));
    }
    assert_eq!(pulled, 3, "healed: the probe pulls and clears the producer");
}

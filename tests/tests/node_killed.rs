//! A prefill node killed (`SIGKILL`) mid-run, in a gateway + 2P + 2D cluster under load: it
//! leaves `/admin/nodes` within the node timeout, and every request — those in flight at the
//! kill, those sent right after it, those after it left the view — is answered 200, by
//! failover to the other prefill node (round-robin sends every other request to the dead one
//! until it leaves the view). Decode nodes run `--kv-load-failure-policy recompute`, so a
//! request whose P died after its prefill, before D's pull, is computed on D rather than
//! failed (counted in `pd_kv_recompute_total`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pd_cluster_tests::cluster::{ClusterSpec, Role, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Answer, Api};

const NODE_TIMEOUT_MS: u64 = 1000;
/// Scheduling slack on two loaded cores, on top of the node timeout, for the gateway to notice
/// and for the test's 20 ms polling.
const SLACK_MS: u64 = 500;
/// Each background client stops after this many requests whatever happens.
const MAX_PER_CLIENT: usize = 200;

fn request(i: usize) -> (Api, serde_json::Value) {
    let api = Api::ALL[i % 3];
    let body = api.body(&format!("{i} Requests keep flowing while a node dies."), 6);
    let body = if i.is_multiple_of(2) {
        api.streaming(&body)
    } else {
        body
    };
    (api, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_node_killed_mid_run_leaves_the_view_and_requests_keep_succeeding() {
    let mut c = TestCluster::start(
        "killed",
        ClusterSpec {
            prefill: 2,
            decode: 2,
            gateway_args: args(&[
                "--node-timeout-ms",
                &NODE_TIMEOUT_MS.to_string(),
                "--native-policy",
                "round-robin",
            ]),
            decode_args: args(&["--kv-load-failure-policy", "recompute"]),
            ..ClusterSpec::default()
        },
    )
    .await;

    // Two clients loop requests until told to stop (or MAX_PER_CLIENT).
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for w in 0..2 {
        let (stop, done) = (stop.clone(), done.clone());
        let gateway = c.gateway.http.clone();
        clients.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut answers = Vec::new();
            for i in 0..MAX_PER_CLIENT {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let (api, body) = request(1000 * (w + 1) + i);
                answers.push((api, openai::send(&client, &gateway, api, &body, None).await));
                done.fetch_add(1, Ordering::Relaxed);
            }
            answers
        }));
    }
    eventually(
        "both prefill nodes to serve",
        Duration::from_secs(30),
        async || {
            let mut served = 0;
            for id in ["p0", "p1"] {
                let m = c.node_metrics(id).await;
                if m.sum("pd_kv_leases_total", &[("event", "granted")]) > 0.0 {
                    served += 1;
                }
            }
            served == 2
        },
    )
    .await;
    let p0_before = c
        .node_metrics("p0")
        .await
        .sum("pd_kv_leases_total", &[("event", "granted")]);

    let status = c.node_mut("p1").proc.kill_and_wait();
    let killed = Instant::now();
    let c = &c;
    // Right after the kill: requests from here while the gateway finds out.
    let right_after = async {
        let mut answers: Vec<(Api, Answer)> = Vec::new();
        for i in 0..6 {
            let (api, body) = request(i);
            answers.push((
                api,
                openai::send(&c.client, &c.gateway.http, api, &body, None).await,
            ));
        }
        answers
    };
    let unlisted = async {
        c.wait_unlisted("p1", Duration::from_secs(10)).await;
        killed.elapsed()
    };
    let (right_after, gone_after) = tokio::join!(right_after, unlisted);
    eprintln!("p1 ({status}) left /admin/nodes {gone_after:?} after the kill");
    assert!(
        gone_after <= Duration::from_millis(NODE_TIMEOUT_MS + SLACK_MS),
        "p1 left the view {gone_after:?} after the kill; the node timeout is {NODE_TIMEOUT_MS} ms"
    );
    assert_eq!(c.listed().await, ["d0", "d1", "p0"]);

    // The load goes on for a few more requests after p1 left, then stops.
    let target = done.load(Ordering::Relaxed) + 4;
    eventually(
        "4 more requests after p1 left",
        Duration::from_secs(30),
        async || done.load(Ordering::Relaxed) >= target,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = right_after;
    for client in clients {
        answers.extend(client.await.expect("a client task"));
    }
    let total = answers.len();
    for (api, a) in &answers {
        assert!(
            a.status == 200 && a.complete && a.error.is_none(),
            "{api:?}: {} {}",
            a.status,
            a.body
        );
    }
    let pulled = answers
        .iter()
        .filter(|(_, a)| a.pulled_tokens.is_some())
        .count();

    // p0 took over; the gateway answered everything it was asked.
    let p0_after = c
        .node_metrics("p0")
        .await
        .sum("pd_kv_leases_total", &[("event", "granted")]);
    assert!(p0_after > p0_before, "p0 served after the kill");
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        total as f64,
        "{}",
        g.show("pd_gateway_requests_total")
    );
    assert_eq!(
        g.sum_except("pd_gateway_requests_total", "outcome", "ok"),
        0.0
    );
    assert_eq!(g.sum("pd_gateway_policy_fallbacks_total", &[]), 0.0);
    let recomputed = c.sum_over(Role::Decode, "pd_kv_recompute_total", &[]).await;
    eprintln!(
        "{total} requests, all 200: {pulled} pulled their KV from P, {recomputed} recomputed on D; \
         failovers: {}",
        g.show("pd_gateway_failovers_total").trim()
    );
    assert!(pulled > 0);
    // Every answer either pulled from a live P or was recomputed and counted as such.
    assert_eq!(
        (total - pulled) as f64,
        recomputed,
        "every answer without pulled KV is a counted recompute"
    );
}

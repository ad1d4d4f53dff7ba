//! Nodes dying and falling silent in a gateway + 2P + 2D cluster under load
//! (`--node-timeout-ms 1000`, round-robin, so every other request goes to each node):
//!
//! 1. A prefill node is killed (`SIGKILL`) with a request in flight on it: it is frozen first
//!    until a request is stuck in its socket, then killed. It leaves `/admin/nodes` within the
//!    node timeout (at once: its registry stream breaks), the stuck request fails over to the
//!    other prefill node, and every request — in flight at the kill, sent right after it, sent
//!    after it left — is answered 200.
//! 2. A decode node that falls silent (`SIGSTOP`: its stream stays open but says nothing) leaves
//!    the view after the node timeout, requests are served by the other decode node meanwhile,
//!    and it rejoins by itself once resumed.
//!
//! Decode nodes run `--kv-load-failure-policy recompute`, so a request whose P died between its
//! prefill and D's pull would be computed on D rather than failed (counted in
//! `pd_kv_recompute_total`, which the test checks against the answers).

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
const MAX_PER_CLIENT: usize = 300;

fn request(i: usize) -> (Api, serde_json::Value) {
    let api = Api::ALL[i % 3];
    let body = api.body(&format!("{i} Requests keep flowing while nodes die."), 6);
    let body = if i.is_multiple_of(2) {
        api.streaming(&body)
    } else {
        body
    };
    (api, body)
}

async fn requests_from_here(c: &TestCluster, first: usize, count: usize) -> Vec<(Api, Answer)> {
    let mut answers = Vec::new();
    for i in first..first + count {
        let (api, body) = request(i);
        answers.push((
            api,
            openai::send(&c.client, &c.gateway.http, api, &body, None).await,
        ));
    }
    answers
}

#[track_caller]
fn assert_all_ok(answers: &[(Api, Answer)]) {
    for (api, a) in answers {
        assert!(
            a.status == 200 && a.complete && a.error.is_none(),
            "{api:?}: {} {}",
            a.status,
            a.body
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_silent_nodes_leave_the_view_and_requests_keep_succeeding() {
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

    // 1. p1 frozen until a request is stuck on it, then killed. Two more requests go out at
    // once (round-robin sends one of any two in a row to p1, as the load does), and p1 must be
    // killed before the gateway drops it for silence.
    c.node("p1").proc.signal(libc::SIGSTOP);
    let mut stuck = Vec::new();
    for i in 500..502 {
        let gateway = c.gateway.http.clone();
        stuck.push(tokio::spawn(async move {
            let (api, body) = request(i);
            let a = openai::send(&reqwest::Client::new(), &gateway, api, &body, None).await;
            (api, a)
        }));
    }
    let p1 = c.node("p1");
    eventually(
        "a request stuck in the frozen p1",
        Duration::from_millis(NODE_TIMEOUT_MS - 300),
        async || p1.unread_bytes() > 0,
    )
    .await;
    let status = c.node_mut("p1").proc.kill_and_wait();
    let killed = Instant::now();
    let c = &c;
    let (right_after, gone_after) = tokio::join!(requests_from_here(c, 0, 6), async {
        c.wait_unlisted("p1", Duration::from_secs(10)).await;
        killed.elapsed()
    });
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
    for task in stuck {
        answers.push(task.await.expect("a request task"));
    }
    for client in clients {
        answers.extend(client.await.expect("a client task"));
    }
    assert_all_ok(&answers);
    let g = c.gateway_metrics().await;
    assert!(
        g.sum("pd_gateway_failovers_total", &[("stage", "prefill")]) >= 1.0,
        "the request stuck on p1 failed over: {}",
        g.show("pd_gateway_failovers_total")
    );
    let p0_after = c
        .node_metrics("p0")
        .await
        .sum("pd_kv_leases_total", &[("event", "granted")]);
    assert!(p0_after > p0_before, "p0 served after the kill");

    // 2. d1 falls silent: it leaves after the node timeout; d0 serves meanwhile.
    c.node("d1").proc.signal(libc::SIGSTOP);
    let silent_after = c
        .wait_unlisted("d1", Duration::from_millis(4 * NODE_TIMEOUT_MS))
        .await;
    eprintln!("d1 (stopped) left /admin/nodes {silent_after:?} after it fell silent");
    assert!(
        silent_after >= Duration::from_millis(NODE_TIMEOUT_MS / 2)
            && silent_after <= Duration::from_millis(NODE_TIMEOUT_MS + SLACK_MS),
        "d1 left {silent_after:?} after falling silent; the node timeout is {NODE_TIMEOUT_MS} ms"
    );
    let d0_before = c
        .node_metrics("d0")
        .await
        .sum("pd_node_kv_pulled_tokens_total", &[]);
    let meanwhile = requests_from_here(c, 100, 6).await;
    assert_all_ok(&meanwhile);
    assert!(
        c.node_metrics("d0")
            .await
            .sum("pd_node_kv_pulled_tokens_total", &[])
            > d0_before
    );
    answers.extend(meanwhile);
    c.node("d1").proc.signal(libc::SIGCONT);
    let resumed = Instant::now();
    c.wait_listed(&["d1"], Duration::from_secs(15)).await;
    eprintln!(
        "d1 back in /admin/nodes {:?} after it resumed",
        resumed.elapsed()
    );
    let back = requests_from_here(c, 200, 4).await;
    assert_all_ok(&back);
    answers.extend(back);

    // The gateway answered everything it was asked; every answer either pulled its prompt's KV
    // from a live P or was recomputed on D and counted as such.
    let total = answers.len();
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
    let pulled = answers
        .iter()
        .filter(|(_, a)| a.pulled_tokens.is_some_and(|t| t > 0))
        .count();
    let recomputed = c.sum_over(Role::Decode, "pd_kv_recompute_total", &[]).await;
    eprintln!(
        "{total} requests, all 200: {pulled} pulled their KV from P, {recomputed} recomputed on D; {}",
        g.show("pd_gateway_failovers_total").trim()
    );
    assert!(pulled > 0);
    assert_eq!(
        (total - pulled) as f64,
        recomputed,
        "every answer without pulled KV is a counted recompute"
    );
}

//! A rolling restart loses nothing: `SIGTERM` drains a process instead of cutting what it serves.
//!
//! 1. **A prefill node** (gateway + 2P + 2D, round-robin, streaming load). Both decode nodes are
//!    frozen (`SIGSTOP`) until p1 holds a lease for a request whose decode node has not pulled
//!    yet, then p1 gets `SIGTERM`. It reports itself draining (the gateway lists it so and routes
//!    nothing new to it), keeps its KV side channel open until every lease it granted is pulled,
//!    and only then exits, with status 0. The decode nodes run the default
//!    `--kv-load-failure-policy fail`, so a pull that found p1 gone would fail its request. p1
//!    then starts again under its id and serves. Then d1 gets `SIGTERM` while it decodes: it
//!    finishes its streams and exits 0. Every request of the load is answered 200, and no
//!    decode node recomputed anything.
//! 2. **The gateway** (1P + 1D): a stream is in flight (its decode node frozen mid-answer) when
//!    the gateway gets `SIGTERM`. It stops accepting connections at once, keeps relaying the
//!    stream past pingora's default one-second cut-off, and exits 0 once the stream has ended.

use std::time::{Duration, Instant};

use futures::StreamExt;
use pd_cluster_tests::cluster::{ClusterSpec, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::load::Load;
use pd_cluster_tests::openai::{self, Api};

/// Leases node `engine_id` has granted (since it started).
async fn granted(c: &TestCluster, engine_id: &str) -> f64 {
    c.node_metrics(engine_id)
        .await
        .sum("pd_kv_leases_total", &[("event", "granted")])
}

/// Waits for node `engine_id`, sent `SIGTERM` at `sent`, to exit by itself with status 0, then
/// for the gateway to drop it.
async fn exits_cleanly_and_leaves(c: &mut TestCluster, engine_id: &str, sent: Instant) {
    let status = c
        .node_mut(engine_id)
        .proc
        .wait_exit(Duration::from_secs(20));
    eprintln!(
        "{engine_id} exited ({status:?}) {:?} after SIGTERM",
        sent.elapsed()
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "{engine_id} did not exit cleanly on its own after draining: {status:?}; its log:\n{}",
        c.node(engine_id).proc.log_tail(30)
    );
    c.wait_unlisted(engine_id, Duration::from_secs(5)).await;
}

/// Waits until the load has finished six more requests.
async fn six_more(load: &Load) {
    let target = load.done() + 6;
    eventually("6 more requests", Duration::from_secs(30), async || {
        load.done() >= target
    })
    .await;
}

/// What `/admin/nodes` says of `engine_id`: `(listed, draining)`.
async fn listed_draining(c: &TestCluster, engine_id: &str) -> (bool, bool) {
    let nodes = c.admin_nodes().await;
    match nodes.iter().find(|n| n["engine_id"] == engine_id) {
        Some(n) => (true, n["draining"] == true),
        None => (false, false),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_drain_on_sigterm_and_no_request_is_lost() {
    let mut c = TestCluster::start(
        "drain-node",
        ClusterSpec {
            prefill: 2,
            decode: 2,
            // The decode nodes are frozen for a moment below: they must not time out.
            gateway_args: args(&[
                "--native-policy",
                "round-robin",
                "--node-timeout-ms",
                "20000",
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let load = Load::start(&c.gateway.http, 3, 400, "A rolling restart loses nothing.");
    eventually("p1 to serve", Duration::from_secs(30), async || {
        granted(&c, "p1").await > 0.0
    })
    .await;

    // Freeze both decode nodes, then send two more requests: round-robin gives p1 one of
    // them, which p1 prefills and leases while no decode node can pull it.
    for d in ["d0", "d1"] {
        c.node(d).proc.signal(libc::SIGSTOP);
    }
    let mut stuck = Vec::new();
    for i in 0..2 {
        let gateway = c.gateway.http.clone();
        stuck.push(tokio::spawn(async move {
            let api = Api::ALL[i];
            let body = api.body(&format!("{i} Sent while the decode nodes are frozen."), 4);
            let a = openai::send(&reqwest::Client::new(), &gateway, api, &body, None).await;
            (api, a)
        }));
    }
    eventually(
        "a live lease on p1 while the decode nodes are frozen",
        Duration::from_secs(10),
        async || c.node_metrics("p1").await.sum("pd_kv_leases_live", &[]) > 0.0,
    )
    .await;
    c.node("p1").proc.signal(libc::SIGTERM);
    let sent = Instant::now();
    eventually(
        "the gateway to list p1 as draining",
        Duration::from_secs(2),
        async || listed_draining(&c, "p1").await == (true, true),
    )
    .await;
    // Its lease is unpulled: it must still be there, side channel open.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !c.node_mut("p1").proc.has_exited(),
        "p1 exited {:?} after SIGTERM with a lease unpulled; its log:\n{}",
        sent.elapsed(),
        c.node("p1").proc.log_tail(30)
    );
    for d in ["d0", "d1"] {
        c.node(d).proc.signal(libc::SIGCONT);
    }
    exits_cleanly_and_leaves(&mut c, "p1", sent).await;

    // The load goes on through p0 alone, then through p1 started again.
    six_more(&load).await;
    c.restart("p1", &[]).await;
    eventually("the new p1 to serve", Duration::from_secs(30), async || {
        granted(&c, "p1").await > 0.0
    })
    .await;

    // A decode node, while it decodes: it finishes its streams, takes nothing new, and exits.
    eventually("d1 decoding", Duration::from_secs(10), async || {
        c.node_metrics("d1")
            .await
            .sum("pd_node_requests_running", &[])
            > 0.0
    })
    .await;
    // (Its metrics go with it: what it recomputed through p1's drain, read now.)
    let d1_recomputed = c.node_metrics("d1").await.sum("pd_kv_recompute_total", &[]);
    c.node("d1").proc.signal(libc::SIGTERM);
    exits_cleanly_and_leaves(&mut c, "d1", Instant::now()).await;
    six_more(&load).await;
    let outcome = load.stop().await;
    for task in stuck {
        let (api, a) = task.await.expect("a request task");
        assert!(
            a.status == 200 && a.complete && a.error.is_none(),
            "{api:?}, sent while p1 held its lease: {} {}",
            a.status,
            a.body
        );
    }
    assert!(
        outcome.failed.is_empty(),
        "{} of {} requests failed across p1's restart and d1's exit: {:#?}",
        outcome.failed.len(),
        outcome.ok + outcome.failed.len(),
        outcome.failed
    );
    let recomputed = d1_recomputed + c.node_metrics("d0").await.sum("pd_kv_recompute_total", &[]);
    assert_eq!(recomputed, 0.0, "every decode pulled its KV");
    eprintln!("{} requests answered across p1's restart", outcome.ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_finishes_its_streams_on_sigterm() {
    let mut c = TestCluster::start(
        "drain-gateway",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            ..ClusterSpec::default()
        },
    )
    .await;
    let api = Api::Chat;
    let body = api.streaming(&api.body("A stream outlives the gateway's SIGTERM.", 48));
    let resp = c
        .client
        .post(format!("{}{}", c.gateway.http, api.path()))
        .json(&body)
        .send()
        .await
        .expect("the stream starts");
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = stream
        .next()
        .await
        .expect("a first chunk")
        .expect("a chunk");
    let mut text = String::from_utf8_lossy(&first).into_owned();
    c.node("d0").proc.signal(libc::SIGSTOP);
    c.gateway.proc.signal(libc::SIGTERM);
    let sent = Instant::now();
    let addr = c
        .gateway
        .http
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    eventually(
        "the gateway to refuse new connections",
        Duration::from_secs(2),
        async || tokio::net::TcpStream::connect(&addr).await.is_err(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !c.gateway.proc.has_exited(),
        "the gateway exited {:?} after SIGTERM with a stream in flight; its log:\n{}",
        sent.elapsed(),
        c.gateway.proc.log_tail(30)
    );
    c.node("d0").proc.signal(libc::SIGCONT);
    let rest = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .await
    .expect("the stream ends within 20 s");
    assert!(
        rest.is_ok(),
        "the stream broke after SIGTERM: {rest:?}; so far:\n{text}"
    );
    assert!(
        text.trim_end().ends_with("data: [DONE]") && text.contains("\"finish_reason\":\"length\""),
        "the stream did not end as an answer does:\n{text}"
    );
    let status = c.gateway.proc.wait_exit(Duration::from_secs(10));
    eprintln!(
        "the gateway exited ({status:?}) {:?} after SIGTERM",
        sent.elapsed()
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "the gateway did not exit cleanly once its stream ended: {status:?}; its log:\n{}",
        c.gateway.proc.log_tail(30)
    );
}

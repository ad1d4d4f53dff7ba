//! A client that leaves between P and D: the decode node is stopped (`SIGSTOP`), so a request
//! gets as far as P's prefill and lease, then the gateway's request to D, and waits there. The
//! client then drops the connection. The gateway notices and releases P's lease itself over P's
//! KV side channel, so P's live leases go back to 0 and its free blocks recover within a second
//! (the lease would otherwise live 30 s). D is resumed at the end and serves again.

use std::time::{Duration, Instant};

use pd_cluster_tests::cluster::{ClusterSpec, Stopped, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_between_p_and_d_releases_p_lease_at_once() {
    // A stopped D stops reporting too: keep it in the view for the test's length.
    let c = TestCluster::start(
        "abort",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: args(&["--node-timeout-ms", "120000"]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let api = Api::Chat;
    let p = c.node("p0");
    let d = c.node("d0");

    // A whole request first: the path works, and P's pool settles.
    let warm = openai::send(
        &c.client,
        &c.gateway.http,
        api,
        &api.streaming(&api.body("Warm-up: the whole path works.", 4)),
        None,
    )
    .await
    .ok();
    assert!(warm.pulled_tokens.is_some_and(|t| t > 0), "{}", warm.body);
    eventually(
        "P's warm-up lease released",
        Duration::from_secs(10),
        async || p.metrics(&c.client).await.sum("pd_kv_leases_live", &[]) == 0.0,
    )
    .await;
    let free_before = p
        .metrics(&c.client)
        .await
        .sum("pd_node_kv_blocks_free", &[]);
    assert!(free_before > 0.0);

    let stopped = Stopped::new(d);
    let body = api.streaming(&api.body(
        "A client that leaves between prefill and decode must not pin P's blocks for 30 s.",
        16,
    ));
    let gateway = c.gateway.http.clone();
    let request = tokio::spawn(async move {
        // Its own client: dropping the request closes its own connection.
        let client = reqwest::Client::new();
        openai::send(&client, &gateway, api, &body, None).await
    });
    // P prefilled and granted the lease ...
    eventually(
        "P to grant the lease",
        Duration::from_secs(20),
        async || p.metrics(&c.client).await.sum("pd_kv_leases_live", &[]) == 1.0,
    )
    .await;
    let free_leased = p
        .metrics(&c.client)
        .await
        .sum("pd_node_kv_blocks_free", &[]);
    assert!(
        free_leased < free_before,
        "the lease holds P's blocks: {free_leased} free, {free_before} before"
    );
    // ... and the gateway sent D the request, which the stopped D has not read.
    eventually(
        "the gateway's request to reach the stopped D",
        Duration::from_secs(10),
        async || d.unread_bytes() > 0,
    )
    .await;
    assert!(!request.is_finished(), "the request waits on the stopped D");

    // The client leaves.
    request.abort();
    let left = Instant::now();
    let _ = request.await;
    let released = eventually(
        "P's lease released after the client left",
        Duration::from_secs(1),
        async || p.metrics(&c.client).await.sum("pd_kv_leases_live", &[]) == 0.0,
    )
    .await;
    eventually(
        "P's free blocks back to before the request",
        Duration::from_secs(1).saturating_sub(left.elapsed()),
        async || {
            p.metrics(&c.client)
                .await
                .sum("pd_node_kv_blocks_free", &[])
                >= free_before
        },
    )
    .await;
    eprintln!(
        "lease released {released:?} after the client left; P's free blocks {free_before} → \
         {free_leased} (leased) → recovered within {:?}",
        left.elapsed()
    );
    let pm = p.metrics(&c.client).await;
    assert_eq!(pm.sum("pd_kv_leases_total", &[("event", "released")]), 2.0);
    assert_eq!(pm.sum("pd_kv_leases_total", &[("event", "expired")]), 0.0);
    // The gateway released it (it counts once P acknowledged, so maybe a moment after P's
    // gauge dropped): nobody else could, D is stopped.
    eventually(
        "the gateway to count its release",
        Duration::from_secs(5),
        async || {
            c.gateway_metrics().await.sum(
                "pd_gateway_leases_released_total",
                &[("why", "client_left")],
            ) == 1.0
        },
    )
    .await;
    eventually(
        "the gateway to count the aborted request",
        Duration::from_secs(5),
        async || {
            c.gateway_metrics()
                .await
                .sum("pd_gateway_requests_total", &[("outcome", "aborted")])
                == 1.0
        },
    )
    .await;

    // D resumes and serves again through the gateway.
    drop(stopped);
    let again = openai::send(
        &c.client,
        &c.gateway.http,
        api,
        &api.body("After the abort: D serves again.", 4),
        None,
    )
    .await
    .ok();
    assert!(again.pulled_tokens.is_some_and(|t| t > 0), "{}", again.body);
}

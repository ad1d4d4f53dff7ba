//! A burst is spread by load: the gateway counts the requests it has just sent to a node in the
//! view the policy sees, instead of waiting up to a state interval for the node to report them.
//!
//! Gateway (built-in least-loaded) + 1P + 2D, eight requests at once. The nodes report their
//! queues every 100 ms at best, and eight routing decisions take a few milliseconds, so a view
//! made of the nodes' reports alone shows both decode nodes idle to every one of them, and
//! least-loaded's tie-break sends all eight to the same one. Counting its own open requests per
//! node, the gateway deals them out four and four.
//!
//! The count starts at the decision, not at the send: a split's decode nodes are asked only
//! after P's phase. A second test stops P and checks that a request spread over both decode
//! nodes (n = 2) shows on each of them at once.

use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ClusterSpec, Role, Stopped, TestCluster};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_is_dealt_out_over_the_decode_nodes() {
    let c = TestCluster::start(
        "burst",
        ClusterSpec {
            prefill: 1,
            decode: 2,
            ..ClusterSpec::default()
        },
    )
    .await;
    let before = [
        c.node_metrics("d0")
            .await
            .sum("pd_node_requests_finished_total", &[]),
        c.node_metrics("d1")
            .await
            .sum("pd_node_requests_finished_total", &[]),
    ];
    let sends = (0..8).map(|i| {
        let (client, gateway) = (c.client.clone(), c.gateway.http.clone());
        async move {
            let api = Api::Completions;
            let body = api.body(&format!("{i} Eight at once, spread by load."), 32);
            openai::send(&client, &gateway, api, &body, None).await
        }
    });
    let answers = futures::future::join_all(sends).await;
    for a in &answers {
        assert!(a.status == 200 && a.complete, "{} {}", a.status, a.body);
    }
    // (A node counts a request finished just after its answer went out.)
    let mut served = [0.0; 2];
    eventually("8 requests counted", Duration::from_secs(10), async || {
        for (k, id) in ["d0", "d1"].into_iter().enumerate() {
            served[k] = c
                .node_metrics(id)
                .await
                .sum("pd_node_requests_finished_total", &[])
                - before[k];
        }
        served[0] + served[1] >= 8.0
    })
    .await;
    eprintln!("decode nodes served {served:?} of the burst");
    // Through P and D, every one: no decode node computed a prompt itself.
    let recomputed = c.sum_over(Role::Decode, "pd_kv_recompute_total", &[]).await;
    assert_eq!(recomputed, 0.0, "every decode pulled its KV from P");
    for id in ["d0", "d1"] {
        let pulled = c
            .node_metrics(id)
            .await
            .sum("pd_node_kv_pulled_tokens_total", &[]);
        assert!(pulled > 0.0, "{id} pulled no KV");
    }
    assert_eq!(served[0] + served[1], 8.0);
    assert!(
        served[0] >= 3.0 && served[1] >= 3.0,
        "least-loaded put {served:?} of a burst of 8 on d0 and d1"
    );
}

/// While P is stopped, a request whose two children are spread over d0 and d1 (round-robin
/// deals n = 2 one each) is open on p0 and reserved on both decode nodes, though neither has
/// been asked yet (the view shows a reservation as a request waiting for remote KV); once P
/// runs again the request completes with both children, and the reservations are gone. Before,
/// only the first decode node of a split was counted from the decision on: d1 showed 0 here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spread_request_counts_its_decode_nodes_from_the_decision_on() {
    let c = TestCluster::start(
        "burst-spread",
        ClusterSpec {
            prefill: 1,
            decode: 2,
            ..ClusterSpec::default()
        },
    )
    .await;
    let (status, v) = c
        .push_policy(&bins::policy("round-robin"), "round-robin", &[])
        .await;
    assert_eq!(status, 200, "push round-robin: {v}");
    // (open, reserved) by the gateway on node `id`.
    let open_on = async |id: &str| {
        c.admin_nodes()
            .await
            .iter()
            .find(|n| n["engine_id"] == id)
            .and_then(|n| {
                Some((
                    n["gateway_open_requests"].as_u64()?,
                    n["gateway_reserved_requests"].as_u64()?,
                ))
            })
    };
    let stopped = Stopped::new(c.node("p0"));
    let (client, gateway) = (c.client.clone(), c.gateway.http.clone());
    let request = tokio::spawn(async move {
        let api = Api::Completions;
        let mut body = api.body("Two children, one on each decode node.", 4);
        body["n"] = json!(2);
        body["seed"] = json!(5);
        body["temperature"] = json!(0.7);
        openai::send(&client, &gateway, api, &body, None).await
    });
    // (Within 2 s: p0, silent while stopped, leaves the view after 3.)
    let mut seen = (None, None, None);
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        seen = (
            open_on("p0").await,
            open_on("d0").await,
            open_on("d1").await,
        );
        if seen == (Some((1, 0)), Some((0, 1)), Some((0, 1))) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        seen,
        (Some((1, 0)), Some((0, 1)), Some((0, 1))),
        "(open, reserved) requests on (p0, d0, d1) while p0 is stopped"
    );
    drop(stopped);
    let a = request.await.expect("the request task").ok();
    assert_eq!(a.texts.len(), 2, "{}", a.body);
    // Both children went through P and one decode node each.
    for id in ["d0", "d1"] {
        let pulled = c
            .node_metrics(id)
            .await
            .sum("pd_node_kv_pulled_tokens_total", &[]);
        assert!(
            pulled > 0.0,
            "{id} pulled no KV: the request was not spread"
        );
    }
    eventually("the counts back to 0", Duration::from_secs(3), async || {
        [
            open_on("p0").await,
            open_on("d0").await,
            open_on("d1").await,
        ] == [Some((0, 0)); 3]
    })
    .await;
}

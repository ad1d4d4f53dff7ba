//! A burst is spread by load: the gateway counts the requests it has just sent to a node in the
//! view the policy sees, instead of waiting up to a state interval for the node to report them.
//!
//! Gateway (built-in least-loaded) + 1P + 2D, eight requests at once. The nodes report their
//! queues every 100 ms at best, and eight routing decisions take a few milliseconds, so a view
//! made of the nodes' reports alone shows both decode nodes idle to every one of them, and
//! least-loaded's tie-break sends all eight to the same one. Counting its own open requests per
//! node, the gateway deals them out four and four.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Role, TestCluster};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};

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

//! A spread answer (n>1 over two decode nodes that keep their turns,
//! `--kv-retain-after-decode`) carries no lease params to a client that is not trusted: not in
//! the merged JSON, not in any chunk of the merged stream, on chat and completions (the APIs
//! with `n`). The nodes do answer with them (each group's retained turn): the gateway takes them
//! out and releases those leases.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};

#[tokio::test]
async fn spread_answers_carry_no_lease_params_to_untrusted_clients() {
    let policy = pd_cluster_tests::bins::policy("round-robin");
    let c = TestCluster::start(
        "spread-params",
        ClusterSpec {
            prefill: 1,
            decode: 2,
            gateway_args: args(&[
                "--policy",
                policy.to_str().expect("a UTF-8 path"),
                "--policy-deadline-ms",
                "50",
            ]),
            decode_args: args(&["--kv-retain-after-decode", "60"]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let spread_before = c
        .gateway_metrics()
        .await
        .sum("pd_gateway_decode_spread_total", &[("groups", "2")]);
    let mut answers = 0;
    for api in [Api::Chat, Api::Completions] {
        for stream in [false, true] {
            let mut body = api.body("Spread me over two decode nodes, please.", 8);
            body["n"] = 2.into();
            if stream {
                body = api.streaming(&body);
            }
            let a = openai::send(&c.client, &c.gateway.http, api, &body, None)
                .await
                .ok();
            assert_eq!(a.texts.len(), 2, "{api:?} stream={stream}: {}", a.body);
            assert!(
                !a.body.contains("kv_transfer_params") && !a.body.contains("remote_block_ids"),
                "{api:?} stream={stream}: lease params reached an untrusted client: {}",
                a.body
            );
            answers += 1;
        }
    }
    // The real path ran: every answer was spread over the two decode nodes.
    let spread = c
        .gateway_metrics()
        .await
        .sum("pd_gateway_decode_spread_total", &[("groups", "2")])
        - spread_before;
    assert_eq!(
        spread,
        f64::from(answers),
        "answers spread over two decode nodes"
    );
    // Each group's kept turn is released by the gateway (no one holder continues a spread
    // turn), not left holding a decode node's blocks until its lease expires.
    let want = f64::from(2 * answers);
    eventually(
        "every group's kept turn released",
        Duration::from_secs(10),
        async || {
            let m = c.gateway_metrics().await;
            m.sum(
                "pd_gateway_leases_released_total",
                &[("why", "spread_turn")],
            ) == want
        },
    )
    .await;
}

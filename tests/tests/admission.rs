//! Admission at the front door (`--max-concurrent-requests 1 --max-queued-requests 1`): with
//! the decode node stopped (`SIGSTOP`), one request holds the only slot, a second waits in
//! line, a third is refused at once with a 429 (`rate_limit_exceeded`, which the OpenAI SDKs
//! retry with backoff), and the waiting one is refused when its wait runs out; one whose client
//! leaves while in line gives its place up at once. No refused request reaches a node. Once D resumes, the held request completes and the next is served.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Role, Stopped, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Answer, Api};

#[track_caller]
fn assert_overloaded(a: &Answer) {
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.retry_after.as_deref(), Some("1"), "{}", a.body);
    let e = a.error.as_ref().expect("an error object");
    assert_eq!(e["code"], "rate_limit_exceeded", "{}", a.body);
    assert_eq!(e["type"], "rate_limit_error", "{}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_gateway_queues_then_refuses_and_nothing_refused_reaches_a_node() {
    let c = TestCluster::start(
        "admission",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            // A stopped D stops reporting too: keep it in the view for the test's length.
            gateway_args: args(&[
                "--node-timeout-ms",
                "120000",
                "--max-concurrent-requests",
                "1",
                "--max-queued-requests",
                "1",
                "--queue-timeout-ms",
                "5000",
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let api = Api::Chat;
    let gw = c.gateway.http.clone();
    let send = |text: &str| {
        let (gw, body) = (gw.clone(), api.streaming(&api.body(text, 4)));
        // Each on its own client (its own connection).
        tokio::spawn(
            async move { openai::send(&reqwest::Client::new(), &gw, api, &body, None).await },
        )
    };
    let gauge = async |name: &str| c.gateway_metrics().await.sum(name, &[]);
    send("Warm-up: the whole path works.").await.unwrap().ok();

    let stopped = Stopped::new(c.node("d0"));
    let held = send("Holds the only slot while D is stopped.");
    eventually("the slot taken", Duration::from_secs(10), async || {
        gauge("pd_gateway_requests_in_flight").await == 1.0
    })
    .await;
    let waiting = send("Waits in line for the slot.");
    eventually("one request in line", Duration::from_secs(10), async || {
        gauge("pd_gateway_requests_queued").await == 1.0
    })
    .await;
    // The line is full: refused at once.
    assert_overloaded(&send("Finds the line full.").await.unwrap());
    // The one in line gives up when its wait runs out.
    assert_overloaded(&waiting.await.unwrap());
    assert!(
        !held.is_finished(),
        "the held request waits on the stopped D"
    );
    assert_eq!(gauge("pd_gateway_requests_queued").await, 0.0);
    // A client that leaves while in line gives its place up at once, long before the wait
    // would run out, and is counted as aborted, not refused.
    let leaving = send("Leaves while in line.");
    eventually(
        "the leaving request in line",
        Duration::from_secs(10),
        async || gauge("pd_gateway_requests_queued").await == 1.0,
    )
    .await;
    leaving.abort();
    let _ = leaving.await;
    eventually("its place given up", Duration::from_secs(2), async || {
        gauge("pd_gateway_requests_queued").await == 0.0
    })
    .await;

    drop(stopped);
    held.await.unwrap().ok();
    send("Served once the slot is free.").await.unwrap().ok();

    let g = c.gateway_metrics().await;
    for reason in ["queue_full", "queue_timeout"] {
        assert_eq!(
            g.sum("pd_gateway_admission_refused_total", &[("reason", reason)]),
            1.0,
            "{}",
            g.show("pd_gateway_admission_refused_total")
        );
    }
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "overloaded")]),
        2.0
    );
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "aborted")]),
        1.0
    );
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        3.0
    );
    assert_eq!(g.sum("pd_gateway_requests_in_flight", &[]), 0.0);
    // Only the three served requests reached a node.
    assert_eq!(
        c.sum_over(Role::Prefill, "pd_node_prompts_total", &[])
            .await,
        3.0
    );
}

//! Nodes that hang with their connections open (`SIGSTOP`: what a deadlock, a stalled host or
//! a network partition looks like from the gateway) in a gateway + 2P + 2D cluster
//! (`--node-timeout-ms 1000`, round-robin):
//!
//! 1. A prefill node hangs before it answers. The request waiting on it fails over to the other
//!    prefill node once the hung one has been out of the view for a node timeout without coming
//!    back, and both requests sent are answered 200.
//! 2. Both decode nodes hang mid-stream. The stream ends instead of hanging, with an OpenAI
//!    error event and no `[DONE]` (an SDK raises rather than taking a cut answer as whole), the
//!    gateway holds nothing open on them afterwards, and once resumed they rejoin and serve.
//! 3. The same on `/v1/responses`: its stream ends with an `error` event.
//!
//! Before, the requests waited for as long as the nodes stayed stopped.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Stopped, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};

const NODE_TIMEOUT_MS: u64 = 1000;
/// Longer than a node's way out: silent for the node timeout (out of the view), then another
/// node timeout without coming back (its requests end), plus the sweep's tick and slack for
/// two loaded cores. A request still waiting past this waits on a hung node.
const GIVE_UP: Duration = Duration::from_secs(12);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_on_a_hung_node_fail_over_or_end() {
    let c = TestCluster::start(
        "hung",
        ClusterSpec {
            prefill: 2,
            decode: 2,
            gateway_args: args(&[
                "--node-timeout-ms",
                &NODE_TIMEOUT_MS.to_string(),
                "--native-policy",
                "round-robin",
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;

    // 1. p0 hangs; two requests at once: round-robin ranks p0 first for one of them, p1 next.
    let answers = {
        let _p0 = Stopped::new(c.node("p0"));
        let sends = (0..2).map(|i| {
            let api = Api::Chat;
            let body = api.body(&format!("{i} A prefill node hangs."), 4);
            let (client, gateway) = (c.client.clone(), c.gateway.http.clone());
            async move { openai::send(&client, &gateway, api, &body, None).await }
        });
        tokio::time::timeout(GIVE_UP, futures::future::join_all(sends))
            .await
            .expect("the requests still wait on the hung prefill node")
    };
    for a in &answers {
        assert!(a.status == 200 && a.complete, "{} {}", a.status, a.body);
    }
    let g = c.gateway_metrics().await;
    assert!(
        g.sum("pd_gateway_failovers_total", &[("stage", "prefill")]) >= 1.0,
        "the request on p0 failed over: {}",
        g.show("pd_gateway_failovers_total")
    );
    c.wait_listed(&["p0"], Duration::from_secs(15)).await;

    // 2. A long stream; both decode nodes hang once its first event is out.
    let api = Api::Completions;
    let body = api.body("Both decode nodes hang mid-stream.", 1500);
    let seen = stream_while_decode_nodes_hang(&c, api, &body).await;
    assert!(
        !seen.contains("data: [DONE]"),
        "the stream ended early, not complete (1500 tokens before the nodes stopped?)"
    );
    let last = last_event(&seen);
    let error: serde_json::Value = last
        .strip_prefix("data: ")
        .and_then(|d| serde_json::from_str(d).ok())
        .unwrap_or_else(|| panic!("the stream's last event is an error object: {last:?}"));
    assert_eq!(error["error"]["type"], "upstream_error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("left the view")),
        "the error names why: {error}"
    );
    // Nothing stays open on the hung nodes; resumed, they rejoin and serve.
    c.wait_listed(&["d0", "d1"], Duration::from_secs(15)).await;
    eventually(
        "no request open on the nodes",
        Duration::from_secs(5),
        async || {
            c.admin_nodes()
                .await
                .iter()
                .all(|n| n["gateway_open_requests"].as_u64() == Some(0))
        },
    )
    .await;
    for i in 0..2 {
        let body = api.body(&format!("{i} Back."), 4);
        let a = openai::send(&c.client, &c.gateway.http, api, &body, None).await;
        assert!(a.status == 200 && a.complete, "{} {}", a.status, a.body);
    }

    // 3. The same on `/v1/responses`, whose error event is `event: error` with the error
    //    object (what the SDKs raise on). It has no `ignore_eos`: first find a prompt whose
    //    greedy answer runs past 200 tokens (the answer is deterministic), so the stream is
    //    still going when the nodes stop right after its first event.
    let api = Api::Responses;
    let mut long = None;
    for i in 0..12 {
        let body = api.body(&format!("{i} Both decode nodes hang mid-response."), 200);
        let a = openai::send(&c.client, &c.gateway.http, api, &body, None).await;
        assert!(a.status == 200 && a.complete, "{} {}", a.status, a.body);
        if a.finish.first().cloned().flatten().as_deref() == Some("incomplete") {
            long = Some(body);
            break;
        }
    }
    let mut body = long.expect("one of 12 prompts runs to 200 tokens without EOS");
    body["max_output_tokens"] = 1500.into();
    let seen = stream_while_decode_nodes_hang(&c, api, &body).await;
    assert!(
        !seen.contains("response.completed") && !seen.contains("response.incomplete"),
        "the response ended before the nodes stopped"
    );
    let last = last_event(&seen);
    let data = last
        .strip_prefix("event: error\ndata: ")
        .unwrap_or_else(|| panic!("the stream's last event is `event: error`: {last:?}"));
    let event: serde_json::Value = serde_json::from_str(data).expect("the event is JSON");
    assert_eq!(event["type"], "error", "{event}");
    assert_eq!(event["error"]["type"], "upstream_error", "{event}");
    assert!(
        event["message"]
            .as_str()
            .is_some_and(|m| m.contains("left the view")),
        "the event names why: {event}"
    );
    c.wait_listed(&["d0", "d1"], Duration::from_secs(15)).await;
}

/// Streams `body` on `api` through the gateway; once its first event is out, both decode
/// nodes hang until the stream ends (or [`GIVE_UP`] passes: a failure). Everything the client
/// read.
async fn stream_while_decode_nodes_hang(
    c: &TestCluster,
    api: Api,
    body: &serde_json::Value,
) -> String {
    let mut resp = c
        .client
        .post(format!("{}{}", c.gateway.http, api.path()))
        .json(&api.streaming(body))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(resp.status(), 200);
    let first = resp
        .chunk()
        .await
        .expect("a first event")
        .unwrap_or_default();
    let mut seen = String::from_utf8_lossy(&first).into_owned();
    let _d0 = Stopped::new(c.node("d0"));
    let _d1 = Stopped::new(c.node("d1"));
    let rest = tokio::time::timeout(GIVE_UP, async {
        while let Ok(Some(piece)) = resp.chunk().await {
            seen.push_str(&String::from_utf8_lossy(&piece));
        }
    })
    .await;
    assert!(
        rest.is_ok(),
        "the {} stream still waits on the hung decode nodes",
        api.label()
    );
    seen
}

/// The last SSE event of a stream.
fn last_event(seen: &str) -> String {
    seen.trim_end()
        .rsplit("\n\n")
        .next()
        .unwrap_or_default()
        .to_owned()
}

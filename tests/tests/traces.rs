//! Traces (issue 49): one request's spans (a whole answer, then a streamed one, each in a trace
//! of its own), exported over OTLP/gRPC by three processes and received by a real OTLP receiver
//! in the test process ([`pd_cluster_tests::otlp`]), form one tree under the client's
//! `traceparent`: the gateway's `request` (a child of the client's span) with
//! its phases `admission`, `tokenize`, `policy`, `prefill` and `decode` (the calls to P and D,
//! the latter holding `relay`); P's `request` under the gateway's `prefill`, with its own
//! `prefill`; D's `request` under the gateway's `decode`, with `decode` and, within it, `pull`.
//! Every span carries the request id, each process exports under its own `service.name`, and
//! nothing else is exported. The processes are stopped with `SIGTERM` before the spans are
//! read: what was still queued is flushed on the way out.
//!
//! Off (no `--otlp-endpoint`, the default), the gateway exports nothing and passes no trace
//! context on: the nodes, exporting, start traces of their own, unrelated to the client's.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::Api;
use pd_cluster_tests::otlp::{KIND_CLIENT, KIND_SERVER, Receiver, Span};
use pd_cluster_tests::process::Proc;

/// The client's traces (one per request) and span.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const STREAMED_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// How long a process may take to drain and exit after `SIGTERM`.
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// What the client sends: in which trace, under which request id, streamed or not.
struct Sent<'a> {
    trace: &'a str,
    request_id: &'a str,
    stream: bool,
}

/// One chat request through the gateway with the client's `traceparent` and `x-request-id`.
async fn chat(cluster: &TestCluster, sent: &Sent<'_>) {
    let body = Api::Chat.body("Where do spans go?", 4);
    let body = match sent.stream {
        true => Api::Chat.streaming(&body),
        false => body,
    };
    let resp = cluster
        .client
        .post(format!("{}{}", cluster.gateway.http, Api::Chat.path()))
        .header("traceparent", format!("00-{}-{CLIENT_SPAN}-01", sent.trace))
        .header("x-request-id", sent.request_id)
        .json(&body)
        .send()
        .await
        .expect("the chat request");
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{body}");
    assert_eq!(sent.stream, body.contains("data: [DONE]"), "{body}");
}

/// `SIGTERM` to every process, then waits until each has exited with status 0 (its exporter
/// flushed on the way).
async fn stop_all(cluster: &mut TestCluster) {
    let mut procs: Vec<&mut Proc> = vec![&mut cluster.gateway.proc];
    procs.extend(cluster.nodes.iter_mut().map(|n| &mut n.proc));
    for p in &procs {
        p.signal(libc::SIGTERM);
    }
    for p in procs {
        eventually(
            "a process to exit after SIGTERM",
            EXIT_TIMEOUT,
            async || p.has_exited(),
        )
        .await;
        let status = p.wait_exit(Duration::ZERO).expect("exited");
        assert!(status.success(), "{} exited with {status}", p.name());
    }
}

/// The one span `service` exported as `name`.
fn one<'a>(spans: &'a [Span], service: &str, name: &str) -> &'a Span {
    let found: Vec<&Span> = spans
        .iter()
        .filter(|s| s.service == service && s.name == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one `{name}` span from {service}, among {spans:#?}"
    );
    found[0]
}

fn assert_child(child: &Span, parent: &Span) {
    assert_eq!(
        child.parent_span_id, parent.span_id,
        "{}'s `{}` is a child of {}'s `{}`",
        child.service, child.name, parent.service, parent.name
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_requests_spans_form_one_tree_across_three_processes() {
    let receiver = Receiver::start().await;
    let otlp = args(&["--otlp-endpoint", &receiver.endpoint]);
    let spec = ClusterSpec {
        prefill: 1,
        decode: 1,
        gateway_args: otlp.clone(),
        node_args: otlp,
        ..Default::default()
    };
    let mut cluster = TestCluster::start("traces", spec).await;
    let sent = [
        Sent {
            trace: TRACE,
            request_id: "trace-test-1",
            stream: false,
        },
        Sent {
            trace: STREAMED_TRACE,
            request_id: "trace-test-2",
            stream: true,
        },
    ];
    for s in &sent {
        chat(&cluster, s).await;
    }
    stop_all(&mut cluster).await;
    let spans = receiver.spans();
    for s in &sent {
        let tree: Vec<Span> = spans
            .iter()
            .filter(|span| span.trace_id == s.trace)
            .cloned()
            .collect();
        one_tree(&tree, s.request_id);
    }
    // Nothing else was exported.
    assert_eq!(spans.len(), 2 * (7 + 2 + 3), "{spans:#?}");
}

/// `spans`, one request's trace, form its tree across three processes, under the client's
/// span; each carries `request_id`.
fn one_tree(spans: &[Span], request_id: &str) {
    for s in spans {
        assert_eq!(s.attribute("request_id"), Some(request_id), "{s:#?}");
    }
    let mut services: Vec<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    services.sort_unstable();
    services.dedup();
    assert_eq!(
        services,
        ["pd-gateway", "pd-node-decode", "pd-node-prefill"],
        "{spans:#?}"
    );

    // The gateway: a server span under the client's, its phases under it.
    let gw = "pd-gateway";
    let root = one(spans, gw, "request");
    assert_eq!(root.parent_span_id, CLIENT_SPAN, "{root:#?}");
    assert_eq!(root.kind, KIND_SERVER);
    for phase in ["admission", "tokenize", "policy", "prefill", "decode"] {
        assert_child(one(spans, gw, phase), root);
    }
    let (gw_prefill, gw_decode) = (one(spans, gw, "prefill"), one(spans, gw, "decode"));
    assert_eq!(gw_prefill.kind, KIND_CLIENT);
    assert_eq!(gw_decode.kind, KIND_CLIENT);
    assert_child(one(spans, gw, "relay"), gw_decode);

    // P: its server span under the gateway's call to it, the prefill within.
    let p = one(spans, "pd-node-prefill", "request");
    assert_eq!(p.kind, KIND_SERVER);
    assert_child(p, gw_prefill);
    assert_child(one(spans, "pd-node-prefill", "prefill"), p);

    // D: its server span under the gateway's call to it, decode within, the pull of P's KV
    // within that.
    let d = one(spans, "pd-node-decode", "request");
    assert_eq!(d.kind, KIND_SERVER);
    assert_child(d, gw_decode);
    let d_decode = one(spans, "pd-node-decode", "decode");
    assert_child(d_decode, d);
    assert_child(one(spans, "pd-node-decode", "pull"), d_decode);
    assert_eq!(spans.len(), 7 + 2 + 3, "no other span: {spans:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_the_gateway_exports_nothing_and_passes_no_trace_context_on() {
    let receiver = Receiver::start().await;
    let spec = ClusterSpec {
        prefill: 1,
        decode: 1,
        // Only the nodes export: they show what reached them.
        node_args: args(&["--otlp-endpoint", &receiver.endpoint]),
        ..Default::default()
    };
    let mut cluster = TestCluster::start("traces-off", spec).await;
    let sent = Sent {
        trace: TRACE,
        request_id: "trace-test-off",
        stream: false,
    };
    chat(&cluster, &sent).await;
    stop_all(&mut cluster).await;
    let spans = receiver.spans();

    assert!(
        spans.iter().all(|s| s.service != "pd-gateway"),
        "{spans:#?}"
    );
    let p = one(&spans, "pd-node-prefill", "request");
    let d = one(&spans, "pd-node-decode", "request");
    for server in [p, d] {
        // No `traceparent` came with the gateway's request: a trace of the node's own.
        assert_eq!(server.parent_span_id, "", "{server:#?}");
        assert_ne!(server.trace_id, TRACE, "{server:#?}");
        assert_eq!(server.attribute("request_id"), Some("trace-test-off"));
    }
    assert_ne!(p.trace_id, d.trace_id);
    assert_child(one(&spans, "pd-node-prefill", "prefill"), p);
}

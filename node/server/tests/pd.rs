//! Prefill/decode disaggregation between real `pd-node` processes, driven the way a vLLM proxy
//! drives them: P gets the request with `max_tokens: 1`, `stream: false` and
//! `kv_transfer_params: {"do_remote_decode": true}`; the `kv_transfer_params` P answers with are
//! copied into the request to D, which pulls the prompt's KV over UCX and decodes.
//!
//! Correctness is token-exact: greedy output through P→D equals a standalone node's, for all three
//! APIs, streaming and not, short and multi-block prompts, and n=3 (seeded) children. Every test
//! also checks that the KV really moved (`kv_pulled_tokens`, transfer bytes) or, on the failure
//! paths, that the recompute was counted with its reason.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pd_model::tiny::{TinySpec, generate};
use serde_json::{Value, json};

pub(crate) struct Node {
    pub(crate) child: Child,
    pub(crate) http: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn model(name: &str) -> PathBuf {
    model_seeded(name, 21)
}

/// A tiny model whose weights come from `seed` (same shapes and tokenizer for every seed).
fn model_seeded(name: &str, seed: u64) -> PathBuf {
    model_spec(
        name,
        &TinySpec {
            seed,
            ..TinySpec::default()
        },
    )
}

/// A model of `spec`'s shapes, in a directory of its own.
pub(crate) fn model_spec(name: &str, spec: &TinySpec) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pd-pd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate(spec, &dir).unwrap();
    dir
}

/// Starts `pd-node serve` on `model` with 4-token blocks (unless `extra` names a
/// `--block-size`) plus `extra` flags.
pub(crate) fn start(model: &Path, extra: &[&str]) -> Node {
    start_env(model, extra, &[])
}

/// [`start`] with environment variables `env` set for the node (e.g. `UCX_TLS`).
fn start_env(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Node {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pd-node"));
    cmd.envs(env.iter().copied());
    cmd.arg("serve").arg("--model").arg(model);
    if !extra.contains(&"--port") {
        cmd.args(["--port", "0"]);
    }
    if !extra.contains(&"--block-size") {
        cmd.args(["--block-size", "4"]);
    }
    cmd.args(["--served-model-name", "tiny"]);
    if !extra.contains(&"--num-gpu-blocks") {
        cmd.args(["--num-gpu-blocks", "256"]);
    }
    cmd.args(extra);
    let mut node = Node {
        child: cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn pd-node"),
        http: String::new(),
    };
    let mut out = BufReader::new(node.child.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "pd-node {extra:?} exited before listening"
        );
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            node.http = a.to_string();
            return node;
        }
    }
}

/// A prefill node (`--engine-id p1` unless `extra` names one).
pub(crate) fn producer(model: &Path, extra: &[&str]) -> Node {
    let mut args = vec!["--kv-role", "kv_producer", "--kv-port", "0"];
    if !extra.contains(&"--engine-id") {
        args.extend_from_slice(&["--engine-id", "p1"]);
    }
    args.extend_from_slice(extra);
    start(model, &args)
}

fn consumer(model: &Path, policy: &str) -> Node {
    consumer_with(model, policy, &["--engine-id", "d1"])
}

/// A consumer with `extra` flags too (its `--engine-id` among them).
pub(crate) fn consumer_with(model: &Path, policy: &str, extra: &[&str]) -> Node {
    consumer_env(model, policy, extra, &[])
}

/// [`consumer_with`] with environment variables `env` set for the node.
fn consumer_env(model: &Path, policy: &str, extra: &[&str], env: &[(&str, &str)]) -> Node {
    let mut args = vec![
        "--kv-role",
        "kv_consumer",
        "--kv-port",
        "0",
        "--kv-recompute-threshold",
        "0",
        "--kv-load-failure-policy",
        policy,
    ];
    args.extend_from_slice(extra);
    start_env(model, &args, env)
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Api {
    Completions,
    Chat,
    Responses,
}

impl Api {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
        }
    }

    /// A greedy request for `text`.
    pub(crate) fn body(self, text: &str, max_tokens: usize) -> Value {
        match self {
            Api::Completions => json!({"model": "tiny", "prompt": text, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
            Api::Chat => json!({"model": "tiny", "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
                "return_token_ids": true}),
            Api::Responses => json!({"model": "tiny", "input": text,
                "max_output_tokens": max_tokens, "temperature": 0}),
        }
    }
}

pub(crate) async fn post(http: &str, path: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{http}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// What a client saw, normalised across APIs and streaming.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Seen {
    /// Token ids per choice (empty for `/v1/responses`, which has none).
    pub(crate) tokens: Vec<Vec<u64>>,
    /// Text per choice.
    pub(crate) texts: Vec<String>,
    /// `usage.prompt_tokens` / `usage.input_tokens`.
    pub(crate) prompt: Option<u64>,
    /// `usage.*_tokens_details.cached_tokens` (prefix cache + pulled).
    pub(crate) cached: Option<u64>,
    /// `usage.*_tokens_details.kv_pulled_tokens`.
    pub(crate) pulled: Option<u64>,
    /// `kv_transfer_params` of the response (final chunk when streaming).
    pub(crate) kv: Option<Value>,
}

fn choice_slot<T: Default + Clone>(v: &mut Vec<T>, i: usize) -> &mut T {
    if v.len() <= i {
        v.resize(i + 1, T::default());
    }
    &mut v[i]
}

fn read_usage(seen: &mut Seen, usage: &Value) {
    seen.prompt = usage
        .get("prompt_tokens")
        .or_else(|| usage.get("input_tokens"))
        .and_then(Value::as_u64);
    let d = usage
        .get("prompt_tokens_details")
        .or_else(|| usage.get("input_tokens_details"));
    seen.cached = d
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64);
    if let Some(p) = d.and_then(|d| d.get("kv_pulled_tokens")) {
        seen.pulled = p.as_u64();
    }
}

/// Reads a whole response (JSON or SSE) into [`Seen`].
pub(crate) async fn seen(api: Api, r: reqwest::Response) -> Seen {
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let streaming = r
        .headers()
        .get("content-type")
        .is_some_and(|v| v.to_str().unwrap().starts_with("text/event-stream"));
    let mut s = Seen::default();
    if !streaming {
        let v: Value = r.json().await.unwrap();
        s.kv = v.get("kv_transfer_params").cloned();
        read_usage(&mut s, &v["usage"]);
        match api {
            Api::Responses => {
                s.texts = vec![
                    v["output"][0]["content"][0]["text"]
                        .as_str()
                        .unwrap()
                        .into(),
                ]
            }
            _ => {
                for c in v["choices"].as_array().unwrap() {
                    let i = c["index"].as_u64().unwrap() as usize;
                    let text = c.get("text").or_else(|| c["message"].get("content"));
                    *choice_slot(&mut s.texts, i) = text.and_then(Value::as_str).unwrap().into();
                    *choice_slot(&mut s.tokens, i) = c["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap())
                        .collect();
                }
            }
        }
        return s;
    }
    seen_sse(api, &r.text().await.unwrap())
}

/// [`seen`] of a streamed body's text.
fn seen_sse(api: Api, body: &str) -> Seen {
    let mut s = Seen::default();
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert!(v.get("error").is_none(), "stream error: {v}");
        if let Some(kv) = v.get("kv_transfer_params") {
            s.kv = Some(kv.clone());
        }
        match api {
            Api::Responses => {
                let t = v["type"].as_str().unwrap();
                if t == "response.completed" || t == "response.incomplete" {
                    let resp = &v["response"];
                    s.texts = vec![
                        resp["output"][0]["content"][0]["text"]
                            .as_str()
                            .unwrap()
                            .into(),
                    ];
                    s.kv = resp.get("kv_transfer_params").cloned();
                    read_usage(&mut s, &resp["usage"]);
                }
            }
            _ => {
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    read_usage(&mut s, u);
                }
                for c in v["choices"].as_array().unwrap() {
                    let i = c["index"].as_u64().unwrap() as usize;
                    let text = c.get("text").or_else(|| c["delta"].get("content"));
                    if let Some(t) = text.and_then(Value::as_str) {
                        choice_slot(&mut s.texts, i).push_str(t);
                    }
                    if let Some(ids) = c.get("token_ids").and_then(Value::as_array) {
                        choice_slot(&mut s.tokens, i)
                            .extend(ids.iter().map(|t| t.as_u64().unwrap()));
                    }
                }
            }
        }
    }
    s
}

/// The request a vLLM proxy sends P for `body`.
pub(crate) fn prefill_body(api: Api, body: &Value) -> Value {
    let mut p = body.clone();
    let o = p.as_object_mut().unwrap();
    match api {
        Api::Responses => {
            o.insert("max_output_tokens".into(), json!(1));
        }
        _ => {
            o.insert("max_tokens".into(), json!(1));
            if api == Api::Chat {
                o.insert("max_completion_tokens".into(), json!(1));
            }
        }
    }
    o.insert("stream".into(), json!(false));
    o.remove("stream_options");
    o.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    p
}

/// Asks P to prefill `body`; returns the `kv_transfer_params` it answered with.
async fn prefill(p: &Node, api: Api, body: &Value) -> Value {
    let r = post(&p.http, api.path(), &prefill_body(api, body)).await;
    let s = seen(api, r).await;
    s.kv.expect("P answers with kv_transfer_params")
}

/// The proxy's whole flow: P, then D with P's params (streaming or not as `body` says).
async fn through_pd(p: &Node, d: &Node, api: Api, body: &Value) -> Seen {
    let params = prefill(p, api, body).await;
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    seen(api, post(&d.http, api.path(), &db).await).await
}

pub(crate) fn streaming(api: Api, body: &Value) -> Value {
    let mut b = body.clone();
    b["stream"] = json!(true);
    if api != Api::Responses {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

/// The value of a Prometheus sample (`name{labels}` exactly as printed), 0 when absent.
pub(crate) async fn metric(node: &Node, sample: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", node.http))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == sample).then(|| value.parse().unwrap())
        })
        .unwrap_or(0.0)
}

pub(crate) async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const SHORT: &str = "Hi";
const LONG: &str = "Prefill and decode run on different nodes; the KV cache moves between them.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_through_p_and_d_equals_one_node_on_every_api() {
    let dir = model("exact");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let mut run = 0;
    for api in [Api::Completions, Api::Chat, Api::Responses] {
        for text in [SHORT, LONG] {
            for stream in [false, true] {
                // A distinct prompt per run, so D's prefix cache never holds any of it.
                run += 1;
                let text = format!("{run}{text}");
                let body = api.body(&text, 12);
                let body = if stream { streaming(api, &body) } else { body };
                let want = seen(api, post(&solo.http, api.path(), &body).await).await;
                assert_eq!(want.pulled, None);
                let got = through_pd(&p, &d, api, &body).await;
                assert_eq!(got.texts, want.texts, "{body}");
                assert_eq!(got.tokens, want.tokens, "{body}");
                // The prompt's KV came from P — all of it, with P's greedy first token, so D
                // computes nothing before its first token — except blocks D had cached (the
                // chat template's head). D never answers with params of its own.
                let prompt = got.prompt.expect("usage");
                let pulled = got.pulled.expect("D reports pulled tokens");
                assert!(pulled > 0);
                assert_eq!(got.cached, Some(prompt), "{body}");
                if api == Api::Completions {
                    assert_eq!(pulled, prompt, "no shared prefix: all pulled");
                }
                assert!(got.kv.is_none());
            }
        }
    }
    // P: every lease was released by D right after its pull, none expired.
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"granted\"}").await,
        12.0
    );
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"released\"}").await,
        12.0
    );
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"expired\"}").await,
        0.0
    );
    assert_eq!(
        metric(
            &d,
            "pd_kv_transfer_failures_total{reason=\"lease_expired\"}"
        )
        .await,
        0.0
    );
    assert!(metric(&d, "pd_kv_transfer_bytes_total").await > 0.0);
    assert!(metric(&d, "pd_node_kv_pulled_tokens_total").await > 0.0);
    // Shared memory maps P's lease board into D: every lease was confirmed there, by a read
    // right after its blocks, not by a round trip.
    assert_eq!(
        metric(&d, "pd_kv_lease_confirms_total{via=\"board\"}").await,
        12.0
    );
    assert_eq!(
        metric(&d, "pd_kv_lease_confirms_total{via=\"rpc\"}").await,
        0.0
    );
    // Prompt logprobs are computed by the node that answers, never through P and D: P refuses
    // to prefill for another node with them (a gateway sends such requests to one node).
    for extra in [
        json!({"echo": true, "logprobs": 1}),
        json!({"prompt_logprobs": 0}),
    ] {
        let mut body = prefill_body(Api::Completions, &Api::Completions.body(SHORT, 4));
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post(&p.http, "/v1/completions", &body).await;
        assert_eq!(r.status(), 400, "{extra}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["param"], "kv_transfer_params", "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("prompt logprobs"),
            "{e}"
        );
    }
}

/// A single completion without logprobs — greedy or sampled — takes P's first token: D then
/// computes nothing before its first token and reports the whole prompt pulled. A seeded
/// sampled request still answers token for token as one node does: D's generator skips the
/// draw P took for that token. A request asking for logprobs and an `n = 2` request compute
/// the last prompt position on D as before (pulled = prompt − 1). An unseeded sampled request
/// takes P's token too. The same holds with penalties, biases and `min_p` set, under
/// structured output, and under `min_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_single_completion_without_logprobs_takes_the_producers_first_token() {
    let dir = model("first-token");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    let base = |i: usize| api.body(&format!("{i}{LONG}"), 6);
    let mut sampled = base(1);
    sampled["temperature"] = json!(0.9);
    sampled["seed"] = json!(7);
    let mut logprobs = base(2);
    logprobs["logprobs"] = json!(2);
    let mut two = base(3);
    two["n"] = json!(2);
    // Penalties and biases act on the first token too (the repetition penalty reads the
    // prompt): P's token stands for D's only under the same ones, which the key attests.
    // (A bias against the plain answer's second token makes sure D's part changes.)
    let plain = seen(api, post(&solo.http, api.path(), &base(5)).await).await;
    let second = plain.tokens[0][1].to_string();
    let mut penalized = base(5);
    for (k, v) in [
        ("repetition_penalty", json!(1.3)),
        ("frequency_penalty", json!(0.7)),
        ("presence_penalty", json!(0.4)),
        ("logit_bias", json!({"17": 3.5, "3": -2, second: -100})),
    ] {
        penalized[k] = v;
    }
    let alone = seen(api, post(&solo.http, api.path(), &penalized).await).await;
    assert_ne!(
        plain.tokens, alone.tokens,
        "the penalties change the answer"
    );
    let mut penalized_sampled = penalized.clone();
    penalized_sampled["prompt"] = base(6)["prompt"].clone();
    penalized_sampled["temperature"] = json!(0.9);
    penalized_sampled["seed"] = json!(11);
    penalized_sampled["min_p"] = json!(0.05);
    let mut penalized_two = penalized_sampled.clone();
    penalized_two["prompt"] = base(7)["prompt"].clone();
    penalized_two["n"] = json!(2);
    // Structured output masks every pick, P's first among them: P's token stands for D's only
    // under the same constraint (the key carries its fingerprint). Greedy under a schema takes
    // P's token; two sampled children under a regex compute it on D.
    let mut schema = base(8);
    schema["max_tokens"] = json!(80);
    schema["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "r",
        "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
        "maximum": 99}, "s": {"enum": ["ab", "cd"]}}, "required": ["n", "s"],
        "additionalProperties": false}}});
    let mut regex_two = base(9);
    regex_two["n"] = json!(2);
    regex_two["temperature"] = json!(0.8);
    regex_two["seed"] = json!(3);
    regex_two["structured_outputs"] = json!({"regex": "[a-f]{3}-[0-9]{2}"});
    let structured = seen(api, post(&solo.http, api.path(), &schema).await).await;
    let v: Value = serde_json::from_str(&structured.texts[0]).expect("JSON under the schema");
    assert!(v["n"].is_u64() && v["s"].is_string(), "{v}");
    // `min_tokens` bans the ending tokens from the first pick on: P bans them too (the key
    // carries the ban). A stop id that is the plain answer's first token moves it.
    let plain_first = seen(api, post(&solo.http, api.path(), &base(10)).await)
        .await
        .tokens[0][0];
    let mut min_tokens = base(10);
    min_tokens["stop_token_ids"] = json!([plain_first]);
    min_tokens["min_tokens"] = json!(3);
    let held = seen(api, post(&solo.http, api.path(), &min_tokens).await).await;
    assert_ne!(
        held.tokens[0][0], plain_first,
        "min_tokens banned the stop id"
    );
    for (body, takes_first) in [
        (min_tokens, true),
        (base(0), true),
        (sampled, true),
        (logprobs, false),
        (two, false),
        (penalized, true),
        (penalized_sampled, true),
        (penalized_two, false),
        (schema, true),
        (regex_two, false),
    ] {
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, &d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{body}");
        assert_eq!(got.texts, want.texts, "{body}");
        let prompt = got.prompt.expect("usage");
        let pulled = if takes_first { prompt } else { prompt - 1 };
        assert_eq!(got.pulled, Some(pulled), "{body}");
        assert_eq!(got.cached, Some(pulled), "{body}");
    }
    let mut unseeded = base(4);
    unseeded["temperature"] = json!(1.2);
    let got = through_pd(&p, &d, api, &unseeded).await;
    assert_eq!(got.tokens[0].len(), 6);
    assert_eq!(got.pulled, got.prompt, "{unseeded}");
}

/// Both ways of reading a producer's pool on one host — copying from the mapping UCX gives
/// (`--kv-pull-via auto`, the default) and UCX gets (`get`) — bring the same KV: token for
/// token as one node, the whole prompt pulled, the lease confirmed on the board either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_through_the_mapping_and_through_ucx_gets_bring_the_same_kv() {
    let dir = model("via");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let mapped = consumer_with(&dir, "fail", &["--engine-id", "d1"]);
    let gets = consumer_with(&dir, "fail", &["--engine-id", "d2", "--kv-pull-via", "get"]);
    let api = Api::Completions;
    for (i, (d, via)) in [(&mapped, "mapped"), (&gets, "get")]
        .into_iter()
        .enumerate()
    {
        let body = api.body(&format!("{i}{LONG}"), 8);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{body}");
        assert_eq!(got.pulled, got.prompt, "{body}");
        assert!(metric(d, "pd_kv_transfer_bytes_total").await > 0.0);
        assert_eq!(
            metric(d, &format!("pd_kv_pulls_total{{via=\"{via}\"}}")).await,
            1.0,
            "read via {via}"
        );
        assert_eq!(
            metric(d, "pd_kv_lease_confirms_total{via=\"board\"}").await,
            1.0
        );
    }
}

/// Issue 13, heterogeneous peers on CPU: producers and consumers whose block sizes (16 ↔ 32)
/// and block layouts (`hnd`, the CPU order, ↔ `nhd`, the GPU order) differ still hand KV over
/// — the consumer converts what it pulls — through the mapped copy and through UCX gets into a
/// staging buffer, in both directions. Every answer equals one node's, token for token, with KV
/// pulled, counted as converted where the layouts differ. A second prompt extending the first
/// makes the consumer pull from the middle of the producer's blocks (its own prefix cache holds
/// the start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_other_block_sizes_and_layouts_hand_over_kv_token_exact() {
    let dir = model("hetero");
    let solo = start(&dir, &["--block-size", "16"]);
    let nhd = ["--kv-layout", "nhd"];
    let prod = |id: &'static str, bs: &'static str, extra: &[&'static str]| {
        let mut a = vec!["--engine-id", id, "--block-size", bs];
        a.extend_from_slice(extra);
        producer(&dir, &a)
    };
    let cons = |id: &'static str, bs: &'static str, extra: &[&'static str]| {
        let mut a = vec!["--engine-id", id, "--block-size", bs];
        a.extend_from_slice(extra);
        consumer_with(&dir, "fail", &a)
    };
    let p16 = prod("p16", "16", &[]);
    let p32n = prod("p32n", "32", &nhd);
    let d32 = cons("d32", "32", &[]);
    let d16n = cons("d16n", "16", &nhd);
    let d32n_get = cons(
        "d32ng",
        "32",
        &["--kv-layout", "nhd", "--kv-pull-via", "get"],
    );
    let d16_get = cons("d16g", "16", &["--kv-pull-via", "get"]);
    // (producer, consumer, whether the layouts differ)
    let pairs = [
        (&p16, &d32, "16 hnd → 32 hnd", true),
        (&p32n, &d16n, "32 nhd → 16 nhd", true),
        (&p16, &d16n, "16 hnd → 16 nhd", true),
        (&p32n, &d32, "32 nhd → 32 hnd", true),
        (&p16, &d32n_get, "16 hnd → 32 nhd, gets", true),
        (&p32n, &d16_get, "32 nhd → 16 hnd, gets", true),
        (&p32n, &d32n_get, "32 nhd → 32 nhd, gets", false),
    ];
    let body = |ids: &[u32]| {
        json!({"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
               "ignore_eos": true, "return_token_ids": true})
    };
    let api = Api::Completions;
    for (i, (p, d, what, differ)) in pairs.into_iter().enumerate() {
        let before = metric(d, "pd_kv_rechunked_pulls_total").await;
        // 57 tokens: three and a half blocks of 16, one and three quarters of 32.
        let first: Vec<u32> = (0..57)
            .map(|j| 3 + ((i * 131 + j * 37) % 500) as u32)
            .collect();
        // The same 57 and 19 more: the consumer holds the first blocks of its own size (48 or
        // 32 tokens) and pulls from there, in the middle of a producer's block of 32.
        let mut second = first.clone();
        second.extend((0..19).map(|j| 3 + ((i * 17 + j * 53) % 500) as u32));
        for (k, ids) in [&first, &second].into_iter().enumerate() {
            let b = body(ids);
            let want = seen(api, post(&solo.http, api.path(), &b).await).await;
            let got = through_pd(p, d, api, &b).await;
            assert_eq!(got.tokens, want.tokens, "{what}, prompt {k}");
            let pulled = got.pulled.unwrap_or(0);
            assert!(pulled > 0, "{what}, prompt {k}: pulled {pulled}");
            if k == 1 {
                // Pulled only what the consumer's cache lacked.
                assert!(
                    got.cached.unwrap_or(0) > pulled,
                    "{what}: cached {:?}, pulled {pulled}",
                    got.cached
                );
            }
        }
        let converted = metric(d, "pd_kv_rechunked_pulls_total").await - before;
        assert_eq!(converted, if differ { 2.0 } else { 0.0 }, "{what}");
    }
    // Params that lie about the producer's block size (15 fits the 57 tokens in 4 blocks as
    // well as 16 does, so the request is admitted): the handshake's word decides, the pull
    // fails as a params mismatch (D's policy here is `fail`), nothing is read.
    let ids: Vec<u32> = (0..57).map(|j| 5 + (j * 41) % 500).collect();
    let b = body(&ids);
    let mut params = prefill(&p16, api, &b).await;
    assert_eq!(params["remote_block_size"], 16, "{params}");
    params["remote_block_size"] = json!(15);
    let mut db = b.clone();
    db["kv_transfer_params"] = params;
    let before = metric(
        &d32,
        "pd_kv_transfer_failures_total{reason=\"params_mismatch\"}",
    )
    .await;
    let r = post(&d32.http, api.path(), &db).await;
    assert_eq!(r.status(), 500);
    assert!(r.text().await.unwrap().contains("blocks of 15"));
    assert_eq!(
        metric(
            &d32,
            "pd_kv_transfer_failures_total{reason=\"params_mismatch\"}"
        )
        .await,
        before + 1.0
    );
    for (d, via) in [(&d32, "mapped"), (&d32n_get, "get"), (&d16_get, "get")] {
        assert!(metric(d, &format!("pd_kv_pulls_total{{via=\"{via}\"}}")).await >= 2.0);
    }
}

/// Half-precision KV end to end: P and D with `--kv-cache-dtype f16` answer token for token as
/// one node with f16 KV, pull all of the prompt, and move exactly half the
/// bytes f32 nodes move for the same prompts; an f32 consumer refuses an f16 producer's KV,
/// naming `kv_cache_dtype`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_precision_kv_through_p_and_d_equals_one_node_and_moves_half_the_bytes() {
    let dir = model("f16");
    let f16 = ["--kv-cache-dtype", "f16"];
    let solo = start(&dir, &f16);
    let p = producer(&dir, &f16);
    let d = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "d1", "--kv-cache-dtype", "f16"],
    );
    let p32 = start(
        &dir,
        &[
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            "p2",
        ],
    );
    let d32 = consumer_with(&dir, "fail", &["--engine-id", "d2"]);
    let api = Api::Completions;
    for (i, stream) in [false, true].into_iter().enumerate() {
        let body = api.body(&format!("{i}{LONG}"), 12);
        let body = if stream { streaming(api, &body) } else { body };
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, &d, api, &body).await;
        assert_eq!(got.texts, want.texts, "{body}");
        assert_eq!(got.tokens, want.tokens, "{body}");
        let prompt = got.prompt.expect("usage");
        assert_eq!(got.pulled, Some(prompt), "{body}");
        let got32 = through_pd(&p32, &d32, api, &body).await;
        assert_eq!(got32.pulled, Some(prompt), "{body}");
    }
    let bytes16 = metric(&d, "pd_kv_transfer_bytes_total").await;
    let bytes32 = metric(&d32, "pd_kv_transfer_bytes_total").await;
    assert!(bytes16 > 0.0);
    assert_eq!(bytes16 * 2.0, bytes32, "f16 KV moves half the bytes");

    // An f32 consumer and an f16 producer: refused by the handshake's compatibility check.
    refused_for_kv_dtype(&p, &d32).await;
}

/// A prompt prefilled on `p` and sent to `d`, whose KV dtype differs: D answers 500, naming
/// `kv_cache_dtype` (the handshake's compatibility check).
async fn refused_for_kv_dtype(p: &Node, d: &Node) {
    let api = Api::Completions;
    let body = api.body(&format!("mixed{LONG}"), 4);
    let mut db = body.clone();
    db["kv_transfer_params"] = prefill(p, api, &body).await;
    let r = post(&d.http, api.path(), &db).await;
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("kv_cache_dtype"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_children_share_one_handoff_and_one_pull() {
    let dir = model("fork");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    // `salt` makes prompts of one length that share no block (D's prefix cache stays cold).
    let body_salted = |n: usize, salt: char| {
        json!({"model": "tiny", "prompt": format!("{salt}{LONG}"), "max_tokens": 10, "n": n,
               "seed": 42, "temperature": 0.9, "ignore_eos": true, "return_token_ids": true})
    };
    let body = |n: usize| body_salted(n, 'a');
    let want = seen(
        Api::Completions,
        post(&solo.http, "/v1/completions", &body(3)).await,
    )
    .await;
    assert_eq!(want.tokens.len(), 3);
    assert_ne!(want.tokens[0], want.tokens[1], "seeded children differ");

    // n=3: P hands off one object; D pulls once and forks three children.
    let params = prefill(&p, Api::Completions, &body(3)).await;
    assert!(params.is_object(), "one handoff for n>1: {params}");
    let mut db = body(3);
    db["kv_transfer_params"] = params;
    let got = seen(
        Api::Completions,
        post(&d.http, "/v1/completions", &db).await,
    )
    .await;
    assert_eq!(
        got.tokens, want.tokens,
        "children equal the standalone node's with the same seeds"
    );
    let bytes_n3 = metric(&d, "pd_kv_transfer_bytes_total").await;

    // n=1 and n=8 move the same bytes (the KV of one prompt).
    let mut moved = Vec::new();
    for (n, salt) in [(1, 'b'), (8, 'c')] {
        let before = metric(&d, "pd_kv_transfer_bytes_total").await;
        let params = prefill(&p, Api::Completions, &body_salted(n, salt)).await;
        let mut db = body_salted(n, salt);
        db["kv_transfer_params"] = params;
        let got = seen(
            Api::Completions,
            post(&d.http, "/v1/completions", &db).await,
        )
        .await;
        assert_eq!(got.tokens.len(), n);
        moved.push(metric(&d, "pd_kv_transfer_bytes_total").await - before);
    }
    assert_eq!(moved[0], bytes_n3);
    assert_eq!(moved[0], moved[1], "n=8 moves the bytes of n=1");

    // The list form (one params object per child, seed PR #38900): blocks shared by the
    // children are pulled once, and every lease is released.
    let before = metric(&d, "pd_kv_transfer_bytes_total").await;
    let want = seen(
        Api::Completions,
        post(&solo.http, "/v1/completions", &body_salted(3, 'd')).await,
    )
    .await;
    let params = prefill(&p, Api::Completions, &body_salted(3, 'd')).await;
    let mut db = body_salted(3, 'd');
    db["kv_transfer_params"] = json!([params.clone(), params.clone(), params]);
    let got = seen(
        Api::Completions,
        post(&d.http, "/v1/completions", &db).await,
    )
    .await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        metric(&d, "pd_kv_transfer_bytes_total").await - before,
        bytes_n3
    );
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
}

/// The GPU path's staging (`pd_model::kv_store`), run on CPU with `--kv-staged`: the model
/// computes on a second pool; P copies a prompt's blocks into its transfer pool before it
/// leases them, D copies pulled blocks into its compute pool before it reads them. Every
/// pairing of staged and in-place nodes answers token for token as one in-place node: greedy
/// on the chat API (D's cache holds the template's head, computed on its compute pool), a
/// prompt extending an earlier one (D's cached blocks plus pulled ones; P's cached ones
/// leased again), and seeded `n = 3` children (their forks copy partial blocks on the compute
/// pool). Without the copies a staged node would hand over or read zeros. D uploads each pulled
/// block as it lands, from the pull (`--kv-upload-while-pulling`, the default), so its engine
/// copies nothing after a pull; a D started with it off has the engine upload instead, as
/// exactly; so does a D reading with UCX gets (its uploads follow each part's flush). The
/// counters show which copies ran where, and on staged nodes only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_kv_as_on_a_gpu_hands_over_kv_token_exact_on_cpu() {
    let dir = model("staged");
    let solo = start(&dir, &[]);
    let p_staged = producer(&dir, &["--engine-id", "ps", "--kv-staged"]);
    let p_plain = producer(&dir, &["--engine-id", "pp"]);
    let d_staged = consumer_with(&dir, "fail", &["--engine-id", "ds", "--kv-staged"]);
    let d_plain = consumer_with(&dir, "fail", &["--engine-id", "dp"]);
    let d_after = consumer_with(
        &dir,
        "fail",
        &[
            "--engine-id",
            "de",
            "--kv-staged",
            "--kv-upload-while-pulling",
            "false",
        ],
    );
    let pairs = [
        (&p_staged, &d_staged, "staged → staged"),
        (&p_staged, &d_plain, "staged → in place"),
        (&p_plain, &d_staged, "in place → staged"),
        (
            &p_plain,
            &d_after,
            "in place → staged, the engine uploading",
        ),
    ];
    for (i, (p, d, what)) in pairs.into_iter().enumerate() {
        let body = Api::Chat.body(&format!("{i}{LONG}"), 10);
        let want = seen(Api::Chat, post(&solo.http, Api::Chat.path(), &body).await).await;
        let got = through_pd(p, d, Api::Chat, &body).await;
        assert_eq!(got.tokens, want.tokens, "{what}, chat");
        assert!(got.pulled.unwrap_or(0) > 0, "{what}, chat");

        let first = format!("{i} {LONG}");
        let second = format!("{first} Then a few more words, for blocks nobody holds yet.");
        for (k, text) in [first, second].iter().enumerate() {
            let body = Api::Completions.body(text, 10);
            let want = seen(
                Api::Completions,
                post(&solo.http, Api::Completions.path(), &body).await,
            )
            .await;
            let got = through_pd(p, d, Api::Completions, &body).await;
            assert_eq!(got.tokens, want.tokens, "{what}, prompt {k}");
            let pulled = got.pulled.unwrap_or(0);
            assert!(pulled > 0, "{what}, prompt {k}");
            if k == 1 {
                assert!(
                    got.cached.unwrap_or(0) > pulled,
                    "{what}: D's cache held the first prompt ({:?} cached, {pulled} pulled)",
                    got.cached
                );
            }
        }

        seeded_children_equal_one_node(&solo, p, d, &format!("{i}"), what).await;
    }
    let down = "pd_node_kv_staged_blocks_down_total";
    let up = "pd_node_kv_staged_blocks_up_total";
    let landed = "pd_kv_landed_blocks_total";
    assert!(metric(&p_staged, down).await > 0.0);
    // Each copy is timed: one per lease on P; on D one per pull, where the engine uploads.
    assert_eq!(
        metric(&p_staged, "pd_node_kv_staging_down_seconds_count").await,
        metric(&p_staged, "pd_kv_leases_total{event=\"granted\"}").await
    );
    // D's pulls uploaded every block they pulled (token-exact above, with nothing uploaded
    // after them); with the flag off, the engine did.
    assert!(metric(&d_staged, landed).await > 0.0);
    assert_eq!(
        metric(&d_staged, up).await,
        0.0,
        "the engine uploaded nothing"
    );
    assert_eq!(
        metric(&d_staged, "pd_node_kv_staging_up_seconds_count").await,
        0.0
    );
    assert!(metric(&d_after, up).await > 0.0);
    assert!(metric(&d_after, "pd_node_kv_staging_up_seconds_count").await > 0.0);
    assert_eq!(metric(&d_after, landed).await, 0.0);
    for plain in [&p_plain, &d_plain] {
        assert_eq!(metric(plain, down).await, 0.0);
        assert_eq!(metric(plain, up).await, 0.0);
        assert_eq!(metric(plain, landed).await, 0.0);
    }
    assert_eq!(metric(&d_staged, down).await, 0.0, "D leases nothing");
    for p in [&p_staged, &p_plain] {
        eventually("P's leases released", async || {
            metric(p, "pd_kv_leases_live").await == 0.0
        })
        .await;
    }
}

/// A cluster computing in bf16 (`--dtype bf16`, a GPU node's usual choice; here on CPU), with
/// P staging its KV as a GPU node does: greedy chat and completions and seeded `n = 3` through
/// P and D equal one bf16 node token for token, every prompt token pulled. The KV follows the
/// model's dtype by default: a bf16 pull moves half the bytes of the same prompt's f32 pull,
/// and an f32 consumer is refused by the handshake's `kv_cache_dtype` check, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_cluster_hands_over_kv_token_exact_against_one_bf16_node() {
    let dir = model("bf16");
    let bf16 = ["--dtype", "bf16"];
    let solo = start(&dir, &bf16);
    let p = producer(&dir, &["--dtype", "bf16", "--kv-staged"]);
    let d = consumer_with(&dir, "fail", &["--engine-id", "d1", "--dtype", "bf16"]);
    let d32 = consumer_with(&dir, "fail", &["--engine-id", "d2"]);
    let p32 = producer(&dir, &["--engine-id", "p2"]);
    for (i, api) in [Api::Chat, Api::Completions].into_iter().enumerate() {
        let body = api.body(&format!("{i}{LONG}"), 12);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, &d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{api:?}");
        assert_eq!(got.pulled, got.prompt, "{api:?}: every prompt token pulled");
        assert!(got.pulled.unwrap_or(0) > 0, "{api:?}");
    }
    seeded_children_equal_one_node(&solo, &p, &d, "n", "bf16").await;

    // The same prompt through an f32 pair: twice the bytes.
    let api = Api::Completions;
    let body = api.body(&format!("bytes{LONG}"), 4);
    let (b16, b32) = (
        metric(&d, "pd_kv_transfer_bytes_total").await,
        metric(&d32, "pd_kv_transfer_bytes_total").await,
    );
    let got16 = through_pd(&p, &d, api, &body).await;
    let got32 = through_pd(&p32, &d32, api, &body).await;
    assert_eq!(got16.pulled, got32.pulled);
    let moved16 = metric(&d, "pd_kv_transfer_bytes_total").await - b16;
    let moved32 = metric(&d32, "pd_kv_transfer_bytes_total").await - b32;
    assert!(moved16 > 0.0);
    assert_eq!(moved16 * 2.0, moved32, "bf16 KV moves half the bytes");

    // A bf16 producer and an f32 consumer: refused, naming the field.
    refused_for_kv_dtype(&p, &d32).await;
}

/// `pd-node gen-tiny-model --gguf q8_0` writes one GGUF file (what a GPU session serves to try
/// candle's quantized CUDA kernels); served by P, D and one node, its greedy output through P
/// and D equals the one node's, every prompt token pulled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_gguf_file_hands_over_kv_token_exact() {
    let file = std::env::temp_dir().join(format!("pd-pd-gguf-{}.gguf", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_pd-node"))
        .args(["gen-tiny-model", "--seed", "5", "--gguf", "q8_0", "--out"])
        .arg(&file)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let magic = std::fs::read(&file).unwrap();
    assert_eq!(&magic[..4], b"GGUF", "a GGUF file, not a directory");
    let solo = start(&file, &[]);
    let p = producer(&file, &[]);
    let d = consumer(&file, "fail");
    let api = Api::Completions;
    let body = api.body(&format!("gguf{LONG}"), 12);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let got = through_pd(&p, &d, api, &body).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.unwrap_or(0) > 0);
    assert_eq!(got.pulled, got.prompt);
    let _ = std::fs::remove_file(&file);
}

/// Seeded `n = 3` sampling (children forked copy-on-write on D) through `p` and `d` equals
/// `solo`, child for child; the children differ from each other.
async fn seeded_children_equal_one_node(solo: &Node, p: &Node, d: &Node, salt: &str, what: &str) {
    let body = json!({"model": "tiny", "prompt": format!("{salt}{SHORT} {LONG}"),
        "max_tokens": 9, "n": 3, "seed": 7, "temperature": 0.9, "ignore_eos": true,
        "return_token_ids": true});
    let api = Api::Completions;
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    assert_ne!(want.tokens[0], want.tokens[1], "seeded children differ");
    let got = through_pd(p, d, api, &body).await;
    assert_eq!(got.tokens, want.tokens, "{what}, n = 3");
}

/// D's recompute counter for `reason`.
pub(crate) async fn recomputes(d: &Node, reason: &str) -> f64 {
    metric(d, &format!("pd_kv_recompute_total{{reason=\"{reason}\"}}")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_follow_the_policy_and_are_counted() {
    let dir = model("fail");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &["--kv-lease-duration", "0.6"]);
    let d_fail = consumer(&dir, "fail");
    let d_recompute = consumer(&dir, "recompute");
    let api = Api::Completions;
    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;

    // Lease expired before the pull: P frees the blocks; D must not use whatever they hold.
    let params = prefill(&p, api, &body).await;
    eventually("the lease to expire on P", async || {
        metric(&p, "pd_kv_leases_total{event=\"expired\"}").await == 1.0
    })
    .await;
    let mut db = body.clone();
    db["kv_transfer_params"] = params.clone();
    let r = post(&d_fail.http, api.path(), &db).await;
    assert_eq!(r.status(), 500);
    let e: Value = r.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("lease_expired"), "{msg}");
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.pulled, None, "nothing pulled: recomputed");
    assert_eq!(recomputes(&d_recompute, "lease_expired").await, 1.0);

    // Forged lease id: never served.
    let fresh = prefill(&p, api, &body).await;
    let mut forged = fresh.clone();
    forged["remote_lease_id"] = json!("0123456789abcdef0123456789abcdef");
    db["kv_transfer_params"] = forged;
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(recomputes(&d_recompute, "lease_expired").await, 2.0);

    // A list form longer than n (one object per completion at most): a 400 before anything is
    // contacted.
    let mut long_list = body.clone();
    long_list["kv_transfer_params"] = json!([fresh.clone(), fresh.clone()]);
    let r = post(&d_fail.http, api.path(), &long_list).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("n = 1"),
        "{e}"
    );

    // Params of another prompt: a 400 naming what does not fit, before any read; P's lease is
    // released at once (not left to expire).
    let released = metric(&p, "pd_kv_leases_total{event=\"released\"}").await;
    let mut other = body.clone();
    other["prompt"] = json!("A different prompt of another length.");
    other["kv_transfer_params"] = fresh.clone();
    let r = post(&d_fail.http, api.path(), &other).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_block_ids");
    let same_length: String = LONG.chars().rev().collect();
    other["prompt"] = json!(same_length);
    let r = post(&d_recompute.http, api.path(), &other).await;
    assert_eq!(r.status(), 400, "a bad request whatever the failure policy");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_prompt_hash");
    eventually("P's lease released after the 400", async || {
        metric(&p, "pd_kv_leases_total{event=\"released\"}").await == released + 1.0
    })
    .await;

    // A producer outside `--kv-allowed-peers`: refused before it is contacted (SSRF guard).
    let d_strict = start(
        &dir,
        &[
            "--kv-role",
            "kv_consumer",
            "--kv-port",
            "0",
            "--engine-id",
            "d3",
            "--kv-allowed-peers",
            "10.9.8.7,p.example:1",
        ],
    );
    db["kv_transfer_params"] = fresh.clone();
    let r = post(&d_strict.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_host");
    assert_eq!(metric(&d_strict, "pd_kv_transfer_bytes_total").await, 0.0);

    // Incomplete params: no pull, as vLLM; counted.
    let mut partial = fresh;
    partial.as_object_mut().unwrap().remove("remote_host");
    db["kv_transfer_params"] = partial;
    let got = seen(api, post(&d_fail.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        metric(
            &d_fail,
            "pd_kv_params_incomplete_total{field=\"remote_host\"}"
        )
        .await,
        1.0
    );

    // Malformed params: 400 naming the field, on D and on P.
    db["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_block_ids": "1,2"});
    let r = post(&d_fail.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_block_ids");
    db["kv_transfer_params"] = json!({"do_remote_decode": "yes"});
    let r = post(&p.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    // A standalone node refuses P/D requests instead of silently computing.
    db["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = post(&solo.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params");

    // P killed after its prefill, and dead for longer than D trusts its lease board alone (a
    // moment after its last grant D would read the dead process's leased blocks, intact, from
    // the mapping: `a_lease_board_that_beat_a_moment_ago_confirms_without_the_owner`).
    let params = prefill(&p, api, &body).await;
    drop(p);
    tokio::time::sleep(BOARD_FRESHNESS * 5).await;
    db["kv_transfer_params"] = params;
    let r = post(&d_fail.http, api.path(), &db).await;
    assert_eq!(r.status(), 500);
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    let total: f64 = {
        let mut t = 0.0;
        for reason in [
            "peer_unreachable",
            "transfer_error",
            "rpc_error",
            "lease_expired",
        ] {
            t += recomputes(&d_recompute, reason).await;
        }
        t
    };
    assert_eq!(total, 3.0, "the dead producer's recompute is counted");
    // D itself is fine and serves on.
    let again = seen(api, post(&d_recompute.http, api.path(), &body).await).await;
    assert_eq!(again.tokens, want.tokens);
}

/// A decode node whose 16-block pool is 15/16 held by its own prefill leases (it is `kv_both`,
/// deprecated but working) lasting `lease_secs`: a P/D request of 5 blocks waits for them.
async fn full_decoder(dir: &Path, lease_secs: &str) -> Node {
    full_decoder_with(dir, lease_secs, &[]).await
}

/// [`full_decoder`] with `extra` flags.
async fn full_decoder_with(dir: &Path, lease_secs: &str, extra: &[&str]) -> Node {
    let mut args = vec![
        "--kv-role",
        "kv_both",
        "--kv-port",
        "0",
        "--engine-id",
        "d1",
        "--kv-recompute-threshold",
        "0",
        "--num-gpu-blocks",
        "16",
        "--kv-lease-duration",
        lease_secs,
        "--kv-max-leased-fraction",
        "1",
    ];
    args.extend_from_slice(extra);
    let d = start(dir, &args);
    let api = Api::Completions;
    for i in 0..3 {
        // Distinct first blocks: 3 × 5 blocks, no prefix shared.
        prefill(&d, api, &api.body(&format!("{i} filler prompt no."), 1)).await;
    }
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_d_releases_the_lease_on_p_at_once() {
    let dir = model("abort");
    let p = producer(&dir, &[]);
    // D also produces (kv_both, deprecated but working), so leases can fill its small pool:
    // the P/D request then waits for blocks on D.
    let d = full_decoder(&dir, "30").await;
    let api = Api::Completions;
    assert_eq!(metric(&d, "pd_kv_leases_live").await, 3.0);
    let body = api.body("twenty-token prompt.", 4);
    let params = prefill(&p, api, &body).await;
    assert_eq!(metric(&p, "pd_kv_leases_live").await, 1.0);
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let http = d.http.clone();
    let client = tokio::spawn(async move { post(&http, api.path(), &db).await });
    eventually("D to wait for blocks", async || {
        metric(&d, "pd_node_requests_waiting_remote_kv").await == 1.0
    })
    .await;
    assert_eq!(
        metric(&d, "pd_kv_transfer_bytes_total").await,
        0.0,
        "still waiting"
    );
    client.abort();
    released_and_gone(&p, &d).await;
}

/// P's one lease was released (not expired: well before its 30 s), and D holds no request
/// waiting for KV any more.
async fn released_and_gone(p: &Node, d: &Node) {
    eventually("P's lease released", async || {
        metric(p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    assert_eq!(
        metric(p, "pd_kv_leases_total{event=\"released\"}").await,
        1.0
    );
    eventually("D's request gone", async || {
        metric(d, "pd_node_requests_waiting_remote_kv").await == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_renews_the_lease_while_it_waits_for_blocks() {
    let dir = model("renew");
    let solo = start(&dir, &[]);
    // P's leases last 0.6 s unless renewed.
    let p = producer(&dir, &["--kv-lease-duration", "0.6"]);
    // D's pool is held by its own prefill leases for 2 s, so the P/D request waits that long.
    let d = full_decoder(&dir, "2").await;
    let api = Api::Completions;
    let body = api.body("twenty-token prompt.", 4);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let params = prefill(&p, api, &body).await;
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let got = seen(api, post(&d.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        got.pulled,
        Some(20),
        "pulled, not recomputed, after waiting"
    );
    // D waited until its own leases expired (one or more) to get blocks.
    assert!(metric(&d, "pd_kv_leases_total{event=\"expired\"}").await >= 1.0);
    assert!(metric(&p, "pd_kv_leases_total{event=\"renewed\"}").await >= 2.0);
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"expired\"}").await,
        0.0
    );
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"released\"}").await,
        1.0
    );
}

/// A free TCP port on loopback (bound, then released for the node to take).
/// A free port below Linux's ephemeral range (32768..): a port a test binds again later (a
/// restarted node keeps its address) must not be handed meanwhile to another process binding
/// port 0, as a port from `bind(":0")` can be.
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Each call starts past the last port handed out, from a per-process offset.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = std::process::id() % 10_000;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(n < 10_000, "no free port in 20000..30000");
        let port = u16::try_from(20_000 + (base + n * 7) % 10_000).expect("below 30000");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Issue 12's first wrong-KV hole: P restarts under the same engine id and side-channel port.
/// D must not read through its cached handshake with the old incarnation (old worker, old
/// remote key) and then confirm the new incarnation's lease: the params name P's epoch, D
/// handshakes again when it differs, and P refuses lease calls naming another epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_restarted_under_the_same_id_and_port_is_never_read_through_a_stale_handshake() {
    let dir = model("restart");
    let solo = start(&dir, &[]);
    let d = consumer(&dir, "fail");
    let port = free_port().to_string();
    let args = [
        "--kv-role",
        "kv_producer",
        "--kv-port",
        port.as_str(),
        "--engine-id",
        "p0",
    ];
    let api = Api::Completions;
    // Same length, different words: the same number of blocks, different KV.
    let texts = [
        "Alpha prompt: prefill and decode nodes share one KV cache between them.",
        "Omega prompt: a restarted producer must never be read through old keys.",
    ];
    let mut epochs = Vec::new();
    for text in texts {
        let p = start(&dir, &args);
        let body = api.body(text, 12);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let params = prefill(&p, api, &body).await;
        epochs.push(params["remote_engine_epoch"].clone());
        let mut db = body.clone();
        db["kv_transfer_params"] = params;
        let got = seen(api, post(&d.http, api.path(), &db).await).await;
        assert_eq!(got.tokens, want.tokens, "{text}");
        assert_eq!(got.texts, want.texts, "{text}");
        assert!(got.pulled.is_some_and(|n| n > 0), "{text}: KV was pulled");
        drop(p); // killed; the next one takes the same id and port
    }
    assert!(epochs[0].is_string(), "P names its epoch: {epochs:?}");
    assert_ne!(epochs[0], epochs[1], "a new epoch per process");

    // A proxy that drops `remote_engine_epoch` (D cannot see the restart): D reads through its
    // cached handshake, names that epoch when it confirms, and the new P refuses: the request
    // fails by D's policy ("fail") instead of decoding on the old process's memory.
    let p = start(&dir, &args);
    let body = api.body(
        "Gamma prompt: without the epoch in the params, P itself must refuse.",
        12,
    );
    let mut params = prefill(&p, api, &body).await;
    params
        .as_object_mut()
        .unwrap()
        .remove("remote_engine_epoch");
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let r = post(&d.http, api.path(), &db).await;
    assert!(r.status().is_server_error(), "{}", r.status());
    let text = r.text().await.unwrap();
    assert!(text.contains("stale_epoch"), "{text}");
    assert_eq!(
        metric(&d, "pd_kv_transfer_failures_total{reason=\"stale_epoch\"}").await,
        1.0
    );
    // D forgot the stale handshake: the next request through this P is served exactly.
    let body = api.body("Delta prompt: after the refusal D handshakes afresh.", 12);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let got = through_pd(&p, &d, api, &body).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.is_some_and(|n| n > 0));
}

/// Issue 12's second wrong-KV hole: params whose optional checks (`remote_prompt_hash`,
/// `remote_num_tokens`) were stripped or forged, naming another prompt's blocks of the same
/// count. D must not decode on them nor enter them in its prefix cache under its own prompt's
/// hashes: P binds each lease to the tokens it computed and says so when D confirms; D compares
/// before using the blocks (`prompt_mismatch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_params_naming_another_prompts_blocks_never_reach_the_answer_or_the_cache() {
    let dir = model("forged");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    // The same block count (`failures_follow_the_policy_and_are_counted` relies on it too).
    let a = api.body(LONG, 12);
    let b = api.body(&LONG.chars().rev().collect::<String>(), 12);
    let want_b = seen(api, post(&solo.http, api.path(), &b).await).await;
    let mut params = prefill(&p, api, &a).await;
    let o = params.as_object_mut().unwrap();
    o.remove("remote_prompt_hash");
    o.remove("remote_num_tokens");
    let mut db = b.clone();
    db["kv_transfer_params"] = params;
    let r = post(&d.http, api.path(), &db).await;
    assert_eq!(r.status(), 500, "A's KV under B's prompt is refused");
    let text = r.text().await.unwrap();
    assert!(text.contains("prompt_mismatch"), "{text}");
    assert_eq!(
        metric(
            &d,
            "pd_kv_transfer_failures_total{reason=\"prompt_mismatch\"}"
        )
        .await,
        1.0
    );
    // D's prefix cache holds nothing of A under B's hashes: B served by D alone is exact.
    let got = seen(api, post(&d.http, api.path(), &b).await).await;
    assert_eq!(got.tokens, want_b.tokens);
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
}

/// Params whose lease is genuine for D's prompt but whose block ids are another live lease's
/// (both obtained from P, spliced by a client that may send params): D would read the other
/// prompt's KV and the lease it confirms would vouch for D's prompt. P binds each lease to its
/// block ids too and says so at confirm; D compares them with the ids it read
/// (`prompt_mismatch`), and never decodes on or caches the other prompt's KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spliced_params_with_another_leases_blocks_never_reach_the_answer_or_the_cache() {
    let dir = model("spliced");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    // Two prompts of the same length, so the block lists fit either.
    let a = api.body(LONG, 12);
    let b = api.body(&LONG.chars().rev().collect::<String>(), 12);
    let want_a = seen(api, post(&solo.http, api.path(), &a).await).await;
    let params_a = prefill(&p, api, &a).await;
    let params_b = prefill(&p, api, &b).await;
    assert_ne!(params_a["remote_block_ids"], params_b["remote_block_ids"]);
    let mut spliced = params_a.clone();
    spliced["remote_block_ids"] = params_b["remote_block_ids"].clone();
    let mut da = a.clone();
    da["kv_transfer_params"] = spliced;
    let r = post(&d.http, api.path(), &da).await;
    assert_eq!(r.status(), 500, "B's KV under A's lease is refused");
    let text = r.text().await.unwrap();
    assert!(text.contains("prompt_mismatch"), "{text}");
    // D's prefix cache holds nothing of B under A's hashes: A served by D alone is exact.
    let got = seen(api, post(&d.http, api.path(), &a).await).await;
    assert_eq!(got.tokens, want_a.tokens);
    // B's own lease was never used; it ends by release (D's) or expiry all the same.
    let mut db = b.clone();
    db["kv_transfer_params"] = params_b;
    let want_b = seen(api, post(&solo.http, api.path(), &b).await).await;
    let got_b = seen(api, post(&d.http, api.path(), &db).await).await;
    assert_eq!(got_b.tokens, want_b.tokens);
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
}

/// Who may read a pool: a producer with a cluster token refuses side-channel calls without it
/// (`UNAUTHENTICATED`, counted), so a decode node outside the cluster cannot handshake, read or
/// touch leases; one with the token pulls as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_side_channel_requires_the_cluster_token() {
    let dir = model("token");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &["--cluster-token", "s3cret"]);
    let outsider = consumer(&dir, "fail");
    let member = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "d2", "--cluster-token", "s3cret"],
    );
    let api = Api::Completions;
    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;

    let mut db = body.clone();
    db["kv_transfer_params"] = prefill(&p, api, &body).await;
    let r = post(&outsider.http, api.path(), &db).await;
    assert_eq!(r.status(), 500);
    let text = r.text().await.unwrap();
    assert!(text.contains("handshake_refused"), "{text}");
    assert!(text.contains("cluster token"), "{text}");
    assert!(metric(&p, "pd_kv_side_channel_refused_total").await >= 1.0);
    assert_eq!(
        metric(&outsider, "pd_node_kv_pulled_tokens_total").await,
        0.0
    );

    let got = through_pd(&p, &member, api, &body).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.is_some_and(|n| n > 0));
}

/// One node, a producer and a decode node (`fail` policy, a 60 s pull timeout, plus
/// `d_extra`) that has already handshaken with the producer and maps its pool: one P/D request
/// went through.
async fn warm_pair(dir: &Path, d_extra: &[&str]) -> (Node, Node, Node) {
    let solo = start(dir, &[]);
    let p = producer(dir, &[]);
    let mut args = vec!["--engine-id", "d1", "--kv-pull-timeout", "60"];
    args.extend_from_slice(d_extra);
    let d = consumer_with(dir, "fail", &args);
    let api = Api::Completions;
    let warm = api.body("a warm-up prompt of a few blocks.", 2);
    assert!(through_pd(&p, &d, api, &warm).await.pulled.unwrap_or(0) > 0);
    (solo, p, d)
}

/// A stream with nothing to say (here: D waiting for a frozen producer's KV) sends SSE
/// comments every `--sse-keep-alive`, so proxies and clients with idle timeouts keep it open;
/// once the producer thaws, the same stream carries the answer, equal to one node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_sends_keep_alive_comments_until_its_answer() {
    let dir = model("keep-alive");
    let (solo, p, d) = warm_pair(&dir, &["--sse-keep-alive", "0.2"]).await;
    let api = Api::Completions;

    let body = api.body("a prompt whose producer freezes while D waits.", 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let params = prefill(&p, api, &body).await;
    let frozen = Frozen::past_the_board(&p);
    let mut db = body.clone();
    db["stream"] = json!(true);
    db["stream_options"] = json!({"include_usage": true});
    db["kv_transfer_params"] = params;
    let mut resp = post(&d.http, api.path(), &db).await;
    assert_eq!(resp.status(), 200);
    // 1.5 s of a frozen producer: comments only (several), no data.
    let mut text = String::new();
    let _ = tokio::time::timeout(Duration::from_millis(1500), async {
        while let Some(chunk) = resp.chunk().await.unwrap() {
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    })
    .await;
    let comments = text.lines().filter(|l| l.starts_with(':')).count();
    assert!(comments >= 2, "keep-alive comments while frozen: {text:?}");
    assert!(
        !text.contains("data:"),
        "data while the producer is frozen: {text:?}"
    );
    drop(frozen);
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let got = seen_sse(api, &text);
    assert_eq!(got.texts, want.texts);
    assert!(got.pulled.unwrap_or(0) > 0, "the answer came from P's KV");
}

/// `SIGSTOP`s a process; `SIGCONT`s it when dropped, whatever happens in between.
struct Frozen(u32);

impl Frozen {
    /// Returns once every thread of the process has stopped: `kill` only queues the signal, and
    /// on a busy machine the other threads run on (answering a confirmation, say) until the
    /// thread that takes it has been scheduled and stopped them.
    fn new(node: &Node) -> Self {
        let pid = node.child.id();
        signal(pid, libc::SIGSTOP);
        let frozen = Frozen(pid);
        let until = Instant::now() + Duration::from_secs(20);
        while !all_threads_stopped(pid) {
            assert!(Instant::now() < until, "process {pid} did not stop");
            std::thread::sleep(Duration::from_millis(2));
        }
        frozen
    }

    /// [`Frozen::new`], and silent for longer than a decode node trusts the producer's lease
    /// board alone ([`BOARD_FRESHNESS`] since its latest grant): a pull from it now waits for
    /// the producer's answer, which does not come. (Within that window a mapped board confirms
    /// the lease without it: `a_lease_board_that_beat_a_moment_ago_confirms_without_the_owner`.)
    fn past_the_board(node: &Node) -> Self {
        let frozen = Self::new(node);
        std::thread::sleep(BOARD_FRESHNESS * 5);
        frozen
    }
}

/// `pd-node --kv-board-freshness-ms`'s default.
const BOARD_FRESHNESS: Duration = Duration::from_millis(50);

/// Whether every thread of `pid` is in the stopped state (`T` in `/proc/<pid>/task/*/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            // The state follows the parenthesised command name.
            stat[stat.rfind(')').map_or(0, |i| i + 2)..].starts_with('T')
        })
    })
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a child process we started and still own.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

/// CPU seconds (user + system) process `pid` has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

/// Issue 12, "never stall": a producer frozen with `SIGSTOP` while D pulls from it. Its pull ends
/// at D's deadline (`--kv-pull-timeout`) and follows the failure policy (recompute: the answer is
/// still exact); pulls from a second producer keep flowing meanwhile; D does not spin while it
/// waits (under 10% of a core); afterwards both producers and D are idle.
///
/// Run under the default transports (shared memory: the reads themselves do not need P, the
/// lease confirmation does) and under `UCX_TLS=tcp` (the reads need P's progress too). Before
/// the fix, the first hung for the side channel's 10 s call timeout and the second forever,
/// with the single puller thread spinning and every other pull queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_producer_costs_only_its_own_pulls_and_only_until_the_deadline() {
    for tls in [None, Some("tcp")] {
        frozen_producer(tls).await;
    }
}

async fn frozen_producer(tls: Option<&str>) {
    let name = tls.unwrap_or("default");
    let dir = model(&format!("frozen-{name}"));
    let env: Vec<(&str, &str)> = tls.map(|t| vec![("UCX_TLS", t)]).unwrap_or_default();
    let solo = start(&dir, &[]);
    let producer_args = |id: &'static str| {
        [
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            id,
            "--kv-lease-duration",
            "3",
        ]
    };
    let p1 = start_env(&dir, &producer_args("p1"), &env);
    let p2 = start_env(&dir, &producer_args("p2"), &env);
    let timeout = 5.0;
    let d = consumer_env(
        &dir,
        "recompute",
        &["--engine-id", "d1", "--kv-pull-timeout", "5"],
        &env,
    );
    let api = Api::Completions;
    // Warm: D has handshaken and connected to both producers.
    for (i, p) in [&p1, &p2].into_iter().enumerate() {
        let body = api.body(&format!("{i} {name} warm-up prompt of some blocks."), 4);
        let got = through_pd(p, &d, api, &body).await;
        assert!(got.pulled.unwrap_or(0) > 0, "{name}: warm-up pulled");
    }

    let body_a = api.body(&format!("{name}: a prompt whose producer freezes."), 8);
    let want_a = seen(api, post(&solo.http, api.path(), &body_a).await).await;
    let params_a = prefill(&p1, api, &body_a).await;
    let frozen = Frozen::past_the_board(&p1);
    let mut db = body_a.clone();
    db["kv_transfer_params"] = params_a;
    let started = Instant::now();
    let http = d.http.clone();
    let a = tokio::spawn(async move { seen(api, post(&http, api.path(), &db).await).await });

    // While A's pull is stalled, D idles: no spinning on the frozen peer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (cpu0, t0) = (cpu_seconds(d.child.id()), Instant::now());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let used = (cpu_seconds(d.child.id()) - cpu0) / t0.elapsed().as_secs_f64();
    if a.is_finished() {
        let early = a.await;
        panic!("{name}: A ended while its producer was frozen: {early:?}");
    }
    assert!(
        used < 0.10,
        "{name}: D used {:.0}% of a core while its pull waited on a frozen producer",
        used * 100.0
    );

    // Pulls from the other producer flow meanwhile.
    for i in 0..2 {
        let body = api.body(&format!("{i} {name}: through the live producer."), 8);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p2, &d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{name}");
        assert!(got.pulled.unwrap_or(0) > 0, "{name}: pulled from P2");
    }
    assert!(
        !a.is_finished(),
        "{name}: P2's pulls completed while A still waits on the frozen P1"
    );

    // A ends by its deadline, recomputed on D: still exact.
    let got_a = tokio::time::timeout(Duration::from_secs(30), a)
        .await
        .unwrap_or_else(|_| panic!("{name}: the pull from a frozen producer never ended"))
        .unwrap();
    let took = started.elapsed().as_secs_f64();
    assert!(
        took < timeout * 1.6,
        "{name}: A took {took:.1} s with a {timeout} s pull deadline"
    );
    assert_eq!(got_a.tokens, want_a.tokens, "{name}");
    assert_eq!(
        got_a.pulled.unwrap_or(0),
        0,
        "{name}: recomputed, not pulled"
    );
    assert_eq!(recomputes(&d, "deadline").await, 1.0, "{name}");
    assert_eq!(
        metric(&d, "pd_kv_transfer_failures_total{reason=\"deadline\"}").await,
        1.0,
        "{name}"
    );

    // Thawed: every pool is idle again (A's lease released or expired).
    drop(frozen);
    for (node, what) in [(&p1, "P1"), (&p2, "P2")] {
        eventually(&format!("{name}: {what}'s leases gone"), async || {
            metric(node, "pd_kv_leases_live").await == 0.0
        })
        .await;
    }
    for m in [
        "pd_node_requests_running",
        "pd_node_requests_waiting",
        "pd_node_requests_waiting_remote_kv",
    ] {
        assert_eq!(metric(&d, m).await, 0.0, "{name}: {m}");
    }
    // P1 serves again, through a fresh endpoint.
    let body = api.body(&format!("{name}: P1 after the thaw."), 4);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let got = through_pd(&p1, &d, api, &body).await;
    assert_eq!(got.tokens, want.tokens, "{name}");
    assert!(got.pulled.unwrap_or(0) > 0, "{name}: pulled from P1 again");
}

/// A producer's lease board that beat a moment ago (its latest grant) confirms a lease on its
/// own: D reads the lease's record right after its reads and does not wait for the producer's
/// answer. Shown with a producer frozen right after its prefill, so its answer never comes
/// while the request runs: D still answers at once, token for token as one node, the whole
/// prompt pulled, counted as a board-alone confirmation. A frozen (or dead) process writes
/// nothing, and the record shows the lease's blocks were not handed out before it stopped, so
/// they are the lease's KV. The window is generous here (10 s) so that a slow machine cannot
/// turn the test into a wait; the default is 50 ms, and a producer silent for longer is heard
/// (`a_frozen_producer_costs_only_its_own_pulls_and_only_until_the_deadline`). After the
/// thaw, the lease is released and both pools are idle.
/// On one host (the board mapped), D asks P nothing once P's board beats: no confirmation
/// alongside its reads (skipped at arrival: `Loader::board_beat_within`) and none after them
/// (the record alone confirms). With `--kv-board-freshness-ms 0` D asks once per request.
/// P counts the confirmations it answered (`pd_kv_leases_total{event="confirmed"}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_lease_board_spares_the_owner_every_confirmation() {
    let dir = model("asks");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    // A 10 s window: a slow machine cannot make the beat look stale at arrival (half of it).
    let board = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "db", "--kv-board-freshness-ms", "10000"],
    );
    let asks = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "da", "--kv-board-freshness-ms", "0"],
    );
    let confirmed = "pd_kv_leases_total{event=\"confirmed\"}";
    let api = Api::Completions;
    for (d, name, per_request) in [(&board, "board", 0.0), (&asks, "asks", 1.0)] {
        // The first request hands D the handshake and maps the board.
        let body = api.body(&format!("{name}: warm-up."), 4);
        through_pd(&p, d, api, &body).await;
        let before = metric(&p, confirmed).await;
        for i in 0..3 {
            let body = api.body(&format!("{i} {name}: {LONG}"), 6);
            let want = seen(api, post(&solo.http, api.path(), &body).await).await;
            let got = through_pd(&p, d, api, &body).await;
            assert_eq!(got.tokens, want.tokens, "{name}");
            assert!(got.pulled.unwrap_or(0) > 0, "{name}");
        }
        assert_eq!(
            metric(&p, confirmed).await - before,
            3.0 * per_request,
            "{name}: confirmations P answered for three requests"
        );
    }
    assert_eq!(
        metric(&board, "pd_kv_lease_board_alone_confirms_total").await,
        4.0
    );
    assert_eq!(
        metric(&asks, "pd_kv_lease_board_alone_confirms_total").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_board_that_beat_a_moment_ago_confirms_without_the_owner() {
    let dir = model("board-alone");
    let (solo, p, d) = warm_pair(&dir, &["--kv-board-freshness-ms", "10000"]).await;
    let api = Api::Completions;
    let alone = "pd_kv_lease_board_alone_confirms_total";
    let before = metric(&d, alone).await;

    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let params = prefill(&p, api, &body).await;
    let frozen = Frozen::new(&p);
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let got = tokio::time::timeout(Duration::from_secs(30), async {
        seen(api, post(&d.http, api.path(), &db).await).await
    })
    .await
    .expect("D waited for its frozen producer's answer");
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.texts, want.texts);
    assert_eq!(got.pulled, got.prompt, "the whole prompt pulled");
    assert_eq!(
        metric(&d, alone).await,
        before + 1.0,
        "confirmed on the board alone"
    );
    assert_eq!(
        metric(&d, "pd_kv_lease_confirms_total{via=\"rpc\"}").await,
        0.0
    );

    drop(frozen);
    eventually("P's lease released after the thaw", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    for m in [
        "pd_node_requests_running",
        "pd_node_requests_waiting",
        "pd_node_requests_waiting_remote_kv",
    ] {
        assert_eq!(metric(&d, m).await, 0.0, "{m}");
    }
}

/// Issue 12: a consumer that cannot get blocks to pull into gives up after `--kv-wait-timeout`
/// and releases the producer's lease at once, instead of holding P's blocks until they expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_gives_up_waiting_for_blocks_and_releases_the_lease() {
    let dir = model("wait");
    let p = producer(&dir, &[]);
    // D's pool stays held by its own leases for 30 s; it waits at most 1 s for blocks.
    let d = full_decoder_with(&dir, "30", &["--kv-wait-timeout", "1"]).await;
    let api = Api::Completions;
    let body = api.body("twenty-token prompt.", 4);
    let params = prefill(&p, api, &body).await;
    assert_eq!(metric(&p, "pd_kv_leases_live").await, 1.0);
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let r = tokio::time::timeout(Duration::from_secs(20), post(&d.http, api.path(), &db))
        .await
        .expect("D gives up waiting");
    assert_eq!(r.status(), 500);
    let e: Value = r.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("no free KV blocks"), "{msg}");
    assert_eq!(
        metric(&d, "pd_kv_transfer_failures_total{reason=\"wait_timeout\"}").await,
        1.0
    );
    released_and_gone(&p, &d).await;
}

/// Issue 12: a prefill node caps the share of its pool that leases may hold
/// (`--kv-max-leased-fraction`): beyond it a prefill for a decode node is a clear 503, while the
/// node's own requests keep being served; once a lease ends the next prefill is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_caps_the_blocks_leases_may_hold() {
    let dir = model("cap");
    let solo = start(&dir, &[]);
    // 16 blocks, leases may hold 8: one 5-block prompt fits, a second would make 10.
    let p = producer(
        &dir,
        &["--num-gpu-blocks", "16", "--kv-max-leased-fraction", "0.5"],
    );
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    let first = api.body("twenty-token prompt.", 4);
    let params = prefill(&p, api, &first).await;
    assert_eq!(metric(&p, "pd_kv_leases_live").await, 1.0);

    let second = api.body("another twenty tokens.", 4);
    let r = post(&p.http, api.path(), &prefill_body(api, &second)).await;
    assert_eq!(r.status(), 503);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "kv_lease_capacity", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--kv-max-leased-fraction"), "{msg}");
    assert_eq!(
        metric(&p, "pd_node_kv_lease_capacity_refusals_total").await,
        1.0
    );
    // The node's own (non-P/D) requests are not refused.
    let own = seen(api, post(&p.http, api.path(), &second).await).await;
    let want = seen(api, post(&solo.http, api.path(), &second).await).await;
    assert_eq!(own.tokens, want.tokens);

    // D pulls the first prompt and releases its lease: room again.
    let mut db = first.clone();
    db["kv_transfer_params"] = params;
    let got = seen(api, post(&d.http, api.path(), &db).await).await;
    assert!(got.pulled.unwrap_or(0) > 0);
    eventually("P's lease released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    let got = through_pd(&p, &d, api, &second).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.unwrap_or(0) > 0);
}

/// Issue 12: the compatibility check covers the weights, not only shapes and the served name.
/// P and D serve "tiny" with the same shapes and tokenizer but different weights: D must never
/// decode on P's KV (it would answer 200 with another model's continuation). The handshake is
/// refused naming `model_fingerprint`; under `recompute` D answers from its own model, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_with_other_weights_under_the_same_name_is_refused() {
    let ours = model_seeded("fp-ours", 21);
    let theirs = model_seeded("fp-theirs", 22);
    let solo = start(&ours, &[]);
    let p = producer(&theirs, &[]);
    let d_fail = consumer(&ours, "fail");
    let d_recompute = consumer_with(&ours, "recompute", &["--engine-id", "d2"]);
    let api = Api::Completions;
    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;

    let params = prefill(&p, api, &body).await;
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let r = post(&d_fail.http, api.path(), &db).await;
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("model_fingerprint"), "{text}");

    let params = prefill(&p, api, &body).await;
    db["kv_transfer_params"] = params;
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.pulled.unwrap_or(0), 0);
    assert_eq!(recomputes(&d_recompute, "handshake_refused").await, 1.0);
}

/// What happened to one soak operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SoakOutcome {
    /// Answered through P and D, token-exact with the standalone node.
    Exact,
    /// The client left before P answered.
    AbortBeforeP,
    /// The client left right after sending D its request (before or during the pull).
    AbortDuringPull,
    /// The client left after D's first streamed token.
    AbortDuringDecode,
    /// P could not be reached or failed (its restart): nothing to compare.
    ProducerDown,
}

/// One soak operation on prompt `i`, through producer `ps[0]` (or `ps[1]` when the first cannot
/// answer, as a proxy fails over) and consumer `d`.
async fn soak_op(i: usize, ps: [&str; 2], d: &str, solo: &str) -> SoakOutcome {
    let api = Api::Completions;
    let mut body = api.body(
        &format!("{i} soak: prefill here, decode there, abort sometimes."),
        6,
    );
    let stream = i.is_multiple_of(3);
    if stream {
        body = streaming(api, &body);
    }
    let client = reqwest::Client::new();
    let pb = prefill_body(api, &body);
    let send_p = {
        let (client, pb) = (client.clone(), pb.clone());
        let ps = [ps[0].to_string(), ps[1].to_string()];
        async move {
            let first = client
                .post(format!("{}{}", ps[0], api.path()))
                .json(&pb)
                .send()
                .await;
            match first {
                Ok(r) if r.status() == 200 => Ok(r),
                _ => {
                    client
                        .post(format!("{}{}", ps[1], api.path()))
                        .json(&pb)
                        .send()
                        .await
                }
            }
        }
    };
    if i % 10 == 1 {
        // Leave before P answers (sometimes before it even got the request).
        let t = tokio::spawn(send_p);
        tokio::time::sleep(Duration::from_micros((i as u64 * 137) % 3000)).await;
        t.abort();
        return SoakOutcome::AbortBeforeP;
    }
    let params = match send_p.await {
        Ok(r) if r.status() == 200 => match seen(api, r).await.kv {
            Some(kv) => kv,
            None => return SoakOutcome::ProducerDown,
        },
        _ => return SoakOutcome::ProducerDown,
    };
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let send_d = client.post(format!("{d}{}", api.path())).json(&db).send();
    match i % 10 {
        2 => {
            let t = tokio::spawn(send_d);
            tokio::time::sleep(Duration::from_micros((i as u64 * 71) % 1500)).await;
            t.abort();
            SoakOutcome::AbortDuringPull
        }
        3 => {
            let mut b = db.clone();
            b = streaming(api, &b);
            let mut r = client
                .post(format!("{d}{}", api.path()))
                .json(&b)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            // The first event carries the first token; then the client is gone.
            let _ = r.chunk().await;
            drop(r);
            SoakOutcome::AbortDuringDecode
        }
        _ => {
            let got = seen(api, send_d.await.unwrap()).await;
            let want = seen(api, post(solo, api.path(), &body).await).await;
            assert_eq!(got.tokens, want.tokens, "op {i}");
            assert_eq!(got.texts, want.texts, "op {i}");
            SoakOutcome::Exact
        }
    }
}

/// Issue 12's soak: 2 P + 2 D (recompute on failure), 500 operations from 6 concurrent clients,
/// a tenth of them leaving before P answers, a tenth right after sending D its request (during
/// the pull), a tenth after the first streamed token; P1 is killed and restarted under the same
/// engine id and ports midway. Every completed answer equals the standalone node's; afterwards
/// every pool is idle within the lease TTL + 1 s (no lease left, no block referenced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_two_producers_two_consumers_with_aborts_and_a_producer_restart() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    const OPS: usize = 500;
    const TTL: f64 = 2.0;
    let dir = model("soak");
    let solo = start(&dir, &[]);
    let (http1, kv1) = (free_port().to_string(), free_port().to_string());
    let ttl = TTL.to_string();
    let p1_args: Vec<String> = [
        "--kv-role",
        "kv_producer",
        "--port",
        &http1,
        "--kv-port",
        &kv1,
        "--engine-id",
        "p1",
        "--kv-lease-duration",
        &ttl,
        "--num-gpu-blocks",
        "2048",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let start_p1 = || {
        let args: Vec<&str> = p1_args.iter().map(String::as_str).collect();
        start(&dir, &args)
    };
    let p1 = Arc::new(Mutex::new(Some(start_p1())));
    let p1_http = p1.lock().unwrap().as_ref().unwrap().http.clone();
    let p2 = start(
        &dir,
        &[
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            "p2",
            "--kv-lease-duration",
            &ttl,
            // Room for the leases that clients leaving before D strand until their TTL.
            "--num-gpu-blocks",
            "2048",
        ],
    );
    let d1 = consumer_with(&dir, "recompute", &["--engine-id", "d1"]);
    let d2 = consumer_with(&dir, "recompute", &["--engine-id", "d2"]);
    let ps = [p1_http.clone(), p2.http.clone()];
    let ds = [d1.http.clone(), d2.http.clone()];

    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let outcomes: Arc<Mutex<HashMap<SoakOutcome, usize>>> = Arc::default();
    let mut clients = Vec::new();
    for _ in 0..6 {
        let (next, done, outcomes) = (next.clone(), done.clone(), outcomes.clone());
        let (ps, ds, solo) = (ps.clone(), ds.clone(), solo.http.clone());
        clients.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= OPS {
                    return;
                }
                let order = [ps[i % 2].as_str(), ps[(i + 1) % 2].as_str()];
                let o = soak_op(i, order, &ds[(i / 2) % 2], &solo).await;
                *outcomes.lock().unwrap().entry(o).or_default() += 1;
                done.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    // Midway, P1 dies and comes back under the same id and ports (a new epoch).
    while done.load(Ordering::SeqCst) < OPS / 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Params from the old incarnation, used after it died: D must recompute, exactly.
    let api = Api::Completions;
    let stale_body = api.body("Stale params: their producer restarted meanwhile.", 6);
    let old = p1.lock().unwrap().take().expect("P1 runs");
    let stale = prefill(&old, api, &stale_body).await;
    drop(old);
    tokio::time::sleep(Duration::from_millis(200)).await;
    *p1.lock().unwrap() = Some(start_p1());
    let mut db = stale_body.clone();
    db["kv_transfer_params"] = stale;
    let got = seen(api, post(&d1.http, api.path(), &db).await).await;
    let want = seen(api, post(&solo.http, api.path(), &stale_body).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        got.pulled.unwrap_or(0),
        0,
        "recomputed, not read from a dead process"
    );
    assert_eq!(recomputes(&d1, "stale_epoch").await, 1.0);
    for c in clients {
        c.await.unwrap();
    }
    let ended = Instant::now();
    let outcomes = outcomes.lock().unwrap().clone();
    eprintln!("soak outcomes: {outcomes:?}");
    let count = |o| outcomes.get(&o).copied().unwrap_or(0);
    assert_eq!(outcomes.values().sum::<usize>(), OPS);
    assert!(count(SoakOutcome::Exact) >= OPS / 2, "{outcomes:?}");
    for o in [
        SoakOutcome::AbortBeforeP,
        SoakOutcome::AbortDuringPull,
        SoakOutcome::AbortDuringDecode,
    ] {
        assert!(count(o) >= OPS / 20, "{o:?}: {outcomes:?}");
    }

    // Idle within the lease TTL + 1 s: no lease, no request, every block free.
    let p1 = p1.lock().unwrap().take().unwrap();
    let deadline = Duration::from_secs_f64(TTL + 1.0);
    for (node, name) in [(&p1, "P1"), (&p2, "P2"), (&d1, "D1"), (&d2, "D2")] {
        loop {
            let idle = metric(node, "pd_kv_leases_live").await == 0.0
                && metric(node, "pd_node_requests_running").await == 0.0
                && metric(node, "pd_node_requests_waiting").await == 0.0
                && metric(node, "pd_node_requests_waiting_remote_kv").await == 0.0
                && metric(node, "pd_node_kv_blocks_free").await
                    == metric(node, "pd_node_kv_blocks_total").await;
            if idle {
                break;
            }
            assert!(
                ended.elapsed() < deadline,
                "{name} not idle {:.1} s after the soak",
                ended.elapsed().as_secs_f64()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // The KV really moved during the soak, and the restarted P1 served too.
    for d in [&d1, &d2] {
        assert!(metric(d, "pd_node_kv_pulled_tokens_total").await > 0.0);
        let text = reqwest::get(format!("{}/metrics", d.http))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for l in text
            .lines()
            .filter(|l| l.starts_with("pd_kv_recompute_total"))
        {
            eprintln!("{}: {l}", d.http);
        }
    }
    assert!(metric(&p1, "pd_kv_leases_total{event=\"granted\"}").await > 0.0);
}

//! Prefill/decode disaggregation between real `pd-node` processes, driven the way a vLLM proxy
//! drives them: P gets the request with `max_tokens: 1`, `stream: false` and
//! `kv_transfer_params: {"do_remote_decode": true}`; the `kv_transfer_params` P answers with are
//! copied into the request to D, which pulls the prompt's KV over UCX and decodes.
//!
//! Correctness is token-exact: greedy output through P→D equals a standalone node's, for all three
//! APIs, streaming and not, short and multi-block prompts, and n=3 (seeded) children. Every test
//! also checks that the KV really moved (`kv_pulled_tokens`, transfer bytes) or, on the failure
//! paths, that the recompute was counted with its reason.
//!
//! One module per subject; starting nodes, driving the proxy's flow, reading what a client saw
//! and the helpers several subjects use are here (`multi_turn` uses them too).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pd_model::tiny::{TinySpec, generate};
use serde_json::{Value, json};

mod failures;
mod formats;
mod handoff;
mod integrity;
mod leases;
mod soak;

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

/// D's recompute counter for `reason`.
pub(crate) async fn recomputes(d: &Node, reason: &str) -> f64 {
    metric(d, &format!("pd_kv_recompute_total{{reason=\"{reason}\"}}")).await
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

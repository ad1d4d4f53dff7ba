//! End-to-end tests of the OpenAI API: the real server, in-process on `127.0.0.1:0`, over a real
//! engine running a generated tiny model. Greedy (`temperature: 0`) everywhere, so streamed and
//! non-streamed outputs of the same request must agree.
//!
//! One module per subject; the server harness and the helpers several subjects use are here.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pd_engine::{Engine, EngineConfig, EngineHandle};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod chat;
mod completions;
mod errors;
mod prompts;
mod responses;
mod sampling;
mod server;
mod structured;
mod tools;

/// Longest context of the test engine.
const MAX_MODEL_LEN: usize = 2048;

/// One tiny model per test process, written once into a fresh temp directory.
fn model_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("pd-node-api-{}-{nanos}", std::process::id()));
        let spec = pd_model::tiny::TinySpec {
            seed: 7,
            ..Default::default()
        };
        pd_model::tiny::generate(&spec, &dir).expect("generate tiny model");
        dir
    })
}

/// A running server; `stop` shuts it down and checks it exited cleanly.
struct Server {
    base: String,
    engine: EngineHandle,
    client: reqwest::Client,
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
    drain: std::sync::Arc<pd_node::drain::Drain>,
}

impl Server {
    async fn start() -> Self {
        Self::start_with(None).await
    }

    /// A server whose chat reads the calls the model writes itself with `tool_parser`
    /// (`--tool-call-parser`); [`Server::start`] detects none for the tiny model.
    async fn start_with(tool_parser: Option<pd_node::ToolCallParser>) -> Self {
        let config = EngineConfig {
            model_dir: model_dir().clone(),
            served_model_name: Some("tiny".into()),
            num_blocks: Some(256),
            max_model_len: Some(MAX_MODEL_LEN),
            ..EngineConfig::default()
        };
        let engine = tokio::task::spawn_blocking(move || Engine::load(&config))
            .await
            .unwrap()
            .expect("load engine");
        let engine = EngineHandle::spawn(engine).expect("spawn engine");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (shutdown, rx) = oneshot::channel::<()>();
        let options = pd_node::HttpOptions {
            tool_parser,
            ..pd_node::HttpOptions::for_engine(&engine)
        };
        assert_eq!(
            pd_node::HttpOptions::for_engine(&engine).tool_parser,
            None,
            "the tiny model's files do not name <tool_call>"
        );
        let drain = options.drain.clone();
        let task = tokio::spawn(pd_node::serve_with(
            listener,
            engine.clone(),
            std::sync::Arc::new(pd_node::Disagg::standalone()),
            options,
            async {
                let _ = rx.await;
            },
        ));
        Self {
            base,
            engine,
            client: reqwest::Client::new(),
            shutdown,
            task,
            drain,
        }
    }

    async fn stop(self) {
        let _ = self.shutdown.send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("server stops within 10 s")
            .expect("server task did not panic")
            .expect("server exited cleanly");
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` and returns status and JSON body.
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
        (status, value)
    }

    /// POSTs `body` (with `stream: true`) and returns the SSE frames once the stream ends.
    async fn post_stream(&self, path: &str, body: &Value) -> Vec<Frame> {
        let resp = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{path}");
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        parse_sse(&resp.text().await.unwrap())
    }

    async fn get(&self, path: &str) -> (u16, String) {
        let resp = self.client.get(self.url(path)).send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }
}

/// One server-sent event: its `event:` name, if any, and its `data:`.
#[derive(Debug)]
struct Frame {
    event: Option<String>,
    data: String,
}

impl Frame {
    fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("frame data is not JSON ({e}): {}", self.data))
    }
}

fn parse_sse(body: &str) -> Vec<Frame> {
    body.split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|frame| {
            let mut event = None;
            let mut data = Vec::new();
            for line in frame.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    event = Some(e.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push(d);
                } else {
                    panic!("unexpected SSE line {line:?}");
                }
            }
            Frame {
                event,
                data: data.join("\n"),
            }
        })
        .collect()
}

/// Chat/completions stream: checks the `[DONE]` terminator and returns the JSON chunks.
fn json_chunks(frames: &[Frame]) -> Vec<Value> {
    let (last, rest) = frames.split_last().expect("stream has frames");
    assert_eq!(last.data, "[DONE]");
    rest.iter().map(Frame::json).collect()
}

#[track_caller]
fn assert_usage(usage: &Value, completion_tokens: u64) {
    assert_eq!(usage["completion_tokens"], completion_tokens, "{usage}");
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 0);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        prompt + completion_tokens
    );
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            <= prompt
    );
}

/// The second of two identical requests (`second`) reports the same counts as the first, except
/// that part of its prompt now comes from the prefix cache.
#[track_caller]
fn assert_same_usage(second: &Value, first: &Value, details: &str) {
    let mut a = second.clone();
    let mut b = first.clone();
    let cached = a[details]["cached_tokens"].take().as_u64().unwrap();
    b[details]["cached_tokens"].take();
    assert_eq!(a, b);
    let prompt = second
        .get("prompt_tokens")
        .or(second.get("input_tokens"))
        .unwrap()
        .as_u64()
        .unwrap();
    // Every prompt here spans more than one block; the last prompt token is always computed.
    assert!(0 < cached && cached < prompt, "{second}");
}

/// Checks status, `error.type` and `error.param` of a failed request.
#[track_caller]
fn assert_error(result: (u16, Value), status: u16, kind: &str, param: Option<&str>) -> Value {
    let (got, body) = result;
    assert_eq!(got, status, "{body}");
    let error = &body["error"];
    assert_eq!(error["type"], kind, "{body}");
    assert_eq!(error["param"].as_str(), param, "{body}");
    assert!(!error["message"].as_str().unwrap().is_empty());
    body
}

/// Parses `pd_node_<name> <value>` out of the Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Opens `count` greedy completion streams of `MAX_MODEL_LEN - 64` tokens (prompts `"{prefix}
/// {i} "`) and reads each one's first chunk, so the engine holds every one of them mid-generation.
async fn open_streams(server: &Server, count: usize, prefix: &str) -> Vec<reqwest::Response> {
    let mut open = Vec::new();
    for i in 0..count {
        let body = json!({
            "prompt": format!("{prefix} {i} "), "max_tokens": MAX_MODEL_LEN - 64,
            "temperature": 0, "ignore_eos": true, "stream": true,
        });
        let mut resp = server
            .client
            .post(server.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        // Completions streams send nothing before the first token: this chunk proves the engine
        // admitted the request and holds its blocks.
        let first = resp.chunk().await.unwrap().expect("a first chunk");
        assert!(first.starts_with(b"data: "));
        open.push(resp);
    }
    open
}

/// Polls `/metrics` and the handle until every block is free again (10 s deadline); returns the
/// generated-tokens counter at that point.
async fn wait_all_blocks_free(server: &Server) -> f64 {
    let total = server.engine.info().num_blocks;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = server.get("/metrics").await;
        let free = metric(&text, "pd_node_kv_blocks_free").unwrap_or(-1.0);
        if free == total as f64 && server.engine.free_blocks() == total {
            return metric(&text, "pd_node_generation_tokens_total").unwrap_or(0.0);
        }
        assert!(
            Instant::now() < deadline,
            "blocks not freed within 10 s: {free} of {total} free"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A streamed response's events, checked (`type` = the SSE event name, `sequence_number`
/// counting from 0), and the response of its terminal event.
fn response_events(frames: &[Frame]) -> (Vec<Value>, Value) {
    let events: Vec<Value> = frames
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let data = f.json();
            assert_eq!(Some(data["type"].as_str().unwrap()), f.event.as_deref());
            assert_eq!(data["sequence_number"], i, "{data}");
            data
        })
        .collect();
    let last = events.last().expect("events").clone();
    assert!(
        ["response.completed", "response.incomplete"].contains(&last["type"].as_str().unwrap()),
        "{last}"
    );
    (events, last["response"].clone())
}

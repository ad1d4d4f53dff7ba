//! End-to-end tests of the OpenAI API: the real server, in-process on `127.0.0.1:0`, over a real
//! engine running a generated tiny model. Greedy (`temperature: 0`) everywhere, so streamed and
//! non-streamed outputs of the same request must agree.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pd_engine::{Engine, EngineConfig, EngineHandle};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

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

#[tokio::test]
async fn a_draining_node_fails_its_health_check_and_still_serves() {
    let server = Server::start().await;
    assert_eq!(server.get("/health").await.0, 200);
    server.drain.begin();
    assert_eq!(server.get("/health").await.0, 503);
    let body =
        json!({"model": "tiny", "prompt": "still served", "max_tokens": 2, "temperature": 0});
    let (status, answer) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    server.stop().await;
}

#[tokio::test]
async fn health_models_and_metrics() {
    let server = Server::start().await;
    assert_eq!(server.get("/health").await.0, 200);

    let (status, body) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["object"], "list");
    let card = &models["data"][0];
    assert_eq!(card["id"], "tiny");
    assert_eq!(card["object"], "model");
    assert_eq!(card["max_model_len"], MAX_MODEL_LEN);
    assert!(card["created"].as_u64().unwrap() > 0);
    assert!(card["owned_by"].is_string());
    // `models.retrieve`: the same card, or 404 for any other id (slashes included).
    let (status, one) = server.get("/v1/models/tiny").await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(serde_json::from_str::<Value>(&one).unwrap(), *card);
    for other in ["/v1/models/other", "/v1/models/org/tiny"] {
        let (status, body) = server.get(other).await;
        assert_eq!(status, 404, "{other}: {body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["code"], "model_not_found", "{body}");
    }

    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "pd_node_kv_blocks_free",
        "pd_node_kv_blocks_total",
        "pd_node_requests_running",
        "pd_node_requests_waiting",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    server.stop().await;
}

#[tokio::test]
async fn completions_stream_matches_non_stream() {
    let server = Server::start().await;
    let body = json!({
        "model": "tiny", "prompt": "Hello, my name is", "max_tokens": 12,
        "temperature": 0, "ignore_eos": true, "user": "ignored", "kv_transfer_params": null,
    });
    let (status, full) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{full}");
    assert!(full["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(full["object"], "text_completion");
    assert_eq!(full["model"], "tiny");
    let choice = &full["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null());
    assert!(choice.get("token_ids").is_none());
    assert_usage(&full["usage"], 12);

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let chunks = json_chunks(&server.post_stream("/v1/completions", &stream_body).await);
    let (usage_chunk, token_chunks) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_same_usage(
        &usage_chunk["usage"],
        &full["usage"],
        "prompt_tokens_details",
    );
    let text: String = token_chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, choice["text"].as_str().unwrap());
    let finishes: Vec<_> = token_chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finishes.len(), 1);
    assert_eq!(finishes[0]["choices"][0]["finish_reason"], "length");
    assert!(
        token_chunks
            .iter()
            .all(|c| c["object"] == "text_completion" && c["id"] == token_chunks[0]["id"])
    );

    // Without include_usage no usage chunk is sent.
    stream_body["stream_options"] = json!(null);
    let plain = json_chunks(&server.post_stream("/v1/completions", &stream_body).await);
    assert!(
        plain
            .iter()
            .all(|c| c.get("usage").is_none() && !c["choices"].as_array().unwrap().is_empty())
    );
    server.stop().await;
}

#[tokio::test]
async fn completions_token_prompt_return_token_ids_and_logprobs() {
    let server = Server::start().await;
    let prompt = [72u32, 101, 108, 108, 111];
    let body = json!({
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true, "logprobs": 2,
    });
    let (status, full) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{full}");
    let choice = &full["choices"][0];
    assert_eq!(choice["prompt_token_ids"], json!(prompt));
    assert_eq!(full["usage"]["prompt_tokens"], prompt.len());
    let token_ids = choice["token_ids"].as_array().unwrap();
    assert_eq!(token_ids.len(), 6);
    let logprobs = &choice["logprobs"];
    assert_eq!(logprobs["tokens"].as_array().unwrap().len(), 6);
    assert_eq!(logprobs["text_offset"].as_array().unwrap().len(), 6);
    for (lp, top) in logprobs["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(logprobs["top_logprobs"].as_array().unwrap())
    {
        assert!(lp.as_f64().unwrap() <= 0.0);
        let top = top.as_object().unwrap();
        // The 2 most likely, and the token itself where it is not one of them.
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
    }

    // Streamed, the token ids arrive one per chunk and the prompt's on the first chunk.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/completions", &stream_body).await);
    assert_eq!(chunks[0]["choices"][0]["prompt_token_ids"], json!(prompt));
    let streamed: Vec<Value> = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(&streamed, token_ids);
    server.stop().await;
}

#[tokio::test]
async fn completions_n_gives_one_choice_per_child() {
    let server = Server::start().await;
    let body =
        json!({"prompt": "abc", "max_tokens": 5, "n": 3, "temperature": 0, "ignore_eos": true});
    let (status, full) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{full}");
    let choices = full["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        // Greedy children of one prompt agree.
        assert_eq!(c["text"], choices[0]["text"]);
    }
    assert_usage(&full["usage"], 15);

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/completions", &stream_body).await);
    let mut texts = [String::new(), String::new(), String::new()];
    let mut finished = [0; 3];
    for chunk in &chunks {
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            texts[i].push_str(c["text"].as_str().unwrap());
            if !c["finish_reason"].is_null() {
                finished[i] += 1;
            }
        }
    }
    assert_eq!(finished, [1, 1, 1]);
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(t, choices[i]["text"].as_str().unwrap());
    }
    server.stop().await;
}

#[tokio::test]
async fn chat_stream_matches_non_stream() {
    let server = Server::start().await;
    let body = json!({
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
        ],
        "max_completion_tokens": 10, "temperature": 0, "ignore_eos": true,
        "logprobs": true, "top_logprobs": 2, "return_token_ids": true,
    });
    let (status, full) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{full}");
    assert!(full["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(full["object"], "chat.completion");
    let choice = &full["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    assert_usage(&full["usage"], 10);
    assert_eq!(
        full["prompt_token_ids"].as_array().unwrap().len() as u64,
        full["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(choice["token_ids"].as_array().unwrap().len(), 10);
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 10);
    for entry in content {
        let token = entry["token"].as_str().unwrap();
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(bytes, token.as_bytes());
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
    }

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let chunks = json_chunks(
        &server
            .post_stream("/v1/chat/completions", &stream_body)
            .await,
    );
    let first = &chunks[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(first["prompt_token_ids"], full["prompt_token_ids"]);
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_same_usage(
        &usage_chunk["usage"],
        &full["usage"],
        "prompt_tokens_details",
    );
    let text: String = rest
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, choice["message"]["content"].as_str().unwrap());
    let last = rest.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let streamed_logprobs = rest
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .count();
    assert_eq!(streamed_logprobs, 10);
    server.stop().await;
}

#[tokio::test]
async fn chat_n_streams_interleave_by_index() {
    let server = Server::start().await;
    let body = json!({
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 4, "n": 3, "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let chunks = json_chunks(&server.post_stream("/v1/chat/completions", &body).await);
    let mut roles = [0; 3];
    let mut finishes = [0; 3];
    for chunk in &chunks {
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if c["delta"]["role"] == "assistant" {
                roles[i] += 1;
            }
            if !c["finish_reason"].is_null() {
                finishes[i] += 1;
            }
        }
    }
    assert_eq!(roles, [1, 1, 1]);
    assert_eq!(finishes, [1, 1, 1]);
    server.stop().await;
}

#[tokio::test]
async fn responses_stream_matches_non_stream() {
    let server = Server::start().await;
    let body = json!({
        "model": "tiny",
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
        "max_output_tokens": 9, "temperature": 0,
    });
    let (status, full) = server.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{full}");
    assert!(full["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(full["object"], "response");
    let text = full["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(full["output"][0]["type"], "message");
    assert_eq!(full["output"][0]["role"], "assistant");
    assert_eq!(full["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(full["output"][0]["content"][0]["annotations"], json!([]));
    let usage = &full["usage"];
    let output_tokens = usage["output_tokens"].as_u64().unwrap();
    assert!((1..=9).contains(&output_tokens));
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + output_tokens
    );
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);
    assert!(usage["input_tokens_details"]["cached_tokens"].is_u64());
    if output_tokens == 9 {
        assert_eq!(full["status"], "incomplete");
        assert_eq!(full["incomplete_details"]["reason"], "max_output_tokens");
    } else {
        assert_eq!(full["status"], "completed");
    }

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let frames = server.post_stream("/v1/responses", &stream_body).await;
    let events: Vec<(String, Value)> = frames
        .iter()
        .map(|f| {
            let data = f.json();
            let name = f.event.clone().expect("every frame names its event");
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect();
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], i, "{data}");
    }
    let names: Vec<&str> = events
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| *n != "response.output_text.delta")
        .collect();
    let terminal = if full["status"] == "completed" {
        "response.completed"
    } else {
        "response.incomplete"
    };
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            terminal,
        ]
    );
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| {
            assert_eq!(d["output_index"], 0);
            assert_eq!(d["content_index"], 0);
            d["delta"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(deltas, text);
    let (_, last) = events.last().unwrap();
    assert_eq!(
        last["response"]["output"][0]["content"][0]["text"],
        text.as_str()
    );
    assert_eq!(last["response"]["status"], full["status"]);
    assert_same_usage(
        &last["response"]["usage"],
        &full["usage"],
        "input_tokens_details",
    );
    let (_, done) = events
        .iter()
        .find(|(n, _)| n == "response.output_text.done")
        .unwrap();
    assert_eq!(done["text"], text.as_str());
    assert_eq!(done["item_id"], last["response"]["output"][0]["id"]);

    // A plain string input works too.
    let (status, simple) = server
        .post(
            "/v1/responses",
            &json!({"input": "hi", "max_output_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{simple}");
    server.stop().await;
}

/// `pd_node_prompts_total{tokens="given"}` and `{tokens="computed"}` now.
async fn prompt_sources(server: &Server) -> (f64, f64) {
    let (_, text) = server.get("/metrics").await;
    let get = |label: &str| {
        metric(
            &text,
            &format!("pd_node_prompts_total{{tokens=\"{label}\"}}"),
        )
        .unwrap_or(-1.0)
    };
    (get("given"), get("computed"))
}

/// A gateway sends the prompt's ids in `prompt_token_ids` (it tokenized the prompt to route
/// it); the node takes them as the prompt on every API and tokenizes nothing. The other prompt
/// fields here say something else on purpose: the answers equal those of the prompt the ids
/// came from, so the ids, not the text, were the prompt.
#[tokio::test]
async fn given_prompt_token_ids_are_the_prompt_on_every_api() {
    let server = Server::start().await;
    let messages = json!([{"role": "user", "content": "Tell me about the sea"}]);
    let chat = |messages: &Value| {
        json!({"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
               "return_token_ids": true})
    };
    let (status, first) = server.post("/v1/chat/completions", &chat(&messages)).await;
    assert_eq!(status, 200, "{first}");
    let ids = first["prompt_token_ids"].clone();
    let (given0, computed0) = prompt_sources(&server).await;

    let mut other = chat(&json!([{"role": "user", "content": "unrelated"}]));
    other["prompt_token_ids"] = ids.clone();
    let (status, again) = server.post("/v1/chat/completions", &other).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["prompt_token_ids"], ids);
    assert_eq!(
        again["choices"][0]["token_ids"],
        first["choices"][0]["token_ids"]
    );
    assert_eq!(
        again["usage"]["prompt_tokens"],
        first["usage"]["prompt_tokens"]
    );

    // Responses renders the same template: the same ids give the same answer.
    let (status, resp) = server
        .post(
            "/v1/responses",
            &json!({"input": "unrelated", "prompt_token_ids": ids, "max_output_tokens": 8,
                    "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(
        resp["usage"]["input_tokens"],
        first["usage"]["prompt_tokens"]
    );
    // The chat reference ignores EOS; Responses stops at it: the same text up to there.
    let text = resp["output"][0]["content"][0]["text"].as_str().unwrap();
    let reference = first["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        !text.is_empty() && reference.starts_with(text),
        "{text:?} vs {reference:?}"
    );

    // Completions: the ids win over `prompt`.
    let completion = |prompt: Value, given: Option<Value>| {
        let mut b = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0,
                           "ignore_eos": true, "return_token_ids": true});
        if let Some(g) = given {
            b["prompt_token_ids"] = g;
        }
        b
    };
    let (status, plain) = server
        .post("/v1/completions", &completion(json!("The sea is"), None))
        .await;
    assert_eq!(status, 200, "{plain}");
    let plain_ids = plain["choices"][0]["prompt_token_ids"].clone();
    let (status, given) = server
        .post(
            "/v1/completions",
            &completion(json!("something else"), Some(plain_ids.clone())),
        )
        .await;
    assert_eq!(status, 200, "{given}");
    assert_eq!(given["choices"][0]["prompt_token_ids"], plain_ids);
    assert_eq!(
        given["choices"][0]["token_ids"],
        plain["choices"][0]["token_ids"]
    );

    // Three prompts taken as given, none computed since (the plain completion was computed).
    let (given1, computed1) = prompt_sources(&server).await;
    assert_eq!((given1 - given0, computed1 - computed0), (3.0, 1.0));

    // Bad ids are the request's fault, named; the other prompt fields are still checked.
    let vocab = server.engine.info().vocab_size;
    for bad in [json!([]), json!([1, vocab])] {
        let r = server
            .post("/v1/completions", &completion(json!("x"), Some(bad)))
            .await;
        assert_error(r, 400, "invalid_request_error", Some("prompt_token_ids"));
    }
    let r = server
        .post(
            "/v1/completions",
            &completion(json!("x"), Some(json!([-1]))),
        )
        .await;
    // A value of the wrong type is named by its field (`prompt_token_ids[0]: invalid value`).
    assert_error(r, 400, "invalid_request_error", Some("prompt_token_ids"));
    let mut bad_messages = chat(&json!([]));
    bad_messages["prompt_token_ids"] = ids;
    let r = server.post("/v1/chat/completions", &bad_messages).await;
    assert_error(r, 400, "invalid_request_error", Some("messages"));
    server.stop().await;
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

#[tokio::test]
async fn errors_have_the_openai_shape() {
    let server = Server::start().await;
    let raw = |path: &'static str, body: &'static str, content_type: &'static str| {
        let req = server
            .client
            .post(server.url(path))
            .header("content-type", content_type)
            .body(body);
        async move {
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    };
    const BAD: &str = "invalid_request_error";

    // Malformed JSON, and JSON that is not an object.
    assert_error(
        raw("/v1/completions", "{\"prompt\": ", "application/json").await,
        400,
        BAD,
        None,
    );
    assert_error(
        raw("/v1/chat/completions", "[1, 2]", "application/json").await,
        400,
        BAD,
        None,
    );
    // A wrong content type still parses.
    let (status, ok) = raw(
        "/v1/completions",
        r#"{"prompt": "hi", "max_tokens": 2}"#,
        "text/plain",
    )
    .await;
    assert_eq!(status, 200, "{ok}");

    // Missing required fields are named.
    assert_error(
        server
            .post("/v1/completions", &json!({"max_tokens": 2}))
            .await,
        400,
        BAD,
        Some("prompt"),
    );
    assert_error(
        server
            .post("/v1/chat/completions", &json!({"model": "tiny"}))
            .await,
        400,
        BAD,
        Some("messages"),
    );
    assert_error(
        server
            .post("/v1/responses", &json!({"model": "tiny"}))
            .await,
        400,
        BAD,
        Some("input"),
    );

    // Unknown model.
    let body = assert_error(
        server
            .post("/v1/completions", &json!({"model": "gpt-9", "prompt": "x"}))
            .await,
        404,
        BAD,
        Some("model"),
    );
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_error(
        server
            .post(
                "/v1/chat/completions",
                &json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
            )
            .await,
        404,
        BAD,
        Some("model"),
    );

    // Out-of-range parameters, named by the field the client sent.
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let completion = |extra: Value| {
        let mut body = json!({"prompt": "x"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for (extra, param) in [
        (json!({"n": 0}), "n"),
        (json!({"n": 100000}), "n"),
        (json!({"n": -1}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": -5}), "max_tokens"),
        (json!({"max_tokens": MAX_MODEL_LEN * 4}), "max_tokens"),
        (json!({"temperature": 5.0}), "temperature"),
        (json!({"top_p": 0.0}), "top_p"),
        (json!({"logprobs": 1000}), "logprobs"),
        (json!({"top_k": -7}), "top_k"),
        (json!({"prompt_logprobs": -1}), "prompt_logprobs"),
        (json!({"prompt": ["a", "b", "c"], "n": 100}), "n"),
        (
            json!({"prompt": vec![65u32; 2000], "echo": true, "logprobs": 20, "n": 128}),
            "prompt",
        ),
        (json!({"prompt_logprobs": 21}), "prompt_logprobs"),
        (
            json!({"prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        ),
        (json!({"echo": true, "max_tokens": -1}), "max_tokens"),
        (json!({"prompt": ["a", 5]}), "prompt"),
        (json!({"prompt": vec!["a"; 257]}), "prompt"),
        (json!({"prompt": ["a", []]}), "prompt"),
        (
            json!({"prompt": ["a", "b"], "prompt_token_ids": [1, 2]}),
            "prompt_token_ids",
        ),
        (
            json!({"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": true}}),
            "kv_transfer_params",
        ),
        (json!({"prompt": [1, 2, 999999]}), "prompt"),
        (json!({"prompt": vec![65u32; MAX_MODEL_LEN + 10]}), "prompt"),
        (json!({"prompt": 12}), "prompt"),
    ] {
        assert_error(
            server
                .post("/v1/completions", &completion(extra.clone()))
                .await,
            400,
            BAD,
            Some(param),
        );
    }
    for (extra, param) in [
        (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"temperature": -1.0}), "temperature"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 1000}),
            "top_logprobs",
        ),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": "word ".repeat(MAX_MODEL_LEN * 2)}]}),
            "messages",
        ),
    ] {
        assert_error(
            server
                .post("/v1/chat/completions", &chat(extra.clone()))
                .await,
            400,
            BAD,
            Some(param),
        );
    }
    assert_error(
        server
            .post(
                "/v1/responses",
                &json!({"input": "x", "max_output_tokens": 0}),
            )
            .await,
        400,
        BAD,
        Some("max_output_tokens"),
    );
    assert_error(
        server.post("/v1/responses", &json!({"input": 5})).await,
        400,
        BAD,
        Some("input"),
    );
    assert_error(
        server
            .post(
                "/v1/responses",
                &json!({"input": "x", "previous_response_id": "resp_1"}),
            )
            .await,
        400,
        BAD,
        Some("previous_response_id"),
    );

    // Unknown route and wrong method.
    let resp = server
        .client
        .post(server.url("/v1/nothing"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let body = assert_error(
        (resp.status().as_u16(), resp.json().await.unwrap()),
        404,
        BAD,
        None,
    );
    assert_eq!(body["error"]["code"], "unknown_url");
    let resp = server
        .client
        .get(server.url("/v1/completions"))
        .send()
        .await
        .unwrap();
    assert_error(
        (resp.status().as_u16(), resp.json().await.unwrap()),
        405,
        BAD,
        None,
    );

    // The server still works after all that.
    let (status, _) = server
        .post("/v1/completions", &completion(json!({"max_tokens": 1})))
        .await;
    assert_eq!(status, 200);
    server.stop().await;
}

#[tokio::test]
async fn oversized_body_is_413() {
    let server = Server::start().await;
    // Announce a body over the limit but send only its first byte: the server must answer from
    // the Content-Length alone, in the OpenAI error shape.
    let addr = server.base.trim_start_matches("http://").to_owned();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{{",
        pd_node::MAX_BODY_BYTES + 1
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    // Read until the head and a Content-Length worth of body arrived (the server may keep the
    // connection open, so EOF is not the end of the response).
    let read = async {
        let mut response = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "connection closed mid-response: {}",
                String::from_utf8_lossy(&response)
            );
            response.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&response).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>())
                    })
                    .expect("response has a content-length")
                    .unwrap();
                if body.len() >= len {
                    return (head.to_owned(), body.to_owned());
                }
            }
        }
    };
    let (head, body) = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("413 within 10 s");
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    let body: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "payload_too_large");
    server.stop().await;
}

/// Parses `pd_node_<name> <value>` out of the Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test]
async fn disconnected_streams_free_their_blocks() {
    let server = Server::start().await;
    let total = server.engine.info().num_blocks;
    assert_eq!(server.engine.free_blocks(), total);
    let max_tokens = MAX_MODEL_LEN - 64;

    drop(open_streams(&server, 4, "stream number").await);

    let generated = wait_all_blocks_free(&server).await;
    // Freed because the requests were aborted, not because they ran to the end.
    assert!(
        generated < (4 * max_tokens) as f64,
        "requests ran to completion ({generated} tokens)"
    );

    // A non-streaming client that gives up: dropping the request future closes the connection,
    // hyper drops the handler, and the handler's request stream aborts the request.
    let request = server
        .client
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": "patience", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}))
        .send();
    let client = tokio::spawn(request);
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.engine.metrics().running.get() == 0 {
        assert!(Instant::now() < deadline, "request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    client.abort();
    let after = wait_all_blocks_free(&server).await;
    assert!(
        after - generated < max_tokens as f64,
        "request ran to completion ({} tokens)",
        after - generated
    );
    server.stop().await;
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

/// The OpenAI sampling fields a client expects to act (`presence_penalty`, `frequency_penalty`,
/// `logit_bias`) and vLLM's (`repetition_penalty`, `min_p`) reach the sampler: each changes a
/// greedy answer that repeats itself, and a bias forces or forbids tokens. (Before they were
/// read, every one of these requests answered exactly the baseline.)
#[tokio::test]
async fn penalties_and_logit_bias_change_greedy_answers() {
    let server = Server::start().await;
    let ids = |body: Value| {
        let server = &server;
        async move {
            let mut body = body;
            let base = json!({
                "prompt": [72, 101, 108, 108, 111, 32, 119], "max_tokens": 24,
                "temperature": 0, "ignore_eos": true, "return_token_ids": true,
            });
            for (k, v) in base.as_object().unwrap() {
                body.as_object_mut().unwrap().entry(k).or_insert(v.clone());
            }
            let (status, out) = server.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{body}: {out}");
            serde_json::from_value::<Vec<u32>>(out["choices"][0]["token_ids"].clone()).unwrap()
        }
    };
    let baseline = ids(json!({})).await;
    let distinct = baseline
        .iter()
        .collect::<std::collections::HashSet<_>>()
        .len();
    assert!(
        distinct < baseline.len(),
        "the baseline must repeat tokens for the penalties to act on: {baseline:?}"
    );
    // Neutral values are the baseline.
    let neutral = json!({"presence_penalty": 0, "frequency_penalty": 0,
        "repetition_penalty": 1, "min_p": 0.5, "logit_bias": {}});
    assert_eq!(ids(neutral).await, baseline);
    for body in [
        json!({"presence_penalty": 2}),
        json!({"frequency_penalty": 2}),
        json!({"frequency_penalty": -2, "presence_penalty": -2}),
    ] {
        let got = ids(body.clone()).await;
        assert_ne!(got, baseline, "{body} changed nothing");
        assert_eq!(
            got[0], baseline[0],
            "{body}: nothing generated yet, same first pick"
        );
    }
    // The repetition penalty reads the prompt too, so it may move the first pick as well.
    assert_ne!(
        ids(json!({"repetition_penalty": 2.0})).await,
        baseline,
        "repetition_penalty changed nothing"
    );
    // A bias of +100 forces a token at every step; −100 on the baseline's first token moves
    // the first pick.
    assert_eq!(ids(json!({"logit_bias": {"42": 100}})).await, vec![42; 24]);
    let banned = ids(json!({"logit_bias": {baseline[0].to_string(): -100}})).await;
    assert_ne!(banned[0], baseline[0]);
    // Chat takes the same fields.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "temperature": 0, "logit_bias": {"42": 100}, "ignore_eos": true, "return_token_ids": true});
    let (status, out) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["token_ids"], json!([42, 42, 42, 42, 42]));
    server.stop().await;
}

/// Out-of-range sampling fields, malformed or unsupported structured output, and the OpenAI
/// features this node does not implement (tools the model may call at will without a tool-call
/// parser, tools on completions, `suffix`, `best_of`), are a 400 naming the field, never
/// silently dropped.
#[tokio::test]
async fn unsupported_features_and_bad_sampling_fields_are_refused_by_name() {
    let server = Server::start().await;
    const BAD: &str = "invalid_request_error";
    let tools = json!([{"type": "function", "function": {"name": "weather", "parameters": {}}}]);
    let chat = |extra: Value| {
        let mut body = json!({"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    for (extra, param) in [
        (json!({"tools": tools}), "tools"),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": "required",
                "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        (
            json!({"response_format": {"type": "structural_tag"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "no-such-type"}}}}),
            "response_format",
        ),
        (
            json!({"structured_outputs": {"regex": "(unclosed"}}),
            "structured_outputs",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
            "guided_regex",
        ),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"7": 101}}), "logit_bias"),
        (json!({"logit_bias": {"4000000": 1}}), "logit_bias"),
    ] {
        assert_error(
            server.post("/v1/chat/completions", &chat(extra)).await,
            400,
            BAD,
            Some(param),
        );
    }
    // Tools the model may not call are fine: it answers in text.
    let (status, out) = server
        .post(
            "/v1/chat/completions",
            &chat(
                json!({"tools": tools, "tool_choice": "none", "response_format": {"type": "text"}}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    for (body, param) in [
        (
            json!({"prompt": "hi", "tools": tools, "tool_choice": "required"}),
            "tool_choice",
        ),
        (json!({"prompt": "hi", "suffix": "bye"}), "suffix"),
        (json!({"prompt": "hi", "best_of": 3, "n": 3}), "best_of"),
    ] {
        assert_error(
            server.post("/v1/completions", &body).await,
            400,
            BAD,
            Some(param),
        );
    }
    assert_error(
        server
            .post(
                "/v1/responses",
                &json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}),
            )
            .await,
        400,
        BAD,
        Some("text.format"),
    );
    server.stop().await;
}

/// Structured output on every API and in each way clients ask for it: OpenAI's
/// `response_format` (`json_schema`, `json_object`), the Responses API's `text.format`, vLLM's
/// `structured_outputs` and `guided_*`. A random model's answer is valid under the constraint
/// every time (the mask does the work: the same prompt unconstrained is not JSON), ends with
/// `finish_reason: "stop"` where the constraint is complete, and streams the same text.
#[tokio::test]
async fn structured_outputs_constrain_answers_on_every_api() {
    let server = Server::start().await;
    let schema = json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "temp": {"type": "integer", "minimum": -50, "maximum": 50},
            "sunny": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["city", "temp", "sunny", "tags"], "additionalProperties": false});
    let valid = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            v["city"].as_str().is_some_and(|c| c.chars().count() <= 8),
            "{v}"
        );
        assert!(
            v["temp"].as_i64().is_some_and(|t| (-50..=50).contains(&t)),
            "{v}"
        );
        assert!(
            v["sunny"].is_boolean() && v["tags"].as_array().is_some_and(|t| t.len() <= 3),
            "{v}"
        );
        assert_eq!(v.as_object().unwrap().len(), 4, "{v}");
    };
    let messages = json!([{"role": "user", "content": "Weather in Paris, as JSON."}]);

    // Chat, json_schema: valid, stopped, and the same streamed.
    let chat = json!({"messages": messages, "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "weather", "schema": schema, "strict": true}}});
    let (status, out) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{out}");
    let content = out["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    valid(&content);
    assert_eq!(out["choices"][0]["finish_reason"], "stop", "{out}");
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let text: String = json_chunks(&server.post_stream("/v1/chat/completions", &streamed).await)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, content);
    // Unconstrained, the same request is not JSON.
    let mut plain = chat.clone();
    plain.as_object_mut().unwrap().remove("response_format");
    let (_, out) = server.post("/v1/chat/completions", &plain).await;
    let text = out["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(text).is_err(), "{text:?}");

    // Chat, json_object, three sampled children: each an object.
    let (status, out) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 200, "n": 3, "temperature": 0.7,
                "seed": 1, "response_format": {"type": "json_object"}}),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    for c in out["choices"].as_array().unwrap() {
        // A random model may nest until max_tokens; whatever it finished is an object. (Read
        // for syntax only: a random number like 1E82539250 is JSON, but no f64.)
        if c["finish_reason"] == "stop" {
            let text = c["message"]["content"].as_str().unwrap();
            serde_json::from_str::<serde::de::IgnoredAny>(text)
                .unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(text.starts_with('{') && text.ends_with('}'), "{text}");
        } else {
            assert!(
                c["message"]["content"].as_str().unwrap().starts_with('{'),
                "{c}"
            );
        }
    }

    // Completions: vLLM's structured_outputs choice and guided_regex, n = 2 sampled.
    let choices = ["sunny", "rainy", "foggy and cold"];
    let (status, out) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Tomorrow will be", "max_tokens": 20, "n": 2, "temperature": 1,
                "seed": 4, "structured_outputs": {"choice": choices}}),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    for c in out["choices"].as_array().unwrap() {
        assert!(choices.contains(&c["text"].as_str().unwrap()), "{c}");
        assert_eq!(c["finish_reason"], "stop", "{c}");
    }
    let (status, out) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Code:", "max_tokens": 20, "temperature": 0,
                "guided_regex": "[A-Z]{2}-[0-9]{3}"}),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    let code = out["choices"][0]["text"].as_str().unwrap().as_bytes();
    assert!(
        code.len() == 6
            && code[..2].iter().all(u8::is_ascii_uppercase)
            && code[2] == b'-'
            && code[3..].iter().all(u8::is_ascii_digit),
        "{out}"
    );

    // Responses: text.format json_schema (the schema inline), streamed and not.
    let body = json!({"input": "Weather in Oslo?", "max_output_tokens": 120, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "weather", "schema": schema}}});
    let (status, out) = server.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["status"], "completed", "{out}");
    let text = out["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    valid(&text);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let frames = server.post_stream("/v1/responses", &streamed).await;
    let done = frames
        .iter()
        .map(|f| f.json())
        .find(|e| e["type"] == "response.output_text.done")
        .expect("output_text.done");
    assert_eq!(done["text"], text.as_str());
    server.stop().await;
}

/// Forced tool calls on chat (`tool_choice` naming a function, or `"required"`): the answer is
/// a call to a declared tool whose arguments are valid under its parameters' schema, on a
/// random model, with `content: null` and `finish_reason: "tool_calls"`; streamed, a named call
/// arrives as OpenAI streams one (id and name first, then argument deltas) and a list of calls
/// as one delta at the end, both equal to the non-streamed answer. The next turn — the
/// assistant's call and the tool's result in `messages` — is taken.
#[tokio::test]
async fn forced_tool_calls_are_calls_to_declared_tools_with_valid_arguments() {
    let server = Server::start().await;
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        // Its definitions move to the root of a "required" list's schema (a pydantic shape).
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"],
            "additionalProperties": false, "$defs": {"Zone": {"enum": ["UTC", "CET"]}}}}}
    ]);
    let valid = |name: &str, arguments: &str| {
        let a: Value = serde_json::from_str(arguments)
            .unwrap_or_else(|e| panic!("{name}({arguments:?}): {e}"));
        match name {
            "get_weather" => {
                assert!(
                    a["city"].as_str().is_some_and(|c| c.chars().count() <= 10),
                    "{a}"
                );
                assert!(
                    ["celsius", "fahrenheit"].contains(&a["unit"].as_str().unwrap()),
                    "{a}"
                );
            }
            "get_time" => assert!(["UTC", "CET"].contains(&a["zone"].as_str().unwrap()), "{a}"),
            other => panic!("a call to undeclared {other}"),
        }
    };
    let messages = json!([{"role": "user", "content": "What is the weather in Oslo?"}]);

    // Named.
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 80, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let choice = &out["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{out}");
    assert!(choice["message"]["content"].is_null(), "{out}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments = call["function"]["arguments"].as_str().unwrap().to_owned();
    valid("get_weather", &arguments);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/chat/completions", &streamed).await);
    let head = &chunks[0]["choices"][0]["delta"];
    assert_eq!(head["role"], "assistant", "{head}");
    assert_eq!(
        head["tool_calls"][0]["function"]["name"], "get_weather",
        "{head}"
    );
    assert_eq!(head["tool_calls"][0]["index"], 0, "{head}");
    assert!(head["tool_calls"][0]["id"].is_string(), "{head}");
    let args: String = chunks[1..]
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(args, arguments);
    assert!(
        chunks
            .iter()
            .all(|c| c["choices"][0]["delta"].get("content").is_none())
    );
    let last = chunks
        .iter()
        .rev()
        .find(|c| !c["choices"][0]["finish_reason"].is_null())
        .unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");

    // Required: one or more calls, each to a declared tool; n = 2 sampled.
    let body = json!({"messages": messages, "tools": tools, "tool_choice": "required",
        "max_tokens": 200, "temperature": 0.8, "seed": 3, "n": 2});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let mut whole = Vec::new();
    for c in out["choices"].as_array().unwrap() {
        // A random model may list calls until max_tokens; a finished list is calls.
        if c["finish_reason"] != "tool_calls" {
            assert_eq!(c["finish_reason"], "length", "{c}");
            continue;
        }
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{c}");
        for call in calls {
            assert!(call.get("index").is_none(), "{call}");
            valid(
                call["function"]["name"].as_str().unwrap(),
                call["function"]["arguments"].as_str().unwrap(),
            );
        }
        whole.push((c["index"].clone(), calls.clone()));
    }
    assert!(
        !whole.is_empty(),
        "no list of calls ended within 200 tokens: {out}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/chat/completions", &streamed).await);
    for (index, calls) in whole {
        let sent: Vec<&Value> = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == index)
            .filter_map(|c| c["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(sent.len(), calls.len(), "{sent:?}");
        for (s, c) in sent.iter().zip(&calls) {
            assert_eq!(s["function"], c["function"]);
        }
    }

    // The next turn carries the call and its result.
    let next = json!({"messages": [
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\":\"Oslo\",\"unit\":\"celsius\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}],
        "tools": tools, "tool_choice": "none", "max_tokens": 8, "temperature": 0});
    let (status, out) = server.post("/v1/chat/completions", &next).await;
    assert_eq!(status, 200, "{out}");
    assert!(out["choices"][0]["message"]["content"].is_string(), "{out}");

    // `parallel_tool_calls: false`: exactly one call (the list's schema allows one).
    let body = json!({"messages": messages, "tools": tools, "tool_choice": "required",
        "parallel_tool_calls": false, "max_tokens": 200, "temperature": 1.0, "seed": 9, "n": 4});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let mut finished = 0;
    for c in out["choices"].as_array().unwrap() {
        if c["finish_reason"] == "tool_calls" {
            assert_eq!(
                c["message"]["tool_calls"].as_array().unwrap().len(),
                1,
                "{c}"
            );
            finished += 1;
        }
    }
    assert!(finished > 0, "{out}");
    server.stop().await;
}

/// `tool_choice: "auto"` (the default with tools) on a node serving with the Hermes parser:
/// the model's text is the answer, and `<tool_call>` blocks in it that call a declared tool
/// with an object of arguments are `tool_calls` (`finish_reason: "tool_calls"`). A random tiny
/// model never writes such a block, so the blocks are held to that shape by a regex
/// (`structured_outputs`, which combines with `"auto"`): the parser is what is tested, on the
/// engine's real text, streamed and not.
#[tokio::test]
async fn tool_calls_the_model_writes_itself_are_read_by_the_nodes_parser() {
    let server = Server::start_with(Some(pd_node::ToolCallParser::Hermes)).await;
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time"}}
    ]);
    let messages = json!([{"role": "user", "content": "What is the weather in Oslo?"}]);

    // Plain text through the parser is the text the model wrote, token for token the same as
    // answering without tools (special tokens kept, as the parser asks of the decoder).
    let plain = json!({"messages": messages, "max_tokens": 24, "temperature": 0,
        "return_token_ids": true, "skip_special_tokens": false});
    let (status, without) = server.post("/v1/chat/completions", &plain).await;
    assert_eq!(status, 200, "{without}");
    let mut auto = plain.clone();
    auto["tools"] = tools.clone();
    auto.as_object_mut().unwrap().remove("skip_special_tokens");
    let (status, with) = server.post("/v1/chat/completions", &auto).await;
    assert_eq!(status, 200, "{with}");
    assert_eq!(
        with["choices"][0]["token_ids"],
        without["choices"][0]["token_ids"]
    );
    assert_eq!(
        with["choices"][0]["message"]["content"], without["choices"][0]["message"]["content"],
        "{with}"
    );
    assert_eq!(
        with["choices"][0]["message"]["tool_calls"],
        json!([]),
        "{with}"
    );
    assert_eq!(with["choices"][0]["finish_reason"], "length");

    // Text, then two calls, each block as Hermes writes it.
    let hermes = r#"Checking [A-Z][a-z]{1,6}\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,6}"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>"#;
    let body = json!({"messages": messages, "tools": tools, "tool_choice": "auto",
        "max_tokens": 200, "temperature": 0.8, "seed": 5, "n": 2,
        "structured_outputs": {"regex": hermes}});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    for c in out["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let content = c["message"]["content"].as_str().unwrap();
        assert!(
            content.starts_with("Checking ") && content.ends_with(".\n"),
            "{content:?}"
        );
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2, "{c}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(
            args["city"].as_str().is_some_and(|s| s.len() >= 2),
            "{args}"
        );
        assert_eq!(
            calls[1]["function"],
            json!({"name": "get_time", "arguments": "{}"})
        );
        for call in calls {
            assert!(call.get("index").is_none(), "{call}");
            assert_eq!(call["type"], "function");
            assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
        }
    }
    // Streamed: the content and calls a client assembles are the ones above (same seed).
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/chat/completions", &streamed).await);
    for c in out["choices"].as_array().unwrap() {
        let index = &c["index"];
        let mine: Vec<&Value> = chunks
            .iter()
            .flat_map(|k| k["choices"].as_array().unwrap())
            .filter(|k| k["index"] == *index)
            .collect();
        let content: String = mine
            .iter()
            .filter_map(|k| k["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, c["message"]["content"].as_str().unwrap());
        let calls: Vec<&Value> = mine
            .iter()
            .filter_map(|k| k["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(calls.len(), 2, "{calls:?}");
        for (i, (sent, whole)) in calls
            .iter()
            .zip(c["message"]["tool_calls"].as_array().unwrap())
            .enumerate()
        {
            assert_eq!(sent["index"], i, "{sent}");
            assert_eq!(sent["function"], whole["function"]);
            assert!(sent["id"].is_string(), "{sent}");
        }
        // No text of a block leaks into the content first.
        assert!(!content.contains('<'), "{content:?}");
        assert_eq!(
            mine.last().unwrap()["finish_reason"],
            "tool_calls",
            "{:?}",
            mine.last()
        );
    }

    // A block calling an undeclared tool is no call: the answer is its text, whole.
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 200, "temperature": 0,
        "structured_outputs": {"regex": r#"<tool_call>\n\{"name": "rm_rf", "arguments": \{\}\}\n</tool_call>"#}});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let c = &out["choices"][0];
    assert_eq!(c["finish_reason"], "stop", "{c}");
    assert_eq!(
        c["message"]["content"],
        "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>"
    );
    assert_eq!(c["message"]["tool_calls"], json!([]), "{c}");

    // tool_choice "none" answers in text, the parser on or not.
    let none = json!({"messages": messages, "tools": tools, "tool_choice": "none",
        "max_tokens": 24, "temperature": 0, "return_token_ids": true});
    let (status, out) = server.post("/v1/chat/completions", &none).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "length");
    server.stop().await;
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

/// `output` without its generated ids, to compare a stream's with a whole answer's.
fn without_ids(output: &Value) -> Value {
    let mut output = output.clone();
    for item in output.as_array_mut().unwrap() {
        let item = item.as_object_mut().unwrap();
        for key in ["id", "call_id"] {
            if let Some(v) = item.remove(key) {
                let prefix = v.as_str().unwrap().split('_').next().unwrap().to_owned();
                item.insert(key.to_owned(), json!(prefix));
            }
        }
    }
    output
}

/// Function tools on the Responses API, in its own shapes: `tools` as `{"type": "function",
/// "name", "parameters"}`, a named `tool_choice` as `{"type": "function", "name"}`, each call a
/// `function_call` output item (`call_id`, `name`, `arguments`) streamed with
/// `response.function_call_arguments.delta`/`.done`; `"required"` and `"auto"` (the node's
/// parser) too, text and calls in the order written; and the next turn's `function_call` and
/// `function_call_output` input items are the conversation the template renders.
#[tokio::test]
async fn function_tools_on_the_responses_api() {
    let server = Server::start_with(Some(pd_node::ToolCallParser::Hermes)).await;
    let tools = json!([
        {"type": "function", "name": "get_weather", "description": "Weather now", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"], "additionalProperties": false}},
        {"type": "function", "name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
            "additionalProperties": false}}
    ]);
    let valid = |item: &Value| {
        assert_eq!(item["type"], "function_call", "{item}");
        assert!(item["id"].as_str().unwrap().starts_with("fc_"), "{item}");
        assert!(
            item["call_id"].as_str().unwrap().starts_with("call_"),
            "{item}"
        );
        let a: Value = serde_json::from_str(item["arguments"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("{item}: {e}"));
        match item["name"].as_str().unwrap() {
            "get_weather" => assert!(
                a["city"].as_str().is_some_and(|c| c.chars().count() <= 10),
                "{a}"
            ),
            "get_time" => assert!(["UTC", "CET"].contains(&a["zone"].as_str().unwrap()), "{a}"),
            other => panic!("a call to undeclared {other}"),
        }
    };
    let ask = |extra: Value| {
        let mut body = json!({"input": "What is the weather in Oslo?", "tools": tools,
            "max_output_tokens": 200, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };

    // Named: one function_call item, its arguments streamed as generated.
    let body = ask(json!({"tool_choice": {"type": "function", "name": "get_weather"}}));
    let (status, whole) = server.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["status"], "completed", "{whole}");
    assert_eq!(whole["tools"], tools);
    assert_eq!(whole["tool_choice"], body["tool_choice"]);
    let output = whole["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{whole}");
    assert_eq!(output[0]["name"], "get_weather");
    assert_eq!(output[0]["status"], "completed");
    valid(&output[0]);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (events, last) = response_events(&server.post_stream("/v1/responses", &streamed).await);
    let names: Vec<&str> = events
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .filter(|n| *n != "response.function_call_arguments.delta")
        .collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, output[0]["arguments"].as_str().unwrap());
    assert_eq!(events[2]["item"]["type"], "function_call");
    assert_eq!(events[2]["item"]["name"], "get_weather");
    assert_eq!(without_ids(&last["output"]), without_ids(&whole["output"]));

    // Required: one or more calls, each valid.
    let body = ask(json!({"tool_choice": "required"}));
    let (status, whole) = server.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{whole}");
    if whole["status"] == "completed" {
        let output = whole["output"].as_array().unwrap();
        assert!(!output.is_empty(), "{whole}");
        output.iter().for_each(valid);
    } else {
        // A random model may list calls until the limit: the list is text then.
        assert_eq!(
            whole["incomplete_details"]["reason"], "max_output_tokens",
            "{whole}"
        );
        assert_eq!(whole["output"][0]["type"], "message", "{whole}");
    }

    // Auto: the text the model writes, then the calls it writes (Hermes blocks, held to that
    // shape by a regex: a random model writes none by itself), as items in that order.
    let hermes = r#"Checking [A-Z][a-z]{1,6}\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,6}"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>"#;
    let body = ask(json!({"temperature": 0.7, "top_p": 0.9,
        "structured_outputs": {"regex": hermes}}));
    let (status, whole) = server.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["status"], "completed", "{whole}");
    let output = whole["output"].as_array().unwrap();
    let kinds: Vec<&str> = output.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["message", "function_call", "function_call"],
        "{whole}"
    );
    let text = output[0]["content"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("Checking ") && text.ends_with(".\n"),
        "{text:?}"
    );
    valid(&output[1]);
    valid(&output[2]);
    assert_eq!(output[2]["arguments"], r#"{"zone": "UTC"}"#);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["temperature"] = json!(0);
    let mut greedy = body.clone();
    greedy["temperature"] = json!(0);
    let (status, whole) = server.post("/v1/responses", &greedy).await;
    assert_eq!(status, 200, "{whole}");
    let (events, last) = response_events(&server.post_stream("/v1/responses", &streamed).await);
    assert_eq!(without_ids(&last["output"]), without_ids(&whole["output"]));
    // Each item announced at its index, the items done equal to the response's.
    let done: Vec<Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_item.done")
        .map(|e| {
            let item = &last["output"][e["output_index"].as_u64().unwrap() as usize];
            assert_eq!(&e["item"], item);
            e["item"].clone()
        })
        .collect();
    assert_eq!(done.len(), 3);
    let streamed_text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(
        streamed_text,
        last["output"][0]["content"][0]["text"].as_str().unwrap()
    );

    // The next turn: the calls and their outputs as input items.
    let next = json!({"tools": tools, "max_output_tokens": 4, "temperature": 0, "input": [
        {"role": "user", "content": "What is the weather in Oslo?"},
        output[0].clone(), output[1].clone(), output[2].clone(),
        {"type": "function_call_output", "call_id": output[1]["call_id"], "output": "4 degrees"},
        {"type": "function_call_output", "call_id": output[2]["call_id"], "output": "12:00"}
    ]});
    let (status, out) = server.post("/v1/responses", &next).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["output"][0]["type"], "message", "{out}");

    // Malformed tool fields are named.
    for (extra, param) in [
        (json!({"tool_choice": {"type": "function"}}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "name": "nope"}}),
            "tool_choice",
        ),
        (
            json!({"tools": [{"type": "web_search"}], "tool_choice": "required"}),
            "tools",
        ),
    ] {
        assert_error(
            server.post("/v1/responses", &ask(extra)).await,
            400,
            "invalid_request_error",
            Some(param),
        );
    }
    let (status, out) = server
        .post(
            "/v1/responses",
            &json!({"input": [{"type": "function_call_output", "output": "x"}]}),
        )
        .await;
    assert_eq!(status, 400, "{out}");
    assert_eq!(out["error"]["param"], "input", "{out}");
    server.stop().await;
}

/// vLLM's `min_tokens`: until a child has generated that many tokens its stop ids and EOS are
/// never picked and stop strings do not end it; `min_tokens` above `max_tokens` is a 400.
#[tokio::test]
async fn min_tokens_holds_back_every_way_to_stop() {
    let server = Server::start().await;
    let ask = |extra: Value| {
        let mut body = json!({"prompt": "Count:", "max_tokens": 12, "temperature": 0,
            "return_token_ids": true, "logit_bias": {"42": 100}});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    // Token 42 is forced at every step: as a stop id it ends the answer at once...
    let (status, out) = server
        .post("/v1/completions", &ask(json!({"stop_token_ids": [42]})))
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "stop", "{out}");
    assert_eq!(out["usage"]["completion_tokens"], 1, "{out}");
    // ...unless min_tokens holds it back: 4 other tokens first, then 42.
    let (status, out) = server
        .post(
            "/v1/completions",
            &ask(json!({"stop_token_ids": [42], "min_tokens": 4})),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    let ids: Vec<u64> = out["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 5, "{out}");
    assert!(ids[..4].iter().all(|&t| t != 42), "{ids:?}");
    assert_eq!(ids[4], 42, "{ids:?}");
    assert_eq!(out["choices"][0]["finish_reason"], "stop", "{out}");
    // A stop string (42's text) counts only from the 3rd token on: the answer is two of it.
    let (_, one) = server
        .post("/v1/completions", &ask(json!({"max_tokens": 1})))
        .await;
    let piece = one["choices"][0]["text"].as_str().unwrap().to_owned();
    assert!(!piece.is_empty(), "{one}");
    let (_, out) = server
        .post("/v1/completions", &ask(json!({"stop": [piece]})))
        .await;
    assert_eq!(out["choices"][0]["text"], "", "{out}");
    let (status, out) = server
        .post(
            "/v1/completions",
            &ask(json!({"stop": [piece], "min_tokens": 3})),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["text"], piece.repeat(2), "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "stop", "{out}");
    assert_eq!(out["usage"]["completion_tokens"], 3, "{out}");
    // Streamed, the same text arrives.
    let mut streamed = ask(json!({"stop": [piece], "min_tokens": 3, "stream": true}));
    streamed.as_object_mut().unwrap().remove("return_token_ids");
    let chunks = json_chunks(&server.post_stream("/v1/completions", &streamed).await);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, piece.repeat(2));
    // A stop string written before min_tokens is not looked for later either: "ab" is
    // written by the 2nd token, min_tokens is 3, and the answer goes on to its end.
    let (status, out) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Count:", "max_tokens": 12, "temperature": 0, "stop": ["ab"],
                "min_tokens": 3, "structured_outputs": {"regex": "abcd"}}),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["text"], "abcd", "{out}");
    // Chat takes it too; more than max_tokens is refused by name.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0, "min_tokens": 6, "logit_bias": {"42": 100}, "stop_token_ids": [42]});
    let (status, out) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "length", "{out}");
    assert_error(
        server
            .post("/v1/completions", &ask(json!({"min_tokens": 13})))
            .await,
        400,
        "invalid_request_error",
        Some("min_tokens"),
    );
    assert_error(
        server
            .post("/v1/completions", &ask(json!({"min_tokens": -1})))
            .await,
        400,
        "invalid_request_error",
        Some("min_tokens"),
    );
    server.stop().await;
}

/// `--tool-call-parser llama3_json`: an answer that is `{"name", "parameters"}` objects is
/// calls, streamed or not; any other answer is text, token for token as without tools.
#[tokio::test]
async fn llama3_json_answers_are_calls_or_text() {
    let server = Server::start_with(Some(pd_node::ToolCallParser::Llama3Json)).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let messages = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let calls = r#"\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{1,6}"\}\}"#;
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 100, "temperature": 0,
        "structured_outputs": {"regex": calls}});
    let (status, whole) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let c = &whole["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{c}");
    assert!(c["message"]["content"].is_null(), "{c}");
    assert_eq!(
        c["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/chat/completions", &streamed).await);
    let sent: Vec<&Value> = chunks
        .iter()
        .filter_map(|k| k["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(sent.len(), 1);
    assert_eq!(
        sent[0]["function"],
        c["message"]["tool_calls"][0]["function"]
    );
    // Text: the model's own answer, as without tools (special tokens kept for the parser).
    let plain = json!({"messages": messages, "max_tokens": 16, "temperature": 0,
        "return_token_ids": true, "skip_special_tokens": false});
    let (_, without) = server.post("/v1/chat/completions", &plain).await;
    let mut auto = plain.clone();
    auto["tools"] = tools;
    let (status, with) = server.post("/v1/chat/completions", &auto).await;
    assert_eq!(status, 200, "{with}");
    assert_eq!(
        with["choices"][0]["message"]["content"],
        without["choices"][0]["message"]["content"]
    );
    assert_eq!(with["choices"][0]["finish_reason"], "length");
    server.stop().await;
}

/// Mistral's calls (`--tool-call-parser mistral`): text, then `[TOOL_CALLS]` and a JSON list
/// of calls (held by a regex here, as a random tiny model would never write one): `tool_calls`
/// after the text, the same streamed as whole; on the Responses API `function_call` items.
#[tokio::test]
async fn mistral_answers_are_text_then_calls() {
    let server = Server::start_with(Some(pd_node::ToolCallParser::Mistral)).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let messages = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let calls = r#"[A-Z][a-z]{2,5}\.\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,6}"\}\}\]"#;
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 100, "temperature": 0,
        "structured_outputs": {"regex": calls}});
    let (status, whole) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let c = &whole["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{c}");
    let content = c["message"]["content"].as_str().unwrap();
    assert!(content.ends_with('.') && !content.contains("TOOL"), "{c}");
    let call = &c["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{call}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/chat/completions", &streamed).await);
    let text: String = chunks
        .iter()
        .filter_map(|k| k["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content);
    let sent: Vec<&Value> = chunks
        .iter()
        .filter_map(|k| k["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(sent.len(), 1);
    assert_eq!(&sent[0]["function"], call);
    server.stop().await;
}

/// Logprobs on the Responses API (`include: ["message.output_text.logprobs"]`, `top_logprobs`):
/// each token of `output_text` with its logprob and alternatives, the same as chat gives for
/// the same conversation; streamed, each delta carries its tokens' logprobs and `.done` all
/// of them. Tools with logprobs are refused by name (logprobs are of text answers).
#[tokio::test]
async fn responses_give_logprobs_when_asked() {
    let server = Server::start().await;
    let body = json!({"input": "Name a colour.", "max_output_tokens": 8, "temperature": 0,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2});
    let (status, out) = server.post("/v1/responses", &body).await;
    assert_eq!(status, 200, "{out}");
    let part = &out["output"][0]["content"][0];
    let logprobs = part["logprobs"].as_array().unwrap();
    assert_eq!(
        logprobs.len() as u64,
        out["usage"]["output_tokens"].as_u64().unwrap(),
        "{out}"
    );
    for lp in logprobs {
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0, "{lp}");
        assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), 2, "{lp}");
        assert!(lp["bytes"].is_array() && lp["token"].is_string(), "{lp}");
    }
    // The same as chat's, for the same conversation.
    let chat = json!({"messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (_, c) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(&c["choices"][0]["logprobs"]["content"], &part["logprobs"]);
    // Streamed: the deltas' logprobs, then all of them on `.done` and in the response.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (events, last) = response_events(&server.post_stream("/v1/responses", &streamed).await);
    let from_deltas: Vec<Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().unwrap().clone())
        .collect();
    assert_eq!(Value::Array(from_deltas), part["logprobs"]);
    let done = events
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .unwrap();
    assert_eq!(done["logprobs"], part["logprobs"]);
    assert_eq!(
        last["output"][0]["content"][0]["logprobs"],
        part["logprobs"]
    );
    // Not asked: none. Asked with tools: a 400 naming `include`.
    let (_, plain) = server
        .post(
            "/v1/responses",
            &json!({"input": "Name a colour.", "max_output_tokens": 8, "temperature": 0}),
        )
        .await;
    assert_eq!(plain["output"][0]["content"][0]["logprobs"], json!([]));
    let mut with_tools = body.clone();
    with_tools["tools"] = json!([{"type": "function", "name": "f"}]);
    with_tools["tool_choice"] = json!("required");
    assert_error(
        server.post("/v1/responses", &with_tools).await,
        400,
        "invalid_request_error",
        Some("include"),
    );
    let mut too_many = body.clone();
    too_many["top_logprobs"] = json!(21);
    assert_error(
        server.post("/v1/responses", &too_many).await,
        400,
        "invalid_request_error",
        Some("top_logprobs"),
    );
    server.stop().await;
}

/// The legacy logprobs object's lists, as `(tokens, token_logprobs, top_logprobs, text_offset)`.
fn legacy_logprobs(choice: &Value) -> (Vec<Value>, Vec<Value>, Vec<Value>, Vec<Value>) {
    let l = &choice["logprobs"];
    let list = |k: &str| {
        l[k].as_array()
            .unwrap_or_else(|| panic!("{k}: {l}"))
            .clone()
    };
    (
        list("tokens"),
        list("token_logprobs"),
        list("top_logprobs"),
        list("text_offset"),
    )
}

#[tokio::test]
async fn echo_and_prompt_logprobs_score_the_prompt_as_generation_scored_it() {
    let server = Server::start().await;
    // A greedy continuation and the logprobs the model gave each of its tokens.
    let prompt = [72u32, 101, 108, 108, 111, 44, 32, 119];
    let (status, first) = server
        .post(
            "/v1/completions",
            &json!({
                "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                "logprobs": 1, "return_token_ids": true,
            }),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    let generated: Vec<u32> = first["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let (_, generated_logprobs, _, _) = legacy_logprobs(&first["choices"][0]);

    // What lm-evaluation-harness sends for a loglikelihood: context + continuation as ids,
    // echo, one logprob, one token. The continuation's logprobs must be the ones generation
    // gave it: each prompt position is scored as a plain forward pass scores it.
    let whole: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let body = json!({
        "prompt": [whole], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true,
        "seed": 1234,
    });
    let (status, scored) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{scored}");
    let choice = &scored["choices"][0];
    let (tokens, token_logprobs, top_logprobs, offsets) = legacy_logprobs(choice);
    assert_eq!(
        tokens.len(),
        whole.len() + 1,
        "the prompt's tokens, then the one generated"
    );
    assert_eq!(
        token_logprobs[0],
        Value::Null,
        "the first token has no logprob"
    );
    assert_eq!(top_logprobs[0], Value::Null);
    for (i, (got, want)) in token_logprobs[prompt.len()..whole.len()]
        .iter()
        .zip(&generated_logprobs)
        .enumerate()
    {
        let (got, want) = (got.as_f64().unwrap(), want.as_f64().unwrap());
        assert!(
            (got - want).abs() < 1e-3,
            "continuation token {i}: {got} scored, {want} when generated"
        );
        // Greedy tokens: the most likely, so the one alternative is the token itself.
        let top = top_logprobs[prompt.len() + i].as_object().unwrap();
        assert_eq!(top.len(), 1);
        assert!((top.values().next().unwrap().as_f64().unwrap() - got).abs() < 1e-6);
    }
    // text_offset walks the echoed text: the prompt decoded, then the new token.
    let text = choice["text"].as_str().unwrap();
    let mut at = 0;
    for (t, o) in tokens.iter().zip(&offsets) {
        assert_eq!(o.as_u64().unwrap() as usize, at);
        at += t.as_str().unwrap().chars().count();
    }
    assert_eq!(at, text.chars().count(), "{text:?}");
    assert_eq!(scored["usage"]["completion_tokens"], 1);
    assert_eq!(
        scored["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "a scored prompt is computed, never served from the prefix cache"
    );

    // Streamed: the prompt and its logprobs on the first chunk, the same answer assembled.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let chunks = json_chunks(&server.post_stream("/v1/completions", &stream_body).await);
    let mut s_text = String::new();
    let mut s_logprobs = Vec::new();
    let mut s_offsets = Vec::new();
    for c in &chunks {
        let Some(ch) = c["choices"].as_array().and_then(|a| a.first()) else {
            continue;
        };
        s_text.push_str(ch["text"].as_str().unwrap());
        let (_, l, _, o) = legacy_logprobs(ch);
        s_logprobs.extend(l);
        s_offsets.extend(o);
    }
    assert_eq!(s_text, text);
    assert_eq!(s_logprobs, token_logprobs);
    assert_eq!(s_offsets, offsets);

    // `max_tokens: 0` with echo: the prompt alone, scored; nothing generated is returned.
    let (status, alone) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Hello, w", "max_tokens": 0, "echo": true, "logprobs": 0}),
        )
        .await;
    assert_eq!(status, 200, "{alone}");
    let choice = &alone["choices"][0];
    assert_eq!(
        choice["text"], "Hello, w",
        "a text prompt is echoed as given"
    );
    let (tokens, token_logprobs, top_logprobs, _) = legacy_logprobs(choice);
    let prompt_tokens = alone["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(tokens.len(), prompt_tokens);
    assert!(
        token_logprobs[1..]
            .iter()
            .all(|l| l.as_f64().unwrap() <= 0.0)
    );
    // No alternatives asked for: each map holds the token itself (OpenAI's "up to logprobs +
    // 1 elements").
    for ((t, l), top) in tokens
        .iter()
        .zip(&token_logprobs)
        .zip(&top_logprobs)
        .skip(1)
    {
        let top = top.as_object().unwrap();
        assert_eq!(top.len(), 1, "{top:?}");
        assert_eq!(top.get(t.as_str().unwrap()), Some(l), "{top:?}");
    }
    assert_eq!(alone["usage"]["completion_tokens"], 0);
    let mut stream_alone =
        json!({"prompt": "Hello, w", "max_tokens": 0, "echo": true, "stream": true});
    stream_alone["stream_options"] = json!({"include_usage": true});
    let chunks = json_chunks(&server.post_stream("/v1/completions", &stream_alone).await);
    let streamed: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .map(|ch| ch["text"].as_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(streamed, "Hello, w");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 0);

    // Echo without logprobs, n = 2: each choice starts with the prompt.
    let (status, two) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 3, "echo": true, "n": 2, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{two}");
    for c in two["choices"].as_array().unwrap() {
        assert!(c["text"].as_str().unwrap().starts_with("Hello"), "{c}");
        assert_eq!(c["logprobs"], Value::Null);
    }

    // vLLM's `prompt_logprobs`: null, then per prompt token an object keyed by token id with
    // the prompt token and its alternatives; the same numbers as echo's.
    let (status, v) = server
        .post(
            "/v1/completions",
            &json!({"prompt": [whole], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let entries = v["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(entries.len(), whole.len());
    assert_eq!(entries[0], Value::Null);
    for (i, e) in entries.iter().enumerate().skip(1) {
        let e = e.as_object().unwrap();
        let own = &e[&whole[i].to_string()];
        assert!(
            (own["logprob"].as_f64().unwrap() - token_logprobs_at(&scored, i)).abs() < 1e-3,
            "position {i}"
        );
        let rank = own["rank"].as_u64().unwrap();
        assert!(rank >= 1);
        // The prompt token, plus the two most likely where it is not one of them.
        assert_eq!(e.len(), if rank <= 2 { 2 } else { 3 }, "{e:?}");
        assert!(e.values().all(|x| x["decoded_token"].is_string()));
    }
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);

    // On chat, the field sits on the response.
    let (status, chat) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                    "prompt_logprobs": 0}),
        )
        .await;
    assert_eq!(status, 200, "{chat}");
    let entries = chat["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        entries.len() as u64,
        chat["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(
        entries[1..]
            .iter()
            .all(|e| e.as_object().unwrap().len() == 1)
    );

    wait_all_blocks_free(&server).await;
    server.stop().await;
}

/// `token_logprobs[i]` of a legacy completion.
fn token_logprobs_at(response: &Value, i: usize) -> f64 {
    response["choices"][0]["logprobs"]["token_logprobs"][i]
        .as_f64()
        .unwrap()
}

#[tokio::test]
async fn tokenizer_endpoints_give_the_ids_generation_uses() {
    let server = Server::start().await;
    // The ids a completion computes for its prompt (vLLM's `return_token_ids`)...
    let (status, done) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Hello, world", "max_tokens": 1, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{done}");
    let (status, t) = server
        .post(
            "/tokenize",
            &json!({"model": "tiny", "prompt": "Hello, world", "return_token_strs": true}),
        )
        .await;
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["tokens"], done["choices"][0]["prompt_token_ids"]);
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    assert_eq!(t["max_model_len"], MAX_MODEL_LEN);
    assert_eq!(
        t["token_strs"].as_array().unwrap().len(),
        t["count"].as_u64().unwrap() as usize
    );
    // ... and a chat's, tools included.
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let (_, chat) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 1, "return_token_ids": true,
                    "tools": tools, "tool_choice": "none"}),
        )
        .await;
    let (status, ct) = server
        .post("/tokenize", &json!({"messages": messages, "tools": tools}))
        .await;
    assert_eq!(status, 200, "{ct}");
    assert_eq!(ct["tokens"], chat["prompt_token_ids"], "{chat}");
    assert_eq!(ct["token_strs"], Value::Null);

    let (status, d) = server
        .post("/detokenize", &json!({"tokens": [72, 101, 108, 108, 111]}))
        .await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["prompt"], "Hello");
    let (status, info) = server.get("/tokenizer_info").await;
    assert_eq!(status, 200);
    let info: Value = serde_json::from_str(&info).unwrap();
    assert!(info["eos_token"].is_string(), "{info}");
    assert!(info["chat_template"].is_string(), "{info}");
    assert_eq!(info["model_max_length"], MAX_MODEL_LEN);

    for (path, body, status, param) in [
        (
            "/tokenize",
            json!({"model": "other", "prompt": "x"}),
            404,
            Some("model"),
        ),
        (
            "/tokenize",
            json!({"prompt": "x", "messages": messages}),
            400,
            Some("prompt"),
        ),
        ("/tokenize", json!({"prompt": ""}), 400, Some("prompt")),
        ("/tokenize", json!({"messages": []}), 400, Some("messages")),
        (
            "/detokenize",
            json!({"tokens": [1, 999999]}),
            400,
            Some("tokens"),
        ),
        ("/detokenize", json!({"tokens": "x"}), 400, None),
    ] {
        let (got, e) = server.post(path, &body).await;
        assert_eq!(got, status, "{path} {body}: {e}");
        if let Some(p) = param {
            assert_eq!(e["error"]["param"], p, "{path} {body}: {e}");
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn a_list_of_prompts_is_answered_prompt_by_prompt_as_each_alone() {
    let server = Server::start().await;
    let prompts = [json!("Hello"), json!("The sky is"), json!([72, 101, 108])];
    let common = json!({"max_tokens": 5, "temperature": 0, "ignore_eos": true, "n": 2,
        "logprobs": 1, "return_token_ids": true});
    let with = |prompt: Value, extra: Value| {
        let mut b = common.clone();
        b["prompt"] = prompt;
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    // Each prompt alone: the reference.
    let mut alone = Vec::new();
    for p in &prompts {
        let (status, r) = server
            .post("/v1/completions", &with(p.clone(), json!({})))
            .await;
        assert_eq!(status, 200, "{r}");
        alone.push(r);
    }
    let (status, batch) = server
        .post("/v1/completions", &with(json!(prompts), json!({})))
        .await;
    assert_eq!(status, 200, "{batch}");
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), prompts.len() * 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "choices in index order");
        let want = &alone[i / 2]["choices"][i % 2];
        for key in ["text", "token_ids", "prompt_token_ids", "finish_reason"] {
            assert_eq!(c[key], want[key], "choice {i}: {key}");
        }
        assert_eq!(
            c["logprobs"]["tokens"], want["logprobs"]["tokens"],
            "choice {i}"
        );
    }
    let sum = |key: &str| -> u64 {
        alone
            .iter()
            .map(|r| r["usage"][key].as_u64().unwrap())
            .sum()
    };
    assert_eq!(batch["usage"]["prompt_tokens"], sum("prompt_tokens"));
    assert_eq!(
        batch["usage"]["completion_tokens"],
        sum("completion_tokens")
    );

    // Streamed: the chunks of all prompts interleave by index and assemble to the same.
    let frames = server
        .post_stream(
            "/v1/completions",
            &with(
                json!(prompts),
                json!({"stream": true, "stream_options": {"include_usage": true}}),
            ),
        )
        .await;
    let chunks = json_chunks(&frames);
    let mut texts = vec![String::new(); choices.len()];
    let mut ids: Vec<Vec<Value>> = vec![Vec::new(); choices.len()];
    for c in &chunks {
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            texts[i].push_str(ch["text"].as_str().unwrap());
            ids[i].extend(ch["token_ids"].as_array().cloned().unwrap_or_default());
        }
    }
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(texts[i], c["text"].as_str().unwrap(), "streamed choice {i}");
        assert_eq!(
            Value::Array(ids[i].clone()),
            c["token_ids"],
            "streamed choice {i}"
        );
    }
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], batch["usage"]["prompt_tokens"]);
    assert_eq!(
        usage["completion_tokens"],
        batch["usage"]["completion_tokens"]
    );

    // lm-evaluation-harness's batched loglikelihood: several id prompts, echo, one token.
    let (status, scored) = server
        .post(
            "/v1/completions",
            &json!({"prompt": [[72, 101, 108, 108, 111], [84, 104, 101]], "echo": true,
                    "logprobs": 1, "max_tokens": 1, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{scored}");
    for (i, len) in [(0, 5), (1, 3)] {
        let lp = &scored["choices"][i]["logprobs"]["token_logprobs"];
        assert_eq!(lp.as_array().unwrap().len(), len + 1, "{scored}");
        assert_eq!(lp[0], Value::Null);
    }
    wait_all_blocks_free(&server).await;
    server.stop().await;
}

/// vLLM's `continuous_usage_stats`: with `include_usage`, every chunk carries the usage so far
/// (completion tokens counted as they are generated, all choices together), and the last
/// usage chunk is the same as without it. Without the option no chunk but the last has usage.
#[tokio::test]
async fn continuous_usage_stats_count_the_tokens_so_far() {
    let server = Server::start().await;
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 4, "n": 2, "temperature": 0,
                   "ignore_eos": true, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
                   "temperature": 0, "ignore_eos": true, "stream": true}),
        ),
    ] {
        let mut continuous = body.clone();
        continuous["stream_options"] =
            json!({"include_usage": true, "continuous_usage_stats": true});
        let chunks = json_chunks(&server.post_stream(path, &continuous).await);
        let (last, rest) = chunks.split_last().unwrap();
        let mut before = 0;
        for c in rest {
            let u = &c["usage"];
            let done = u["completion_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("{c}"));
            assert!(done >= before && done <= 8, "{path}: {c}");
            assert_eq!(
                u["total_tokens"].as_u64(),
                u["prompt_tokens"].as_u64().map(|p| p + done)
            );
            before = done;
        }
        assert_eq!(
            before, 8,
            "{path}: all 2 × 4 tokens counted by the last chunk"
        );
        let mut plain = body.clone();
        plain["stream_options"] = json!({"include_usage": true});
        let plain = json_chunks(&server.post_stream(path, &plain).await);
        // (The second request's prompt may come from the prefix cache.)
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(
                last["usage"][k],
                plain.last().unwrap()["usage"][k],
                "{path}"
            );
        }
        assert!(
            plain[..plain.len() - 1]
                .iter()
                .all(|c| c.get("usage").is_none_or(Value::is_null))
        );
    }
    server.stop().await;
}

/// The sample of `name` with vLLM's labels for the test model (`engine="0",model_name="tiny"`),
/// and `extra` labels after them.
fn vllm_metric(text: &str, name: &str, extra: &str) -> Option<f64> {
    let head = format!(r#"{name}{{engine="0",model_name="tiny"{extra}}} "#);
    text.lines()
        .find_map(|l| l.strip_prefix(&head)?.trim().parse().ok())
}

/// What reads a vLLM server's `/metrics` (Kubernetes' inference gateway, llm-d's endpoint
/// picker, autoscalers on the queue) reads a live node: `vllm:` samples move with the engine and
/// equal the node's own in the same scrape.
#[tokio::test]
async fn vllm_metric_names_follow_the_live_engine() {
    let server = Server::start().await;
    let info = server.engine.info();
    let idle_gauges = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ];
    let (_, idle) = server.get("/metrics").await;
    for name in idle_gauges {
        assert_eq!(vllm_metric(&idle, name, ""), Some(0.0), "{name}");
    }
    let config = format!(
        r#",block_size="{}",cache_dtype="{}",num_gpu_blocks="{}""#,
        info.block_size,
        info.kv_layout.dtype.as_str(),
        info.num_blocks
    );
    assert_eq!(
        vllm_metric(&idle, "vllm:cache_config_info", &config),
        Some(1.0),
        "{idle}"
    );

    // One answer run to its length: vLLM's per-request histograms hold it once.
    let (status, done) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "count to five", "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{done}");
    let (_, one) = server.get("/metrics").await;
    let reason = |text: &str, r: &str| {
        vllm_metric(
            text,
            "vllm:request_success_total",
            &format!(r#",finished_reason="{r}""#),
        )
    };
    assert_eq!(reason(&one, "length"), Some(1.0), "{one}");
    assert_eq!(reason(&one, "abort"), Some(0.0));
    assert_eq!(
        vllm_metric(&one, "vllm:request_generation_tokens_sum", ""),
        Some(5.0)
    );
    assert_eq!(
        vllm_metric(&one, "vllm:request_prompt_tokens_sum", ""),
        done["usage"]["prompt_tokens"].as_f64()
    );
    for name in [
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
    ] {
        assert_eq!(vllm_metric(&one, name, ""), Some(1.0), "{name}");
    }

    // Three streams held open mid-generation.
    let open = open_streams(&server, 3, "a long story about the sea, number").await;
    let (_, busy) = server.get("/metrics").await;
    let running = vllm_metric(&busy, "vllm:num_requests_running", "").expect("running");
    let waiting = vllm_metric(&busy, "vllm:num_requests_waiting", "").expect("waiting");
    assert_eq!(running + waiting, 3.0, "{busy}");
    assert_eq!(Some(running), metric(&busy, "pd_node_requests_running"));
    let free = metric(&busy, "pd_node_kv_blocks_free").expect("free");
    let usage = vllm_metric(&busy, "vllm:kv_cache_usage_perc", "").expect("usage");
    assert!(usage > 0.0, "three sequences hold blocks: {usage}");
    assert_eq!(usage, 1.0 - free / info.num_blocks as f64);
    assert_eq!(
        vllm_metric(&busy, "vllm:gpu_cache_usage_perc", ""),
        Some(usage)
    );
    assert_eq!(
        vllm_metric(&busy, "vllm:prompt_tokens_total", ""),
        metric(&busy, "pd_node_prompt_tokens_total")
    );
    assert!(vllm_metric(&busy, "vllm:prompt_tokens_total", "").unwrap() > 0.0);
    assert_eq!(
        vllm_metric(&busy, "vllm:time_to_first_token_seconds_count", ""),
        Some(4.0),
        "{busy}"
    );

    drop(open);
    wait_all_blocks_free(&server).await;
    let (_, after) = server.get("/metrics").await;
    for name in idle_gauges {
        assert_eq!(vllm_metric(&after, name, ""), Some(0.0), "{name}");
    }
    // The clients that left ended their requests as aborts.
    assert_eq!(reason(&after, "abort"), Some(3.0), "{after}");
    assert_eq!(reason(&after, "length"), Some(1.0));
    assert_eq!(
        vllm_metric(&after, "vllm:generation_tokens_total", ""),
        metric(&after, "pd_node_generation_tokens_total")
    );
    server.stop().await;
}

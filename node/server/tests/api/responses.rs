//! The Responses API: streamed events equal the whole response, and logprobs when asked.

use super::*;

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

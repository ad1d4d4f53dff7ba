//! Failed requests: OpenAI's error shape, an oversized body, and unsupported features or bad
//! sampling fields refused by name.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

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

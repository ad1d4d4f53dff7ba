//! The chat API: streamed equals whole, `n` streams interleaved by index, and usage in streams
//! (vLLM's `continuous_usage_stats`, on completions too).

use super::*;

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

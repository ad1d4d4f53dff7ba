//! Sampling fields that act: penalties and `logit_bias` change greedy answers; `min_tokens`
//! holds back every way to stop.

use super::*;

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

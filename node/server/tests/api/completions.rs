//! The completions API: streamed equals whole, token-id prompts with ids and logprobs back, `n`
//! children, and `echo` / `prompt_logprobs` scoring the prompt.

use super::*;

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

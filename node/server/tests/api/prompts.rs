//! What the prompt is: a gateway's `prompt_token_ids` on every API, the tokenizer endpoints
//! giving the ids generation uses, and a list of prompts answered each as alone.

use super::*;

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

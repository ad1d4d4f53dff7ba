//! Structured output on every API, in every way clients ask for it.

use super::*;

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

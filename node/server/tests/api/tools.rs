//! Tool calls: forced calls on chat, calls the model writes itself read by the node's parsers
//! (Hermes, Llama 3 JSON, Mistral), and function tools on the Responses API.

use super::*;

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

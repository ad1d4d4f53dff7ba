//! Prompt building's tests: chat, completions and Responses inputs, tools, bounds.

use serde_json::json;

use super::*;
use crate::test_util::byte_level_tokenizer;

#[test]
fn prompt_shapes() {
    assert_eq!(
        completion_prompt(json!("hi")).unwrap(),
        PromptInput::Text("hi".into())
    );
    assert_eq!(
        completion_prompt(json!([1, 2])).unwrap(),
        PromptInput::Tokens(vec![1, 2])
    );
    assert_eq!(
        completion_prompt(json!(["hi"])).unwrap(),
        PromptInput::Text("hi".into())
    );
    assert_eq!(
        completion_prompt(json!([[3]])).unwrap(),
        PromptInput::Tokens(vec![3])
    );
    for bad in [
        json!(["a", "b"]),
        json!([-1]),
        json!(null),
        json!({}),
        json!([]),
        json!([[1], [2]]),
    ] {
        let e = completion_prompt(bad.clone()).unwrap_err();
        assert_eq!(e.param, "prompt", "{bad}");
        assert!(e.source.is_none());
    }
}

#[test]
fn given_ids_are_checked_against_the_vocabulary() {
    assert_eq!(given_ids(vec![1, 9], 10).unwrap(), vec![1, 9]);
    for bad in [vec![], vec![3, 10]] {
        let e = given_ids(bad, 10).unwrap_err();
        assert_eq!(e.param, GIVEN_IDS_FIELD);
        assert!(e.source.is_none());
    }
}

#[test]
fn chat_content_parts() {
    let msgs: Vec<ChatMessageIn> = serde_json::from_value(json!([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": ""},
    ]))
    .unwrap();
    let out = chat_messages(&msgs).unwrap();
    assert_eq!(out[0].role, "system");
    assert_eq!(out[1].content, "a\nb");
    assert_eq!(out[2].content, "");

    let msgs: Vec<ChatMessageIn> =
        serde_json::from_value(json!([{"role": "user", "content": [{"type": "image_url"}]}]))
            .unwrap();
    assert_eq!(chat_messages(&msgs).unwrap_err().param, "messages");
    let msgs: Vec<ChatMessageIn> =
        serde_json::from_value(json!([{"role": "wizard", "content": "x"}])).unwrap();
    assert_eq!(chat_messages(&msgs).unwrap_err().param, "messages");
    assert_eq!(chat_messages(&[]).unwrap_err().param, "messages");
}

#[test]
fn a_message_without_content_is_refused_unless_an_assistant_s_tool_calls() {
    // OpenAI: `content` is required, except on an assistant message that carries
    // `tool_calls`. A null user message used to render as an empty turn.
    for (i, bad) in [
        json!([{"role": "user", "content": null}]),
        json!([{"role": "user"}]),
        json!([{"role": "system", "content": "s"}, {"role": "tool", "tool_call_id": "c"}]),
        json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]),
        json!([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": []}]),
    ]
    .into_iter()
    .enumerate()
    {
        let msgs: Vec<ChatMessageIn> = serde_json::from_value(bad).unwrap();
        let e = chat_messages(&msgs).unwrap_err();
        assert_eq!(e.param, "messages", "case {i}");
        let last = msgs.len() - 1;
        assert!(
            e.message.contains(&format!("messages[{last}].content")),
            "case {i}: {}",
            e.message
        );
    }
    let ok: Vec<ChatMessageIn> = serde_json::from_value(json!([
        {"role": "user", "content": ""},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": []},
    ]))
    .unwrap();
    let out = chat_messages(&ok).unwrap();
    assert_eq!(out[1].content, "");
    assert_eq!(out[2].content, "");
}

#[test]
fn responses_input() {
    let out = responses_messages(Some("sys"), &json!("hello")).unwrap();
    assert_eq!(
        (out[0].role.as_str(), out[1].role.as_str()),
        ("system", "user")
    );
    let out = responses_messages(
        None,
        &json!([
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        ]),
    )
    .unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(out[1].content, "a");
    let e = responses_messages(None, &json!([{"type": "function_call", "name": "f"}])).unwrap_err();
    assert_eq!(e.param, "input");
    assert_eq!(
        responses_messages(None, &json!(5)).unwrap_err().param,
        "input"
    );
}

#[test]
fn completion_tokens_encode_text_and_check_ids() {
    let (_dir, tok) = byte_level_tokenizer();
    let ids = prompt_tokens(&tok, PromptKind::Completion(PromptInput::Text("hi".into()))).unwrap();
    assert_eq!(ids, tok.encode("hi", true).unwrap());
    let ids = prompt_tokens(
        &tok,
        PromptKind::Completion(PromptInput::Tokens(vec![1, 2])),
    )
    .unwrap();
    assert_eq!(ids, vec![1, 2]);

    let vocab = tok.vocab_size() as u32;
    let e = prompt_tokens(
        &tok,
        PromptKind::Completion(PromptInput::Tokens(vec![1, vocab])),
    )
    .unwrap_err();
    assert_eq!(e.param, "prompt");
    assert!(e.message.contains("out of vocabulary"), "{e}");
    // A node's padded embedding admits ids above the tokenizer's vocabulary.
    let ids = prompt_tokens_in_vocab(
        &tok,
        PromptKind::Completion(PromptInput::Tokens(vec![vocab])),
        vocab as usize + 8,
    )
    .unwrap();
    assert_eq!(ids, vec![vocab]);

    let e = prompt_tokens(
        &tok,
        PromptKind::Completion(PromptInput::Text(String::new())),
    )
    .unwrap_err();
    assert_eq!(
        (e.param, e.message.as_str()),
        ("prompt", "prompt must not be empty")
    );
}

#[test]
fn chat_tokens_render_the_template_without_extra_special_tokens() {
    let (_dir, tok) = byte_level_tokenizer();
    let messages = vec![ChatMessage::new("user", "hello")];
    let ids = prompt_tokens(&tok, PromptKind::Chat(messages.clone(), "messages")).unwrap();
    let text = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(ids, tok.encode(&text, false).unwrap());
}

#[test]
fn chat_without_a_template_names_the_param() {
    let dir = crate::test_util::TempDir::new("no-template");
    crate::write_byte_level_tokenizer(dir.path(), 300).unwrap();
    let config = dir.path().join("tokenizer_config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&config, json.to_string()).unwrap();
    let _ = std::fs::remove_file(dir.path().join("chat_template.jinja"));
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(!tok.has_chat_template());
    let e = prompt_tokens(
        &tok,
        PromptKind::Chat(vec![ChatMessage::new("user", "x")], "input"),
    )
    .unwrap_err();
    assert_eq!(e.param, "input");
    assert!(e.message.contains("no chat template"), "{e}");
    assert!(e.source.is_none());
}

/// A tool-aware template (Qwen2.5's shape, cut down) sees the request's `tools` and each
/// assistant call with its arguments as an object, and the tool's answer with its call id;
/// without tools it renders as before.
#[test]
fn tools_and_tool_calls_reach_the_template() {
    let dir = crate::test_util::TempDir::new("tool-template");
    crate::write_byte_level_tokenizer(dir.path(), 300).unwrap();
    let template = "{% if tools %}TOOLS{% for t in tools %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]{% endfor %}\n{% endif %}\
{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}{% endif %}{% if m.tool_call_id is defined %}#{{ m.tool_call_id }}{% endif %}\n{% endfor %}";
    let config = dir.path().join("tokenizer_config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["chat_template"] = json!(template);
    std::fs::write(&config, json.to_string()).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let msgs: Vec<ChatMessageIn> = serde_json::from_value(json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}
    ]))
    .unwrap();
    let messages = chat_messages(&msgs).unwrap();
    let tools = json!([{"type": "function", "function": {"name": "weather",
        "parameters": {"type": "object"}}}]);
    assert_eq!(chat_tools(Some(&json!([]))), None);
    let tools = chat_tools(Some(&tools)).unwrap();
    let ids = prompt_tokens(
        &tok,
        PromptKind::ChatWithTools(messages.clone(), tools, "messages"),
    )
    .unwrap();
    let text = tok.decode(&ids, false).unwrap();
    assert_eq!(
        text,
        // (HF's settings: a newline after a block tag is dropped; `tojson` spaces as
        // Python's json.dumps.)
        "TOOLS[weather:{\"type\": \"object\"}]<user>weather?<assistant>CALL weather Oslo<tool>rain#c1"
    );
    let ids = prompt_tokens(&tok, PromptKind::Chat(messages, "messages")).unwrap();
    assert!(!tok.decode(&ids, false).unwrap().contains("TOOLS"));
    // Malformed calls are the client's fault, named.
    let bad: Vec<ChatMessageIn> = serde_json::from_value(
        json!([{"role": "assistant", "content": null, "tool_calls": {"a": 1}}]),
    )
    .unwrap();
    assert_eq!(chat_messages(&bad).unwrap_err().param, "messages");
}

/// The Responses API's items and tools render as the same conversation in chat form: a
/// `function_call` joins the assistant turn before it, its output is a `tool` message.
#[test]
fn responses_function_items_are_the_chat_conversation() {
    let items = json!([
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "weather",
            "arguments": "{\"city\": \"Oslo\"}", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "function_call", "call_id": "c3", "name": "time", "arguments": "{}"}
    ]);
    let messages = responses_messages(None, &items).unwrap();
    let chat: Vec<ChatMessageIn> = serde_json::from_value(json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}
    ]))
    .unwrap();
    assert_eq!(messages, chat_messages(&chat).unwrap());
    let tools = json!([{"type": "function", "name": "weather", "description": "now",
        "parameters": {"type": "object"}, "strict": true}, {"type": "web_search"}]);
    assert_eq!(
        responses_tools(Some(&tools)),
        Some(json!([{"type": "function", "function": {"name": "weather",
            "description": "now", "parameters": {"type": "object"}}}, {"type": "web_search"}]))
    );
    assert_eq!(responses_tools(Some(&json!([]))), None);
    assert_eq!(responses_tools(None), None);
    for bad in [
        json!([{"type": "function_call", "name": "x", "arguments": "{}"}]),
        json!([{"type": "function_call_output", "output": "x"}]),
        json!([{"type": "reasoning", "summary": []}]),
    ] {
        assert_eq!(responses_messages(None, &bad).unwrap_err().param, "input");
    }
}

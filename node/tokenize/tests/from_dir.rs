//! Loading model directories shaped like real Hugging Face checkpoints.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use pd_tokenize::{
    BYTE_LEVEL_ENDOFTEXT_ID, BYTE_LEVEL_IM_END_ID, BYTE_LEVEL_IM_START_ID, ChatMessage,
    TokenizeError, Tokenizer, write_byte_level_tokenizer,
};
use serde_json::json;

/// A unique directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("pd-tokenize-it-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn write(&self, file: &str, contents: &str) {
        std::fs::write(self.0.join(file), contents).expect("write file");
    }

    fn write_json(&self, file: &str, value: &serde_json::Value) {
        self.write(file, &value.to_string());
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A directory with the byte-level `tokenizer.json`, the given `tokenizer_config.json` and no
/// `generation_config.json`.
fn model_dir(name: &str, config: serde_json::Value) -> TempDir {
    let dir = TempDir::new(name);
    write_byte_level_tokenizer(dir.path(), 300).expect("write tokenizer");
    std::fs::remove_file(dir.path().join("generation_config.json")).expect("remove");
    dir.write_json("tokenizer_config.json", &config);
    dir
}

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect()
}

#[test]
fn missing_files_are_named() {
    let dir = TempDir::new("missing");
    let err = Tokenizer::from_dir(dir.path()).expect_err("no files");
    assert!(
        matches!(&err, TokenizeError::ReadFile { path, .. } if path.ends_with("tokenizer.json"))
    );
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    write_byte_level_tokenizer(dir.path(), 300).expect("write");
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).expect("remove");
    let err = Tokenizer::from_dir(dir.path()).expect_err("no config");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn invalid_files_are_named() {
    let dir = model_dir("invalid", json!({}));
    dir.write("config.json", "{not json");
    let err = Tokenizer::from_dir(dir.path()).expect_err("bad json");
    assert!(matches!(&err, TokenizeError::ParseJson { path, .. } if path.ends_with("config.json")));

    dir.write_json("config.json", &json!({"eos_token_id": "two"}));
    let err = Tokenizer::from_dir(dir.path()).expect_err("bad eos");
    assert!(
        matches!(
            &err,
            TokenizeError::InvalidField {
                field: "eos_token_id",
                ..
            }
        ),
        "{err}"
    );

    dir.write("tokenizer.json", "{}");
    let err = Tokenizer::from_dir(dir.path()).expect_err("bad tokenizer");
    assert!(
        matches!(&err, TokenizeError::LoadTokenizer { path, .. } if path.ends_with("tokenizer.json"))
    );
}

#[test]
fn eos_ids_are_the_union_of_all_sources() {
    let dir = model_dir(
        "eos",
        json!({"bos_token": {"content": "<|endoftext|>", "lstrip": false}, "eos_token": {"content": "<|im_end|>", "special": true}}),
    );
    dir.write_json(
        "generation_config.json",
        &json!({"eos_token_id": [258, 257]}),
    );
    dir.write_json(
        "config.json",
        &json!({"eos_token_id": 256, "bos_token_id": 256}),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    assert_eq!(
        tok.eos_token_ids(),
        &[
            BYTE_LEVEL_IM_END_ID,
            BYTE_LEVEL_IM_START_ID,
            BYTE_LEVEL_ENDOFTEXT_ID
        ]
    );
    assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert!(!tok.has_chat_template());
    let err = tok
        .apply_chat_template(&msgs(&[("user", "x")]), true)
        .expect_err("no template");
    assert!(matches!(err, TokenizeError::NoChatTemplate { .. }));

    // Multimodal configs nest the text model's ids; null means none.
    dir.write_json(
        "config.json",
        &json!({"eos_token_id": null, "text_config": {"eos_token_id": [256]}}),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    assert_eq!(tok.eos_token_ids(), &[258, 257, 256]);
}

#[test]
fn object_special_tokens_reach_the_template() {
    let dir = model_dir(
        "objects",
        json!({
            "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": false, "normalized": true, "rstrip": false, "single_word": false},
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
            "unk_token": null,
            "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
        }),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let text = tok
        .apply_chat_template(&msgs(&[("user", "a"), ("assistant", "b")]), false)
        .expect("render");
    assert_eq!(text, "<|endoftext|>a<|im_end|>b<|im_end|>");
    // The rendered BOS is a special token already: encode without adding specials.
    let ids = tok.encode(&text, false).expect("encode");
    assert_eq!(ids, vec![256, u32::from(b'a'), 258, u32::from(b'b'), 258]);
}

#[test]
fn list_form_chat_template_uses_default() {
    let dir = model_dir(
        "list",
        json!({
            "eos_token": "<|im_end|>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"},
                {"name": "rag", "template": "RAG"}
            ]
        }),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    assert!(tok.has_chat_template());
    let text = tok
        .apply_chat_template(&msgs(&[("user", "hi")]), true)
        .expect("render");
    assert_eq!(text, "[user]hi[assistant]");

    let dir = model_dir(
        "list-no-default",
        json!({"chat_template": [{"name": "tool_use", "template": "TOOLS"}]}),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    assert!(!tok.has_chat_template());
}

#[test]
fn chat_template_jinja_file_overrides_config() {
    let dir = model_dir("jinja-file", json!({"chat_template": "FROM CONFIG"}));
    dir.write("chat_template.jinja", "FROM FILE {{ messages | length }}\n");
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let text = tok
        .apply_chat_template(&msgs(&[("user", "hi")]), true)
        .expect("render");
    assert_eq!(text, "FROM FILE 1");
}

#[test]
fn bad_template_fails_at_load() {
    let dir = model_dir(
        "bad-template",
        json!({"chat_template": "{% for m in messages %}"}),
    );
    let err = Tokenizer::from_dir(dir.path()).expect_err("syntax error");
    assert!(
        matches!(&err, TokenizeError::TemplateSyntax { path, .. } if path.ends_with("tokenizer_config.json"))
    );
}

/// Mistral-7B-Instruct-v0.1's template, which rejects non-alternating roles.
const MISTRAL_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

#[test]
fn raise_exception_gives_a_clear_error() {
    let dir = model_dir(
        "mistral",
        json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL_TEMPLATE}),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let ok = tok
        .apply_chat_template(
            &msgs(&[("user", "a"), ("assistant", "b"), ("user", "c")]),
            true,
        )
        .expect("render");
    assert_eq!(ok, "<s>[INST] a [/INST]b</s>[INST] c [/INST]");

    let err = tok
        .apply_chat_template(&msgs(&[("user", "a"), ("user", "b")]), true)
        .expect_err("roles do not alternate");
    match &err {
        TokenizeError::TemplateException { message } => assert_eq!(
            message,
            "Conversation roles must alternate user/assistant/user/assistant/..."
        ),
        other => panic!("expected TemplateException, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "chat template error: Conversation roles must alternate user/assistant/user/assistant/..."
    );

    let dir = model_dir(
        "raise-x",
        json!({"chat_template": "{{ raise_exception('x') }}"}),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let err = tok.apply_chat_template(&[], false).expect_err("raises");
    assert!(matches!(&err, TokenizeError::TemplateException { message } if message == "x"));
}

/// The system-message part of Llama 3.2's template: whitespace control, `trim`, slicing,
/// `is defined` / `is not none`, and `strftime_now`.
const LLAMA32_TEMPLATE: &str = r#"{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

#[test]
fn llama32_style_template() {
    let dir = model_dir(
        "llama32",
        json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA32_TEMPLATE}),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let text = tok
        .apply_chat_template(&msgs(&[("system", "  Be brief. "), ("user", "Hi\n")]), true)
        .expect("render");
    let head = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: ";
    let tail = "\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    let date = text
        .strip_prefix(head)
        .and_then(|t| t.strip_suffix(tail))
        .unwrap_or_else(|| panic!("unexpected rendering {text:?}"));
    // "%d %b %Y", e.g. "05 Mar 2026".
    let parts: Vec<&str> = date.split(' ').collect();
    assert!(
        matches!(parts.as_slice(), [d, m, y] if d.len() == 2 && m.len() == 3 && y.len() == 4),
        "{date:?}"
    );
}

/// Qwen2.5's template without the tool branches: `{%- if tools %}`, default system prompt,
/// trailing newline of the template source dropped as jinja2 does.
const QWEN25_TEMPLATE: &str = "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

#[test]
fn qwen25_style_template() {
    let dir = model_dir(
        "qwen25",
        json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null, "chat_template": QWEN25_TEMPLATE}),
    );
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    assert_eq!(tok.bos_token(), None);
    let text = tok
        .apply_chat_template(
            &msgs(&[("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]),
            true,
        )
        .expect("render");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn chat_message_serde_shape() {
    let m: ChatMessage = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).expect("parse");
    assert_eq!(m, ChatMessage::new("user", "hi"));
    assert_eq!(
        serde_json::to_string(&m).expect("ser"),
        r#"{"role":"user","content":"hi"}"#
    );
}

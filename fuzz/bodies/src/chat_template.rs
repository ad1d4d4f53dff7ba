//! A chat template from outside (a model's files, or a node's registration on the gateway)
//! compiled and rendered as the nodes and the gateway do (`pd_tokenize::Tokenizer::from_files`
//! with `chat_template.jinja`, then `apply_chat_template`), under minijinja's fuel.
//!
//! Input: the template's source, a `0xFF` byte, then the bytes the messages are read from.
//!
//! Property: the template compiles and renders, or fails with an error; never a panic, and
//! never a hang (libFuzzer's `-timeout` catches a render that runs past its fuel).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use pd_tokenize::{ChatMessage, Tokenizer};

use crate::input::Input;

/// A byte-level tokenizer's files, without a template.
fn base_files() -> &'static BTreeMap<String, String> {
    static FILES: OnceLock<BTreeMap<String, String>> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pd-fuzz-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        pd_tokenize::write_byte_level_tokenizer(&dir, 300).expect("tiny tokenizer");
        let t = Tokenizer::from_dir(&dir).expect("tiny tokenizer");
        let _ = std::fs::remove_dir_all(&dir);
        let mut files = t.files().clone();
        files.remove("chat_template.jinja");
        if let Some(config) = files.get_mut("tokenizer_config.json")
            && let Ok(mut v) = serde_json::from_str::<serde_json::Value>(config)
            && let Some(o) = v.as_object_mut()
        {
            o.remove("chat_template");
            *config = v.to_string();
        }
        files
    })
}

/// The target.
pub fn run(data: &[u8]) {
    crate::caught_panics_are_not_crashes();
    let mut input = Input::new(data);
    let template = String::from_utf8_lossy(input.until(&[0xFF])).into_owned();
    let mut files = base_files().clone();
    files.insert("chat_template.jinja".into(), template);
    let Ok(t) = Tokenizer::from_files(&files) else {
        return;
    };
    let messages: Vec<ChatMessage> = (0..input.below(6))
        .map(|_| {
            let role = input.pick(&["system", "user", "assistant", "tool", ""]);
            ChatMessage::new(role, input.string(64))
        })
        .collect();
    let generation = input.bool();
    let _ = t.apply_chat_template(&messages, generation);
    if input.bool() {
        let tools = serde_json::json!([{"type": "function", "function": {"name": input.string(8), "parameters": {}}}]);
        let _ = t.apply_chat_template_with_tools(&messages, Some(&tools), generation);
    }
}

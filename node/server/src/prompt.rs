//! From request inputs to prompt token ids: prompt shapes, chat messages, the chat template and
//! the tokenizer. Tokenizing runs on the blocking pool, never on the reactor.

use pd_engine::EngineHandle;
use pd_tokenize::{ChatMessage, Tokenizer};
use serde_json::Value;

use crate::error::ApiError;
use crate::openai::chat::ChatMessageIn;

/// A completions prompt: text to tokenize, or tokens as given.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// Reads `/v1/completions`' `prompt`: a string, an array of token ids, or a one-element list of
/// either. Longer lists (batches) are refused: send one request per prompt.
pub(crate) fn completion_prompt(value: Value) -> Result<PromptInput, ApiError> {
    const SHAPE: &str = "prompt must be a string or an array of token ids";
    match value {
        Value::String(s) => Ok(PromptInput::Text(s)),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::invalid("prompt", "prompt must not be empty"))
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            token_ids(&items).map(PromptInput::Tokens)
        }
        Value::Array(mut items) if items.len() == 1 => match items.pop() {
            Some(Value::String(s)) => Ok(PromptInput::Text(s)),
            Some(Value::Array(ids)) if ids.iter().all(Value::is_number) => {
                token_ids(&ids).map(PromptInput::Tokens)
            }
            _ => Err(ApiError::invalid("prompt", SHAPE)),
        },
        Value::Array(items) if items.iter().all(|v| v.is_string() || v.is_array()) => {
            Err(ApiError::invalid(
                "prompt",
                format!(
                    "batched prompts ({} prompts in one request) are not supported; send one request per prompt",
                    items.len()
                ),
            ))
        }
        _ => Err(ApiError::invalid("prompt", SHAPE)),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        format!("token ids must be integers in 0..2^32, got {v}"),
                    )
                })
        })
        .collect()
}

/// Roles a chat template understands; `developer` (OpenAI's newer name) is sent as `system`.
fn template_role(role: &str) -> Option<&'static str> {
    match role {
        "system" | "developer" => Some("system"),
        "user" => Some("user"),
        "assistant" => Some("assistant"),
        "tool" => Some("tool"),
        _ => None,
    }
}

/// The text of a message's `content`: a string, null, or a list of `{type, text}` parts whose
/// type is one of `text_types`. Parts are joined with newlines, as vLLM does.
fn content_text(
    content: Option<&Value>,
    text_types: &[&str],
    param: &'static str,
    at: &str,
) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                if !text_types.contains(&kind) {
                    return Err(ApiError::invalid(
                        param,
                        format!(
                            "{at}.content[{i}]: only text content parts ({}) are supported, got `{kind}`",
                            text_types.join(", ")
                        ),
                    ));
                }
                match part.get("text").and_then(Value::as_str) {
                    Some(t) => texts.push(t),
                    None => {
                        return Err(ApiError::invalid(
                            param,
                            format!("{at}.content[{i}]: missing string field `text`"),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(ApiError::invalid(
            param,
            format!("{at}.content must be a string or a list of content parts"),
        )),
    }
}

/// Checks `/v1/chat/completions`' `messages` and turns them into template messages.
pub(crate) fn chat_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("messages[{i}]");
            let role = template_role(&m.role).ok_or_else(|| {
                ApiError::invalid("messages", format!("{at}.role: unknown role `{}`", m.role))
            })?;
            let content = content_text(m.content.as_ref(), &["text"], "messages", &at)?;
            Ok(ChatMessage {
                role: role.to_owned(),
                content,
            })
        })
        .collect()
}

/// Turns `/v1/responses`' `instructions` and `input` into template messages.
pub(crate) fn responses_messages(
    instructions: Option<&str>,
    input: &Value,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages = Vec::new();
    if let Some(instructions) = instructions {
        messages.push(ChatMessage {
            role: "system".to_owned(),
            content: instructions.to_owned(),
        });
    }
    match input {
        Value::String(s) => messages.push(ChatMessage {
            role: "user".to_owned(),
            content: s.clone(),
        }),
        Value::Array(items) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                if kind != "message" {
                    return Err(ApiError::invalid(
                        "input",
                        format!("{at}: only message items are supported, got `{kind}`"),
                    ));
                }
                let role = item.get("role").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid("input", format!("{at}: missing string field `role`"))
                })?;
                let role = template_role(role).ok_or_else(|| {
                    ApiError::invalid("input", format!("{at}.role: unknown role `{role}`"))
                })?;
                let content = content_text(
                    item.get("content"),
                    &["input_text", "output_text", "text"],
                    "input",
                    &at,
                )?;
                messages.push(ChatMessage {
                    role: role.to_owned(),
                    content,
                });
            }
        }
        Value::Array(_) => return Err(ApiError::invalid("input", "input must not be empty")),
        _ => {
            return Err(ApiError::invalid(
                "input",
                "input must be a string or a list of messages",
            ));
        }
    }
    Ok(messages)
}

/// Tokenizes a completions prompt (with the tokenizer's special tokens, e.g. BOS) or checks
/// given token ids against the vocabulary.
pub(crate) async fn completion_tokens(
    engine: &EngineHandle,
    prompt: PromptInput,
) -> Result<Vec<u32>, ApiError> {
    let tokens = match prompt {
        PromptInput::Tokens(ids) => {
            let vocab = engine.info().vocab_size;
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is out of vocabulary (size {vocab})"),
                ));
            }
            ids
        }
        PromptInput::Text(text) => {
            let tokenizer = engine.tokenizer().clone();
            tokio::task::spawn_blocking(move || tokenizer.encode(&text, true)).await??
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt must not be empty"));
    }
    Ok(tokens)
}

/// Renders `messages` through the model's chat template (with the generation prompt) and
/// tokenizes the result without adding special tokens: the template carries its own.
pub(crate) async fn chat_tokens(
    engine: &EngineHandle,
    messages: Vec<ChatMessage>,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let tokenizer = engine.tokenizer().clone();
    if !tokenizer.has_chat_template() {
        return Err(ApiError::invalid(
            param,
            "this model has no chat template; use /v1/completions",
        ));
    }
    tokio::task::spawn_blocking(move || {
        let text = tokenizer
            .apply_chat_template(&messages, true)
            .map_err(|e| ApiError::invalid(param, format!("chat template failed: {e}")))?;
        Ok(tokenizer.encode(&text, false)?)
    })
    .await?
}

/// The text of one token, for logprobs.
pub(crate) fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer
        .decode(&[id], false)
        .ok()
        .or_else(|| tokenizer.id_to_token(id))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

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
            assert_eq!(e.param(), Some("prompt"), "{bad}");
        }
    }

    #[test]
    fn chat_content_parts() {
        let msgs: Vec<ChatMessageIn> = serde_json::from_value(json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null},
        ]))
        .unwrap();
        let out = chat_messages(&msgs).unwrap();
        assert_eq!(out[0].role, "system");
        assert_eq!(out[1].content, "a\nb");
        assert_eq!(out[2].content, "");

        let msgs: Vec<ChatMessageIn> =
            serde_json::from_value(json!([{"role": "user", "content": [{"type": "image_url"}]}]))
                .unwrap();
        assert_eq!(chat_messages(&msgs).unwrap_err().param(), Some("messages"));
        let msgs: Vec<ChatMessageIn> =
            serde_json::from_value(json!([{"role": "wizard", "content": "x"}])).unwrap();
        assert_eq!(chat_messages(&msgs).unwrap_err().param(), Some("messages"));
        assert_eq!(chat_messages(&[]).unwrap_err().param(), Some("messages"));
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
        let e =
            responses_messages(None, &json!([{"type": "function_call", "name": "f"}])).unwrap_err();
        assert_eq!(e.param(), Some("input"));
        assert_eq!(
            responses_messages(None, &json!(5)).unwrap_err().param(),
            Some("input")
        );
    }
}

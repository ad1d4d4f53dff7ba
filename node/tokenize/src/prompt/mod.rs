//! From OpenAI request fields to prompt token ids: the prompt shapes of `/v1/completions`, the
//! `messages` of `/v1/chat/completions`, the `instructions`/`input` of `/v1/responses`, and
//! [`prompt_tokens`], which renders and tokenizes them. Nodes and the gateway both call this
//! module, so a request's prompt is the same ids wherever it is computed.
//!
//! Everything here is synchronous and may take milliseconds on long prompts (template
//! rendering, BPE): async callers run [`prompt_tokens`] on a blocking pool.

use serde_json::Value;

use crate::error::TokenizeError;
use crate::tokenizer::{ChatMessage, Tokenizer};

/// A request field that does not make a prompt, naming the field (OpenAI's `error.param`).
///
/// `source` is set only when the tokenizer itself failed on input it should have taken (a
/// server-side fault, answered 500 by a node); otherwise the request is at fault (400).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PromptError {
    /// The request field at fault: `prompt`, `messages` or `input`.
    pub param: &'static str,
    /// What is wrong, for the client.
    pub message: String,
    /// The tokenizer's failure, when that is what happened.
    #[source]
    pub source: Option<TokenizeError>,
}

impl PromptError {
    /// The request is at fault.
    pub(crate) fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param,
            message: message.into(),
            source: None,
        }
    }

    /// The tokenizer failed.
    pub(crate) fn tokenizer(param: &'static str, source: TokenizeError) -> Self {
        Self {
            param,
            message: format!("tokenizer error: {source}"),
            source: Some(source),
        }
    }
}

/// One `/v1/chat/completions` input message. `content` is a string, a list of parts, or null
/// (only on an assistant message with tool calls: [`chat_messages`] refuses it elsewhere).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message's content as sent.
    #[serde(default)]
    pub content: Option<Value>,
    /// An assistant message's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A tool message's call id.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// A completions prompt: text to tokenize, or tokens as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text, tokenized with the tokenizer's special tokens (e.g. BOS).
    Text(String),
    /// Token ids, used as given once checked against the vocabulary.
    Tokens(Vec<u32>),
}

/// Prompts of up to this many bytes of text are tokenized where they arrive (tens of µs);
/// longer ones belong on a blocking pool, off an async reactor.
pub const INLINE_TOKENIZE_BYTES: usize = 4096;

/// Whether preparing `p` is cheap enough to run on an async task: token ids (only checked
/// against the vocabulary) and text up to [`INLINE_TOKENIZE_BYTES`].
pub fn tokenize_inline_ok(p: &PromptKind) -> bool {
    match p {
        PromptKind::Completion(PromptInput::Tokens(_)) => true,
        PromptKind::Completion(PromptInput::Text(t)) => t.len() <= INLINE_TOKENIZE_BYTES,
        PromptKind::Chat(m, _) => {
            m.iter().map(|m| m.content.len()).sum::<usize>() <= INLINE_TOKENIZE_BYTES
        }
        // Tools and tool calls go through `tojson` too: never inline.
        PromptKind::ChatWithTools(..) => false,
    }
}

/// What [`prompt_tokens`] tokenizes.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptKind {
    /// A `/v1/completions` prompt.
    Completion(PromptInput),
    /// Messages for the chat template, and the request field they came from (`messages` or
    /// `input`), named in errors.
    Chat(Vec<ChatMessage>, &'static str),
    /// As [`PromptKind::Chat`], with the request's `tools` for the template ([`chat_tools`]).
    ChatWithTools(Vec<ChatMessage>, Value, &'static str),
}

/// The `tools` a chat request gives its template: the list as sent, when it holds any (a
/// request's `tools` field, read the same way by the node and the gateway so both render the
/// same prompt).
pub fn chat_tools(tools: Option<&Value>) -> Option<Value> {
    tools
        .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()))
        .cloned()
}

/// `/v1/responses`' `tools` in the chat form templates and [`chat_tools`] take: each function
/// tool `{"type": "function", "name", "description", "parameters", "strict"}` becomes
/// `{"type": "function", "function": {"name", "description", "parameters"}}`; any other tool
/// is kept as sent (a node refuses it by name). Read the same way by the node and the gateway.
pub fn responses_tools(tools: Option<&Value>) -> Option<Value> {
    let list = tools?.as_array()?;
    let converted: Vec<Value> = list
        .iter()
        .map(|tool| {
            let is_function = tool.get("type").and_then(Value::as_str) == Some("function");
            match tool.as_object() {
                Some(t) if is_function && !t.contains_key("function") => {
                    let mut function = serde_json::Map::new();
                    for key in ["name", "description", "parameters"] {
                        if let Some(v) = t.get(key) {
                            function.insert(key.to_owned(), v.clone());
                        }
                    }
                    serde_json::json!({"type": "function", "function": function})
                }
                _ => tool.clone(),
            }
        })
        .collect();
    chat_tools(Some(&Value::Array(converted)))
}

/// Most prompts one `/v1/completions` request may list.
pub const MAX_PROMPTS: usize = 256;

/// Reads `/v1/completions`' `prompt`: a string, an array of token ids, or a list of either
/// (a batch: one answer per prompt, [`MAX_PROMPTS`] at most).
///
/// # Errors
/// A [`PromptError`] naming `prompt`.
pub fn completion_prompts(value: Value) -> Result<Vec<PromptInput>, PromptError> {
    const SHAPE: &str = "prompt must be a string, an array of token ids, or a list of strings or of token-id arrays";
    match value {
        Value::String(s) => Ok(vec![PromptInput::Text(s)]),
        Value::Array(items) if items.is_empty() => {
            Err(PromptError::invalid("prompt", "prompt must not be empty"))
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok(vec![PromptInput::Tokens(token_ids(&items)?)])
        }
        Value::Array(items) if items.len() > MAX_PROMPTS => Err(PromptError::invalid(
            "prompt",
            format!(
                "at most {MAX_PROMPTS} prompts in one request, got {}",
                items.len()
            ),
        )),
        Value::Array(items) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => Ok(PromptInput::Text(s)),
                Value::Array(ids) if !ids.is_empty() && ids.iter().all(Value::is_number) => {
                    token_ids(&ids).map(PromptInput::Tokens)
                }
                _ => Err(PromptError::invalid("prompt", SHAPE)),
            })
            .collect(),
        _ => Err(PromptError::invalid("prompt", SHAPE)),
    }
}

/// [`completion_prompts`] for one prompt: a batch (a list of several) is refused.
///
/// # Errors
/// A [`PromptError`] naming `prompt`.
pub fn completion_prompt(value: Value) -> Result<PromptInput, PromptError> {
    let mut prompts = completion_prompts(value)?;
    if prompts.len() != 1 {
        return Err(PromptError::invalid(
            "prompt",
            format!(
                "a list of {} prompts is not one prompt; send them to /v1/completions",
                prompts.len()
            ),
        ));
    }
    Ok(prompts.remove(0))
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, PromptError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    PromptError::invalid(
                        "prompt",
                        format!("token ids must be integers in 0..2^32, got {v}"),
                    )
                })
        })
        .collect()
}

/// A tool call as transformers hands it to chat templates: `function.arguments` parsed into
/// an object where the client sent it as a JSON string (OpenAI's form), as vLLM does; any
/// other call as sent.
fn template_call(call: &Value) -> Value {
    let mut call = call.clone();
    if let Some(args) = call.pointer_mut("/function/arguments")
        && let Some(parsed) = args
            .as_str()
            .and_then(|s| serde_json::from_str::<Value>(s).ok())
    {
        *args = parsed;
    }
    call
}

/// A `function_call` input item (a call the model made in an earlier turn) as a template
/// tool call: added to the assistant message just before it (the turn's text, or its earlier
/// calls), else to a new assistant message with no text, as chat clients send it.
fn push_call(messages: &mut Vec<ChatMessage>, item: &Value, at: &str) -> Result<(), PromptError> {
    let call_id = string_field(item, "call_id", at)?;
    let name = string_field(item, "name", at)?;
    let arguments = string_field(item, "arguments", at)?;
    let call = template_call(&serde_json::json!({"id": call_id, "type": "function",
        "function": {"name": name, "arguments": arguments}}));
    let joins = messages
        .last()
        .is_some_and(|m| m.role == "assistant" && m.tool_call_id.is_none());
    if !joins {
        messages.push(ChatMessage {
            role: "assistant".to_owned(),
            content: String::new(),
            tool_calls: None,
            tool_call_id: None,
        });
    }
    if let Some(last) = messages.last_mut() {
        match &mut last.tool_calls {
            Some(Value::Array(calls)) => calls.push(call),
            _ => last.tool_calls = Some(Value::Array(vec![call])),
        }
    }
    Ok(())
}

/// `item[key]` as a string, or a 400 naming `input`.
fn string_field<'a>(item: &'a Value, key: &str, at: &str) -> Result<&'a str, PromptError> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| PromptError::invalid("input", format!("{at}: missing string field `{key}`")))
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
) -> Result<String, PromptError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                if !text_types.contains(&kind) {
                    return Err(PromptError::invalid(
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
                        return Err(PromptError::invalid(
                            param,
                            format!("{at}.content[{i}]: missing string field `text`"),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(PromptError::invalid(
            param,
            format!("{at}.content must be a string or a list of content parts"),
        )),
    }
}

/// Checks `/v1/chat/completions`' `messages` and turns them into template messages.
///
/// # Errors
/// A [`PromptError`] naming `messages`.
pub fn chat_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, PromptError> {
    if messages.is_empty() {
        return Err(PromptError::invalid(
            "messages",
            "messages must not be empty",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("messages[{i}]");
            let role = template_role(&m.role).ok_or_else(|| {
                PromptError::invalid("messages", format!("{at}.role: unknown role `{}`", m.role))
            })?;
            let calls_something = matches!(&m.tool_calls, Some(Value::Array(c)) if !c.is_empty());
            if matches!(m.content, None | Some(Value::Null))
                && !(role == "assistant" && calls_something)
            {
                return Err(PromptError::invalid(
                    "messages",
                    format!(
                        "{at}.content is required: a string or a list of content parts (only an \
                         assistant message with tool_calls may leave it out)"
                    ),
                ));
            }
            let content = content_text(m.content.as_ref(), &["text"], "messages", &at)?;
            let tool_calls = match &m.tool_calls {
                None | Some(Value::Null) => None,
                Some(Value::Array(calls)) => {
                    Some(Value::Array(calls.iter().map(template_call).collect()))
                }
                Some(_) => {
                    return Err(PromptError::invalid(
                        "messages",
                        format!("{at}.tool_calls must be a list"),
                    ));
                }
            };
            Ok(ChatMessage {
                role: role.to_owned(),
                content,
                tool_calls,
                tool_call_id: m.tool_call_id.clone(),
            })
        })
        .collect()
}

/// Turns `/v1/responses`' `instructions` and `input` into template messages.
///
/// # Errors
/// A [`PromptError`] naming `input`.
pub fn responses_messages(
    instructions: Option<&str>,
    input: &Value,
) -> Result<Vec<ChatMessage>, PromptError> {
    let mut messages = Vec::new();
    if let Some(instructions) = instructions {
        messages.push(ChatMessage {
            role: "system".to_owned(),
            content: instructions.to_owned(),
            tool_calls: None,
            tool_call_id: None,
        });
    }
    match input {
        Value::String(s) => messages.push(ChatMessage {
            role: "user".to_owned(),
            content: s.clone(),
            tool_calls: None,
            tool_call_id: None,
        }),
        Value::Array(items) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match kind {
                    "message" => {}
                    "function_call" => {
                        push_call(&mut messages, item, &at)?;
                        continue;
                    }
                    "function_call_output" => {
                        let call_id = string_field(item, "call_id", &at)?;
                        let output = content_text(
                            item.get("output"),
                            &["input_text", "output_text", "text"],
                            "input",
                            &at,
                        )?;
                        messages.push(ChatMessage {
                            role: "tool".to_owned(),
                            content: output,
                            tool_calls: None,
                            tool_call_id: Some(call_id.to_owned()),
                        });
                        continue;
                    }
                    _ => {
                        return Err(PromptError::invalid(
                            "input",
                            format!(
                                "{at}: only message, function_call and function_call_output items are supported, got `{kind}`"
                            ),
                        ));
                    }
                }
                let role = item.get("role").and_then(Value::as_str).ok_or_else(|| {
                    PromptError::invalid("input", format!("{at}: missing string field `role`"))
                })?;
                let role = template_role(role).ok_or_else(|| {
                    PromptError::invalid("input", format!("{at}.role: unknown role `{role}`"))
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
                    tool_calls: None,
                    tool_call_id: None,
                });
            }
        }
        Value::Array(_) => return Err(PromptError::invalid("input", "input must not be empty")),
        _ => {
            return Err(PromptError::invalid(
                "input",
                "input must be a string or a list of messages",
            ));
        }
    }
    Ok(messages)
}

/// The prompt's token ids, as a node computes them:
/// - [`PromptKind::Completion`]: text is encoded *with* the tokenizer's special tokens (e.g.
///   BOS); token ids are checked against [`Tokenizer::vocab_size`]; an empty result is refused.
/// - [`PromptKind::Chat`]: the messages are rendered through the chat template with the
///   generation prompt, then encoded *without* special tokens (the template carries its own).
///
/// Same as [`prompt_tokens_in_vocab`] with the tokenizer's vocabulary size.
///
/// # Errors
/// A [`PromptError`] naming the field: empty prompt, token id out of vocabulary, no chat
/// template, the template refused the conversation; or the tokenizer failed (`source` set).
pub fn prompt_tokens(tokenizer: &Tokenizer, prompt: PromptKind) -> Result<Vec<u32>, PromptError> {
    prompt_tokens_in_vocab(tokenizer, prompt, tokenizer.vocab_size())
}

/// [`prompt_tokens`] with given token ids checked against `vocab_size` instead of the
/// tokenizer's (a node checks against its model's embedding size, which may be padded above
/// the tokenizer's vocabulary).
///
/// # Errors
/// As [`prompt_tokens`].
pub fn prompt_tokens_in_vocab(
    tokenizer: &Tokenizer,
    prompt: PromptKind,
    vocab_size: usize,
) -> Result<Vec<u32>, PromptError> {
    match prompt {
        PromptKind::Completion(input) => {
            let tokens = match input {
                PromptInput::Tokens(ids) => return checked_ids(ids, vocab_size, "prompt"),
                PromptInput::Text(text) => tokenizer
                    .encode(&text, true)
                    .map_err(|e| PromptError::tokenizer("prompt", e))?,
            };
            if tokens.is_empty() {
                return Err(PromptError::invalid("prompt", "prompt must not be empty"));
            }
            Ok(tokens)
        }
        PromptKind::Chat(messages, param) => chat_prompt(tokenizer, &messages, None, param),
        PromptKind::ChatWithTools(messages, tools, param) => {
            chat_prompt(tokenizer, &messages, Some(&tools), param)
        }
    }
}

/// `messages` (and `tools`) through the chat template with the generation prompt, encoded
/// without special tokens.
fn chat_prompt(
    tokenizer: &Tokenizer,
    messages: &[ChatMessage],
    tools: Option<&Value>,
    param: &'static str,
) -> Result<Vec<u32>, PromptError> {
    if !tokenizer.has_chat_template() {
        return Err(PromptError::invalid(
            param,
            "this model has no chat template; use /v1/completions",
        ));
    }
    let text = tokenizer
        .apply_chat_template_with_tools(messages, tools, true)
        .map_err(|e| PromptError::invalid(param, format!("chat template failed: {e}")))?;
    tokenizer
        .encode(&text, false)
        .map_err(|e| PromptError::tokenizer(param, e))
}

/// The request field in which a gateway sends the prompt's token ids, as it computed them with
/// the node's own tokenizer and template (from the node's registration, through
/// [`prompt_tokens`]): a node that finds it takes those ids as the prompt and renders and
/// tokenizes nothing, on any of the three APIs. The other prompt fields (`prompt`, `messages`,
/// `input`) still come along and are still checked for shape. The name is the one a node
/// answers with under vLLM's `return_token_ids`, so a client can send back what it was told.
///
/// Nothing here needs trusting the sender: ids that do not match the text are that request's
/// own prompt, as a token-id `prompt` on `/v1/completions` would be (checked against the
/// vocabulary, cached under their own block hashes).
pub const GIVEN_IDS_FIELD: &str = "prompt_token_ids";

/// Checks token ids given as the prompt ([`GIVEN_IDS_FIELD`]): at least one, each below
/// `vocab_size`.
///
/// # Errors
/// A [`PromptError`] naming [`GIVEN_IDS_FIELD`].
pub fn given_ids(ids: Vec<u32>, vocab_size: usize) -> Result<Vec<u32>, PromptError> {
    checked_ids(ids, vocab_size, GIVEN_IDS_FIELD)
}

fn checked_ids(
    ids: Vec<u32>,
    vocab_size: usize,
    param: &'static str,
) -> Result<Vec<u32>, PromptError> {
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(PromptError::invalid(
            param,
            format!("token id {bad} is out of vocabulary (size {vocab_size})"),
        ));
    }
    if ids.is_empty() {
        return Err(PromptError::invalid(
            param,
            format!("{param} must not be empty"),
        ));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests;

//! From request inputs to prompt token ids. The prompt shapes, chat messages and the
//! render-then-tokenize rule are `pd_tokenize::prompt`'s (shared with the gateway); this module
//! runs them — short ones in place, long ones on the blocking pool, never on the reactor — and
//! maps their errors to [`ApiError`].

use pd_engine::EngineHandle;
use pd_tokenize::prompt::{PromptError, PromptKind, given_ids, prompt_tokens_in_vocab};
use pd_tokenize::{ChatMessage, Tokenizer};

pub(crate) use pd_tokenize::prompt::PromptInput;

use crate::error::ApiError;
use crate::routes::AppState;

impl From<PromptError> for ApiError {
    /// The request's fault is a 400 naming the field; a tokenizer failure stays a 500.
    fn from(e: PromptError) -> Self {
        match e.source {
            Some(source) => ApiError::Tokenize(source),
            None => ApiError::invalid(e.param, e.message),
        }
    }
}

/// Reads `/v1/completions`' `prompt`: one prompt or a batch (see
/// [`pd_tokenize::prompt::completion_prompts`]).
pub(crate) fn completion_prompts(value: serde_json::Value) -> Result<Vec<PromptInput>, ApiError> {
    Ok(pd_tokenize::prompt::completion_prompts(value)?)
}

/// Checks `/v1/chat/completions`' `messages` (see [`pd_tokenize::prompt::chat_messages`]).
pub(crate) fn chat_messages(
    messages: &[pd_tokenize::prompt::ChatMessageIn],
) -> Result<Vec<ChatMessage>, ApiError> {
    Ok(pd_tokenize::prompt::chat_messages(messages)?)
}

/// Turns `/v1/responses`' `instructions` and `input` into template messages (see
/// [`pd_tokenize::prompt::responses_messages`]).
pub(crate) fn responses_messages(
    instructions: Option<&str>,
    input: &serde_json::Value,
) -> Result<Vec<ChatMessage>, ApiError> {
    Ok(pd_tokenize::prompt::responses_messages(
        instructions,
        input,
    )?)
}

/// [`pd_tokenize::prompt::prompt_tokens`], with given token ids checked against the model's
/// vocabulary (its embedding size): in place for token ids and short texts
/// ([`pd_tokenize::prompt::tokenize_inline_ok`]: a hop to the blocking pool costs more than
/// they do), on the blocking pool otherwise.
async fn tokens(engine: &EngineHandle, prompt: PromptKind) -> Result<Vec<u32>, ApiError> {
    let tokenizer = engine.tokenizer().clone();
    let vocab = engine.info().vocab_size;
    if pd_tokenize::prompt::tokenize_inline_ok(&prompt) {
        return Ok(prompt_tokens_in_vocab(&tokenizer, prompt, vocab)?);
    }
    Ok(
        tokio::task::spawn_blocking(move || prompt_tokens_in_vocab(&tokenizer, prompt, vocab))
            .await??,
    )
}

/// The prompt's token ids: those a gateway gave in `prompt_token_ids`
/// ([`pd_tokenize::prompt::GIVEN_IDS_FIELD`]), checked against the model's vocabulary, or else
/// `prompt` computed here. Counted by which (`pd_node_prompts_total`).
async fn resolved(
    state: &AppState,
    given: Option<Vec<u32>>,
    prompt: PromptKind,
) -> Result<Vec<u32>, ApiError> {
    let prompts = &state.disagg.node_metrics.prompts;
    match given {
        Some(ids) => {
            let ids = given_ids(ids, state.engine.info().vocab_size)?;
            prompts.with_label_values(&["given"]).inc();
            Ok(ids)
        }
        None => {
            let ids = tokens(&state.engine, prompt).await?;
            prompts.with_label_values(&["computed"]).inc();
            Ok(ids)
        }
    }
}

/// A completions prompt's ids: `given`, else `prompt` tokenized (with the tokenizer's special
/// tokens, e.g. BOS) or its token ids checked against the vocabulary.
pub(crate) async fn completion_tokens(
    state: &AppState,
    given: Option<Vec<u32>>,
    prompt: PromptInput,
) -> Result<Vec<u32>, ApiError> {
    resolved(state, given, PromptKind::Completion(prompt)).await
}

/// A chat prompt's ids: `given`, else `messages` (and the request's `tools`, from
/// `pd_tokenize::prompt::chat_tools`) rendered through the model's chat template (with the
/// generation prompt) and tokenized without special tokens (the template carries its own).
pub(crate) async fn chat_tokens(
    state: &AppState,
    given: Option<Vec<u32>>,
    messages: Vec<ChatMessage>,
    tools: Option<serde_json::Value>,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let prompt = match tools {
        Some(tools) => PromptKind::ChatWithTools(messages, tools, param),
        None => PromptKind::Chat(messages, param),
    };
    resolved(state, given, prompt).await
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
    use axum::http::StatusCode;
    use serde_json::json;

    use super::*;

    #[test]
    fn prompt_errors_map_to_400_naming_the_field() {
        let e = completion_prompts(json!([-1])).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.param(), Some("prompt"));
        assert_eq!(chat_messages(&[]).unwrap_err().param(), Some("messages"));
        assert_eq!(
            responses_messages(None, &json!(5)).unwrap_err().param(),
            Some("input")
        );
    }
}

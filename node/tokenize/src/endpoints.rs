//! vLLM's tokenizer endpoints — `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` —
//! as request and response bodies and what they compute. Nodes serve them from their model's
//! tokenizer and the gateway from the one a node registered, through this one implementation,
//! so both answer alike, and alike with what generation does: a `/tokenize`d prompt is the
//! prompt a completion or chat request computes ([`crate::prompt`]'s rules). Clients that
//! tokenize remotely (lm-evaluation-harness's `tokenizer_backend=remote`, which probes
//! `/tokenizer_info` and `/tokenize`) need no copy of the model's files.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::prompt::{self, ChatMessageIn, PromptError};
use crate::tokenizer::Tokenizer;

/// The paths these endpoints are served at (no `/v1` prefix, as in vLLM).
pub const TOKENIZE_PATH: &str = "/tokenize";
/// See [`TOKENIZE_PATH`].
pub const DETOKENIZE_PATH: &str = "/detokenize";
/// See [`TOKENIZE_PATH`].
pub const TOKENIZER_INFO_PATH: &str = "/tokenizer_info";

/// Whether `path` is one of these endpoints (servers guard them like `/v1/`).
pub fn is_tokenizer_path(path: &str) -> bool {
    [TOKENIZE_PATH, DETOKENIZE_PATH, TOKENIZER_INFO_PATH].contains(&path)
}

/// `POST /tokenize`: a completion `prompt` or chat `messages` (with optional `tools`), exactly
/// one of them.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TokenizeRequest {
    /// The served model; checked by the server.
    #[serde(default)]
    pub model: Option<String>,
    /// Text, tokenized as a completion prompt is.
    #[serde(default)]
    pub prompt: Option<String>,
    /// Chat messages, rendered through the chat template as a chat request's are.
    #[serde(default)]
    pub messages: Option<Vec<ChatMessageIn>>,
    /// OpenAI function tools for the template (chat only).
    #[serde(default)]
    pub tools: Option<Value>,
    /// Add the tokenizer's special tokens (BOS). Default: true for `prompt` (as completions
    /// do), false for `messages` (the template writes its own).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// End a chat with the assistant's turn opening (default true, as chat requests do).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's vocabulary string.
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

/// `/tokenize`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenizeResponse {
    /// `tokens.len()`.
    pub count: usize,
    /// The model's context length.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Each token's vocabulary string, when asked for.
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// The served model; checked by the server.
    #[serde(default)]
    pub model: Option<String>,
    /// Token ids to decode.
    pub tokens: Vec<u32>,
}

/// `/detokenize`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DetokenizeResponse {
    /// The text, special tokens included.
    pub prompt: String,
}

/// Tokenizes `req` with `tokenizer` as generation would.
///
/// # Errors
/// A [`PromptError`] naming the field: neither or both of `prompt` and `messages`, an empty
/// prompt, no chat template, the template refused the conversation, a tokenizer failure.
pub fn tokenize(
    tokenizer: &Tokenizer,
    req: &TokenizeRequest,
    max_model_len: usize,
) -> Result<TokenizeResponse, PromptError> {
    let tokens = match (&req.prompt, &req.messages) {
        (Some(text), None) => {
            if text.is_empty() {
                return Err(PromptError::invalid("prompt", "prompt must not be empty"));
            }
            tokenizer
                .encode(text, req.add_special_tokens.unwrap_or(true))
                .map_err(|e| PromptError::tokenizer("prompt", e))?
        }
        (None, Some(messages)) => {
            let messages = prompt::chat_messages(messages)?;
            let tools = prompt::chat_tools(req.tools.as_ref().filter(|t| !t.is_null()));
            if !tokenizer.has_chat_template() {
                return Err(PromptError::invalid(
                    "messages",
                    "this model has no chat template; tokenize a prompt instead",
                ));
            }
            let text = tokenizer
                .apply_chat_template_with_tools(
                    &messages,
                    tools.as_ref(),
                    req.add_generation_prompt.unwrap_or(true),
                )
                .map_err(|e| {
                    PromptError::invalid("messages", format!("chat template failed: {e}"))
                })?;
            tokenizer
                .encode(&text, req.add_special_tokens.unwrap_or(false))
                .map_err(|e| PromptError::tokenizer("messages", e))?
        }
        _ => {
            return Err(PromptError::invalid(
                "prompt",
                "give either prompt (text) or messages (a chat), not both",
            ));
        }
    };
    let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&t| tokenizer.id_to_token(t).unwrap_or_default())
            .collect()
    });
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len,
        tokens,
        token_strs,
    })
}

/// Decodes `req.tokens`, special tokens included, as `transformers`' `decode` does by default.
///
/// # Errors
/// A [`PromptError`] naming `tokens`: an id outside the vocabulary, a decoder failure.
pub fn detokenize(
    tokenizer: &Tokenizer,
    req: &DetokenizeRequest,
) -> Result<DetokenizeResponse, PromptError> {
    if let Some(bad) = req
        .tokens
        .iter()
        .find(|&&t| t as usize >= tokenizer.vocab_size())
    {
        return Err(PromptError::invalid(
            "tokens",
            format!(
                "token id {bad} is outside the vocabulary ({})",
                tokenizer.vocab_size()
            ),
        ));
    }
    let prompt = tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| PromptError::tokenizer("tokens", e))?;
    Ok(DetokenizeResponse { prompt })
}

/// `/tokenizer_info`: the tokenizer's class, special tokens, chat template and context length,
/// in `tokenizer_config.json`'s names (what a remote tokenizer client reads).
pub fn tokenizer_info(tokenizer: &Tokenizer, max_model_len: usize) -> Value {
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token(),
        "eos_token": tokenizer.eos_token(),
        "pad_token": tokenizer.pad_token(),
        "unk_token": tokenizer.unk_token(),
        "chat_template": tokenizer.chat_template(),
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{PromptInput, PromptKind};

    #[test]
    fn tokenize_gives_the_ids_generation_computes() {
        // Each test writes its own directory: two tests writing one file raced (CI, stop 38).
        let (_dir, tok) = crate::test_util::byte_level_tokenizer();
        let req = |body: Value| -> TokenizeRequest { serde_json::from_value(body).unwrap() };
        let text = tokenize(&tok, &req(serde_json::json!({"prompt": "Hello"})), 64).unwrap();
        let want = prompt::prompt_tokens(
            &tok,
            PromptKind::Completion(PromptInput::Text("Hello".into())),
        )
        .unwrap();
        assert_eq!(text.tokens, want);
        assert_eq!((text.count, text.max_model_len), (want.len(), 64));
        assert_eq!(text.token_strs, None);

        let messages = serde_json::json!([{"role": "user", "content": "Hi"}]);
        let chat = tokenize(
            &tok,
            &req(serde_json::json!({"messages": messages, "return_token_strs": true})),
            64,
        )
        .unwrap();
        let parsed: Vec<ChatMessageIn> = serde_json::from_value(messages.clone()).unwrap();
        let want = prompt::prompt_tokens(
            &tok,
            PromptKind::Chat(prompt::chat_messages(&parsed).unwrap(), "messages"),
        )
        .unwrap();
        assert_eq!(chat.tokens, want);
        let strs = chat.token_strs.unwrap();
        assert_eq!(strs.len(), want.len());
        assert_eq!(strs[0], tok.id_to_token(want[0]).unwrap());
        // Without the generation prompt the render stops after the user's turn.
        let bare = tokenize(
            &tok,
            &req(serde_json::json!({"messages": messages, "add_generation_prompt": false})),
            64,
        )
        .unwrap();
        assert!(bare.count < chat.count && chat.tokens.starts_with(&bare.tokens));

        for bad in [
            serde_json::json!({}),
            serde_json::json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
            serde_json::json!({"prompt": ""}),
        ] {
            assert!(tokenize(&tok, &req(bad.clone()), 64).is_err(), "{bad}");
        }
    }

    #[test]
    fn detokenize_round_trips_and_checks_the_vocabulary() {
        // Each test writes its own directory: two tests writing one file raced (CI, stop 38).
        let (_dir, tok) = crate::test_util::byte_level_tokenizer();
        let ids = tok.encode("Hello, world", false).unwrap();
        let back = detokenize(
            &tok,
            &DetokenizeRequest {
                model: None,
                tokens: ids,
            },
        )
        .unwrap();
        assert_eq!(back.prompt, "Hello, world");
        let e = detokenize(
            &tok,
            &DetokenizeRequest {
                model: None,
                tokens: vec![1, 100_000],
            },
        )
        .unwrap_err();
        assert_eq!(e.param, "tokens");
        let info = tokenizer_info(&tok, 64);
        assert_eq!(info["eos_token"], tok.eos_token().unwrap());
        assert!(info["chat_template"].is_string());
    }
}

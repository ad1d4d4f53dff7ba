//! `/v1/completions` request and response bodies.

use serde::{Deserialize, Serialize};

use super::{SamplingFields, Usage};

/// `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    #[serde(default)]
    pub(crate) model: Option<String>,
    /// A string, an array of token ids, or a one-element list of either (see `prompt`).
    pub(crate) prompt: serde_json::Value,
    /// Absent means 16 (OpenAI's default); `null` means up to the context length.
    #[serde(default = "default_max_tokens")]
    pub(crate) max_tokens: Option<i64>,
    /// Top alternatives per token, 0 for the sampled token's logprob only.
    #[serde(default)]
    pub(crate) logprobs: Option<i64>,
    /// Prepend the prompt to each choice's text (and, with `logprobs`, its tokens' logprobs,
    /// the first one `null`). With `max_tokens: 0`, the prompt alone.
    #[serde(default)]
    pub(crate) echo: Option<bool>,
    /// The prompt as token ids, computed by a gateway with this node's tokenizer
    /// (`pd_tokenize::prompt::GIVEN_IDS_FIELD`): when present, nothing is rendered or tokenized.
    #[serde(default)]
    pub(crate) prompt_token_ids: Option<Vec<u32>>,
    /// P/D disaggregation (vLLM's field): checked in `kv_params`.
    #[serde(default)]
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
    #[serde(flatten)]
    pub(crate) sampling: SamplingFields,
    /// `tools` and `tool_choice` (`tools`).
    #[serde(flatten)]
    pub(crate) tools: super::tools::ToolFields,
    /// Structured output (`structured`).
    #[serde(flatten)]
    pub(crate) structured: super::structured::StructuredFields,
    /// Refused unless set to what this node does anyway (`unsupported`).
    #[serde(flatten)]
    pub(crate) unsupported: super::unsupported::UnsupportedFields,
}

fn default_max_tokens() -> Option<i64> {
    Some(16)
}

impl CompletionRequest {
    /// The answer's length limit (16 when absent, see `max_tokens`) and its field
    /// ([`pd_wire::Api::pick_max_tokens`]).
    pub(crate) fn max_tokens(&self) -> (Option<i64>, &'static str) {
        pd_wire::Api::Completions.pick_max_tokens(|field| match field {
            "max_tokens" => self.max_tokens,
            _ => None,
        })
    }
}

/// A completion, or one chunk of a streamed one (same object in both cases).
#[derive(Debug, Serialize)]
pub(crate) struct CompletionResponse {
    pub(crate) id: String,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) usage: Option<Usage>,
    /// A prefill node's handoff to the decode node (streaming: on the chunk that finishes the
    /// last choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
}

/// One choice (one child of an `n > 1` request).
#[derive(Debug, Serialize)]
pub(crate) struct CompletionChoice {
    pub(crate) index: usize,
    pub(crate) text: String,
    pub(crate) logprobs: Option<CompletionLogprobs>,
    pub(crate) finish_reason: Option<&'static str>,
    /// vLLM `return_token_ids`: the prompt's tokens (first chunk of each choice when streaming).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) prompt_token_ids: Option<Vec<u32>>,
    /// vLLM `return_token_ids`: the generated tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) token_ids: Option<Vec<u32>>,
    /// vLLM `prompt_logprobs` (not streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) prompt_logprobs: Option<super::PromptLogprobs>,
}

/// The legacy completions logprobs object. The `null`s are an echoed prompt's first token.
#[derive(Debug, Default, Serialize)]
pub(crate) struct CompletionLogprobs {
    pub(crate) tokens: Vec<String>,
    pub(crate) token_logprobs: Vec<Option<f32>>,
    pub(crate) top_logprobs: Vec<Option<TokenMap>>,
    pub(crate) text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// `other`'s tokens after `self`'s.
    pub(crate) fn append(&mut self, other: CompletionLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
    }
}

/// `{token: logprob, ...}` in the given order (a JSON object, as the legacy API returns it).
#[derive(Debug, Default)]
pub(crate) struct TokenMap(pub(crate) Vec<(String, f32)>);

impl Serialize for TokenMap {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

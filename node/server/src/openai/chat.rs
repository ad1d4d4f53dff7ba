//! `/v1/chat/completions` request and response bodies.

use serde::{Deserialize, Serialize};

use super::{SamplingFields, Usage};

/// `POST /v1/chat/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatCompletionRequest {
    #[serde(default)]
    pub(crate) model: Option<String>,
    pub(crate) messages: Vec<ChatMessageIn>,
    /// Deprecated by OpenAI in favour of `max_completion_tokens`, still sent by most clients.
    #[serde(default)]
    pub(crate) max_tokens: Option<i64>,
    /// Wins over `max_tokens` when both are set. Neither: up to the context length.
    #[serde(default)]
    pub(crate) max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) logprobs: Option<bool>,
    /// Alternatives per token (needs `logprobs: true`).
    #[serde(default)]
    pub(crate) top_logprobs: Option<i64>,
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

impl ChatCompletionRequest {
    /// The answer's length limit as sent and the field it came from: which one wins is
    /// `pd_wire`'s rule ([`pd_wire::Api::pick_max_tokens`]), shared with the gateway.
    pub(crate) fn max_tokens(&self) -> (Option<i64>, &'static str) {
        pd_wire::Api::ChatCompletions.pick_max_tokens(|field| match field {
            "max_completion_tokens" => self.max_completion_tokens,
            "max_tokens" => self.max_tokens,
            _ => None,
        })
    }
}

/// One input message: `pd_tokenize`'s, so the gateway reads `messages` as the node does.
pub(crate) use pd_tokenize::prompt::ChatMessageIn;

/// A chat completion.
#[derive(Debug, Serialize)]
pub(crate) struct ChatCompletionResponse {
    pub(crate) id: String,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) choices: Vec<ChatChoice>,
    pub(crate) usage: Usage,
    /// vLLM `return_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) prompt_token_ids: Option<Vec<u32>>,
    /// vLLM `prompt_logprobs` (not streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) prompt_logprobs: Option<super::PromptLogprobs>,
    /// A prefill node's handoff to the decode node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
}

/// One choice of a chat completion.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChoice {
    pub(crate) index: usize,
    pub(crate) message: ChatMessageOut,
    pub(crate) logprobs: Option<ChatLogprobs>,
    pub(crate) finish_reason: Option<&'static str>,
    /// vLLM `return_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) token_ids: Option<Vec<u32>>,
}

/// The generated message: its text, its tool calls, or both (`content: null` where a call
/// came with no text).
#[derive(Debug, Serialize)]
pub(crate) struct ChatMessageOut {
    pub(crate) role: &'static str,
    pub(crate) content: Option<String>,
    pub(crate) tool_calls: Vec<serde_json::Value>,
}

/// `choices[].logprobs`.
#[derive(Debug, Default, Serialize)]
pub(crate) struct ChatLogprobs {
    pub(crate) content: Vec<ChatTokenLogprob>,
}

/// Logprob of one generated token.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ChatTokenLogprob {
    pub(crate) token: String,
    pub(crate) logprob: f32,
    pub(crate) bytes: Vec<u8>,
    pub(crate) top_logprobs: Vec<TopLogprob>,
}

/// One alternative at a position.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TopLogprob {
    pub(crate) token: String,
    pub(crate) logprob: f32,
    pub(crate) bytes: Vec<u8>,
}

/// One streamed chunk.
#[derive(Debug, Serialize)]
pub(crate) struct ChatCompletionChunk {
    pub(crate) id: String,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) usage: Option<Usage>,
    /// vLLM `return_token_ids`: on the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) prompt_token_ids: Option<Vec<u32>>,
    /// A prefill node's handoff: on the chunk that finishes the last choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
}

/// One choice's part of a chunk.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChunkChoice {
    pub(crate) index: usize,
    pub(crate) delta: ChatDelta,
    pub(crate) logprobs: Option<ChatLogprobs>,
    pub(crate) finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) token_ids: Option<Vec<u32>>,
}

/// What a chunk adds to a choice's message.
#[derive(Debug, Default, Serialize)]
pub(crate) struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) content: Option<String>,
    /// A forced tool call: the first delta names it (`id`, `function.name`), later ones add to
    /// its `function.arguments`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tool_calls: Option<Vec<serde_json::Value>>,
}

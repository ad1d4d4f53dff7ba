//! `/v1/responses` request, response and stream-event bodies.

use serde::{Deserialize, Serialize};

use super::chat::ChatTokenLogprob;

/// `POST /v1/responses` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    #[serde(default)]
    pub(crate) model: Option<String>,
    /// A string, or a list of `{role, content}` message items.
    pub(crate) input: serde_json::Value,
    /// Becomes a leading system message.
    #[serde(default)]
    pub(crate) instructions: Option<String>,
    #[serde(default)]
    pub(crate) max_output_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) temperature: Option<f32>,
    #[serde(default)]
    pub(crate) top_p: Option<f32>,
    #[serde(default)]
    pub(crate) stream: Option<bool>,
    /// Server-side conversation state; not kept by this node.
    #[serde(default)]
    pub(crate) previous_response_id: Option<String>,
    /// The prompt as token ids, computed by a gateway with this node's tokenizer
    /// (`pd_tokenize::prompt::GIVEN_IDS_FIELD`): when present, nothing is rendered or tokenized.
    #[serde(default)]
    pub(crate) prompt_token_ids: Option<Vec<u32>>,
    /// P/D disaggregation (vLLM's field): checked in `kv_params`.
    #[serde(default)]
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
    /// vLLM extension: see `SamplingFields::cache_salt`.
    #[serde(default)]
    pub(crate) cache_salt: Option<String>,
    /// `tools` and `tool_choice` (`tools`).
    #[serde(flatten)]
    pub(crate) tools: super::tools::ToolFields,
    /// Structured output (`structured`).
    #[serde(flatten)]
    pub(crate) structured: super::structured::StructuredFields,
    /// Alternatives per token in `output_text.logprobs` (0–20); asking for it asks for
    /// logprobs.
    #[serde(default)]
    pub(crate) top_logprobs: Option<i64>,
    /// Extra output: `message.output_text.logprobs` adds each token's logprob. Other values
    /// name output this node never makes (reasoning, tool results): nothing to add.
    #[serde(default)]
    pub(crate) include: Option<Vec<String>>,
    /// Refused unless set to what this node does anyway (`unsupported`).
    #[serde(flatten)]
    pub(crate) unsupported: super::unsupported::UnsupportedFields,
}

impl ResponsesRequest {
    /// The answer's length limit as sent and its field ([`pd_wire::Api::pick_max_tokens`]).
    pub(crate) fn max_tokens(&self) -> (Option<i64>, &'static str) {
        pd_wire::Api::Responses.pick_max_tokens(|field| match field {
            "max_output_tokens" => self.max_output_tokens,
            _ => None,
        })
    }
}

/// The `response` object (also the payload of `response.created` / `.completed` events).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResponseObject {
    pub(crate) id: String,
    pub(crate) object: &'static str,
    pub(crate) created_at: u64,
    pub(crate) model: String,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub(crate) status: &'static str,
    pub(crate) incomplete_details: Option<IncompleteDetails>,
    pub(crate) error: Option<ResponseError>,
    pub(crate) instructions: Option<String>,
    pub(crate) max_output_tokens: Option<usize>,
    pub(crate) temperature: f32,
    pub(crate) top_p: f32,
    pub(crate) output: Vec<OutputItem>,
    pub(crate) parallel_tool_calls: bool,
    /// As sent (`"auto"` when absent).
    pub(crate) tool_choice: serde_json::Value,
    /// As sent.
    pub(crate) tools: Vec<serde_json::Value>,
    pub(crate) usage: Option<ResponseUsage>,
    /// A prefill node's handoff to the decode node (in the final response object).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
}

/// Why a response is `incomplete`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct IncompleteDetails {
    pub(crate) reason: &'static str,
}

/// Why a response `failed`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResponseError {
    pub(crate) code: &'static str,
    pub(crate) message: String,
}

/// One item of a response's `output`.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub(crate) enum OutputItem {
    Message(OutputMessage),
    FunctionCall(FunctionCall),
}

/// An output item of type `function_call`: one call of a declared function tool.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FunctionCall {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    /// The item's id (`fc_...`).
    pub(crate) id: String,
    /// The id the next turn's `function_call_output` answers (`call_...`).
    pub(crate) call_id: String,
    pub(crate) name: String,
    /// The arguments, a JSON object's text.
    pub(crate) arguments: String,
    pub(crate) status: &'static str,
}

/// An output item of type `message`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutputMessage {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) id: String,
    pub(crate) role: &'static str,
    pub(crate) status: &'static str,
    pub(crate) content: Vec<OutputText>,
}

/// A content part of type `output_text`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutputText {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) text: String,
    pub(crate) annotations: Vec<serde_json::Value>,
    /// Each token's logprob, where `include` asked for them.
    pub(crate) logprobs: Vec<ChatTokenLogprob>,
}

impl OutputText {
    pub(crate) fn new(text: String) -> Self {
        Self::with_logprobs(text, Vec::new())
    }

    pub(crate) fn with_logprobs(text: String, logprobs: Vec<ChatTokenLogprob>) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs,
        }
    }
}

/// `usage` of a response.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResponseUsage {
    pub(crate) input_tokens: usize,
    pub(crate) output_tokens: usize,
    pub(crate) total_tokens: usize,
    pub(crate) input_tokens_details: InputTokensDetails,
    pub(crate) output_tokens_details: OutputTokensDetails,
}

impl ResponseUsage {
    pub(crate) fn new(
        input_tokens: usize,
        cached_tokens: usize,
        pulled_tokens: usize,
        output_tokens: usize,
    ) -> Self {
        Self {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens + output_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens,
                kv_pulled_tokens: (pulled_tokens > 0).then_some(pulled_tokens),
            },
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
            },
        }
    }
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct InputTokensDetails {
    pub(crate) cached_tokens: usize,
    /// Extension: of `cached_tokens`, those pulled from a prefill node (absent when none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kv_pulled_tokens: Option<usize>,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutputTokensDetails {
    pub(crate) reasoning_tokens: usize,
}

/// One server-sent event of a streamed response; `type` is also the SSE `event:` name.
#[derive(Debug, Serialize)]
#[serde(tag = "type")]
pub(crate) enum ResponseStreamEvent {
    #[serde(rename = "response.created")]
    Created {
        sequence_number: u64,
        response: ResponseObject,
    },
    #[serde(rename = "response.in_progress")]
    InProgress {
        sequence_number: u64,
        response: ResponseObject,
    },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        sequence_number: u64,
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        logprobs: Vec<ChatTokenLogprob>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        logprobs: Vec<ChatTokenLogprob>,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        delta: String,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        sequence_number: u64,
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.completed")]
    Completed {
        sequence_number: u64,
        response: ResponseObject,
    },
    #[serde(rename = "response.incomplete")]
    Incomplete {
        sequence_number: u64,
        response: ResponseObject,
    },
    #[serde(rename = "response.failed")]
    Failed {
        sequence_number: u64,
        response: ResponseObject,
    },
}

impl ResponseStreamEvent {
    /// The event's `type`, used as the SSE `event:` line.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Created { .. } => "response.created",
            Self::InProgress { .. } => "response.in_progress",
            Self::OutputItemAdded { .. } => "response.output_item.added",
            Self::ContentPartAdded { .. } => "response.content_part.added",
            Self::OutputTextDelta { .. } => "response.output_text.delta",
            Self::OutputTextDone { .. } => "response.output_text.done",
            Self::ContentPartDone { .. } => "response.content_part.done",
            Self::FunctionCallArgumentsDelta { .. } => "response.function_call_arguments.delta",
            Self::FunctionCallArgumentsDone { .. } => "response.function_call_arguments.done",
            Self::OutputItemDone { .. } => "response.output_item.done",
            Self::Completed { .. } => "response.completed",
            Self::Incomplete { .. } => "response.incomplete",
            Self::Failed { .. } => "response.failed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_name_matches_serialized_type() {
        let e = ResponseStreamEvent::OutputTextDelta {
            sequence_number: 3,
            item_id: "msg_1".into(),
            output_index: 0,
            content_index: 0,
            delta: "hi".into(),
            logprobs: Vec::new(),
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], e.name());
        assert_eq!(v["sequence_number"], 3);
        assert_eq!(v["delta"], "hi");
    }
}

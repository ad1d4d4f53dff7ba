//! `POST /v1/responses` (single output message, no tools, no stored state).

use axum::Json;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use pd_engine::{EngineError, FinishReason, GenerateRequest, RequestEvent, SamplingParams};

use super::{AppState, JsonBody, new_id, unix_now};
use crate::error::ApiError;
use crate::generation::{TokenCounts, collect};
use crate::kv_params::KvReply;
use crate::openai::non_negative;
use crate::openai::responses::{
    IncompleteDetails, OutputMessage, OutputText, ResponseError, ResponseObject,
    ResponseStreamEvent, ResponseUsage, ResponsesRequest,
};
use crate::prompt::{chat_tokens, responses_messages};
use crate::sse::{SseFormatter, event_frame, sse_response};

pub(super) async fn create(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let model = state.model_name(req.model.as_deref())?;
    req.unsupported.refuse()?;
    req.tools.refuse()?;
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            "previous_response_id",
            "this server does not store responses; send the whole conversation in `input`",
        ));
    }
    let defaults = SamplingParams::default();
    let params = SamplingParams {
        temperature: req.temperature.unwrap_or(defaults.temperature),
        top_p: req.top_p.unwrap_or(defaults.top_p),
        max_tokens: req
            .max_output_tokens
            .map(|m| non_negative(m, "max_output_tokens"))
            .transpose()?,
        structured: req.structured.to_structured()?,
        ..defaults
    };
    let engine_error = |e: EngineError| {
        ApiError::from(e)
            .rename_param("max_tokens", "max_output_tokens")
            .rename_param("prompt", "input")
    };
    params.validate().map_err(|e| engine_error(e.into()))?;
    let directive = state.kv_directive(req.kv_transfer_params.as_ref(), params.n)?;
    let messages = responses_messages(req.instructions.as_deref(), &req.input)?;
    let prompt_tokens = chat_tokens(&state, req.prompt_token_ids, messages, None, "input").await?;
    directive.check_prompt(&prompt_tokens, state.engine.info().block_size)?;

    let prompt_len = prompt_tokens.len();
    let template = ResponseObject {
        id: new_id("resp_"),
        object: "response",
        created_at: unix_now(),
        model,
        status: "in_progress",
        incomplete_details: None,
        error: None,
        instructions: req.instructions,
        max_output_tokens: params.max_tokens,
        temperature: params.temperature,
        top_p: params.top_p,
        output: Vec::new(),
        parallel_tool_calls: false,
        tool_choice: "auto",
        tools: Vec::new(),
        usage: None,
        kv_transfer_params: None,
    };
    let stream = state
        .submit(GenerateRequest {
            prompt_tokens: prompt_tokens.clone(),
            params,
            kv: directive.transfer(),
            cache_salt: crate::openai::cache_salt(req.cache_salt.as_ref())?,
        })
        .await
        .map_err(engine_error)?;
    let (stream, kv) = state.events(stream, directive, &template.id, &prompt_tokens);
    let message_id = new_id("msg_");
    tracing::debug!(id = %template.id, engine_id = %stream.id(), prompt_len, "response");

    if req.stream.unwrap_or(false) {
        let formatter = ResponseStream {
            response: template,
            message_id,
            counts: TokenCounts::new(prompt_len),
            text: String::new(),
            sequence_number: 0,
            done: false,
            kv,
        };
        return Ok(sse_response(stream, formatter, state.sse_keep_alive));
    }

    let generation = collect(stream, 1, prompt_len, kv).await?;
    let kv_transfer_params = generation.kv_transfer_params;
    let child = generation.children.into_iter().next().unwrap_or_default();
    let mut response = complete(
        template,
        message_id,
        child.text,
        child.finish_reason,
        &generation.usage,
    );
    response.kv_transfer_params = kv_transfer_params;
    Ok(Json(response).into_response())
}

/// `(response status, item status, incomplete reason)` for a finish reason.
fn statuses(reason: Option<FinishReason>) -> (&'static str, &'static str, Option<&'static str>) {
    match reason {
        Some(FinishReason::Stop) => ("completed", "completed", None),
        Some(FinishReason::Length) => ("incomplete", "incomplete", Some("max_output_tokens")),
        Some(FinishReason::Abort) | None => ("cancelled", "incomplete", None),
    }
}

/// The final response object: `template` with its output, status and usage filled in.
fn complete(
    mut response: ResponseObject,
    message_id: String,
    text: String,
    reason: Option<FinishReason>,
    counts: &TokenCounts,
) -> ResponseObject {
    let (status, item_status, incomplete) = statuses(reason);
    response.status = status;
    response.incomplete_details = incomplete.map(|reason| IncompleteDetails { reason });
    response.output = vec![message(message_id, item_status, Some(text))];
    response.usage = Some(ResponseUsage::new(
        counts.prompt_tokens,
        counts.cached_tokens,
        counts.pulled_tokens,
        counts.completion_tokens,
    ));
    response
}

fn message(id: String, status: &'static str, text: Option<String>) -> OutputMessage {
    OutputMessage {
        kind: "message",
        id,
        role: "assistant",
        status,
        content: text.map(OutputText::new).into_iter().collect(),
    }
}

/// Streams the Responses API's typed events, each with `event:` and a `sequence_number`.
#[derive(Debug)]
struct ResponseStream {
    /// The response as announced in `response.created` (status `in_progress`, no output).
    response: ResponseObject,
    message_id: String,
    counts: TokenCounts,
    /// Output text so far.
    text: String,
    sequence_number: u64,
    /// A terminal event (`completed`, `incomplete`, `failed`) was sent.
    done: bool,
    kv: KvReply,
}

impl ResponseStream {
    fn next_seq(&mut self) -> u64 {
        let n = self.sequence_number;
        self.sequence_number += 1;
        n
    }

    fn emit(&mut self, out: &mut Vec<Event>, make: impl FnOnce(u64) -> ResponseStreamEvent) {
        let event = make(self.next_seq());
        event_frame(out, event.name(), &event);
    }

    fn delta(&mut self, out: &mut Vec<Event>, delta: String) {
        if delta.is_empty() {
            return;
        }
        self.text.push_str(&delta);
        let item_id = self.message_id.clone();
        self.emit(out, |sequence_number| {
            ResponseStreamEvent::OutputTextDelta {
                sequence_number,
                item_id,
                output_index: 0,
                content_index: 0,
                delta,
                logprobs: Vec::new(),
            }
        });
    }

    fn fail(&mut self, out: &mut Vec<Event>, error: &ApiError) {
        let mut response = self.response.clone();
        response.status = "failed";
        response.error = Some(ResponseError {
            code: "server_error",
            message: error.to_string(),
        });
        self.emit(out, |sequence_number| ResponseStreamEvent::Failed {
            sequence_number,
            response,
        });
        self.done = true;
    }
}

impl SseFormatter for ResponseStream {
    fn prelude(&mut self, out: &mut Vec<Event>) {
        let response = self.response.clone();
        self.emit(out, |sequence_number| ResponseStreamEvent::Created {
            sequence_number,
            response,
        });
        let response = self.response.clone();
        self.emit(out, |sequence_number| ResponseStreamEvent::InProgress {
            sequence_number,
            response,
        });
        let item = message(self.message_id.clone(), "in_progress", None);
        self.emit(out, |sequence_number| {
            ResponseStreamEvent::OutputItemAdded {
                sequence_number,
                output_index: 0,
                item,
            }
        });
        let item_id = self.message_id.clone();
        self.emit(out, |sequence_number| {
            ResponseStreamEvent::ContentPartAdded {
                sequence_number,
                item_id,
                output_index: 0,
                content_index: 0,
                part: OutputText::new(String::new()),
            }
        });
    }

    fn event(&mut self, event: RequestEvent, out: &mut Vec<Event>) {
        self.counts.observe(&event);
        self.kv.observe(&event);
        match event {
            RequestEvent::Started { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_) => {}
            RequestEvent::Token { text, .. } => self.delta(out, text),
            RequestEvent::Finished { reason, text, .. } => {
                self.delta(out, text);
                let text = self.text.clone();
                let item_id = self.message_id.clone();
                self.emit(out, |sequence_number| ResponseStreamEvent::OutputTextDone {
                    sequence_number,
                    item_id: item_id.clone(),
                    output_index: 0,
                    content_index: 0,
                    text: text.clone(),
                    logprobs: Vec::new(),
                });
                self.emit(out, |sequence_number| {
                    ResponseStreamEvent::ContentPartDone {
                        sequence_number,
                        item_id,
                        output_index: 0,
                        content_index: 0,
                        part: OutputText::new(text),
                    }
                });
                let mut response = complete(
                    self.response.clone(),
                    self.message_id.clone(),
                    self.text.clone(),
                    Some(reason),
                    &self.counts,
                );
                response.kv_transfer_params = self.kv.params();
                let item = response
                    .output
                    .first()
                    .cloned()
                    .unwrap_or_else(|| message(self.message_id.clone(), "completed", None));
                self.emit(out, |sequence_number| ResponseStreamEvent::OutputItemDone {
                    sequence_number,
                    output_index: 0,
                    item,
                });
                self.emit(out, |sequence_number| match reason {
                    FinishReason::Stop => ResponseStreamEvent::Completed {
                        sequence_number,
                        response,
                    },
                    FinishReason::Length | FinishReason::Abort => ResponseStreamEvent::Incomplete {
                        sequence_number,
                        response,
                    },
                });
                self.done = true;
            }
            RequestEvent::Failed { message } => {
                self.fail(out, &ApiError::GenerationFailed(message))
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<Event>) {
        if !self.done {
            self.fail(out, &ApiError::EngineStopped);
        }
    }
}

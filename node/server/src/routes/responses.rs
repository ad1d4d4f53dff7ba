//! `POST /v1/responses` (no stored state): a message, function calls, or both.
//!
//! One [`Output`] builds a response's `output` items from its text, for a whole answer and
//! for a stream alike: a streamed answer is the same text in pieces, so the items a client
//! assembles from the events equal the ones a non-streaming request gets.

use axum::Json;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use pd_engine::{EngineError, FinishReason, GenerateRequest, RequestEvent, SamplingParams};
use pd_wire::Api;

use super::{AppState, GatewayId, JsonBody, logprob_entry, new_id, unix_now};
use crate::error::ApiError;
use crate::generation::{TokenCounts, collect};
use crate::kv_params::KvReply;
use crate::openai::chat::ChatTokenLogprob;
use crate::openai::non_negative;
use crate::openai::responses::{
    FunctionCall, IncompleteDetails, OutputItem, OutputMessage, OutputText, ResponseError,
    ResponseObject, ResponseStreamEvent, ResponseUsage, ResponsesRequest,
};
use crate::openai::tool_parser::{CallReader, Piece};
use crate::openai::tools::ToolCalling;
use crate::prompt::{chat_tokens, responses_messages};
use crate::sse::{SseFormatter, event_frame, sse_response};

const API: Api = Api::Responses;

pub(super) async fn create(
    State(state): State<AppState>,
    GatewayId(gateway): GatewayId,
    JsonBody(req): JsonBody<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let model = state.model_name(req.model.as_deref())?;
    req.unsupported.refuse()?;
    let tools = req.tools.for_responses(state.tool_parser)?;
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            "previous_response_id",
            "this server does not store responses; send the whole conversation in `input`",
        ));
    }
    let (max_tokens, max_tokens_param) = req.max_tokens();
    let defaults = SamplingParams::default();
    let mut params = SamplingParams {
        n: pd_wire::request::DEFAULT_N as usize, // `/v1/responses` has no `n`
        temperature: req.temperature.unwrap_or(defaults.temperature),
        top_p: req.top_p.unwrap_or(defaults.top_p),
        max_tokens: max_tokens
            .map(|m| non_negative(m, max_tokens_param))
            .transpose()?,
        structured: req.structured.to_structured()?,
        ..defaults
    };
    tools.apply(&mut params)?;
    // Logprobs: `include` asks for them, or `top_logprobs` above 0 does (alternatives).
    let asked = req
        .include
        .iter()
        .flatten()
        .any(|i| i == "message.output_text.logprobs");
    let top = req
        .top_logprobs
        .map(|k| non_negative(k, "top_logprobs"))
        .transpose()?;
    params.logprobs = (asked || top.is_some_and(|k| k > 0)).then(|| top.unwrap_or(0));
    if params.logprobs.is_some() && !matches!(tools, ToolCalling::Text) {
        return Err(ApiError::invalid(
            "include",
            "output_text logprobs are given for text answers: send them without tools, or with tool_choice \"none\"",
        ));
    }
    let engine_error = |e: EngineError| {
        ApiError::from(e)
            .rename_param("logprobs", "top_logprobs")
            .rename_param("max_tokens", max_tokens_param)
            .rename_param("prompt", API.prompt_field())
    };
    params.validate().map_err(|e| engine_error(e.into()))?;
    let directive = state.kv_directive(req.kv_transfer_params.as_ref(), params.n)?;
    let messages = responses_messages(req.instructions.as_deref(), &req.input)?;
    let template_tools = req.tools.listed_for_responses();
    let prompt_tokens = chat_tokens(
        &state,
        req.prompt_token_ids,
        messages,
        template_tools,
        API.prompt_field(),
    )
    .await?;
    directive.check_prompt(&prompt_tokens, state.engine.info())?;

    let prompt_len = prompt_tokens.len();
    let (echo_tools, echo_choice) = req.tools.echo();
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
        parallel_tool_calls: req.tools.parallel(),
        tool_choice: echo_choice,
        tools: echo_tools,
        usage: None,
        kv_transfer_params: None,
    };
    let stream = state
        .submit(GenerateRequest {
            prompt_tokens: prompt_tokens.clone(),
            params,
            kv: directive.transfer(),
            cache_salt: crate::openai::cache_salt(req.cache_salt.as_ref())?,
            gateway,
        })
        .await
        .map_err(engine_error)?;
    let (stream, kv) = state.events(stream, directive, &template.id, &prompt_tokens);
    tracing::debug!(id = %template.id, engine_id = %stream.id(), prompt_len, "response");

    if req.stream.unwrap_or(false) {
        let formatter = ResponseStream {
            response: template,
            output: Output::new(tools),
            tokenizer: state.engine.tokenizer().clone(),
            counts: TokenCounts::new(prompt_len),
            done: false,
            kv,
        };
        return Ok(sse_response(stream, formatter, state.sse_keep_alive));
    }

    let generation = collect(stream, 1, prompt_len, kv).await?;
    let kv_transfer_params = generation.kv_transfer_params;
    let child = generation.children.into_iter().next().unwrap_or_default();
    // The events a stream would have sent are built and dropped: the items are what counts.
    let mut output = Output::new(tools);
    output.start();
    let tokenizer = state.engine.tokenizer();
    let logprobs = child
        .logprobs
        .iter()
        .map(|lp| logprob_entry(tokenizer, lp))
        .collect();
    output.text(child.text, logprobs);
    let items = output.end(child.finish_reason);
    let mut response = complete(template, items, child.finish_reason, &generation.usage);
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
    items: Vec<OutputItem>,
    reason: Option<FinishReason>,
    counts: &TokenCounts,
) -> ResponseObject {
    let (status, _, incomplete) = statuses(reason);
    response.status = status;
    response.incomplete_details = incomplete.map(|reason| IncompleteDetails { reason });
    response.output = items;
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

/// The output item being streamed.
#[derive(Debug)]
enum Open {
    Message {
        id: String,
        text: String,
        logprobs: Vec<ChatTokenLogprob>,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// Builds one response's `output` items as its text arrives, and the typed events that
/// announce them (each with its `sequence_number`).
///
/// - Text answers (no tools, `tool_choice: "none"`) are one `message` item, opened at once.
/// - A named function (`tool_choice: {"type": "function", "name"}`) is one `function_call`
///   item, opened at once, its arguments streamed as generated.
/// - `"required"` is a list of calls, whole only at its end: each becomes a `function_call`
///   item then (the text, as a message, where it is not a list).
/// - `"auto"`: the node's tool-call parser reads the text; its content goes to `message` items
///   and each call it reads to a `function_call` item, in the order written.
#[derive(Debug)]
struct Output {
    tools: ToolCalling,
    /// `"auto"`'s reader of the model's own calls.
    reader: Option<CallReader>,
    /// A `"required"` list's text so far.
    list: String,
    items: Vec<OutputItem>,
    open: Option<Open>,
    sequence_number: u64,
    events: Vec<ResponseStreamEvent>,
}

impl Output {
    fn new(tools: ToolCalling) -> Self {
        Self {
            reader: tools.reader(),
            tools,
            list: String::new(),
            items: Vec::new(),
            open: None,
            sequence_number: 0,
            events: Vec::new(),
        }
    }

    fn emit(&mut self, make: impl FnOnce(u64) -> ResponseStreamEvent) {
        let event = make(self.sequence_number);
        self.sequence_number += 1;
        self.events.push(event);
    }

    /// The events built since the last call.
    fn take_events(&mut self) -> Vec<ResponseStreamEvent> {
        std::mem::take(&mut self.events)
    }

    /// Opens what is known before any text: a text answer's message, a named call.
    fn start(&mut self) {
        match &self.tools {
            ToolCalling::Text => self.open_message(),
            ToolCalling::Named(f) => {
                let name = f.name.clone();
                self.open_call(name);
            }
            ToolCalling::Required { .. } | ToolCalling::Auto { .. } => {}
        }
    }

    /// The answer's next piece of text, and the logprobs of the tokens that wrote it (text
    /// answers only).
    fn text(&mut self, text: String, logprobs: Vec<ChatTokenLogprob>) {
        if text.is_empty() && logprobs.is_empty() {
            return;
        }
        match &self.tools {
            ToolCalling::Text => self.content(text, logprobs),
            ToolCalling::Named(_) => self.arguments(text),
            ToolCalling::Required { .. } => self.list.push_str(&text),
            ToolCalling::Auto { .. } => {
                let mut pieces = Vec::new();
                if let Some(reader) = &mut self.reader {
                    reader.push(&text, &mut pieces);
                }
                self.pieces(pieces);
            }
        }
    }

    /// The answer ended (`reason`): closes what is open and returns every item.
    fn end(&mut self, reason: Option<FinishReason>) -> Vec<OutputItem> {
        match &self.tools {
            ToolCalling::Required { .. } => {
                let list = std::mem::take(&mut self.list);
                match self.tools.calls_of(&list) {
                    Some(calls) => {
                        for c in calls {
                            let name = c["function"]["name"].as_str().unwrap_or_default();
                            let arguments = c["function"]["arguments"].as_str().unwrap_or_default();
                            self.whole_call(name.to_owned(), arguments.to_owned());
                        }
                    }
                    None => self.content(list, Vec::new()),
                }
            }
            ToolCalling::Auto { .. } => {
                let mut pieces = Vec::new();
                if let Some(reader) = &mut self.reader {
                    reader.finish(&mut pieces);
                }
                self.pieces(pieces);
            }
            ToolCalling::Text | ToolCalling::Named(_) => {}
        }
        if self.open.is_none() && self.items.is_empty() {
            // Nothing was written: an empty message, as a text answer has.
            self.open_message();
        }
        let (_, status, _) = statuses(reason);
        self.close(status);
        self.items.clone()
    }

    fn pieces(&mut self, pieces: Vec<Piece>) {
        for piece in pieces {
            match piece {
                Piece::Content(text) => self.content(text, Vec::new()),
                Piece::Call { name, arguments } => self.whole_call(name, arguments),
            }
        }
    }

    fn output_index(&self) -> usize {
        self.items.len()
    }

    fn open_message(&mut self) {
        let id = new_id("msg_");
        let output_index = self.output_index();
        let item = OutputItem::Message(message(id.clone(), "in_progress", None));
        self.emit(|sequence_number| ResponseStreamEvent::OutputItemAdded {
            sequence_number,
            output_index,
            item,
        });
        let item_id = id.clone();
        self.emit(|sequence_number| ResponseStreamEvent::ContentPartAdded {
            sequence_number,
            item_id,
            output_index,
            content_index: 0,
            part: OutputText::new(String::new()),
        });
        self.open = Some(Open::Message {
            id,
            text: String::new(),
            logprobs: Vec::new(),
        });
    }

    fn open_call(&mut self, name: String) {
        self.close("completed");
        let id = new_id("fc_");
        let call_id = new_id("call_");
        let output_index = self.output_index();
        let item = OutputItem::FunctionCall(FunctionCall {
            kind: "function_call",
            id: id.clone(),
            call_id: call_id.clone(),
            name: name.clone(),
            arguments: String::new(),
            status: "in_progress",
        });
        self.emit(|sequence_number| ResponseStreamEvent::OutputItemAdded {
            sequence_number,
            output_index,
            item,
        });
        self.open = Some(Open::Call {
            id,
            call_id,
            name,
            arguments: String::new(),
        });
    }

    /// Text for a message (the open one, or a new one), with its tokens' logprobs.
    fn content(&mut self, delta: String, delta_logprobs: Vec<ChatTokenLogprob>) {
        if delta.is_empty() && delta_logprobs.is_empty() {
            return;
        }
        if !matches!(self.open, Some(Open::Message { .. })) {
            self.close("completed");
            self.open_message();
        }
        let output_index = self.output_index();
        let Some(Open::Message { id, text, logprobs }) = &mut self.open else {
            return;
        };
        text.push_str(&delta);
        logprobs.extend(delta_logprobs.iter().cloned());
        let item_id = id.clone();
        self.emit(|sequence_number| ResponseStreamEvent::OutputTextDelta {
            sequence_number,
            item_id,
            output_index,
            content_index: 0,
            delta,
            logprobs: delta_logprobs,
        });
    }

    /// More of the open call's arguments.
    fn arguments(&mut self, delta: String) {
        let output_index = self.output_index();
        let Some(Open::Call { id, arguments, .. }) = &mut self.open else {
            return;
        };
        arguments.push_str(&delta);
        let item_id = id.clone();
        self.emit(
            |sequence_number| ResponseStreamEvent::FunctionCallArgumentsDelta {
                sequence_number,
                item_id,
                output_index,
                delta,
            },
        );
    }

    /// A call read whole: opened, its arguments in one delta, closed.
    fn whole_call(&mut self, name: String, arguments: String) {
        self.open_call(name);
        self.arguments(arguments);
        self.close("completed");
    }

    /// Closes the open item, if any, with `status`.
    fn close(&mut self, status: &'static str) {
        let Some(open) = self.open.take() else {
            return;
        };
        let output_index = self.output_index();
        let item = match open {
            Open::Message { id, text, logprobs } => {
                let item_id = id.clone();
                let (done, done_logprobs) = (text.clone(), logprobs.clone());
                self.emit(|sequence_number| ResponseStreamEvent::OutputTextDone {
                    sequence_number,
                    item_id,
                    output_index,
                    content_index: 0,
                    text: done,
                    logprobs: done_logprobs,
                });
                let item_id = id.clone();
                let part_done = OutputText::with_logprobs(text, logprobs);
                let part = part_done.clone();
                self.emit(|sequence_number| ResponseStreamEvent::ContentPartDone {
                    sequence_number,
                    item_id,
                    output_index,
                    content_index: 0,
                    part,
                });
                let mut item = message(id, status, None);
                item.content.push(part_done);
                OutputItem::Message(item)
            }
            Open::Call {
                id,
                call_id,
                name,
                arguments,
            } => {
                let item_id = id.clone();
                let (done_name, done_arguments) = (name.clone(), arguments.clone());
                self.emit(
                    |sequence_number| ResponseStreamEvent::FunctionCallArgumentsDone {
                        sequence_number,
                        item_id,
                        output_index,
                        name: done_name,
                        arguments: done_arguments,
                    },
                );
                OutputItem::FunctionCall(FunctionCall {
                    kind: "function_call",
                    id,
                    call_id,
                    name,
                    arguments,
                    status,
                })
            }
        };
        let done = item.clone();
        self.emit(|sequence_number| ResponseStreamEvent::OutputItemDone {
            sequence_number,
            output_index,
            item: done,
        });
        self.items.push(item);
    }
}

/// Streams the Responses API's typed events, each with `event:` and a `sequence_number`.
#[derive(Debug)]
struct ResponseStream {
    /// The response as announced in `response.created` (status `in_progress`, no output).
    response: ResponseObject,
    output: Output,
    /// Renders logprobs' tokens.
    tokenizer: std::sync::Arc<pd_tokenize::Tokenizer>,
    counts: TokenCounts,
    /// A terminal event (`completed`, `incomplete`, `failed`) was sent.
    done: bool,
    kv: KvReply,
}

impl ResponseStream {
    /// Sends the events `output` built.
    fn flush(&mut self, out: &mut Vec<Event>) {
        for event in self.output.take_events() {
            event_frame(out, event.name(), &event);
        }
    }

    fn fail(&mut self, out: &mut Vec<Event>, error: &ApiError) {
        let mut response = self.response.clone();
        response.status = "failed";
        response.error = Some(ResponseError {
            code: "server_error",
            message: error.to_string(),
        });
        self.output
            .emit(|sequence_number| ResponseStreamEvent::Failed {
                sequence_number,
                response,
            });
        self.flush(out);
        self.done = true;
    }
}

impl SseFormatter for ResponseStream {
    fn prelude(&mut self, out: &mut Vec<Event>) {
        let response = self.response.clone();
        self.output
            .emit(|sequence_number| ResponseStreamEvent::Created {
                sequence_number,
                response,
            });
        let response = self.response.clone();
        self.output
            .emit(|sequence_number| ResponseStreamEvent::InProgress {
                sequence_number,
                response,
            });
        self.output.start();
        self.flush(out);
    }

    fn event(&mut self, event: RequestEvent, out: &mut Vec<Event>) {
        self.counts.observe(&event);
        self.kv.observe(&event);
        match event {
            // The Responses API never asks for prompt logprobs.
            RequestEvent::Started { .. }
            | RequestEvent::PromptLogprobs { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_) => {}
            RequestEvent::Token { text, logprob, .. } => {
                let logprobs = logprob
                    .iter()
                    .map(|lp| logprob_entry(&self.tokenizer, lp))
                    .collect();
                self.output.text(text, logprobs);
                self.flush(out);
            }
            RequestEvent::Finished { reason, text, .. } => {
                self.output.text(text, Vec::new());
                let items = self.output.end(Some(reason));
                let mut response =
                    complete(self.response.clone(), items, Some(reason), &self.counts);
                response.kv_transfer_params = self.kv.params();
                self.output.emit(|sequence_number| match reason {
                    FinishReason::Stop => ResponseStreamEvent::Completed {
                        sequence_number,
                        response,
                    },
                    FinishReason::Length | FinishReason::Abort => ResponseStreamEvent::Incomplete {
                        sequence_number,
                        response,
                    },
                });
                self.flush(out);
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

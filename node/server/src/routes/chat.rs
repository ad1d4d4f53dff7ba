//! `POST /v1/chat/completions`.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use pd_engine::{EngineError, GenerateRequest, RequestEvent, TokenLogprob};
use pd_tokenize::Tokenizer;
use pd_wire::Api;

use super::{AppState, GatewayId, JsonBody, logprob_entry, new_id, unix_now};
use crate::error::ApiError;
use crate::generation::{TokenCounts, collect};
use crate::kv_params::KvReply;
use crate::openai::chat::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatMessageOut,
};
use crate::openai::tool_parser::CallReader;
use crate::openai::tools::{ToolCalling, auto_finish, message_parts};
use crate::openai::{PromptLogprobs, Usage, non_negative};
use crate::prompt::{chat_messages, chat_tokens, token_text};
use crate::sse::{SseFormatter, data_frame, done, error_frame, sse_response};

const ROLE: &str = "assistant";
const API: Api = Api::ChatCompletions;

pub(super) async fn create(
    State(state): State<AppState>,
    GatewayId(gateway): GatewayId,
    JsonBody(req): JsonBody<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let model = state.model_name(req.model.as_deref())?;
    req.unsupported.refuse()?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs requires logprobs to be true",
            ));
        }
        (false, _) => None,
        (true, k) => Some(non_negative(k.unwrap_or(0), "top_logprobs")?),
    };
    let max_tokens = req.max_tokens();
    // The engine names `max_tokens` and `logprobs`; answer with the fields this client sent.
    let max_tokens_param = max_tokens.1;
    let engine_error = |e: EngineError| {
        ApiError::from(e)
            .rename_param("max_tokens", max_tokens_param)
            .rename_param("logprobs", "top_logprobs")
            .rename_param("prompt", API.prompt_field())
    };
    let tools = req.tools.for_chat(state.tool_parser)?;
    let mut params = req.sampling.to_params(max_tokens, logprobs)?;
    params.structured = req.structured.to_structured()?;
    tools.apply(&mut params)?;
    params.validate().map_err(|e| engine_error(e.into()))?;
    let prompt_logprobs = params.prompt_logprobs;
    let directive = state.kv_directive(req.kv_transfer_params.as_ref(), params.n)?;
    let messages = chat_messages(&req.messages)?;
    let template_tools = pd_tokenize::prompt::chat_tools(req.tools.listed());
    let prompt_tokens = chat_tokens(
        &state,
        req.prompt_token_ids,
        messages,
        template_tools,
        API.prompt_field(),
    )
    .await?;
    directive.check_prompt(&prompt_tokens, state.engine.info())?;

    let n = params.n;
    let prompt_len = prompt_tokens.len();
    let prompt_token_ids = req
        .sampling
        .return_token_ids()
        .then(|| prompt_tokens.clone());
    let id = new_id("chatcmpl-");
    let stream = state
        .submit(GenerateRequest {
            prompt_tokens: prompt_tokens.clone(),
            params,
            kv: directive.transfer(),
            cache_salt: crate::openai::cache_salt(req.sampling.cache_salt.as_ref())?,
            gateway,
        })
        .await
        .map_err(engine_error)?;
    let (stream, kv) = state.events(stream, directive, &id, &prompt_tokens);
    let out = Output {
        id,
        created: unix_now(),
        model,
        tokenizer: state.engine.tokenizer().clone(),
        return_token_ids: prompt_token_ids.is_some(),
        tools,
    };
    tracing::debug!(id = %out.id, engine_id = %stream.id(), n, prompt_len, "chat completion");

    if req.sampling.stream() {
        let formatter = ChatStream {
            counts: TokenCounts::new(prompt_len),
            include_usage: req.sampling.include_usage(),
            continuous_usage: req.sampling.continuous_usage(),
            finished: vec![false; n],
            calls: vec![String::new(); n],
            readers: (0..n)
                .filter_map(|_| out.tools.reader().map(|r| (r, 0)))
                .collect(),
            failed: false,
            prompt_token_ids,
            out,
            kv,
        };
        return Ok(sse_response(stream, formatter, state.sse_keep_alive));
    }

    let generation = collect(stream, n, prompt_len, kv).await?;
    let prompt_logprobs = prompt_logprobs.map(|_| {
        PromptLogprobs::new(&generation.prompt_logprobs, |id| {
            token_text(&out.tokenizer, id)
        })
    });
    let choices = generation
        .children
        .into_iter()
        .enumerate()
        .map(|(index, child)| {
            let finish_reason = child.finish_reason.map(|r| r.as_str());
            let (content, mut tool_calls, finish_reason) = match out.tools.reader() {
                // "auto": the parser reads the model's text; text answers keep their (possibly
                // empty) content, calls alone have none.
                Some(mut reader) => {
                    let mut pieces = Vec::new();
                    reader.push(&child.text, &mut pieces);
                    reader.finish(&mut pieces);
                    let (content, calls) = message_parts(pieces, &mut 0);
                    let finish_reason = auto_finish(finish_reason, calls.len());
                    let content = content.or_else(|| calls.is_empty().then(String::new));
                    (content, calls, finish_reason)
                }
                None => match out.tools.calls_of(&child.text) {
                    Some(calls) => (None, calls, out.tools.finish(finish_reason, &child.text)),
                    None => (Some(child.text), Vec::new(), finish_reason),
                },
            };
            // `index` is a streamed delta's field, not a message's.
            for c in &mut tool_calls {
                if let Some(o) = c.as_object_mut() {
                    o.remove("index");
                }
            }
            ChatChoice {
                index,
                message: ChatMessageOut {
                    role: ROLE,
                    content,
                    tool_calls,
                },
                logprobs: logprobs.is_some().then(|| ChatLogprobs {
                    content: child
                        .logprobs
                        .iter()
                        .map(|lp| logprob_entry(&out.tokenizer, lp))
                        .collect(),
                }),
                finish_reason,
                token_ids: out.return_token_ids.then_some(child.token_ids),
            }
        })
        .collect();
    Ok(Json(ChatCompletionResponse {
        id: out.id,
        object: "chat.completion",
        created: out.created,
        model: out.model,
        choices,
        usage: generation.usage.usage(),
        prompt_token_ids,
        prompt_logprobs,
        kv_transfer_params: generation.kv_transfer_params,
    })
    .into_response())
}

/// What every chunk of one request repeats.
#[derive(Debug)]
struct Output {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    return_token_ids: bool,
    /// Whether answers are text, forced tool calls, or the model's choice (`"auto"`).
    tools: ToolCalling,
}

/// Streams `chat.completion.chunk`s: a role chunk per choice, content deltas interleaved by
/// `index`, a final chunk per choice with its `finish_reason`, the usage chunk, `[DONE]`. A
/// named tool call streams as OpenAI's do: the role chunk names the call (`id`,
/// `function.name`), then each delta adds to `function.arguments`. A list of calls
/// (`"required"`) is whole only at the end: it is sent as one delta of every call with the
/// choice's last chunk. Under `"auto"` the node's parser reads the text: content deltas as it
/// lets text through, and each call as one delta (index, id, name, arguments) when its block
/// is whole.
#[derive(Debug)]
struct ChatStream {
    out: Output,
    counts: TokenCounts,
    include_usage: bool,
    /// vLLM's `continuous_usage_stats`: every chunk with choices carries the usage so far.
    continuous_usage: bool,
    finished: Vec<bool>,
    /// Per choice, a tool-call answer's text so far (a `"required"` list is sent as calls when
    /// it ends).
    calls: Vec<String>,
    /// Per choice, where the model may call tools itself (`"auto"`): the reader of its text and
    /// how many calls it has sent (the next call's `index`). Empty otherwise.
    readers: Vec<(CallReader, usize)>,
    failed: bool,
    /// Sent on the first chunk, then `None`.
    prompt_token_ids: Option<Vec<u32>>,
    kv: KvReply,
}

impl ChatStream {
    /// `"auto"`: what `child`'s new `text` (and, where `ended`, the end of its answer) adds:
    /// content the reader let through and whole calls, and how many calls it has sent so far.
    fn written(&mut self, child: usize, text: &str, ended: bool) -> (ChatDelta, usize) {
        let Some((reader, sent)) = self.readers.get_mut(child) else {
            return (ChatDelta::default(), 0);
        };
        let mut pieces = Vec::new();
        reader.push(text, &mut pieces);
        if ended {
            reader.finish(&mut pieces);
        }
        let (content, calls) = message_parts(pieces, sent);
        let delta = ChatDelta {
            content,
            tool_calls: (!calls.is_empty()).then_some(calls),
            ..ChatDelta::default()
        };
        (delta, *sent)
    }

    /// What new `text` of `child` adds: content, a named call's arguments, or nothing yet (a
    /// list of calls is kept until it ends).
    fn delta(&mut self, child: usize, text: String) -> ChatDelta {
        if text.is_empty() {
            return ChatDelta::default();
        }
        match &self.out.tools {
            ToolCalling::Text => ChatDelta {
                content: Some(text),
                ..ChatDelta::default()
            },
            ToolCalling::Auto { .. } => self.written(child, &text, false).0,
            ToolCalling::Named(_) => {
                // Kept too: whether the call is whole decides its `finish_reason`.
                if let Some(buffer) = self.calls.get_mut(child) {
                    buffer.push_str(&text);
                }
                ChatDelta {
                    tool_calls: Some(vec![
                        serde_json::json!({"index": 0, "function": {"arguments": text}}),
                    ]),
                    ..ChatDelta::default()
                }
            }
            ToolCalling::Required { .. } => {
                if let Some(buffer) = self.calls.get_mut(child) {
                    buffer.push_str(&text);
                }
                ChatDelta::default()
            }
        }
    }

    fn chunk(
        &mut self,
        choices: Vec<ChatChunkChoice>,
        usage: Option<Usage>,
    ) -> ChatCompletionChunk {
        let usage = usage.or_else(|| {
            (self.continuous_usage && !choices.is_empty()).then(|| self.counts.usage_so_far())
        });
        ChatCompletionChunk {
            id: self.out.id.clone(),
            object: "chat.completion.chunk",
            created: self.out.created,
            model: self.out.model.clone(),
            choices,
            usage,
            prompt_token_ids: self.prompt_token_ids.take(),
            kv_transfer_params: None,
        }
    }

    fn choice(
        &self,
        index: usize,
        delta: ChatDelta,
        logprob: Option<&TokenLogprob>,
        token_ids: Vec<u32>,
        finish: Option<&'static str>,
    ) -> ChatChunkChoice {
        ChatChunkChoice {
            index,
            delta,
            logprobs: logprob.map(|lp| ChatLogprobs {
                content: vec![logprob_entry(&self.out.tokenizer, lp)],
            }),
            finish_reason: finish,
            token_ids: self.out.return_token_ids.then_some(token_ids),
        }
    }
}

impl SseFormatter for ChatStream {
    fn prelude(&mut self, out: &mut Vec<Event>) {
        for index in 0..self.finished.len() {
            let delta = ChatDelta {
                role: Some(ROLE),
                content: (!self.out.tools.calls()).then(String::new),
                tool_calls: self.out.tools.named_head().map(|head| vec![head]),
            };
            let choice = self.choice(index, delta, None, Vec::new(), None);
            let chunk = self.chunk(vec![choice], None);
            data_frame(out, &chunk);
        }
    }

    fn event(&mut self, event: RequestEvent, out: &mut Vec<Event>) {
        self.counts.observe(&event);
        self.kv.observe(&event);
        let choice = match event {
            // Streams never ask for prompt logprobs (`SamplingFields::prompt_logprobs`).
            RequestEvent::Started { .. }
            | RequestEvent::PromptLogprobs { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_) => None,
            RequestEvent::Token {
                child,
                token_id,
                text,
                logprob,
            } => {
                let delta = self.delta(child, text);
                if delta.content.is_none()
                    && delta.tool_calls.is_none()
                    && logprob.is_none()
                    && !self.out.return_token_ids
                {
                    None
                } else {
                    Some(self.choice(child, delta, logprob.as_ref(), vec![token_id], None))
                }
            }
            RequestEvent::Finished {
                child,
                reason,
                text,
                ..
            } => {
                if let Some(f) = self.finished.get_mut(child) {
                    *f = true;
                }
                let mut finish = Some(reason.as_str());
                let delta = match &self.out.tools {
                    ToolCalling::Text => ChatDelta {
                        content: (!text.is_empty()).then_some(text),
                        ..ChatDelta::default()
                    },
                    ToolCalling::Auto { .. } => {
                        let (delta, calls) = self.written(child, &text, true);
                        finish = auto_finish(finish, calls);
                        delta
                    }
                    ToolCalling::Named(_) => {
                        let delta = self.delta(child, text);
                        let all = self
                            .calls
                            .get_mut(child)
                            .map(std::mem::take)
                            .unwrap_or_default();
                        finish = self.out.tools.finish(finish, &all);
                        delta
                    }
                    ToolCalling::Required { .. } => {
                        let mut all = self
                            .calls
                            .get_mut(child)
                            .map(std::mem::take)
                            .unwrap_or_default();
                        all.push_str(&text);
                        match self.out.tools.calls_of(&all) {
                            Some(calls) => {
                                finish = self.out.tools.finish(finish, &all);
                                ChatDelta {
                                    tool_calls: Some(calls),
                                    ..ChatDelta::default()
                                }
                            }
                            None => ChatDelta {
                                content: Some(all),
                                ..ChatDelta::default()
                            },
                        }
                    }
                };
                Some(self.choice(child, delta, None, Vec::new(), finish))
            }
            RequestEvent::Failed { message } => {
                self.failed = true;
                error_frame(out, &ApiError::GenerationFailed(message));
                None
            }
        };
        if let Some(choice) = choice {
            let last = choice.finish_reason.is_some() && self.finished.iter().all(|f| *f);
            let mut chunk = self.chunk(vec![choice], None);
            if last {
                chunk.kv_transfer_params = self.kv.params();
            }
            data_frame(out, &chunk);
        }
    }

    fn finish(&mut self, out: &mut Vec<Event>) {
        if !self.failed && self.finished.iter().any(|f| !f) {
            self.failed = true;
            error_frame(out, &ApiError::EngineStopped);
        }
        if self.include_usage && !self.failed {
            let chunk = self.chunk(Vec::new(), Some(self.counts.usage()));
            data_frame(out, &chunk);
        }
        out.push(done());
    }
}

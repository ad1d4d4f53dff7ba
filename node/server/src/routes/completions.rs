//! `POST /v1/completions`.

use axum::Json;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use pd_engine::{EngineError, GenerateRequest, RequestEvent, TokenLogprob};
use pd_tokenize::Tokenizer;

use super::{AppState, JsonBody, new_id, unix_now};
use crate::error::ApiError;
use crate::generation::{TokenCounts, collect};
use crate::kv_params::KvReply;
use crate::openai::completions::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, TokenMap,
};
use crate::openai::non_negative;
use crate::prompt::{completion_prompt, completion_tokens, token_text};
use crate::sse::{SseFormatter, data_frame, done, error_frame, sse_response};

const OBJECT: &str = "text_completion";

pub(super) async fn create(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let model = state.model_name(req.model.as_deref())?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    req.unsupported.refuse()?;
    req.tools.refuse()?;
    let logprobs = req
        .logprobs
        .map(|l| non_negative(l, "logprobs"))
        .transpose()?;
    let mut params = req
        .sampling
        .to_params((req.max_tokens, "max_tokens"), logprobs)?;
    params.structured = req.structured.to_structured()?;
    params.validate().map_err(EngineError::from)?;
    let directive = state.kv_directive(req.kv_transfer_params.as_ref(), params.n)?;
    let prompt_tokens =
        completion_tokens(&state, req.prompt_token_ids, completion_prompt(req.prompt)?).await?;
    directive.check_prompt(&prompt_tokens, state.engine.info().block_size)?;

    let n = params.n;
    let prompt_len = prompt_tokens.len();
    let return_token_ids = req.sampling.return_token_ids();
    let prompt_token_ids = return_token_ids.then(|| prompt_tokens.clone());
    let id = new_id("cmpl-");
    let stream = state
        .submit(GenerateRequest {
            prompt_tokens: prompt_tokens.clone(),
            params,
            kv: directive.transfer(),
            cache_salt: crate::openai::cache_salt(req.sampling.cache_salt.as_ref())?,
        })
        .await?;
    let (stream, kv) = state.events(stream, directive, &id, &prompt_tokens);
    let out = Output {
        id,
        created: unix_now(),
        model,
        tokenizer: state.engine.tokenizer().clone(),
        logprobs: logprobs.is_some(),
        prompt_token_ids,
    };
    tracing::debug!(id = %out.id, engine_id = %stream.id(), n, prompt_len, "completion");

    if req.sampling.stream() {
        let formatter = CompletionStream {
            counts: TokenCounts::new(prompt_len),
            include_usage: req.sampling.include_usage(),
            children: vec![ChildState::default(); n],
            failed: false,
            out,
            kv,
        };
        return Ok(sse_response(stream, formatter, state.sse_keep_alive));
    }

    let generation = collect(stream, n, prompt_len, kv).await?;
    let choices = generation
        .children
        .into_iter()
        .enumerate()
        .map(|(index, child)| CompletionChoice {
            index,
            text: child.text,
            logprobs: out
                .logprobs
                .then(|| out.logprobs_of(&child.logprobs, &mut 0)),
            finish_reason: child.finish_reason.map(|r| r.as_str()),
            prompt_token_ids: out.prompt_token_ids.clone(),
            token_ids: out.prompt_token_ids.is_some().then_some(child.token_ids),
        })
        .collect();
    let mut response = out.response(choices, Some(generation.usage.usage()));
    response.kv_transfer_params = generation.kv_transfer_params;
    Ok(Json(response).into_response())
}

/// What every response or chunk of one request repeats.
#[derive(Debug)]
struct Output {
    id: String,
    created: u64,
    model: String,
    tokenizer: std::sync::Arc<Tokenizer>,
    /// The request asked for logprobs.
    logprobs: bool,
    /// Set when the request asked for `return_token_ids`.
    prompt_token_ids: Option<Vec<u32>>,
}

impl Output {
    fn response(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<crate::openai::Usage>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: OBJECT,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            kv_transfer_params: None,
        }
    }

    /// The legacy logprobs object for `tokens`; `offset` is the running `text_offset`.
    fn logprobs_of(&self, tokens: &[TokenLogprob], offset: &mut usize) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for lp in tokens {
            let text = token_text(&self.tokenizer, lp.token_id);
            out.text_offset.push(*offset);
            *offset += text.chars().count();
            out.tokens.push(text);
            out.token_logprobs.push(lp.logprob);
            out.top_logprobs.push(TokenMap(
                lp.top
                    .iter()
                    .map(|&(id, logprob)| (token_text(&self.tokenizer, id), logprob))
                    .collect(),
            ));
        }
        out
    }
}

#[derive(Debug, Default, Clone)]
struct ChildState {
    /// `prompt_token_ids` was sent on this choice's first chunk.
    started: bool,
    /// Running `text_offset` of this choice's logprobs, in characters.
    offset: usize,
    finished: bool,
}

/// Streams `text_completion` chunks, one per token event, interleaved by `index`.
#[derive(Debug)]
struct CompletionStream {
    out: Output,
    counts: TokenCounts,
    include_usage: bool,
    children: Vec<ChildState>,
    failed: bool,
    kv: KvReply,
}

impl CompletionStream {
    fn chunk(
        &mut self,
        child: usize,
        text: String,
        token: Option<(u32, Option<TokenLogprob>)>,
        finish: Option<&'static str>,
    ) -> Option<CompletionResponse> {
        let state = self.children.get_mut(child)?;
        let prompt_token_ids = if state.started {
            None
        } else {
            self.out.prompt_token_ids.clone()
        };
        state.started = true;
        let (token_ids, logprob) = match token {
            Some((id, logprob)) => (vec![id], logprob),
            None => (Vec::new(), None),
        };
        let logprobs = self
            .out
            .logprobs
            .then(|| self.out.logprobs_of(logprob.as_slice(), &mut state.offset));
        let choice = CompletionChoice {
            index: child,
            text,
            logprobs,
            finish_reason: finish,
            prompt_token_ids,
            token_ids: self.out.prompt_token_ids.is_some().then_some(token_ids),
        };
        Some(self.out.response(vec![choice], None))
    }
}

impl SseFormatter for CompletionStream {
    fn prelude(&mut self, _out: &mut Vec<Event>) {}

    fn event(&mut self, event: RequestEvent, out: &mut Vec<Event>) {
        self.counts.observe(&event);
        self.kv.observe(&event);
        let chunk = match event {
            RequestEvent::Started { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_) => None,
            RequestEvent::Token {
                child,
                token_id,
                text,
                logprob,
            } => {
                if text.is_empty() && logprob.is_none() && self.out.prompt_token_ids.is_none() {
                    None
                } else {
                    self.chunk(child, text, Some((token_id, logprob)), None)
                }
            }
            RequestEvent::Finished {
                child,
                reason,
                text,
                ..
            } => {
                if let Some(c) = self.children.get_mut(child) {
                    c.finished = true;
                }
                let last = self.children.iter().all(|c| c.finished);
                let mut chunk = self.chunk(child, text, None, Some(reason.as_str()));
                if let Some(c) = &mut chunk
                    && last
                {
                    c.kv_transfer_params = self.kv.params();
                }
                chunk
            }
            RequestEvent::Failed { message } => {
                self.failed = true;
                error_frame(out, &ApiError::GenerationFailed(message));
                None
            }
        };
        if let Some(chunk) = chunk {
            data_frame(out, &chunk);
        }
    }

    fn finish(&mut self, out: &mut Vec<Event>) {
        if !self.failed && self.children.iter().any(|c| !c.finished) {
            self.failed = true;
            error_frame(out, &ApiError::EngineStopped);
        }
        if self.include_usage && !self.failed {
            data_frame(
                out,
                &self.out.response(Vec::new(), Some(self.counts.usage())),
            );
        }
        out.push(done());
    }
}

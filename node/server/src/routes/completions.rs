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
use crate::openai::{PromptLogprobs, non_negative};
use crate::prompt::{completion_prompt, completion_tokens, token_text};
use crate::sse::{SseFormatter, data_frame, done, error_frame, sse_response};
use pd_tokenize::prompt::PromptInput;

const OBJECT: &str = "text_completion";

pub(super) async fn create(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let model = state.model_name(req.model.as_deref())?;
    req.unsupported.refuse()?;
    req.tools.refuse()?;
    let logprobs = req
        .logprobs
        .map(|l| non_negative(l, "logprobs"))
        .transpose()?;
    let echo = req.echo == Some(true);
    // `echo` with `max_tokens: 0` returns the prompt alone (vLLM's "echo without
    // generation"): the engine generates one token, which is not returned.
    let generate = !(echo && req.max_tokens == Some(0));
    let max_tokens = if generate { req.max_tokens } else { Some(1) };
    let mut params = req
        .sampling
        .to_params((max_tokens, "max_tokens"), logprobs.filter(|_| generate))?;
    params.structured = req.structured.to_structured()?;
    // Echoed logprobs score the prompt too, with as many alternatives as the rest.
    let echo_logprobs = logprobs.filter(|_| echo);
    let asked_prompt_logprobs = params.prompt_logprobs;
    params.prompt_logprobs = asked_prompt_logprobs.max(echo_logprobs);
    params.validate().map_err(EngineError::from)?;
    let directive = state.kv_directive(req.kv_transfer_params.as_ref(), params.n)?;
    let prompt = completion_prompt(req.prompt)?;
    let echo_text = match (&prompt, echo) {
        (_, false) => None,
        (PromptInput::Text(text), true) => Some(text.clone()),
        (PromptInput::Tokens(_), true) => None, // decoded below, once the ids are known
    };
    let prompt_tokens = completion_tokens(&state, req.prompt_token_ids, prompt).await?;
    directive.check_prompt(&prompt_tokens, state.engine.info().block_size)?;
    let echo = echo.then(|| Echo {
        text: echo_text.unwrap_or_else(|| {
            state
                .engine
                .tokenizer()
                .decode(&prompt_tokens, false)
                .unwrap_or_default()
        }),
        first_token: prompt_tokens[0],
        logprobs: Vec::new(),
        generate,
    });

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
        logprobs,
        prompt_token_ids,
        echo,
        prompt_logprobs: asked_prompt_logprobs,
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

    let mut out = out;
    let generation = collect(stream, n, prompt_len, kv).await?;
    let prompt_logprobs = out.prompt_logprobs_field(&generation.prompt_logprobs);
    if let Some(e) = &mut out.echo {
        e.logprobs = generation.prompt_logprobs;
    }
    let generate = out.echo.as_ref().is_none_or(|e| e.generate);
    let choices = generation
        .children
        .into_iter()
        .enumerate()
        .map(|(index, child)| {
            let mut offset = 0;
            let (mut text, mut logprobs) = out.echoed(&mut offset);
            if generate {
                text.push_str(&child.text);
                if let Some(l) = &mut logprobs {
                    l.append(out.logprobs_of(&child.logprobs, &mut offset));
                }
            }
            CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason: child.finish_reason.map(|r| r.as_str()),
                prompt_token_ids: out.prompt_token_ids.clone(),
                token_ids: out.prompt_token_ids.is_some().then(|| {
                    if generate {
                        child.token_ids
                    } else {
                        Vec::new()
                    }
                }),
                prompt_logprobs: prompt_logprobs.clone(),
            }
        })
        .collect();
    let mut usage = generation.usage;
    if !generate {
        usage.completion_tokens = 0;
    }
    let mut response = out.response(choices, Some(usage.usage()));
    response.kv_transfer_params = generation.kv_transfer_params;
    Ok(Json(response).into_response())
}

/// `echo`: the prompt goes before each choice's text (and its logprobs before the choice's).
#[derive(Debug)]
struct Echo {
    /// The prompt as given, or its ids decoded.
    text: String,
    /// The prompt's first token, which has no logprob.
    first_token: u32,
    /// The logprobs of prompt tokens 1.. (when `logprobs` was asked for), filled as the
    /// engine sends them.
    logprobs: Vec<TokenLogprob>,
    /// False for `max_tokens: 0`: the prompt alone.
    generate: bool,
}

/// What every response or chunk of one request repeats.
#[derive(Debug)]
struct Output {
    id: String,
    created: u64,
    model: String,
    tokenizer: std::sync::Arc<Tokenizer>,
    /// The request's `logprobs`: alternatives per token.
    logprobs: Option<usize>,
    /// Set when the request asked for `return_token_ids`.
    prompt_token_ids: Option<Vec<u32>>,
    echo: Option<Echo>,
    /// The request's own `prompt_logprobs` (vLLM's field in the answer).
    prompt_logprobs: Option<usize>,
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
        let k = self.logprobs.unwrap_or(0);
        let mut out = CompletionLogprobs::default();
        for lp in tokens {
            let text = token_text(&self.tokenizer, lp.token_id);
            out.text_offset.push(*offset);
            *offset += text.chars().count();
            out.tokens.push(text);
            out.token_logprobs.push(Some(lp.logprob));
            out.top_logprobs.push(Some(TokenMap(
                lp.top
                    .iter()
                    .take(k)
                    .map(|&(id, logprob)| (token_text(&self.tokenizer, id), logprob))
                    .collect(),
            )));
        }
        out
    }

    /// What `echo` puts before a choice: the prompt's text, and with `logprobs` its tokens'
    /// (the first token's logprob and alternatives `null`). Empty without `echo`.
    fn echoed(&self, offset: &mut usize) -> (String, Option<CompletionLogprobs>) {
        let Some(echo) = &self.echo else {
            return (
                String::new(),
                self.logprobs.map(|_| CompletionLogprobs::default()),
            );
        };
        let logprobs = self.logprobs.map(|_| {
            let first = token_text(&self.tokenizer, echo.first_token);
            let mut l = CompletionLogprobs {
                text_offset: vec![*offset],
                token_logprobs: vec![None],
                top_logprobs: vec![None],
                tokens: Vec::new(),
            };
            *offset += first.chars().count();
            l.tokens.push(first);
            l.append(self.logprobs_of(&echo.logprobs, offset));
            l
        });
        (echo.text.clone(), logprobs)
    }

    /// vLLM's `prompt_logprobs` field, when the request asked for it.
    fn prompt_logprobs_field(&self, scored: &[TokenLogprob]) -> Option<PromptLogprobs> {
        let k = self.prompt_logprobs?;
        let trimmed: Vec<TokenLogprob> = scored
            .iter()
            .map(|lp| TokenLogprob {
                top: lp.top.iter().take(k).copied().collect(),
                ..lp.clone()
            })
            .collect();
        Some(PromptLogprobs::new(&trimmed, |id| {
            token_text(&self.tokenizer, id)
        }))
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
        let first = !state.started;
        state.started = true;
        let prompt_token_ids = if first {
            self.out.prompt_token_ids.clone()
        } else {
            None
        };
        // `echo`: the prompt (and its logprobs) go first, on the choice's first chunk.
        let (mut all_text, mut logprobs) = if first {
            self.out.echoed(&mut state.offset)
        } else {
            (String::new(), self.out.logprobs.map(|_| Default::default()))
        };
        all_text.push_str(&text);
        let (token_ids, logprob) = match token {
            Some((id, logprob)) => (vec![id], logprob),
            None => (Vec::new(), None),
        };
        if let Some(l) = &mut logprobs {
            l.append(self.out.logprobs_of(logprob.as_slice(), &mut state.offset));
        }
        let choice = CompletionChoice {
            index: child,
            text: all_text,
            logprobs,
            finish_reason: finish,
            prompt_token_ids,
            token_ids: self.out.prompt_token_ids.is_some().then_some(token_ids),
            prompt_logprobs: None,
        };
        Some(self.out.response(vec![choice], None))
    }
}

impl CompletionStream {
    /// `echo` with `max_tokens: 0`: a token is dropped; a child's end sends the prompt alone.
    fn finish_unreturned(&mut self, event: RequestEvent) -> Option<CompletionResponse> {
        let RequestEvent::Finished { child, reason, .. } = event else {
            return None;
        };
        if let Some(c) = self.children.get_mut(child) {
            c.finished = true;
        }
        let last = self.children.iter().all(|c| c.finished);
        let mut chunk = self.chunk(child, String::new(), None, Some(reason.as_str()));
        if let Some(c) = &mut chunk
            && last
        {
            c.kv_transfer_params = self.kv.params();
        }
        chunk
    }
}

impl SseFormatter for CompletionStream {
    fn prelude(&mut self, _out: &mut Vec<Event>) {}

    fn event(&mut self, event: RequestEvent, out: &mut Vec<Event>) {
        self.counts.observe(&event);
        self.kv.observe(&event);
        let generate = self.out.echo.as_ref().is_none_or(|e| e.generate);
        let chunk = match event {
            RequestEvent::PromptLogprobs { logprobs, .. } => {
                if let Some(e) = &mut self.out.echo {
                    e.logprobs.extend(logprobs);
                }
                None
            }
            // `echo` with `max_tokens: 0`: the token generated is not returned.
            RequestEvent::Token { .. } | RequestEvent::Finished { .. } if !generate => {
                self.finish_unreturned(event)
            }
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
            let mut counts = self.counts;
            if self.out.echo.as_ref().is_some_and(|e| !e.generate) {
                counts.completion_tokens = 0;
            }
            data_frame(out, &self.out.response(Vec::new(), Some(counts.usage())));
        }
        out.push(done());
    }
}

//! `POST /v1/completions`.

use axum::Json;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use pd_engine::{EngineError, GenerateRequest, RequestEvent, TokenLogprob};
use pd_tokenize::Tokenizer;
use pd_wire::Api;

use super::{AppState, GatewayId, JsonBody, new_id, unix_now};
use crate::error::ApiError;
use crate::generation::{TokenCounts, collect};
use crate::kv_params::KvReply;
use crate::openai::completions::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, TokenMap,
};
use crate::openai::{PromptLogprobs, non_negative};
use crate::prompt::{completion_prompts, completion_tokens, token_text};
use crate::sse::{Merged, SseFormatter, data_frame, done, error_frame, sse_response};
use pd_tokenize::prompt::PromptInput;

const OBJECT: &str = "text_completion";

/// Most choices one request may ask for: prompts × `n`.
const MAX_CHOICES: usize = 256;
/// Most logprob entries the prompt scores of one answer may hold: prompt tokens × choices
/// (each choice repeats its prompt's) × (1 + alternatives). A scored prompt costs one prefill,
/// so without this bound `n` and a list of prompts would multiply it into gigabytes of answer.
const MAX_SCORED_ENTRIES: usize = 1 << 22;

pub(super) async fn create(
    State(state): State<AppState>,
    GatewayId(gateway): GatewayId,
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
    let (max_tokens, max_tokens_param) = req.max_tokens();
    let generate = !(echo && max_tokens == Some(0));
    let max_tokens = if generate { max_tokens } else { Some(1) };
    let mut params = req.sampling.to_params(
        (max_tokens, max_tokens_param),
        logprobs.filter(|_| generate),
    )?;
    params.structured = req.structured.to_structured()?;
    // Echoed logprobs score the prompt too, with as many alternatives as the rest.
    let echo_logprobs = logprobs.filter(|_| echo);
    let asked_prompt_logprobs = params.prompt_logprobs;
    params.prompt_logprobs = asked_prompt_logprobs.max(echo_logprobs);
    params.validate().map_err(EngineError::from)?;
    let prompts = completion_prompts(req.prompt)?;
    if prompts.len() * params.n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!(
                "at most {MAX_CHOICES} choices per request: {} prompts × n = {} asks for {}",
                prompts.len(),
                params.n,
                prompts.len() * params.n
            ),
        ));
    }
    if prompts.len() > 1 {
        // A batch is this node's to answer, each prompt computed here.
        if req.kv_transfer_params.is_some() {
            return Err(ApiError::invalid(
                "kv_transfer_params",
                "a list of prompts is answered by one node: send it without kv_transfer_params",
            ));
        }
        if req.prompt_token_ids.is_some() {
            return Err(ApiError::invalid(
                "prompt_token_ids",
                "prompt_token_ids are one prompt's ids; this request lists several prompts",
            ));
        }
    }
    let directive = state.kv_directive(req.kv_transfer_params.as_ref(), params.n)?;
    let cache_salt = crate::openai::cache_salt(req.sampling.cache_salt.as_ref())?;
    let return_token_ids = req.sampling.return_token_ids();
    let n = params.n;
    let id = new_id("cmpl-");
    let created = unix_now();
    let tokenizer = state.engine.tokenizer().clone();

    // Every prompt is checked and tokenized before any is submitted: a bad one fails the
    // request with nothing started.
    let mut given = req.prompt_token_ids;
    let mut tokenized = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let echo_text = match (&prompt, echo) {
            (PromptInput::Text(text), true) => Some(text.clone()),
            _ => None, // token ids are decoded below, once checked
        };
        let prompt_tokens = completion_tokens(&state, given.take(), prompt).await?;
        directive.check_prompt(&prompt_tokens, state.engine.info())?;
        tokenized.push((prompt_tokens, echo_text));
    }
    if let Some(k) = params.prompt_logprobs {
        // Each choice repeats its prompt's scores (echo, and vLLM's field).
        let copies =
            usize::from(echo_logprobs.is_some()) + usize::from(asked_prompt_logprobs.is_some());
        let tokens: usize = tokenized.iter().map(|(t, _)| t.len()).sum();
        let entries = tokens * params.n * copies * (k + 1);
        if entries > MAX_SCORED_ENTRIES {
            return Err(ApiError::invalid(
                Api::Completions.prompt_field(),
                format!(
                    "the prompt scores asked for come to {entries} entries (prompt tokens × choices × \
                     alternatives), more than {MAX_SCORED_ENTRIES}: ask for fewer prompts, choices or \
                     alternatives"
                ),
            ));
        }
    }
    let mut transfer = Some(directive);
    let mut parts = Vec::with_capacity(tokenized.len());
    let mut streams = Vec::with_capacity(tokenized.len());
    let mut replies = Vec::with_capacity(tokenized.len());
    for (i, (prompt_tokens, echo_text)) in tokenized.into_iter().enumerate() {
        // The request's params are the first prompt's (a batch has none).
        let directive = match transfer.take() {
            Some(d) => d,
            None => state.kv_directive(None, n)?,
        };
        let stream = state
            .submit(GenerateRequest {
                prompt_tokens: prompt_tokens.clone(),
                params: params.clone(),
                kv: directive.transfer(),
                cache_salt: cache_salt.clone(),
                gateway: gateway.clone(),
            })
            .await?;
        let (stream, kv) = state.events(stream, directive, &id, &prompt_tokens);
        tracing::debug!(%id, engine_id = %stream.id(), n, prompt = i, prompt_len = prompt_tokens.len(), "completion");
        let echo = echo.then(|| Echo {
            text: echo_text
                .unwrap_or_else(|| tokenizer.decode(&prompt_tokens, false).unwrap_or_default()),
            first_token: prompt_tokens[0],
            logprobs: Vec::new(),
            generate,
        });
        parts.push(Part {
            out: Output {
                id: id.clone(),
                created,
                model: model.clone(),
                tokenizer: tokenizer.clone(),
                logprobs,
                prompt_token_ids: return_token_ids.then(|| prompt_tokens.clone()),
                echo,
                prompt_logprobs: asked_prompt_logprobs,
                first_index: i * n,
            },
            prompt_len: prompt_tokens.len(),
        });
        streams.push(stream);
        replies.push(kv);
    }

    if req.sampling.stream() {
        let formatter = CompletionStream {
            parts: parts
                .into_iter()
                .zip(replies)
                .map(|(p, kv)| PartStream {
                    counts: TokenCounts::new(p.prompt_len),
                    children: vec![ChildState::default(); n],
                    out: p.out,
                    kv,
                })
                .collect(),
            include_usage: req.sampling.include_usage(),
            continuous_usage: req.sampling.continuous_usage(),
            failed: false,
        };
        return Ok(sse_response(
            Merged::new(streams),
            formatter,
            state.sse_keep_alive,
        ));
    }

    let generations = futures::future::try_join_all(
        streams
            .into_iter()
            .zip(replies)
            .zip(&parts)
            .map(|((stream, kv), p)| collect(stream, n, p.prompt_len, kv)),
    )
    .await?;
    let mut choices = Vec::with_capacity(parts.len() * n);
    let mut usage = TokenCounts::default();
    let mut kv_transfer_params = None;
    for (mut part, generation) in parts.into_iter().zip(generations) {
        let out = &mut part.out;
        let prompt_logprobs = out.prompt_logprobs_field(&generation.prompt_logprobs);
        if let Some(e) = &mut out.echo {
            e.logprobs = generation.prompt_logprobs;
        }
        let generate = out.echo.as_ref().is_none_or(|e| e.generate);
        for (child_index, child) in generation.children.into_iter().enumerate() {
            let mut offset = 0;
            let (mut text, mut logprobs) = out.echoed(&mut offset);
            if generate {
                text.push_str(&child.text);
                if let Some(l) = &mut logprobs {
                    l.append(out.logprobs_of(&child.logprobs, &mut offset));
                }
            }
            choices.push(CompletionChoice {
                index: out.first_index + child_index,
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
            });
        }
        let mut counts = generation.usage;
        if !generate {
            counts.completion_tokens = 0;
        }
        usage.add(&counts);
        kv_transfer_params = kv_transfer_params.or(generation.kv_transfer_params);
    }
    let out = Output::common(id, created, model, tokenizer);
    let mut response = out.response(choices, Some(usage.usage()));
    response.kv_transfer_params = kv_transfer_params;
    Ok(Json(response).into_response())
}

/// One prompt of a request: its output state and length.
#[derive(Debug)]
struct Part {
    out: Output,
    prompt_len: usize,
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
    /// The `index` of this prompt's first choice (prompt i of a list: i × n).
    first_index: usize,
}

impl Output {
    /// What a response names whatever its prompts: the usage chunk, a batch's whole answer.
    fn common(
        id: String,
        created: u64,
        model: String,
        tokenizer: std::sync::Arc<Tokenizer>,
    ) -> Self {
        Self {
            id,
            created,
            model,
            tokenizer,
            logprobs: None,
            prompt_token_ids: None,
            echo: None,
            prompt_logprobs: None,
            first_index: 0,
        }
    }

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
            out.tokens.push(text.clone());
            out.token_logprobs.push(Some(lp.logprob));
            // The `k` most likely, and the token itself where it is not one of them (OpenAI:
            // "up to logprobs + 1 elements").
            let mut top: Vec<(String, f32)> = lp
                .top
                .iter()
                .take(k)
                .map(|&(id, logprob)| (token_text(&self.tokenizer, id), logprob))
                .collect();
            if !lp.top.iter().take(k).any(|&(id, _)| id == lp.token_id) {
                top.push((text, lp.logprob));
            }
            out.top_logprobs.push(Some(TokenMap(top)));
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

/// Streams `text_completion` chunks, one per token event, interleaved by `index` (across a
/// batch's prompts too: prompt i's choices are `i × n..`).
#[derive(Debug)]
struct CompletionStream {
    parts: Vec<PartStream>,
    include_usage: bool,
    /// vLLM's `continuous_usage_stats`: every chunk carries the whole request's usage so far.
    continuous_usage: bool,
    failed: bool,
}

/// One prompt's share of a [`CompletionStream`].
#[derive(Debug)]
struct PartStream {
    out: Output,
    counts: TokenCounts,
    children: Vec<ChildState>,
    kv: KvReply,
}

impl PartStream {
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
            index: self.out.first_index + child,
            text: all_text,
            logprobs,
            finish_reason: finish,
            prompt_token_ids,
            token_ids: self.out.prompt_token_ids.is_some().then_some(token_ids),
            prompt_logprobs: None,
        };
        Some(self.out.response(vec![choice], None))
    }

    /// Child `child` ended: its last chunk (`text` and the finish reason), which carries the
    /// P/D params when it was the last child to end.
    fn finished(
        &mut self,
        child: usize,
        text: String,
        reason: &'static str,
    ) -> Option<CompletionResponse> {
        if let Some(c) = self.children.get_mut(child) {
            c.finished = true;
        }
        let last = self.children.iter().all(|c| c.finished);
        let mut chunk = self.chunk(child, text, None, Some(reason));
        if let Some(c) = &mut chunk
            && last
        {
            c.kv_transfer_params = self.kv.params();
        }
        chunk
    }

    /// The chunk one engine event makes, if any (`Failed` is the caller's).
    fn event(&mut self, event: RequestEvent) -> Option<CompletionResponse> {
        self.counts.observe(&event);
        self.kv.observe(&event);
        let generate = self.out.echo.as_ref().is_none_or(|e| e.generate);
        match event {
            RequestEvent::PromptLogprobs { logprobs, .. } => {
                if let Some(e) = &mut self.out.echo {
                    e.logprobs.extend(logprobs);
                }
                None
            }
            // `echo` with `max_tokens: 0`: the token generated is not returned; a child's end
            // sends the prompt alone.
            RequestEvent::Token { .. } if !generate => None,
            RequestEvent::Finished { child, reason, .. } if !generate => {
                self.finished(child, String::new(), reason.as_str())
            }
            RequestEvent::Started { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_)
            | RequestEvent::Failed { .. } => None,
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
            } => self.finished(child, text, reason.as_str()),
        }
    }

    /// This prompt's counts until now (`echo` without generation returns no tokens).
    fn counts_so_far(&self) -> TokenCounts {
        let mut counts = self.counts;
        if self.out.echo.as_ref().is_some_and(|e| !e.generate) {
            counts.generated = 0;
        }
        counts
    }

    /// This prompt's usage as answered (`echo` without generation returns no tokens).
    fn usage(&self) -> TokenCounts {
        let mut counts = self.counts;
        if self.out.echo.as_ref().is_some_and(|e| !e.generate) {
            counts.completion_tokens = 0;
        }
        counts
    }
}

impl SseFormatter<(usize, RequestEvent)> for CompletionStream {
    fn prelude(&mut self, _out: &mut Vec<Event>) {}

    fn event(&mut self, (part, event): (usize, RequestEvent), out: &mut Vec<Event>) {
        if self.failed {
            return; // a batch's other prompts after one failed: nothing more is sent
        }
        let Some(p) = self.parts.get_mut(part) else {
            return;
        };
        if let RequestEvent::Failed { message } = event {
            self.failed = true;
            error_frame(out, &ApiError::GenerationFailed(message));
            return;
        }
        if let Some(mut chunk) = p.event(event) {
            if self.continuous_usage {
                let mut so_far = TokenCounts::default();
                for p in &self.parts {
                    so_far.add(&p.counts_so_far());
                }
                chunk.usage = Some(so_far.usage_so_far());
            }
            data_frame(out, &chunk);
        }
    }

    fn finish(&mut self, out: &mut Vec<Event>) {
        let unfinished = self
            .parts
            .iter()
            .any(|p| p.children.iter().any(|c| !c.finished));
        if !self.failed && unfinished {
            self.failed = true;
            error_frame(out, &ApiError::EngineStopped);
        }
        if self.include_usage
            && !self.failed
            && let Some(first) = self.parts.first()
        {
            let mut usage = TokenCounts::default();
            for p in &self.parts {
                usage.add(&p.usage());
            }
            data_frame(out, &first.out.response(Vec::new(), Some(usage.usage())));
        }
        out.push(done());
    }
}

//! Running one engine request to the end and keeping what each child produced (non-streaming
//! endpoints), plus the per-request token accounting shared with the streaming ones.

use pd_engine::{FinishReason, RequestEvent, TokenLogprob};

use crate::disagg::Events;
use crate::error::ApiError;
use crate::kv_params::KvReply;

/// What one child (one choice) produced.
#[derive(Debug, Default)]
pub(crate) struct ChildOutput {
    pub(crate) text: String,
    pub(crate) token_ids: Vec<u32>,
    pub(crate) logprobs: Vec<TokenLogprob>,
    pub(crate) finish_reason: Option<FinishReason>,
    pub(crate) completion_tokens: usize,
}

/// A finished request.
#[derive(Debug)]
pub(crate) struct Generation {
    pub(crate) usage: TokenCounts,
    /// One entry per child, indexed by `child`.
    pub(crate) children: Vec<ChildOutput>,
    /// A prefill node's handoff, for the response.
    pub(crate) kv_transfer_params: Option<serde_json::Value>,
    /// `prompt_logprobs`: the logprobs of prompt tokens 1.., when asked for.
    pub(crate) prompt_logprobs: Vec<TokenLogprob>,
}

/// Token accounting of one request.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TokenCounts {
    pub(crate) prompt_tokens: usize,
    pub(crate) cached_tokens: usize,
    /// Of `cached_tokens`, those pulled from a prefill node.
    pub(crate) pulled_tokens: usize,
    pub(crate) completion_tokens: usize,
    /// Tokens generated so far (all children), counted as they come.
    pub(crate) generated: usize,
}

impl TokenCounts {
    pub(crate) fn new(prompt_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            ..Self::default()
        }
    }

    /// Folds the counts an event carries into `self`.
    pub(crate) fn observe(&mut self, event: &RequestEvent) {
        match event {
            RequestEvent::Started {
                prompt_tokens,
                cached_tokens,
                pulled_tokens,
            } => {
                self.prompt_tokens = *prompt_tokens;
                self.cached_tokens = *cached_tokens;
                self.pulled_tokens = *pulled_tokens;
            }
            RequestEvent::Finished {
                completion_tokens, ..
            } => self.completion_tokens += completion_tokens,
            RequestEvent::Token { .. } => self.generated += 1,
            RequestEvent::PromptLogprobs { .. }
            | RequestEvent::Failed { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_) => {}
        }
    }

    /// Adds `other`'s counts (a batch's prompts).
    pub(crate) fn add(&mut self, other: &TokenCounts) {
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.pulled_tokens += other.pulled_tokens;
        self.completion_tokens += other.completion_tokens;
        self.generated += other.generated;
    }

    /// The usage so far, for vLLM's `continuous_usage_stats`: the tokens generated until now.
    pub(crate) fn usage_so_far(&self) -> crate::openai::Usage {
        crate::openai::Usage::new(
            self.prompt_tokens,
            self.cached_tokens,
            self.pulled_tokens,
            self.generated,
        )
    }

    pub(crate) fn usage(&self) -> crate::openai::Usage {
        crate::openai::Usage::new(
            self.prompt_tokens,
            self.cached_tokens,
            self.pulled_tokens,
            self.completion_tokens,
        )
    }
}

/// Reads `stream` until every one of its `n` children finished.
///
/// # Errors
/// [`ApiError::GenerationFailed`] when the engine reported a failure, [`ApiError::EngineStopped`]
/// when the stream ended with a child unfinished.
pub(crate) async fn collect(
    mut stream: Events,
    n: usize,
    prompt_tokens: usize,
    mut kv: KvReply,
) -> Result<Generation, ApiError> {
    let mut usage = TokenCounts::new(prompt_tokens);
    let mut children: Vec<ChildOutput> = (0..n).map(|_| ChildOutput::default()).collect();
    let mut prompt_logprobs = Vec::new();
    while let Some(event) = stream.recv().await {
        usage.observe(&event);
        kv.observe(&event);
        match event {
            RequestEvent::PromptLogprobs { logprobs, .. } => prompt_logprobs.extend(logprobs),
            RequestEvent::Started { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_) => {}
            RequestEvent::Token {
                child,
                token_id,
                text,
                logprob,
            } => {
                if let Some(out) = children.get_mut(child) {
                    out.text.push_str(&text);
                    out.token_ids.push(token_id);
                    out.logprobs.extend(logprob);
                }
            }
            RequestEvent::Finished {
                child,
                reason,
                text,
                completion_tokens,
            } => {
                if let Some(out) = children.get_mut(child) {
                    out.text.push_str(&text);
                    out.finish_reason = Some(reason);
                    out.completion_tokens = completion_tokens;
                }
            }
            RequestEvent::Failed { message } => return Err(ApiError::GenerationFailed(message)),
        }
    }
    if children.iter().any(|c| c.finish_reason.is_none()) {
        return Err(ApiError::EngineStopped);
    }
    Ok(Generation {
        usage,
        children,
        kv_transfer_params: kv.params(),
        prompt_logprobs,
    })
}

//! What a caller hands the engine ([`GenerateRequest`]) and what it gets back ([`RequestEvent`]).

use std::fmt;

/// Engine-wide unique id of one request (all of its `n` children share it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// How to pick tokens and when to stop. Validated by [`SamplingParams::validate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Number of independent completions of the same prompt. The prompt is prefilled once and
    /// the children share its blocks copy-on-write.
    pub n: usize,
    /// 0.0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1.0 disables it.
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Seed for the sampler. Child `i` of an `n>1` request uses `seed + i`.
    pub seed: Option<u64>,
    /// Most tokens to generate per child. `None`: up to the model's context length.
    pub max_tokens: Option<usize>,
    /// Stop when the generated text contains one of these (the stop string is not returned).
    pub stop: Vec<String>,
    /// Stop when one of these token ids is generated (in addition to EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop on the model's EOS tokens.
    pub ignore_eos: bool,
    /// Return this many top alternatives' log-probabilities with every token (of the model's
    /// distribution, before the penalties and biases below: vLLM's default).
    pub logprobs: Option<usize>,
    /// OpenAI's `presence_penalty` (−2..2): subtracted once from the logit of every token this
    /// child has generated so far. 0 disables it.
    pub presence_penalty: f32,
    /// OpenAI's `frequency_penalty` (−2..2): subtracted from a token's logit once per time this
    /// child has generated it. 0 disables it.
    pub frequency_penalty: f32,
    /// vLLM's `repetition_penalty` (> 0): the logits of tokens in the prompt or generated so far
    /// are divided by it when positive, multiplied when negative. 1 disables it.
    pub repetition_penalty: f32,
    /// vLLM's `min_p` (0..=1): after temperature, drop tokens less likely than `min_p` × the
    /// most likely token's probability. 0 disables it; no effect on greedy picks.
    pub min_p: f32,
    /// OpenAI's `logit_bias`: added to these tokens' logits (−100..=100), sorted by token id,
    /// one entry per id.
    pub logit_bias: Vec<(u32, f32)>,
    /// Structured output: what every child's text must match (a JSON schema, any JSON object, a
    /// regex, a choice, a grammar). Logits of tokens that would break it are −∞ before anything
    /// else (vLLM's order), so logprobs are of the masked distribution; a child ends where the
    /// constraint is complete.
    pub structured: Option<StructuredOutput>,
    /// vLLM's `skip_special_tokens`: leave special tokens (other than the EOS and stop tokens
    /// that end a child, never part of its text) out of the text. A tool-call parser that
    /// looks for markers a tokenizer marks special (`<tool_call>`) turns it off.
    pub skip_special_tokens: bool,
    /// vLLM's `min_tokens`: until a child has generated this many tokens, the model's EOS
    /// tokens (unless `ignore_eos`) and `stop_token_ids` are not picked (their logits are −∞)
    /// and stop strings are not looked for (nor later in the text written before). A
    /// structured output that is complete still ends the child: nothing may follow it. 0
    /// disables it; at most `max_tokens` (but on a prefill for a decode node, which generates
    /// one token whatever `max_tokens` says).
    pub min_tokens: usize,
    /// vLLM's `prompt_logprobs` (and what `echo` with `logprobs` needs): the logprob of every
    /// prompt token after the first under the model's distribution at its position, with this
    /// many top alternatives ([`RequestEvent::PromptLogprobs`]). The prompt is then computed
    /// in full: no prefix-cache hits, no KV from another node.
    pub prompt_logprobs: Option<usize>,
}

/// A request's structured-output constraint and the request field it came from (named in
/// errors: `response_format`, `structured_outputs`, `guided_json`...).
#[derive(Clone, Debug, PartialEq)]
pub struct StructuredOutput {
    /// What the output must match.
    pub spec: pd_grammar::OutputSpec,
    /// The OpenAI/vLLM field that asked for it.
    pub field: &'static str,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            structured: None,
            skip_special_tokens: true,
            min_tokens: 0,
            prompt_logprobs: None,
        }
    }
}

/// Largest `n` one request may ask for.
pub const MAX_N: usize = 128;
/// Largest `logprobs` (top alternatives per token) one request may ask for.
pub const MAX_LOGPROBS: usize = 20;
/// Most stop strings one request may give (every new piece of text is checked against each).
pub const MAX_STOP: usize = 32;
/// Longest stop string, in bytes (the engine holds back up to this much text per child).
pub const MAX_STOP_LEN: usize = 512;
/// Most stop token ids one request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Most `logit_bias` entries one request may give (each is applied on every step).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// A request the engine could not take; `param` names the offending field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidRequest {
    /// Human-readable reason.
    pub message: String,
    /// The request field at fault, in the OpenAI API's naming (`n`, `max_tokens`, `messages`...).
    pub param: Option<&'static str>,
}

impl InvalidRequest {
    pub(crate) fn new(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            param: Some(param),
        }
    }
}

impl SamplingParams {
    /// Checks ranges that do not depend on the prompt.
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        if self.n == 0 || self.n > MAX_N {
            return Err(InvalidRequest::new(
                "n",
                format!("n must be between 1 and {MAX_N}, got {}", self.n),
            ));
        }
        if !(self.temperature.is_finite() && (0.0..=2.0).contains(&self.temperature)) {
            return Err(InvalidRequest::new(
                "temperature",
                format!(
                    "temperature must be between 0 and 2, got {}",
                    self.temperature
                ),
            ));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(InvalidRequest::new(
                "top_p",
                format!("top_p must be in (0, 1], got {}", self.top_p),
            ));
        }
        if self.max_tokens == Some(0) {
            return Err(InvalidRequest::new(
                "max_tokens",
                "max_tokens must be at least 1",
            ));
        }
        if let Some(k) = self.logprobs
            && k > MAX_LOGPROBS
        {
            return Err(InvalidRequest::new(
                "logprobs",
                format!("at most {MAX_LOGPROBS} logprobs per token, got {k}"),
            ));
        }
        if let Some(k) = self.prompt_logprobs
            && k > MAX_LOGPROBS
        {
            return Err(InvalidRequest::new(
                "prompt_logprobs",
                format!("at most {MAX_LOGPROBS} prompt logprobs per token, got {k}"),
            ));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err(InvalidRequest::new(
                "stop",
                "stop strings must not be empty",
            ));
        }
        if self.stop.len() > MAX_STOP {
            return Err(InvalidRequest::new(
                "stop",
                format!("at most {MAX_STOP} stop strings, got {}", self.stop.len()),
            ));
        }
        if let Some(s) = self.stop.iter().find(|s| s.len() > MAX_STOP_LEN) {
            return Err(InvalidRequest::new(
                "stop",
                format!(
                    "stop strings are at most {MAX_STOP_LEN} bytes, got one of {}",
                    s.len()
                ),
            ));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(InvalidRequest::new(
                "stop_token_ids",
                format!(
                    "at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}",
                    self.stop_token_ids.len()
                ),
            ));
        }
        for (value, param) in [
            (self.presence_penalty, "presence_penalty"),
            (self.frequency_penalty, "frequency_penalty"),
        ] {
            if !(value.is_finite() && (-2.0..=2.0).contains(&value)) {
                return Err(InvalidRequest::new(
                    param,
                    format!("{param} must be between -2 and 2, got {value}"),
                ));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(InvalidRequest::new(
                "repetition_penalty",
                format!(
                    "repetition_penalty must be greater than 0, got {}",
                    self.repetition_penalty
                ),
            ));
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return Err(InvalidRequest::new(
                "min_p",
                format!("min_p must be between 0 and 1, got {}", self.min_p),
            ));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(InvalidRequest::new(
                "logit_bias",
                format!(
                    "at most {MAX_LOGIT_BIAS} logit_bias entries, got {}",
                    self.logit_bias.len()
                ),
            ));
        }
        if let Some(&(token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b)))
        {
            return Err(InvalidRequest::new(
                "logit_bias",
                format!(
                    "logit_bias values must be between -100 and 100, got {bias} for token {token}"
                ),
            ));
        }
        if !self.logit_bias.windows(2).all(|w| w[0].0 < w[1].0) {
            return Err(InvalidRequest::new(
                "logit_bias",
                "logit_bias must name each token once, in increasing order of id",
            ));
        }
        Ok(())
    }

    /// Whether anything changes the logits before the pick: penalties or biases.
    pub fn adjusts_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// One generation request: already-tokenized prompt plus sampling parameters.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Prompt token ids (chat template already applied).
    pub prompt_tokens: Vec<u32>,
    /// How to sample.
    pub params: SamplingParams,
    /// Whether the prompt's KV is handed to, or taken from, another node.
    pub kv: KvTransfer,
    /// vLLM's `cache_salt`: prefix-cache hits only between requests with the same salt
    /// ([`pd_kv_pool::root_hash`]).
    pub cache_salt: Option<String>,
    /// The gateway the request came through (its `gateway_id`, from the `x-pd-gateway-id`
    /// header), when one said: a prefill node tags the leases it grants for the request with
    /// it, and [`crate::EngineHandle::release_gateway_leases`] ends them when that gateway
    /// leaves. `None`: untagged leases, which only their reader or their deadline ends.
    pub gateway: Option<std::sync::Arc<str>>,
}

/// A request's part in prefill/decode disaggregation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvTransfer {
    /// Computed and decoded here.
    #[default]
    Local,
    /// Prefill node: compute the prompt, sample one token per child, then keep the prompt's
    /// blocks under one lease per decode node that will pull them ([`RequestEvent::KvReady`],
    /// once per consumer). `consumers` is at least 1 (0 is taken as 1).
    Produce {
        /// Decode nodes that will each pull the prompt's KV under their own lease.
        consumers: usize,
    },
    /// As [`KvTransfer::Produce`], but a prefix of the prompt's KV (an earlier turn of the
    /// conversation, kept by the node that decoded it) is pulled first, as for
    /// [`KvTransfer::Consume`]; only the rest is computed here (reverse pull).
    PullThenProduce {
        /// Decode nodes that will pull the prompt's KV under their own lease.
        consumers: usize,
    },
    /// Decode node: the prompt's KV, or a prefix of it, comes from a peer. The request waits
    /// with blocks reserved ([`RequestEvent::AwaitingKv`]) until the reservation is given back
    /// ([`crate::EngineHandle::remote_kv_ready`]), then computes what was not pulled.
    Consume,
}

/// The prompt's blocks on a prefill node, held under a lease for the decode node to read.
#[derive(Clone, Debug, PartialEq)]
pub struct KvHandoff {
    /// The lease id (unguessable).
    pub lease: pd_kv_pool::LeaseId,
    /// Its generation.
    pub generation: u64,
    /// When it ends unless renewed.
    pub deadline: std::time::SystemTime,
    /// The blocks, in prompt order: block `i` holds positions `i*block_size..`.
    pub block_ids: Vec<pd_kv_pool::BlockId>,
    /// Prompt tokens whose KV the blocks hold.
    pub num_tokens: usize,
    /// The chained prefix hash of the last whole block held (`pd_kv_pool::block_hash` chain,
    /// from the request's root): what a gateway keys a retained turn by, since the next turn's
    /// prompt hashes to the same chain. Set for retained turns.
    pub last_block_hash: Option<u64>,
    /// The chained hash of the last whole block of the prompt, and the tokens up to it: where a
    /// resent history whose answer re-encodes differently still meets this turn. Set for
    /// retained turns whose prompt fills a block.
    pub prompt_key: Option<(u64, usize)>,
    /// The lease's record on the node's lease board, where a reader confirms it one-sidedly
    /// (`None`: no board, or it was full; confirm through the side channel).
    pub board_slot: Option<u32>,
}

/// How a wait for remote KV ended ([`crate::EngineHandle::remote_kv_ready`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteKv {
    /// The KV of the first `n` prompt tokens is in the reserved blocks.
    Pulled(usize),
    /// As [`RemoteKv::Pulled`], from a producer that did not attest what its blocks hold (a
    /// peer without hash-bound leases): used for this request only, never entered in the
    /// prefix cache (nor anything computed on top of it).
    PulledUnattested(usize),
    /// As [`RemoteKv::Pulled`] for the prompt's first `tokens`, with the token the producer
    /// picked right after them, attested at confirm (a prefill's first token), and how it
    /// picked it (`key`: 0 for the argmax, else its sampling parameters and seed). When
    /// `tokens` is the whole prompt and the request is a single completion without logprobs
    /// whose own parameters give the same key, the engine emits that token at once, as its
    /// first, instead of computing the last prompt position again: it is the token one node
    /// would have picked from the same prefill. Otherwise it is [`RemoteKv::Pulled`]`(tokens)`.
    PulledWithFirstToken {
        /// Prompt tokens whose KV is in the reserved blocks.
        tokens: usize,
        /// The producer's token after them.
        first_token: u32,
        /// How it was picked (`LeaseContents::next_token_key`).
        key: u64,
    },
    /// Nothing usable arrived: compute the prompt here (the caller counted why).
    Recompute,
}

/// Why a child stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The request was aborted (client gone, engine shutting down).
    Abort,
}

impl FinishReason {
    /// The OpenAI API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Log-probability of one token, with the top alternatives at that position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token id.
    pub token_id: u32,
    /// Its natural-log probability under the (temperature-free) model distribution.
    pub logprob: f32,
    /// The `logprobs` most likely tokens at this position, most likely first.
    pub top: Vec<(u32, f32)>,
    /// The token's rank in the distribution, from 1 (the most likely): one more than the
    /// number of tokens more likely than it (vLLM's `rank`).
    pub rank: u32,
}

/// Something that happened to a request, in order.
#[derive(Debug, PartialEq)]
pub enum RequestEvent {
    /// The prompt was admitted; `cached_tokens` of it came from the prefix cache or a pull.
    Started {
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Tokens of the prompt whose KV was reused or pulled instead of computed.
        cached_tokens: usize,
        /// Of `cached_tokens`, those pulled from a peer.
        pulled_tokens: usize,
    },
    /// ([`KvTransfer::Consume`], [`KvTransfer::PullThenProduce`]) Blocks are reserved for the
    /// prompt: pull the peer's blocks `first_block()..` into the reservation's blocks, then give
    /// it back with [`crate::EngineHandle::remote_kv_ready`] (or `remote_kv_landed`). Other
    /// requests keep running meanwhile.
    AwaitingKv(crate::KvReservation),
    /// (`prompt_logprobs`) The logprobs of prompt tokens `first..first + logprobs.len()`, sent
    /// as the prompt is computed (in order, contiguous, from token 1, all before the first
    /// `Token`). The first prompt token has none.
    PromptLogprobs {
        /// Index in the prompt of the token `logprobs[0]` scores (≥ 1).
        first: usize,
        /// One per token, with the request's `prompt_logprobs` top alternatives.
        logprobs: Vec<TokenLogprob>,
    },
    /// ([`KvTransfer::Produce`]) The prompt is computed and its blocks are leased; sent once per
    /// consumer (each a lease of its own on the same blocks), before the first token.
    KvReady(KvHandoff),
    /// (`kv_retain_after_decode`) The finished completion's full blocks — prompt and generated
    /// tokens — are kept under a retained lease for the conversation's next turn; sent just
    /// before that child's [`RequestEvent::Finished`]. `num_tokens` is a multiple of the block
    /// size.
    Retained(KvHandoff),
    /// Child `child` produced a token. `text` is the newly decodable text (may be empty while a
    /// multi-byte character is incomplete, or while a possible stop string is held back).
    Token {
        /// Index of the child in `0..n`.
        child: usize,
        /// The sampled token.
        token_id: u32,
        /// Text to append to this child's output.
        text: String,
        /// Present when the request asked for logprobs.
        logprob: Option<TokenLogprob>,
    },
    /// Child `child` is done. `text` is held-back text flushed at the end (may be empty).
    Finished {
        /// Index of the child in `0..n`.
        child: usize,
        /// Why it stopped.
        reason: FinishReason,
        /// Remaining text of this child not yet sent in a `Token` event.
        text: String,
        /// Tokens generated by this child.
        completion_tokens: usize,
    },
    /// The engine failed while running this request (a model error); the request is over.
    Failed {
        /// What went wrong.
        message: String,
    },
}

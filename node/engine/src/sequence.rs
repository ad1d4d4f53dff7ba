//! One sequence: a prompt plus the tokens one child generated, and the blocks holding its K/V.

use std::time::Instant;

use pd_grammar::TokenMatcher;
use pd_kv_pool::{BlockHash, BlockId};
use pd_tokenize::IncrementalDecoder;
use rand_chacha::ChaCha8Rng;

use crate::request::RequestId;

/// A prompt and one child's continuation, with its KV bookkeeping.
#[derive(Debug)]
pub(crate) struct Sequence {
    /// The request this sequence belongs to.
    pub(crate) request: RequestId,
    /// Index of this child in `0..n`.
    pub(crate) child: usize,
    /// Prompt followed by generated tokens.
    pub(crate) tokens: Vec<u32>,
    /// Length of the prompt part of `tokens`.
    pub(crate) prompt_len: usize,
    /// Leading tokens whose K/V is in `blocks`.
    pub(crate) num_computed: usize,
    /// Blocks holding positions `0..num_computed` (and room for what is being computed).
    pub(crate) blocks: Vec<BlockId>,
    /// Hashes of the leading full blocks, registered in the prefix cache.
    pub(crate) hashes: Vec<BlockHash>,
    /// Parent of the first block's hash: the deployment key and the request's `cache_salt`
    /// (`pd_kv_pool::root_hash`); `None`: the plain chain.
    pub(crate) root: Option<BlockHash>,
    /// False once the sequence holds KV whose contents nobody vouched for (pulled from a
    /// producer that does not attest its leases): none of its blocks, nor any computed on top
    /// of them, is ever entered in the prefix cache.
    pub(crate) cacheable: bool,
    /// This child's sampler state.
    pub(crate) rng: ChaCha8Rng,
    /// Turns generated tokens into text.
    pub(crate) decoder: IncrementalDecoder,
    /// Generated text so far (stop strings removed).
    pub(crate) text: String,
    /// Bytes of `text` already sent to the client.
    pub(crate) sent: usize,
    /// Bytes of `text` written before `min_tokens` was reached: stop strings are looked for
    /// only after them (0 without `min_tokens`).
    pub(crate) stop_floor: usize,
    /// When this child last produced a token.
    pub(crate) last_token_at: Option<Instant>,
    /// Where this child's output stands in the request's structured-output constraint.
    pub(crate) grammar: Option<TokenMatcher>,
    /// Prompt logprobs still to send: the index of the next prompt token whose logprob is
    /// wanted (from 1: the first token has none). While set, the prompt is computed from its
    /// first token (no prefix-cache hits: a cached position has no logits) in chunks of at most
    /// [`PROMPT_ROWS_CHUNK`] tokens, with a logits row for every position. `None`: not asked
    /// for, or all sent.
    pub(crate) prompt_rows: Option<usize>,
}

/// Most prompt tokens one step computes for the sequences that want prompt logprobs, all of
/// them together: each position's logits row is `vocab` f32s (49 152 × 4 B = 192 KiB on
/// SmolLM2), so 512 rows are ~100 MiB a step.
pub(crate) const PROMPT_ROWS_CHUNK: usize = 512;

impl Sequence {
    /// Tokens generated so far.
    pub(crate) fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether the next step computes prompt positions whose logits rows are wanted: it then
    /// takes from the step's [`PROMPT_ROWS_CHUNK`].
    pub(crate) fn wants_rows(&self) -> bool {
        self.prompt_rows.is_some() && self.num_computed < self.prompt_len
    }

    /// A child sharing every block of `self` (references are taken by the caller).
    pub(crate) fn fork(&self, child: usize, rng: ChaCha8Rng) -> Sequence {
        Sequence {
            request: self.request,
            child,
            tokens: self.tokens.clone(),
            prompt_len: self.prompt_len,
            num_computed: self.num_computed,
            blocks: self.blocks.clone(),
            hashes: self.hashes.clone(),
            root: self.root,
            cacheable: self.cacheable,
            rng,
            decoder: self.decoder.clone(),
            text: self.text.clone(),
            sent: self.sent,
            stop_floor: self.stop_floor,
            last_token_at: self.last_token_at,
            grammar: self.grammar.clone(),
            prompt_rows: self.prompt_rows,
        }
    }
}

//! The engine: one thread that owns the model, the KV pool and the scheduler, takes commands
//! ([`Engine::run`]) and steps while there is work.
//!
//! - `config`: what an engine is started with ([`EngineConfig`]); `load`: [`Engine::load`].
//! - here: the [`Engine`] type, its loop and commands (add, abort, remote KV ready), between-step
//!   housekeeping, and the checks a request passes before it is queued ([`validate`]).
//! - `step`: one step's pipeline: plan, batch, forward, commit, prompt logprobs, sample.
//! - `emit`: one token out of a child, in named steps (pick, grammar, detokenize, stops and
//!   hold-back, length, finish).
//! - `hand_off`: KV handed to others under a lease: a prefill's prompt for decode nodes, a
//!   finished turn retained for the conversation's next.

mod config;
mod emit;
mod hand_off;
mod load;
mod step;

pub use config::{EngineConfig, KvCompute, ModelDtype, PoolMemory};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use pd_grammar::{GrammarError, TokenMatcher, Vocabulary};
use pd_kv_pool::{CacheEvent, KvPool};
use pd_model::{Model, StagedKv};
use pd_tokenize::Tokenizer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{broadcast, mpsc as tokio_mpsc};

use crate::handle::{CacheSubscription, Command, EngineInfo};
use crate::lease_book::LeaseBook;
use crate::metrics::EngineMetrics;
use crate::request::{
    FinishReason, GenerateRequest, InvalidRequest, KvTransfer, RemoteKv, RequestEvent, RequestId,
    SamplingParams,
};
use crate::sampler;
use crate::scheduler::Scheduler;
use crate::sequence::Sequence;

/// Per-request state kept while any child is alive.
#[derive(Debug)]
struct RequestState {
    params: SamplingParams,
    /// How this request picks its first token, from its parameters as asked (before a missing
    /// seed was drawn): [`sampler::first_token_key`].
    first_token_key: u64,
    events: tokio_mpsc::UnboundedSender<RequestEvent>,
    arrival: Instant,
    /// Children not yet finished.
    open: usize,
    /// Whether the `n` children were forked off child 0 yet.
    forked: bool,
    /// When `Started` was sent: the request's first admission to run (a sequence preempted
    /// mid-prefill is admitted again; this stays the first).
    scheduled_at: Option<Instant>,
    first_token_at: Option<Instant>,
    /// Resolved `max_tokens`.
    max_tokens: usize,
    /// Longest stop string in bytes (text held back from the client).
    max_stop_len: usize,
    /// The tokens `min_tokens` holds back while a child is short of it
    /// ([`sampler::min_tokens_ban`]).
    min_tokens_ban: Vec<u32>,
    /// Its part in P/D disaggregation.
    kv: KvTransfer,
    /// The gateway it came through, which tags the leases granted for it.
    gateway: Option<Arc<str>>,
}

impl RequestState {
    /// What a child that has generated `generated` tokens may not pick now.
    fn banned(&self, generated: usize) -> &[u32] {
        if generated < self.params.min_tokens {
            &self.min_tokens_ban
        } else {
            &[]
        }
    }
}

/// The model, its KV pool and the scheduler, stepped by one thread.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    /// The compute pool, when the model does not compute on `pool` ([`KvCompute`]). Declared
    /// before `pool` so it drops first: a device pool page-locks the transfer pool's memory
    /// and must unregister it before that memory is freed.
    staged: Option<Box<dyn StagedKv>>,
    /// `staged`'s uploader, handed to pulls with their reservations
    /// ([`crate::KvReservation::upload`]) to upload their blocks as they land.
    uploader: Option<Arc<dyn pd_model::BlockUpload>>,
    /// The transfer pool: what peers read and pulls write.
    pool: KvPool,
    /// A staging copy of this step failed: the step fails instead of reading the block.
    compute_fault: Option<String>,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    info: EngineInfo,
    metrics: EngineMetrics,
    requests: HashMap<RequestId, RequestState>,
    eos: Vec<u32>,
    leases: Arc<LeaseBook>,
    cache_events: broadcast::Sender<CacheEvent>,
    /// [`EngineConfig::kv_hash_key`].
    hash_key: u64,
    /// [`EngineConfig::kv_retain_after_decode`].
    retain_after_decode: Option<std::time::Duration>,
    /// The vocabulary structured outputs compile against (built once at load), or why the
    /// tokenizer cannot have one.
    vocabulary: Result<Arc<Vocabulary>, GrammarError>,
}

impl Engine {
    /// The vocabulary structured outputs compile against ([`crate::EngineHandle::submit`]).
    pub(crate) fn vocabulary(&self) -> &Result<Arc<Vocabulary>, GrammarError> {
        &self.vocabulary
    }

    pub(crate) fn leases(&self) -> &Arc<LeaseBook> {
        &self.leases
    }

    pub(crate) fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub(crate) fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub(crate) fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// The engine thread's loop: take commands, step while there is work, sleep otherwise.
    pub(crate) fn run(mut self, commands: mpsc::Receiver<Command>) {
        loop {
            if !self.scheduler.has_work() {
                // Idle: sleep until a command arrives or the next lease is due.
                let c = match self.leases.next_deadline() {
                    None => commands
                        .recv()
                        .map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                    Some(due) => {
                        commands.recv_timeout(due.saturating_duration_since(Instant::now()))
                    }
                };
                match c {
                    Ok(c) => {
                        if !self.handle(c) {
                            break;
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            let mut stop = false;
            while let Ok(c) = commands.try_recv() {
                if !self.handle(c) {
                    stop = true;
                    break;
                }
            }
            if stop {
                break;
            }
            // After the commands, so a request that just arrived for remote KV is parked (and its
            // caller can start pulling) before this step, not after it.
            self.housekeeping();
            // Nothing could run (waiting sequences cannot get blocks held elsewhere): sleep until
            // a command arrives or a little time passed, instead of spinning.
            if self.scheduler.has_work() && !self.step() {
                match commands.recv_timeout(std::time::Duration::from_millis(10)) {
                    Ok(c) => {
                        if !self.handle(c) {
                            break;
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            // And after the step: its prefix-cache changes go out now, not when the next command
            // wakes an engine that went idle.
            self.housekeeping();
        }
        for (_, state) in self.requests.drain() {
            let _ = state.events.send(RequestEvent::Failed {
                message: "engine shut down".into(),
            });
        }
    }

    /// Applies one command; false means stop.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Add {
                id,
                request,
                grammar,
                arrival,
                events,
            } => self.add(id, *request, grammar.map(|g| *g), arrival, events),
            Command::Abort(id) => self.abort(id),
            Command::RemoteKv(id, outcome, landed) => self.remote_kv_ready(id, outcome, landed),
            Command::Wake => {}
            Command::SubscribeCache(reply) => {
                let _ = reply.send(CacheSubscription {
                    cached: self.scheduler.cached_hashes(),
                    events: self.cache_events.subscribe(),
                });
            }
            Command::Shutdown => return false,
        }
        true
    }

    /// Work between steps: drop the references of ended leases, park requests waiting for
    /// remote KV (telling their callers where to write), publish prefix-cache changes.
    fn housekeeping(&mut self) {
        let ended = self.leases.collect(Instant::now());
        self.scheduler.release_lease_refs(ended);
        let leases = &self.leases;
        let parked = self
            .scheduler
            .park_pending(&mut || leases.revoke_oldest_retained());
        if !parked.is_empty() {
            // Blocks taken from the cache are invalid from now on: poison them *before* the
            // caller starts writing pulled KV into them, not at the next step.
            for b in self.scheduler.take_freed() {
                self.pool.poison_block(b);
            }
            // Pulls may upload into these blocks from now on: after what this thread has asked
            // of the compute pool so far (a GPU's stream may still be writing a block freed
            // since).
            if let Some(u) = &self.uploader {
                u.mark();
            }
        }
        for (id, blocks, first_block, cached_tokens) in parked {
            if let Some(state) = self.requests.get(&id) {
                let reservation = crate::KvReservation::new(
                    id,
                    blocks,
                    (first_block, cached_tokens),
                    self.uploader.clone(),
                );
                let _ = state.events.send(RequestEvent::AwaitingKv(reservation));
            }
        }
        for e in self.scheduler.take_cache_events() {
            // No subscriber is fine: the event is dropped.
            let _ = self.cache_events.send(e);
        }
        self.update_gauges();
    }

    /// A consumer's wait for remote KV ended: it joins the queue with what arrived.
    fn remote_kv_ready(&mut self, id: RequestId, outcome: RemoteKv, landed: bool) {
        let (tokens, cacheable, first) = match outcome {
            RemoteKv::Pulled(n) => (n, true, None),
            RemoteKv::PulledUnattested(n) => (n, false, None),
            RemoteKv::PulledWithFirstToken {
                tokens,
                first_token,
                key,
            } => (tokens, true, Some((first_token, key))),
            RemoteKv::Recompute => (0, true, None),
        };
        // The producer's first token stands for ours when we sample once (one child) with
        // nothing else wanted from the logits. It was sampled under the parameters of the
        // request the producer got — a proxy sends it the same ones — and from the same seed:
        // our generator skips the draw it took (`Pick::Given`), so a seeded request stays the
        // same token for token as on one node.
        let first = first
            .filter(|&(_, key)| {
                self.requests.get(&id).is_some_and(|s| {
                    s.params.n == 1 && s.params.logprobs.is_none() && s.first_token_key == key
                })
            })
            .map(|(token, _)| token);
        let Some((prompt_tokens, held, pulled)) =
            self.scheduler
                .remote_kv_ready(id, tokens, cacheable, first.is_some())
        else {
            tracing::debug!(request = %id, "remote KV for a request no longer waiting");
            return;
        };
        // The pull wrote the transfer pool; the model reads the compute pool (unless the pull
        // uploaded the blocks as they landed).
        if let Some(s) = &mut self.staged
            && pulled > 0
            && !landed
        {
            let blocks = self.scheduler.waiting_blocks(id, held - pulled, held);
            let t = Instant::now();
            if let Err(e) = s.upload(&self.pool, &blocks) {
                tracing::error!(request = %id, error = %e, "staging pulled KV into the compute pool failed");
                if let Some(state) = self.requests.remove(&id) {
                    let _ = state.events.send(RequestEvent::Failed {
                        message: format!("staging pulled KV failed: {e}"),
                    });
                }
                self.scheduler.remove_request(id);
                self.update_gauges();
                return;
            }
            self.metrics.kv_staged_up.inc_by(blocks.len() as u64);
            self.metrics
                .kv_staging_up_seconds
                .observe(t.elapsed().as_secs_f64());
        }
        self.metrics.kv_pulled_tokens.inc_by(pulled as u64);
        if let Some(state) = self.requests.get_mut(&id)
            && state.scheduled_at.is_none()
        {
            state.scheduled_at = Some(Instant::now());
            self.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
            self.metrics
                .prefix_cache_queries
                .inc_by(prompt_tokens as u64);
            self.metrics
                .prefix_cache_hits
                .inc_by((held - pulled) as u64);
            let _ = state.events.send(RequestEvent::Started {
                prompt_tokens,
                cached_tokens: held,
                pulled_tokens: pulled,
            });
        }
        if let Some(token) = first
            && held == prompt_tokens
        {
            self.emit_first_token(id, token);
        }
    }

    fn add(
        &mut self,
        id: RequestId,
        request: GenerateRequest,
        grammar: Option<TokenMatcher>,
        arrival: Instant,
        events: tokio_mpsc::UnboundedSender<RequestEvent>,
    ) {
        let GenerateRequest {
            prompt_tokens,
            params,
            kv,
            cache_salt,
            gateway,
        } = request;
        let prompt_len = prompt_tokens.len();
        let max_tokens = match kv {
            // Prefill only: one token per child, as vLLM's proxies ask of a prefill node.
            KvTransfer::Produce { .. } | KvTransfer::PullThenProduce { .. } => 1,
            _ => params
                .max_tokens
                .unwrap_or(self.info.max_model_len - prompt_len),
        };
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        let seq = Sequence {
            request: id,
            child: 0,
            decoder: self
                .tokenizer
                .decoder_with_prompt(params.skip_special_tokens, &prompt_tokens),
            tokens: prompt_tokens,
            prompt_len,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            root: pd_kv_pool::root_hash(self.hash_key, cache_salt.as_deref()),
            cacheable: true,
            rng: ChaCha8Rng::seed_from_u64(seed),
            text: String::new(),
            sent: 0,
            stop_floor: 0,
            last_token_at: None,
            grammar,
            // The first prompt token has no logprob; a one-token prompt has none to send.
            prompt_rows: params.prompt_logprobs.filter(|_| prompt_len > 1).map(|_| 1),
        };
        if seq.grammar.is_some() {
            self.metrics.structured_requests.inc();
        }
        let max_stop_len = params.stop.iter().map(String::len).max().unwrap_or(0);
        let min_tokens_ban = sampler::min_tokens_ban(&params, &self.eos);
        self.requests.insert(
            id,
            RequestState {
                open: params.n,
                first_token_key: sampler::first_token_key(&params),
                params: SamplingParams {
                    seed: Some(seed),
                    ..params
                },
                events,
                arrival,
                forked: false,
                scheduled_at: None,
                first_token_at: None,
                max_tokens,
                max_stop_len,
                min_tokens_ban,
                kv,
                gateway,
            },
        );
        let remote_kv = matches!(kv, KvTransfer::Consume | KvTransfer::PullThenProduce { .. });
        self.scheduler.enqueue(seq, remote_kv);
        self.update_gauges();
    }

    pub(super) fn abort(&mut self, id: RequestId) {
        if let Some(state) = self.requests.remove(&id) {
            let n = self.scheduler.remove_request(id);
            tracing::debug!(request = %id, sequences = n, "request aborted");
            self.metrics.requests_finished.inc();
            // Its open children end here, unmeasured (their sequences are gone).
            self.metrics
                .request_success
                .with_label_values(&[FinishReason::Abort.as_str()])
                .inc_by(state.open as u64);
            self.update_gauges();
        }
    }

    /// The queue and pool gauges, from the scheduler's counts.
    pub(super) fn update_gauges(&self) {
        let n = self.scheduler.lengths();
        self.metrics.running.set(n.running as i64);
        self.metrics.waiting.set(n.waiting as i64);
        self.metrics.waiting_remote_kv.set(n.remote as i64);
        self.metrics.kv_blocks_free.set(n.free_blocks as i64);
    }
}

/// Checks `request` against the model and pool before it is queued.
pub(crate) fn validate(info: &EngineInfo, request: &GenerateRequest) -> Result<(), InvalidRequest> {
    request.params.validate()?;
    let len = request.prompt_tokens.len();
    if len == 0 {
        return Err(InvalidRequest::new("prompt", "the prompt is empty"));
    }
    if let Some(&t) = request
        .prompt_tokens
        .iter()
        .find(|&&t| t as usize >= info.vocab_size)
    {
        return Err(InvalidRequest::new(
            "prompt",
            format!(
                "token id {t} is outside the vocabulary ({})",
                info.vocab_size
            ),
        ));
    }
    if let Some(&(t, _)) = request
        .params
        .logit_bias
        .iter()
        .find(|&&(t, _)| t as usize >= info.vocab_size)
    {
        return Err(InvalidRequest::new(
            "logit_bias",
            format!(
                "logit_bias names token id {t}, outside the vocabulary ({})",
                info.vocab_size
            ),
        ));
    }
    if len >= info.max_model_len {
        return Err(InvalidRequest::new(
            "prompt",
            format!(
                "This model's maximum context length is {} tokens. However, your prompt has {len} tokens \
                 (at least one token must be left for the completion).",
                info.max_model_len
            ),
        ));
    }
    // A prefill for a decode node generates one token whatever `max_tokens` says (vLLM's
    // proxies send it 1): `min_tokens` is the decode node's to check.
    let producing = matches!(
        request.kv,
        KvTransfer::Produce { .. } | KvTransfer::PullThenProduce { .. }
    );
    // Prompt logprobs come from computing the prompt here, and the node that computes it must
    // answer: neither a prefill for another node nor KV pulled from one.
    if request.params.prompt_logprobs.is_some() && !matches!(request.kv, KvTransfer::Local) {
        return Err(InvalidRequest::new(
            "kv_transfer_params",
            "prompt logprobs (echo with logprobs, prompt_logprobs) are computed by the node that \
             answers: send the request to one node, without kv_transfer_params",
        ));
    }
    if let Some(max) = request.params.max_tokens
        && request.params.min_tokens > max
        && !producing
    {
        return Err(InvalidRequest::new(
            "min_tokens",
            format!(
                "min_tokens ({}) must not exceed max_tokens ({max})",
                request.params.min_tokens
            ),
        ));
    }
    if let Some(m) = request.params.max_tokens
        && m > info.max_model_len.saturating_sub(len)
    {
        return Err(InvalidRequest::new(
            "max_tokens",
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens \
                 ({len} in the prompt, {m} in the completion).",
                info.max_model_len,
                len + m
            ),
        ));
    }
    Ok(())
}

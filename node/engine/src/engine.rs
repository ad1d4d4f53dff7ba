//! One engine step: schedule, run the batch through the model, sample, emit events.

use std::path::PathBuf;

/// Everything needed to start an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The model: a Hugging Face directory (config.json, *.safetensors, tokenizer files), a GGUF
    /// file, or a directory holding one GGUF file ([`pd_model::ModelSource::open`]).
    pub model_dir: PathBuf,
    /// Name clients must use in `model`; defaults to the directory's name (a GGUF file's name
    /// without `.gguf`).
    pub served_model_name: Option<String>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool; overrides `kv_cache_memory` when set.
    pub num_blocks: Option<usize>,
    /// Bytes of KV pool to allocate when `num_blocks` is unset.
    pub kv_cache_memory: usize,
    /// Element type of the KV pool; `None`: the model's default, f16 for a GGUF model
    /// (quantized weights gain nothing from f32 KV, which doubles the pool and every KV
    /// transfer), f32 for a Hugging Face directory. Attention accumulates in f32 either way.
    pub kv_cache_dtype: Option<KvDtype>,
    /// Order inside a block of the KV pool: `hnd` (the CPU kernels') or `nhd` (the GPU
    /// layout). Peers with the other order, or another block size, still exchange KV: the
    /// consumer converts after the pull.
    pub kv_layout: KvOrder,
    /// Token budget of one step (decode tokens + prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Context length limit; defaults to the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Reuse cached full blocks across requests.
    pub enable_prefix_caching: bool,
    /// Where the pool's memory comes from; `None`: the heap. A node that serves KV to peers
    /// allocates it through UCX so they can read it one-sidedly.
    pub pool_memory: Option<PoolMemory>,
    /// How long a prefill node keeps a finished prompt's blocks for a decode node unless the
    /// lease is renewed (vLLM's `kv_lease_duration`).
    pub kv_lease_duration: std::time::Duration,
    /// Share of the pool that leases for decode nodes may hold (0 < f ≤ 1); a prefill request
    /// that would take leases beyond it is refused ([`crate::EngineError::LeaseCapacity`]), so
    /// the node's own prefills always find blocks.
    pub kv_max_leased_fraction: f64,
    /// Keep a finished request's full blocks (prompt and generated tokens) under a lease for
    /// this long, for the conversation's next turn to pull or reuse here
    /// ([`RequestEvent::Retained`]); `None`: free them at once. The engine revokes the oldest
    /// such lease when it needs blocks, before preempting anything.
    pub kv_retain_after_decode: Option<std::time::Duration>,
    /// The per-deployment prefix-cache hash key ([`pd_kv_pool::hash_key`] of the operator's
    /// secret; 0: none). The gateway must hash with the same key.
    pub kv_hash_key: u64,
    /// How a GGUF model's quantized weights are held and multiplied (ignored for a Hugging
    /// Face directory). Default: [`QuantPolicy::Fast`].
    pub gguf_weights: QuantPolicy,
    /// Where the model computes on its KV: on the transfer pool itself, or on a compute pool
    /// blocks are staged through ([`pd_model::kv_store`]).
    pub kv_compute: KvCompute,
    /// What the model's weights and activations are held in (`pd-node --dtype`).
    pub dtype: ModelDtype,
}

/// What a model's weights and activations are held in. Attention reads f32 queries and
/// accumulates in f32 whatever this is; logits are f32; the KV pool's own element type is
/// [`EngineConfig::kv_cache_dtype`] (by default it follows this one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ModelDtype {
    /// f32 on the CPU (exact and fastest there for dense weights); on CUDA the checkpoint's
    /// own f16 or bf16 (`torch_dtype`), else bf16, as vLLM's `--dtype auto` picks. GGUF: f32.
    #[default]
    Auto,
    /// 32-bit float.
    F32,
    /// 16-bit float (Hugging Face directories only).
    F16,
    /// bfloat16 (Hugging Face directories only).
    Bf16,
}

impl ModelDtype {
    /// Parses `auto`, `f32`/`float32`, `f16`/`float16`/`half`, `bf16`/`bfloat16`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "auto" => Self::Auto,
            "f32" | "float32" | "float" => Self::F32,
            "f16" | "float16" | "half" => Self::F16,
            "bf16" | "bfloat16" => Self::Bf16,
            _ => return None,
        })
    }

    /// The dtype to compute in for `source` on `compute`.
    fn resolve(self, compute: KvCompute, source: &ModelSource) -> Result<DType, EngineError> {
        Ok(match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::Bf16 => DType::BF16,
            Self::Auto => match (compute, source) {
                (KvCompute::Cuda(_), ModelSource::HfDir(_)) => match source.stored_dtype()? {
                    Some(DType::F16) => DType::F16,
                    _ => DType::BF16,
                },
                _ => DType::F32,
            },
        })
    }
}

/// Where the model runs and keeps the KV it computes on ([`pd_model::kv_store`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvCompute {
    /// On the CPU, over the transfer pool itself (no copies).
    #[default]
    InPlace,
    /// On the CPU, over a second host pool; blocks are copied to the transfer pool before a
    /// lease is granted on them and from it after a pull, exactly as on a GPU. This is the GPU
    /// path's staging, testable without a GPU (`pd-node --kv-staged`).
    HostStaged,
    /// On CUDA device `ordinal`: weights, activations and the compute pool in device memory,
    /// staged to and from the host transfer pool (`cuda` feature; **never run on a GPU so
    /// far**: `docs/gpu.md`).
    Cuda(usize),
}

/// Allocates the KV pool for a layout (e.g. in UCX-allocated memory).
#[derive(Clone)]
pub struct PoolMemory(
    pub std::sync::Arc<dyn Fn(KvLayout) -> Result<KvPool, pd_kv_pool::AllocatorError> + Send + Sync>,
);

impl std::fmt::Debug for PoolMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolMemory(..)")
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            model_dir: PathBuf::new(),
            served_model_name: None,
            block_size: 16,
            num_blocks: None,
            kv_cache_memory: 256 << 20,
            kv_cache_dtype: None,
            kv_layout: KvOrder::Hnd,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: None,
            enable_prefix_caching: true,
            pool_memory: None,
            kv_lease_duration: std::time::Duration::from_secs(30),
            kv_max_leased_fraction: 0.9,
            kv_retain_after_decode: None,
            kv_hash_key: 0,
            gguf_weights: QuantPolicy::Fast,
            kv_compute: KvCompute::InPlace,
            dtype: ModelDtype::Auto,
        }
    }
}

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use candle_core::{DType, Device};
use pd_grammar::{GrammarError, TokenMatcher, Vocabulary};
use pd_kv_pool::{CacheEvent, KvDtype, KvLayout, KvOrder, KvPool};
use pd_model::gguf::QuantPolicy;
use pd_model::{BatchInput, Model, ModelSource};
use pd_model::{PagedKv, StagedKv};
use pd_tokenize::Tokenizer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{broadcast, mpsc as tokio_mpsc};

use crate::error::EngineError;
use crate::handle::{CacheSubscription, Command, EngineInfo};
use crate::lease_book::LeaseBook;
use crate::metrics::EngineMetrics;
use crate::request::{
    FinishReason, GenerateRequest, InvalidRequest, KvHandoff, KvTransfer, RemoteKv, RequestEvent,
    RequestId, SamplingParams,
};
use crate::sampler;
use crate::scheduler::{Scheduler, SchedulerConfig, StepPlan};
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
    /// `staged`'s uploader, for pulls that upload their blocks as they land.
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

/// Prefix-cache events buffered for a subscriber that is slow to read; past this it lags and
/// resubscribes (the engine never waits).
const CACHE_EVENT_CAPACITY: usize = 16 * 1024;

impl Engine {
    /// Loads the model and tokenizer of `cfg.model_dir` and allocates the KV pool.
    ///
    /// # Errors
    /// [`EngineError::Model`] naming an unsupported architecture/dtype or a missing file,
    /// [`EngineError::Tokenize`] for tokenizer files, [`EngineError::Invalid`] for a pool too small.
    pub fn load(cfg: &EngineConfig) -> Result<Self, EngineError> {
        let device = compute_device(cfg.kv_compute)?;
        let source = ModelSource::open(&cfg.model_dir)?;
        let dtype = cfg.dtype.resolve(cfg.kv_compute, &source)?;
        if dtype == DType::BF16 && device.is_cpu() {
            // candle-core 0.11 multiplies bf16 on the CPU by converting to f32 on every call.
            tracing::warn!(
                "bf16 on the CPU decodes ~4x slower than f32 (BENCHMARKS.md, \"The model's dtype\"); \
                 it is meant for CUDA, or for testing what a GPU node computes"
            );
        }
        let model = source.load_model_as(&device, cfg.gguf_weights, dtype)?;
        let tokenizer = Arc::new(source.tokenizer()?);
        let fingerprint = source.fingerprint()?;
        let mc = model.config().clone();
        let bad =
            |param: &'static str, m: String| EngineError::Invalid(InvalidRequest::new(param, m));
        if cfg.block_size == 0 || cfg.max_num_batched_tokens == 0 || cfg.max_num_seqs == 0 {
            return Err(bad(
                "block_size",
                "block size, token budget and sequence limit must be positive".into(),
            ));
        }
        let mut layout = KvLayout {
            num_blocks: 0,
            block_size: cfg.block_size,
            num_layers: mc.num_layers,
            num_kv_heads: mc.num_kv_heads,
            head_dim: mc.head_dim,
            dtype: cfg.kv_cache_dtype.unwrap_or(match (&source, dtype) {
                (ModelSource::Gguf(_), _) => KvDtype::F16,
                (ModelSource::HfDir(_), DType::F16) => KvDtype::F16,
                (ModelSource::HfDir(_), DType::BF16) => KvDtype::BF16,
                (ModelSource::HfDir(_), _) => KvDtype::F32,
            }),
            order: cfg.kv_layout,
        };
        layout.num_blocks = cfg.num_blocks.unwrap_or_else(|| {
            KvLayout::blocks_for_bytes(cfg.kv_cache_memory, layout.block_bytes())
        });
        if layout.num_blocks == 0 {
            return Err(bad(
                "num_gpu_blocks",
                format!(
                    "KV pool of {} bytes holds no block of {} bytes",
                    cfg.kv_cache_memory,
                    layout.block_bytes()
                ),
            ));
        }
        let pool = match &cfg.pool_memory {
            Some(f) => (f.0)(layout),
            None => KvPool::new(layout),
        }
        .map_err(|e| {
            bad(
                "kv_cache_memory",
                format!("cannot allocate the KV pool: {e}"),
            )
        })?;
        let mut staged = compute_pool(cfg.kv_compute, layout, &device)?;
        let uploader = match &mut staged {
            Some(s) => {
                tracing::info!(kv_path = s.path(), "the model computes on a staged KV pool");
                s.uploader(&pool)
                    .map_err(|e| bad("kv_compute", format!("cannot upload pulled blocks: {e}")))?
            }
            None => None,
        };
        // Candle's CUDA device queues on the per-thread default stream: the weights' copies and
        // the compute pool's zeroing were queued on this thread's, while the engine computes on
        // its own thread's. Let them finish before the engine thread starts.
        device.synchronize().map_err(|e| {
            EngineError::Invalid(InvalidRequest::new(
                "device",
                format!("the device did not finish loading: {e}"),
            ))
        })?;
        let capacity = layout.num_blocks * layout.block_size;
        let mut max_model_len = cfg
            .max_model_len
            .unwrap_or(mc.max_position_embeddings)
            .min(mc.max_position_embeddings);
        #[cfg(feature = "cuda")]
        if matches!(cfg.kv_compute, KvCompute::Cuda(_))
            && max_model_len > pd_kernels::cuda::MAX_ATTENTION_POSITIONS
        {
            tracing::warn!(
                max_model_len,
                limit = pd_kernels::cuda::MAX_ATTENTION_POSITIONS,
                "the CUDA attention kernel attends over at most this many positions; capping max_model_len"
            );
            max_model_len = pd_kernels::cuda::MAX_ATTENTION_POSITIONS;
        }
        if max_model_len > capacity {
            tracing::warn!(
                max_model_len,
                capacity,
                "KV pool holds fewer tokens than the context; capping max_model_len"
            );
            max_model_len = capacity;
        }
        let model_name = cfg
            .served_model_name
            .clone()
            .unwrap_or_else(|| source.default_name());
        // The tokenizer's own EOS first: the one a constrained output ends with.
        let mut eos = tokenizer.eos_token_ids().to_vec();
        eos.extend_from_slice(&mc.eos_token_ids);
        let started = Instant::now();
        let vocabulary = Vocabulary::new(tokenizer.clone(), &eos).map(Arc::new);
        match &vocabulary {
            Ok(v) => tracing::debug!(
                tokens = v.size(),
                ms = started.elapsed().as_millis() as u64,
                "structured output vocabulary built"
            ),
            Err(e) => tracing::warn!(error = %e, "structured output unavailable"),
        }
        eos.sort_unstable();
        eos.dedup();
        let metrics = EngineMetrics::new();
        metrics.kv_blocks_total.set(layout.num_blocks as i64);
        metrics.kv_blocks_free.set(layout.num_blocks as i64);
        tracing::info!(
            model = %model_name, blocks = layout.num_blocks, block_size = layout.block_size,
            pool_bytes = layout.pool_bytes(), dtype = dtype.as_str(), kv_cache_dtype = layout.dtype.as_str(), kv_layout = layout.order.as_str(), max_model_len,
            "engine ready"
        );
        Ok(Self {
            info: EngineInfo {
                model_name,
                max_model_len,
                block_size: layout.block_size,
                num_blocks: layout.num_blocks,
                vocab_size: mc.vocab_size,
                kv_layout: layout,
                fingerprint,
                max_leased_blocks: max_leased_blocks(cfg.kv_max_leased_fraction, layout.num_blocks),
                kv_path: staged.as_ref().map_or("in-place", |s| s.path()),
            },
            scheduler: Scheduler::new(
                SchedulerConfig {
                    block_size: layout.block_size,
                    max_num_batched_tokens: cfg.max_num_batched_tokens,
                    max_num_seqs: cfg.max_num_seqs,
                    enable_prefix_caching: cfg.enable_prefix_caching,
                },
                layout.num_blocks,
            )
            .recording_cache_events(),
            model,
            pool,
            staged,
            uploader,
            compute_fault: None,
            tokenizer,
            metrics,
            requests: HashMap::new(),
            eos,
            leases: Arc::new(LeaseBook::new(cfg.kv_lease_duration, rand::random())),
            hash_key: cfg.kv_hash_key,
            retain_after_decode: cfg.kv_retain_after_decode.filter(|d| !d.is_zero()),
            vocabulary,
            cache_events: broadcast::channel(CACHE_EVENT_CAPACITY).0,
        })
    }

    /// The staged pool's uploader for pulls ([`crate::EngineHandle::uploader`]).
    pub(crate) fn uploader(&self) -> Option<Arc<dyn pd_model::BlockUpload>> {
        self.uploader.clone()
    }

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
                let _ = state.events.send(RequestEvent::AwaitingKv {
                    blocks,
                    first_block,
                    cached_tokens,
                });
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

    /// Emits `token` as the first token of `request`'s single sequence, which waits at the
    /// queue's front with its whole prompt held: no forward pass. The sequence then decodes from
    /// the next step like any other (its first step computes this token's KV), or, when this
    /// token finished it, ends here.
    fn emit_first_token(&mut self, request: RequestId, token: u32) {
        // Emitting works on running sequences; this one is there only for the call.
        let Some(index) = self.scheduler.emit_from_front(request) else {
            return;
        };
        let outcome = self.emit_token(index, Pick::Given(token));
        self.scheduler.end_emit(index, outcome != Ok(false));
        if outcome.is_err() {
            self.abort(request);
        }
        self.update_gauges();
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
            },
        );
        let remote_kv = matches!(kv, KvTransfer::Consume | KvTransfer::PullThenProduce { .. });
        self.scheduler.enqueue(seq, remote_kv);
        self.update_gauges();
    }

    fn abort(&mut self, id: RequestId) {
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

    /// One step, in its phases: [`Engine::plan`] (what runs, pool work before it),
    /// [`Engine::batch`], [`Engine::forward`], the scheduler's `commit`, [`Engine::sample`]
    /// (handoffs, forks, tokens out), then the scheduler's `retire`. False when nothing could
    /// be scheduled.
    fn step(&mut self) -> bool {
        let plan = self.plan();
        if plan.scheduled.is_empty() {
            return false; // (`plan` updated the gauges)
        }
        let (batch, rows, prefill_tokens) = self.batch(&plan);
        let Some((logits, vocab)) = self.forward(&plan, &batch, prefill_tokens) else {
            return true;
        };
        for s in &plan.scheduled {
            self.scheduler.commit(*s);
        }
        self.prompt_logprobs(&logits, vocab, &rows);
        let out = self.sample(&logits, vocab, &rows);
        self.scheduler.retire(&out.finished, &out.parked, &out.gone);
        for id in out.gone {
            self.abort(id);
        }
        self.update_gauges();
        true
    }

    /// Plans the step (reclaiming retained turns before preempting), tells newly admitted
    /// requests they started, poisons freed blocks and makes the copy-on-write copies.
    fn plan(&mut self) -> StepPlan {
        let leases = &self.leases;
        let plan = self
            .scheduler
            .schedule_with(&mut || leases.revoke_oldest_retained());
        self.metrics.preemptions.inc_by(plan.preempted as u64);
        for &(id, cached) in &plan.admitted {
            if let Some(state) = self.requests.get_mut(&id)
                && state.scheduled_at.is_none()
            {
                state.scheduled_at = Some(Instant::now());
                let prompt_tokens = self
                    .scheduler
                    .running()
                    .iter()
                    .find(|s| s.request == id)
                    .map_or(0, |s| s.prompt_len);
                self.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
                self.metrics
                    .prefix_cache_queries
                    .inc_by(prompt_tokens as u64);
                self.metrics.prefix_cache_hits.inc_by(cached as u64);
                let _ = state.events.send(RequestEvent::Started {
                    prompt_tokens,
                    cached_tokens: cached,
                    pulled_tokens: 0,
                });
            }
        }
        for b in self.scheduler.take_freed() {
            self.pool.poison_block(b);
        }
        for &(src, dst) in &plan.copies {
            match &mut self.staged {
                None => self.pool.copy_block(src, dst),
                Some(s) => {
                    if let Err(e) = s.copy_block(src, dst) {
                        // Blocks come from the scheduler, inside the pool: a device failure.
                        // The step must not read the block it did not fill: it fails.
                        tracing::error!(error = %e, "copy-on-write on the compute pool failed");
                        self.compute_fault = Some(e.to_string());
                    }
                }
            }
        }
        self.scheduler.finish_copies(&plan.copies);
        // Gauges show this step's allocations before any of its events goes out.
        self.update_gauges();
        plan
    }

    /// The step's input; what each logits row is for, in row order; and the prompt tokens it
    /// computes (decode rows are one token past the prompt).
    fn batch(&self, plan: &StepPlan) -> (BatchInput, Vec<Row>, usize) {
        let bs = self.info.block_size;
        let mut batch = BatchInput::default();
        let mut rows = Vec::new();
        let mut prefill_tokens = 0;
        for s in &plan.scheduled {
            let seq = self.scheduler.seq(s.index);
            let start = seq.num_computed;
            let end = start + s.num_tokens;
            let want_logits = end == seq.tokens.len();
            // Prompt logprobs: the row at position p scores prompt token p + 1; rows of the
            // positions still unsent, short of the last prompt position (that row is sampled).
            let prompt_rows = seq.prompt_rows.map_or(0..0, |next| {
                start.max(next - 1)..end.min(seq.prompt_len - 1)
            });
            if let Err(e) = batch.push_seq_with_rows(
                &seq.tokens[start..end],
                start,
                &seq.blocks,
                bs,
                prompt_rows.clone(),
                want_logits,
            ) {
                tracing::error!(error = %e, "scheduler produced an invalid batch");
            }
            rows.extend(prompt_rows.map(|position| Row::Prompt {
                index: s.index,
                position,
            }));
            if want_logits {
                rows.push(Row::Sample(s.index));
            }
            prefill_tokens += (start + s.num_tokens)
                .min(seq.prompt_len)
                .saturating_sub(start);
        }
        (batch, rows, prefill_tokens)
    }

    /// Runs the model: `(rows, vocab)` logits copied out once for the whole step, read row by
    /// row. On a model error every request in the step fails and leaves (`None`).
    fn forward(
        &mut self,
        plan: &StepPlan,
        batch: &BatchInput,
        prefill_tokens: usize,
    ) -> Option<(Vec<f32>, usize)> {
        let started = Instant::now();
        let kv: &mut dyn PagedKv = match &mut self.staged {
            Some(s) => s.as_mut(),
            None => &mut self.pool,
        };
        let logits = match self.compute_fault.take() {
            Some(e) => Err(pd_model::ModelError::Device(e)),
            None => self.model.forward(batch, kv).and_then(|l| {
                let vocab = l.dim(1)?;
                Ok((l.flatten_all()?.to_vec1::<f32>()?, vocab))
            }),
        };
        match logits {
            Ok(l) => {
                if prefill_tokens >= crate::metrics::PREFILL_RATE_MIN_TOKENS {
                    let secs = started.elapsed().as_secs_f64();
                    crate::metrics::ewma(
                        &self.metrics.prefill_tokens_per_second,
                        prefill_tokens as f64 / secs,
                    );
                }
                Some(l)
            }
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed");
                let ids: HashSet<RequestId> = plan
                    .scheduled
                    .iter()
                    .map(|s| self.scheduler.seq(s.index).request)
                    .collect();
                for id in ids {
                    if let Some(state) = self.requests.remove(&id) {
                        let _ = state.events.send(RequestEvent::Failed {
                            message: format!("model error: {e}"),
                        });
                    }
                    self.scheduler.remove_request(id);
                }
                self.update_gauges();
                None
            }
        }
    }

    /// Scores the prompt rows of the step: one [`RequestEvent::PromptLogprobs`] per sequence
    /// and step, for the prompt tokens its rows score, in order. A sequence preempted and
    /// computed again sends nothing twice (`prompt_rows` only moves forward).
    fn prompt_logprobs(&mut self, logits: &[f32], vocab: usize, rows: &[Row]) {
        // (rows, vocab) logits, row r for rows[r].
        let mut r = 0;
        while r < rows.len() {
            let Row::Prompt { index, position } = rows[r] else {
                r += 1;
                continue;
            };
            let run = rows[r..]
                .iter()
                .take_while(|row| matches!(row, Row::Prompt { index: i, .. } if *i == index))
                .count();
            let seq = self.scheduler.seq_mut(index);
            let Some(state) = self.requests.get(&seq.request) else {
                r += run;
                continue;
            };
            let k = state.params.prompt_logprobs.unwrap_or(0);
            let scored: Vec<crate::TokenLogprob> = (0..run)
                .filter_map(|j| {
                    let row = logits.get((r + j) * vocab..(r + j + 1) * vocab)?;
                    let token = *seq.tokens.get(position + j + 1)?;
                    Some(sampler::logprobs(row, token, k))
                })
                .collect();
            let next = position + run + 1;
            seq.prompt_rows = (next < seq.prompt_len).then_some(next);
            let _ = state.events.send(RequestEvent::PromptLogprobs {
                first: position + 1,
                logprobs: scored,
            });
            r += run;
        }
    }

    /// Turns each sampled row into tokens. A request's first sample also hands its prompt's KV
    /// off ([`Engine::hand_off`]) and forks its `n` children, who all take a token from the
    /// same row.
    fn sample(&mut self, logits: &[f32], vocab: usize, rows: &[Row]) -> StepOutcome {
        let mut out = StepOutcome::default();
        let sampled = rows
            .iter()
            .zip(logits.chunks_exact(vocab.max(1)))
            .filter_map(|(r, row)| match r {
                Row::Sample(index) => Some((row, index)),
                Row::Prompt { .. } => None,
            });
        for (row, &index) in sampled {
            let id = self.scheduler.seq(index).request;
            let Some(state) = self.requests.get_mut(&id) else {
                continue;
            };
            let mut children = vec![index];
            if !state.forked {
                state.forked = true;
                let (n, seed) = (state.params.n, state.params.seed.unwrap_or(0));
                self.hand_off(id, index, row);
                let (all, parked) = self.scheduler.fork(index, n, seed);
                children = all;
                out.parked.extend(parked);
            }
            for i in children {
                match self.emit_token(i, Pick::Sample(row)) {
                    Ok(true) => {
                        let s = self.scheduler.seq(i);
                        out.finished.insert((s.request, s.child));
                    }
                    Ok(false) => {}
                    Err(()) => {
                        out.gone.insert(id);
                    }
                }
            }
        }
        out
    }

    /// A prefill's computed prompt: leases its blocks to each decode node that will pull them,
    /// once for all `n` children (they would share them anyway). Each lease holds its own
    /// reference per block, so one consumer's release never frees blocks another still reads.
    /// Nothing for other requests, or for a client already gone (nobody could hand a lease to
    /// a decode node).
    fn hand_off(&mut self, id: RequestId, index: usize, row: &[f32]) {
        let Some(state) = self.requests.get(&id) else {
            return;
        };
        let (KvTransfer::Produce { consumers } | KvTransfer::PullThenProduce { consumers }) =
            state.kv
        else {
            return;
        };
        if state.events.is_closed() {
            return;
        }
        let seq = self.scheduler.seq(index);
        let blocks = seq.blocks[..seq.prompt_len.div_ceil(self.info.block_size)].to_vec();
        let num_tokens = seq.prompt_len;
        // Bound to what the blocks hold: a reader checks it on confirm. A single completion's
        // first token goes with it — the token `emit_token` samples next, drawn here from a
        // copy of the sequence's generator in the same state — so a reader that wants nothing
        // else from the logits need not compute the last prompt position again.
        let first = (state.params.n == 1 && state.params.logprobs.is_none())
            .then(|| {
                let history = sampler::History::of(&seq.tokens, seq.prompt_len);
                let mut rng = seq.rng.clone();
                let banned = state.banned(0);
                match seq.grammar.clone() {
                    None => Some(sampler::sample(
                        row,
                        &state.params,
                        history,
                        banned,
                        &mut rng,
                    )),
                    Some(mut grammar) => {
                        // As `emit_token` will: the row masked by the constraint first.
                        let mut masked = row.to_vec();
                        grammar.mask(&mut masked).ok()?;
                        Some(sampler::sample(
                            &masked,
                            &state.params,
                            history,
                            banned,
                            &mut rng,
                        ))
                    }
                }
            })
            .flatten();
        let contents = pd_kv_pool::LeaseContents::of(&seq.tokens[..seq.prompt_len])
            .in_blocks(&blocks)
            .with_next_token(first, state.first_token_key);
        // A peer reads the transfer pool: the computed KV goes there before any lease names it.
        if let Err(e) = stage_down(&mut self.staged, &mut self.pool, &self.metrics, &blocks) {
            tracing::error!(request = %id, error = %e, "staging the prompt's KV for its lease failed; no lease");
            return;
        }
        for _ in 0..consumers.max(1) {
            self.scheduler.hold_for_lease(&blocks);
            let lease = self
                .leases
                .grant(blocks.clone(), contents, "", Instant::now());
            tracing::debug!(request = %id, lease = %lease.id, blocks = lease.blocks.len(), "prompt KV leased");
            let _ = state.events.send(RequestEvent::KvReady(KvHandoff {
                lease: lease.id,
                generation: lease.generation,
                deadline: to_system_time(lease.deadline),
                block_ids: lease.blocks,
                num_tokens,
                last_block_hash: None,
                board_slot: lease.slot,
            }));
        }
    }

    /// Picks a token for `running[index]` (samples it, or takes the one given), updates its
    /// text and sends the events. `Ok(true)`: the child finished. `Err(())`: the client is gone.
    fn emit_token(&mut self, index: usize, pick: Pick<'_>) -> Result<bool, ()> {
        let seq = self.scheduler.seq_mut(index);
        let Some(state) = self.requests.get_mut(&seq.request) else {
            return Err(());
        };
        let (token, logprob) = match pick {
            Pick::Sample(logits) => {
                // Structured output: the row masked to the tokens that keep the output valid,
                // before anything else reads it.
                let masked;
                let logits = match &mut seq.grammar {
                    None => logits,
                    Some(grammar) => {
                        let mut row = logits.to_vec();
                        if let Err(e) = grammar.mask(&mut row) {
                            fail_structured(&state.events, &self.metrics, seq.request, &e);
                            return Err(());
                        }
                        masked = row;
                        &masked[..]
                    }
                };
                let history = sampler::History::of(&seq.tokens, seq.prompt_len);
                let banned = state.banned(seq.num_generated());
                let token = sampler::sample(logits, &state.params, history, banned, &mut seq.rng);
                let logprob = state
                    .params
                    .logprobs
                    .map(|k| sampler::logprobs(logits, token, k));
                (token, logprob)
            }
            Pick::Given(token) => {
                sampler::skip_draw(&state.params, &mut seq.rng);
                if let Some(grammar) = &mut seq.grammar {
                    // As one node would have: this position's mask computed (so the matcher
                    // and its caches stand where they would), the token checked against it.
                    let mut scratch = vec![0.0f32; self.info.vocab_size];
                    let allowed = grammar.mask(&mut scratch).and_then(|()| {
                        match scratch.get(token as usize) {
                            Some(l) if l.is_finite() => Ok(()),
                            _ => Err(GrammarError::Failed(format!(
                                "the producer's first token {token} breaks the constraint"
                            ))),
                        }
                    });
                    if let Err(e) = allowed {
                        fail_structured(&state.events, &self.metrics, seq.request, &e);
                        return Err(());
                    }
                }
                (token, None)
            }
        };
        if let Some(grammar) = &mut seq.grammar
            && let Err(e) = grammar.accept(token)
        {
            fail_structured(&state.events, &self.metrics, seq.request, &e);
            return Err(());
        }
        seq.tokens.push(token);
        let now = Instant::now();
        match (state.first_token_at, seq.last_token_at) {
            (None, _) => {
                state.first_token_at = Some(now);
                self.metrics
                    .time_to_first_token
                    .observe((now - state.arrival).as_secs_f64());
            }
            (_, Some(prev)) => self
                .metrics
                .inter_token_latency
                .observe((now - prev).as_secs_f64()),
            _ => {}
        }
        seq.last_token_at = Some(now);
        self.metrics.generation_tokens.inc();

        let mut reason = None;
        // A constrained output allows EOS only where it is complete: it ends there even under
        // `ignore_eos`.
        let eos_ends = !state.params.ignore_eos || seq.grammar.is_some();
        if (eos_ends && self.eos.contains(&token)) || state.params.stop_token_ids.contains(&token) {
            reason = Some(FinishReason::Stop);
        } else {
            let piece = seq
                .decoder
                .step(&self.tokenizer, token)
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, token, "detokenization failed");
                    String::new()
                });
            // Stop strings count from `min_tokens` on (vLLM's rule), this token included, and
            // only where they start in text written from then on (earlier text was let through
            // unchecked, and may have been sent).
            let generated = seq.num_generated();
            let may_stop = generated >= state.params.min_tokens;
            if generated == state.params.min_tokens {
                seq.stop_floor = seq.text.len();
            }
            let search_from = seq
                .sent
                .saturating_sub(state.max_stop_len)
                .max(seq.stop_floor);
            seq.text.push_str(&piece);
            if let Some(at) = may_stop
                .then(|| find_stop(&seq.text, search_from, &state.params.stop))
                .flatten()
            {
                seq.text.truncate(at);
                reason = Some(FinishReason::Stop);
            } else if seq.grammar.as_ref().is_some_and(TokenMatcher::is_complete) {
                // Nothing may follow (the JSON value is closed, the choice made): done, without
                // another step to pick the only token left, EOS.
                reason = Some(FinishReason::Stop);
            }
        }
        if reason.is_none()
            && (seq.num_generated() >= state.max_tokens
                || seq.tokens.len() >= self.info.max_model_len)
        {
            reason = Some(FinishReason::Length);
            if let Ok(rest) = seq.decoder.flush(&self.tokenizer) {
                seq.text.push_str(&rest);
            }
        }
        // Hold back what could be the start of a stop string.
        let mut upto = if reason.is_some() || state.max_stop_len == 0 {
            seq.text.len()
        } else {
            seq.text.len().saturating_sub(state.max_stop_len - 1)
        };
        while !seq.text.is_char_boundary(upto) {
            upto -= 1;
        }
        let text = if upto > seq.sent {
            seq.text[seq.sent..upto].to_string()
        } else {
            String::new()
        };
        seq.sent = seq.sent.max(upto);
        let child = seq.child;
        if state
            .events
            .send(RequestEvent::Token {
                child,
                token_id: token,
                text,
                logprob,
            })
            .is_err()
        {
            return Err(());
        }
        let Some(reason) = reason else {
            return Ok(false);
        };
        let completion_tokens = seq.num_generated();
        let prompt_tokens = seq.prompt_len;
        let id = seq.request;
        // A finished single completion may be kept for the conversation's next turn: its full,
        // computed blocks (the last sampled token has no KV yet) under a retained lease, bound
        // to the tokens they hold. Not for KV nobody vouched for, nor for a prefill's handoff.
        if let Some(ttl) = self.retain_after_decode
            && state.params.n == 1
            && seq.cacheable
            && !matches!(
                state.kv,
                KvTransfer::Produce { .. } | KvTransfer::PullThenProduce { .. }
            )
            && !matches!(reason, FinishReason::Abort)
        {
            let full = seq.num_computed / self.info.block_size;
            if full > 0 {
                let blocks = seq.blocks[..full].to_vec();
                let num_tokens = full * self.info.block_size;
                let contents =
                    pd_kv_pool::LeaseContents::of(&seq.tokens[..num_tokens]).in_blocks(&blocks);
                let last_block_hash = match seq.hashes.get(full - 1) {
                    Some(h) => h.0,
                    None => pd_kv_pool::hash_full_blocks_from(
                        seq.root,
                        &seq.tokens[..num_tokens],
                        self.info.block_size,
                    )
                    .last()
                    .map_or(0, |h| h.0),
                };
                if let Err(e) = stage_down(&mut self.staged, &mut self.pool, &self.metrics, &blocks)
                {
                    tracing::error!(request = %id, error = %e, "staging a finished turn's KV failed; not retained");
                } else {
                    self.scheduler.hold_for_lease(&blocks);
                    let lease = self
                        .leases
                        .grant_retained(blocks, contents, Instant::now(), ttl);
                    self.metrics.kv_retained.inc();
                    let _ = state.events.send(RequestEvent::Retained(KvHandoff {
                        lease: lease.id,
                        generation: lease.generation,
                        deadline: to_system_time(lease.deadline),
                        block_ids: lease.blocks,
                        num_tokens,
                        last_block_hash: Some(last_block_hash),
                        board_slot: lease.slot,
                    }));
                }
            }
        }
        // Measured before the client hears of it, so a scrape after the answer counts it.
        self.metrics.observe_finished(
            reason,
            prompt_tokens,
            completion_tokens,
            state.arrival,
            state.scheduled_at,
            state.first_token_at,
        );
        let _ = state.events.send(RequestEvent::Finished {
            child,
            reason,
            text: String::new(),
            completion_tokens,
        });
        state.open -= 1;
        if state.open == 0 {
            self.metrics
                .e2e_latency
                .observe(state.arrival.elapsed().as_secs_f64());
            self.metrics.requests_finished.inc();
            self.requests.remove(&id);
        }
        Ok(true)
    }

    fn update_gauges(&self) {
        let n = self.scheduler.lengths();
        self.metrics.running.set(n.running as i64);
        self.metrics.waiting.set(n.waiting as i64);
        self.metrics.waiting_remote_kv.set(n.remote as i64);
        self.metrics.kv_blocks_free.set(n.free_blocks as i64);
    }
}

/// What one logits row of a step is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    /// Sampled for `running[.0]`: its next token.
    Sample(usize),
    /// Scores prompt token `position + 1` of `running[index]` (prompt logprobs).
    Prompt { index: usize, position: usize },
}

/// What [`Engine::sample`] leaves for the scheduler's `retire`.
#[derive(Default)]
struct StepOutcome {
    /// Children that finished this step: (request, child).
    finished: HashSet<(RequestId, usize)>,
    /// Children forked with no room to run yet ([`Scheduler::fork`]).
    parked: Vec<(RequestId, usize)>,
    /// Requests whose client went away.
    gone: HashSet<RequestId>,
}

/// How [`Engine::emit_token`] gets its token.
#[derive(Clone, Copy)]
enum Pick<'a> {
    /// Sampled from this row of logits (vocab,) with the request's parameters.
    Sample(&'a [f32]),
    /// Given: the producer's first token, attested ([`RemoteKv::PulledWithFirstToken`]).
    Given(u32),
}

/// A monotonic deadline as wall-clock time (for peers in other processes), reading both clocks
/// now.
fn to_system_time(deadline: Instant) -> std::time::SystemTime {
    pd_kv_pool::deadline_on_wall_clock(deadline, Instant::now(), std::time::SystemTime::now())
}

/// Byte index of the first stop string found in `text[from..]` (earliest match wins).
fn find_stop(text: &str, mut from: usize, stops: &[String]) -> Option<usize> {
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| i + from))
        .min()
}

/// Copies `blocks` from the compute pool, when the model computes on one, to the transfer
/// pool, before a lease names them; counted and timed.
fn stage_down(
    staged: &mut Option<Box<dyn StagedKv>>,
    pool: &mut KvPool,
    metrics: &EngineMetrics,
    blocks: &[pd_kv_pool::BlockId],
) -> Result<(), pd_model::ModelError> {
    let Some(s) = staged else {
        return Ok(());
    };
    let t = Instant::now();
    s.download(pool, blocks)?;
    metrics.kv_staged_down.inc_by(blocks.len() as u64);
    metrics
        .kv_staging_down_seconds
        .observe(t.elapsed().as_secs_f64());
    Ok(())
}

/// The device the model's weights and activations live on.
fn compute_device(c: KvCompute) -> Result<Device, EngineError> {
    match c {
        KvCompute::InPlace | KvCompute::HostStaged => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        KvCompute::Cuda(ordinal) => Device::new_cuda(ordinal).map_err(|e| {
            EngineError::Invalid(InvalidRequest::new(
                "device",
                format!("cannot open CUDA device {ordinal}: {e}"),
            ))
        }),
        #[cfg(not(feature = "cuda"))]
        KvCompute::Cuda(_) => Err(EngineError::Invalid(InvalidRequest::new(
            "device",
            "this build has no CUDA support (build with --features cuda)",
        ))),
    }
}

/// The compute pool [`KvCompute`] asks for (`None`: the model computes on the transfer pool).
fn compute_pool(
    c: KvCompute,
    layout: KvLayout,
    device: &Device,
) -> Result<Option<Box<dyn StagedKv>>, EngineError> {
    let bad = |e: pd_model::ModelError| {
        EngineError::Invalid(InvalidRequest::new(
            "kv_cache_memory",
            format!("cannot allocate the compute pool: {e}"),
        ))
    };
    let _ = device;
    Ok(match c {
        KvCompute::InPlace => None,
        KvCompute::HostStaged => Some(Box::new(pd_model::HostStaged::new(layout).map_err(bad)?)),
        #[cfg(feature = "cuda")]
        KvCompute::Cuda(_) => Some(Box::new(
            pd_model::device_pool::DevicePool::new(layout, device).map_err(bad)?,
        )),
        #[cfg(not(feature = "cuda"))]
        KvCompute::Cuda(_) => None,
    })
}

/// Checks `request` against the model and pool before it is queued.
/// Blocks leases may hold: `fraction` of `num_blocks` (clamped to 0..=1), rounded down.
fn max_leased_blocks(fraction: f64, num_blocks: usize) -> usize {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        1.0
    };
    (f * num_blocks as f64).floor() as usize
}

/// Ends a request whose structured output could not be followed: the client gets the reason
/// ([`RequestEvent::Failed`]) and the caller aborts it (the `Err` of `emit_token`).
fn fail_structured(
    events: &tokio_mpsc::UnboundedSender<RequestEvent>,
    metrics: &EngineMetrics,
    request: RequestId,
    e: &GrammarError,
) {
    tracing::warn!(%request, error = %e, "structured output failed");
    metrics.structured_failures.inc();
    let _ = events.send(RequestEvent::Failed {
        message: e.to_string(),
    });
}

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

//! Building an engine: the model, its tokenizer and vocabulary, the KV pool (and the compute
//! pool the model works on, when it is elsewhere), the scheduler and the lease book.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use pd_grammar::Vocabulary;
use pd_kv_pool::{KvDtype, KvLayout, KvPool};
use pd_model::{ModelSource, StagedKv};
use tokio::sync::broadcast;

use super::{Engine, EngineConfig, KvCompute};
use crate::error::EngineError;
use crate::handle::EngineInfo;
use crate::lease_book::LeaseBook;
use crate::metrics::EngineMetrics;
use crate::request::InvalidRequest;
use crate::scheduler::{Scheduler, SchedulerConfig};

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
        // The model file's sizes, multiplied: checked before anything else multiplies them.
        let block_bytes = layout.checked_block_bytes().ok_or_else(|| {
            bad(
                "model",
                format!(
                    "the model's KV block size overflows ({} layers × {} KV heads × {} head size \
                     × {} positions)",
                    layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
                ),
            )
        })?;
        layout.num_blocks = cfg
            .num_blocks
            .unwrap_or_else(|| KvLayout::blocks_for_bytes(cfg.kv_cache_memory, block_bytes));
        if layout.num_blocks == 0 {
            return Err(bad(
                "num_gpu_blocks",
                format!(
                    "KV pool of {} bytes holds no block of {} bytes",
                    cfg.kv_cache_memory, block_bytes
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
        metrics.kv_blocks_capacity.set(layout.num_blocks as i64);
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
                binding_key: cfg.binding_key.clone(),
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

/// Blocks leases may hold: `fraction` of `num_blocks` (clamped to 0..=1), rounded down.
fn max_leased_blocks(fraction: f64, num_blocks: usize) -> usize {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        1.0
    };
    (f * num_blocks as f64).floor() as usize
}

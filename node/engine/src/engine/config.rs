//! What an engine is started with: [`EngineConfig`] and the choices it names (the model's
//! dtype, where the model computes on its KV, where the pool's memory comes from).

use std::path::PathBuf;

use candle_core::DType;
use pd_kv_pool::{KvDtype, KvLayout, KvOrder, KvPool};
use pd_model::ModelSource;
use pd_model::gguf::QuantPolicy;

use crate::error::EngineError;

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
    /// ([`crate::RequestEvent::Retained`]); `None`: free them at once. The engine revokes the oldest
    /// such lease when it needs blocks, before preempting anything.
    pub kv_retain_after_decode: Option<std::time::Duration>,
    /// The per-deployment prefix-cache hash key ([`pd_kv_pool::hash_key`] of the operator's
    /// secret; 0: none). The gateway must hash with the same key.
    pub kv_hash_key: u64,
    /// The key binding leased KV to its prompt ([`pd_kv_pool::prompt_binding`]), from the
    /// cluster token; a producer and its consumers must hold the same. Default: the key of no
    /// token.
    pub binding_key: pd_kv_pool::BindingKey,
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
    pub(super) fn resolve(
        self,
        compute: KvCompute,
        source: &ModelSource,
    ) -> Result<DType, EngineError> {
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
            binding_key: pd_kv_pool::BindingKey::from_cluster_token(""),
            gguf_weights: QuantPolicy::Fast,
            kv_compute: KvCompute::InPlace,
            dtype: ModelDtype::Auto,
        }
    }
}

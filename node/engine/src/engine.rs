//! One engine step: schedule, run the batch through the model, sample, emit events.

use std::path::PathBuf;

/// Everything needed to start an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer files).
    pub model_dir: PathBuf,
    /// Name clients must use in `model`; defaults to the directory's name.
    pub served_model_name: Option<String>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool; overrides `kv_cache_memory` when set.
    pub num_blocks: Option<usize>,
    /// Bytes of KV pool to allocate when `num_blocks` is unset.
    pub kv_cache_memory: usize,
    /// Token budget of one step (decode tokens + prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Context length limit; defaults to the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Reuse cached full blocks across requests.
    pub enable_prefix_caching: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            model_dir: PathBuf::new(),
            served_model_name: None,
            block_size: 16,
            num_blocks: None,
            kv_cache_memory: 256 << 20,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: None,
            enable_prefix_caching: true,
        }
    }
}

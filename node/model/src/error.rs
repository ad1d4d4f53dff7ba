//! Errors of model loading and the forward pass.

use std::path::PathBuf;

/// Why a model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file of the model directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `config.json` (or the safetensors index) is not valid JSON of the expected shape.
    #[error("invalid {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// The architecture in `config.json` is not one this engine implements.
    #[error(
        "unsupported architecture {0:?}: supported are LlamaForCausalLM, MistralForCausalLM (without a sliding window) and Qwen2ForCausalLM (GGUF: llama, qwen2)"
    )]
    UnsupportedArchitecture(String),
    /// The weights' or requested dtype is not supported.
    #[error(
        "unsupported dtype {0:?}: supported are float32, float16 and bfloat16 weights (computed in f32 on CPU)"
    )]
    UnsupportedDtype(String),
    /// A config value is missing or inconsistent.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// No `*.safetensors` file in the directory.
    #[error("no safetensors weights in {0}")]
    NoWeights(PathBuf),
    /// `--model` names no model this engine reads.
    #[error("no model at {path}: {why}")]
    NoModel {
        /// The path given.
        path: PathBuf,
        /// What was expected.
        why: String,
    },
    /// A GGUF file's header or a tensor could not be read (not GGUF, truncated, or a tensor
    /// type candle does not know, named by its ggml type id).
    #[error("cannot read GGUF file {path}: {source}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// candle's error.
        source: candle_core::Error,
    },
    /// A GGUF tensor's type is not a weight format this engine computes with.
    #[error(
        "unsupported GGUF tensor type {dtype} of {tensor}: supported are F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K"
    )]
    UnsupportedTensorType {
        /// The tensor's GGUF name.
        tensor: String,
        /// Its type.
        dtype: String,
    },
    /// A candle operation failed (missing tensor, shape mismatch...).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The batch does not fit the pool or the model.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The GPU path failed (allocation, copy, launch): `device_pool`, `cuda` feature.
    #[error("GPU: {0}")]
    Device(String),
    /// The tokenizer files could not be written.
    #[error(transparent)]
    Tokenizer(#[from] pd_tokenize::TokenizeError),
}

//! `pd-node gen-tiny-model`: a small random model of either architecture, for tests.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use pd_model::tiny::{TinyArch, TinySpec};

/// Architecture of a generated model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Arch {
    /// Llama (no attention bias).
    Llama,
    /// Qwen2 (bias on q/k/v projections).
    Qwen2,
}

impl From<Arch> for TinyArch {
    fn from(arch: Arch) -> Self {
        match arch {
            Arch::Llama => TinyArch::Llama,
            Arch::Qwen2 => TinyArch::Qwen2,
        }
    }
}

/// `pd-node gen-tiny-model`.
#[derive(Debug, Args)]
pub struct GenTinyModelArgs {
    /// Directory to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the weights: the same seed gives the same files.
    #[arg(long)]
    pub seed: u64,
    /// Architecture.
    #[arg(long, value_enum, default_value_t = Arch::Llama)]
    pub arch: Arch,
    /// Decoder layers.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 512)]
    pub vocab: usize,
    /// MLP intermediate size.
    #[arg(long, default_value_t = 128)]
    pub intermediate: usize,
    /// Context length the model claims.
    #[arg(long, default_value_t = 2048)]
    pub max_position_embeddings: usize,
    /// Safetensors files to split the weights over.
    #[arg(long, default_value_t = 1)]
    pub shards: usize,
    /// Write the same weights as one GGUF file instead, in this tensor type (`f32`, `f16`,
    /// `q8_0`, `q4_0`, `q4_1`, `q4_k`, `q6_k`, ...); `--out` then names the file.
    #[arg(long, value_parser = parse_ggml_type)]
    pub gguf: Option<pd_model::gguf::GgmlDType>,
}

/// Parses `--gguf`: a GGUF tensor type by its lower-case name.
fn parse_ggml_type(s: &str) -> Result<pd_model::gguf::GgmlDType, String> {
    use pd_model::gguf::GgmlDType as T;
    Ok(match s {
        "f32" => T::F32,
        "f16" => T::F16,
        "bf16" => T::BF16,
        "q4_0" => T::Q4_0,
        "q4_1" => T::Q4_1,
        "q5_0" => T::Q5_0,
        "q5_1" => T::Q5_1,
        "q8_0" => T::Q8_0,
        "q2_k" => T::Q2K,
        "q3_k" => T::Q3K,
        "q4_k" => T::Q4K,
        "q5_k" => T::Q5K,
        "q6_k" => T::Q6K,
        _ => {
            return Err(format!(
                "unknown --gguf {s:?}: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k..q6_k"
            ));
        }
    })
}

impl GenTinyModelArgs {
    /// The model these arguments describe.
    pub fn spec(&self) -> TinySpec {
        TinySpec {
            arch: self.arch.into(),
            seed: self.seed,
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            vocab: self.vocab,
            intermediate: self.intermediate,
            max_position_embeddings: self.max_position_embeddings,
            shards: self.shards,
        }
    }
}

//! Model code of the engine: reads a Hugging Face model directory (config.json and safetensors)
//! or a GGUF file into Llama-family or Qwen2 layers and runs a batched forward pass whose attention reads and
//! writes K/V in the paged [`pd_kv_pool::KvPool`] through per-sequence block tables.
//!
//! Brief overview:
//! - [`ModelSource`]: what `--model` names (HF directory, GGUF file or a directory holding
//!   one), and the model and tokenizer built from it.
//! - [`config`]: the raw `config.json` ([`HfConfig`]) and the resolved [`ModelConfig`].
//! - [`weights`]: [`WeightSource`], the model's tensors by Hugging Face name (safetensors, or
//!   [`gguf`]), and [`weights::Proj`], a linear layer held dense or quantized.
//! - [`gguf`]: GGUF files through candle's reader: config from the metadata, tokenizer
//!   metadata as [`pd_tokenize::GgufVocab`], tensors kept quantized, requantized or dequantized.
//! - [`q4_1`]: our own Q4_1 × Q8_1 matmul for small batches (AVX2 / AVX-VNNI, scalar
//!   fallback), which candle-core 0.11.1 has only in scalar form.
//! - [`llama`]: one struct per layer ([`llama::Attention`], [`llama::Mlp`],
//!   [`llama::DecoderLayer`], [`Model`]); Qwen2 is the same graph with q/k/v biases.
//! - [`paged_attention`]: the kernels that write a step's K/V into the pool and attend over
//!   block tables (CPU reference implementation; a CUDA version slots in behind the same calls).
//! - `attention_math`: the one definition of a row's attention arithmetic (scores, `exp`, the
//!   sums) and its AVX2 twin, bit for bit the same, so no step's grouping changes a token.
//! - [`kv_store`]: where K/V live while the model computes — the transfer pool itself
//!   ([`PagedKv`] for `KvPool`), or a compute pool the engine stages blocks through
//!   ([`StagedKv`]: [`HostStaged`] on CPU, `device_pool::DevicePool` on a GPU).
//! - [`BatchInput`]: one step's flattened tokens, positions, slots and block tables.
//! - [`tiny`]: writes a real, seeded, tiny HF model directory for tests and the demo.
//!
//! This crate does not schedule, sample, allocate blocks or know about requests: block tables and
//! slots come from the caller, and it only touches the pool memory at those slots.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod attention_math;
mod batch;
pub mod config;
#[cfg(feature = "cuda")]
pub mod device_pool;
mod error;
pub mod gguf;
pub mod kv_store;
pub mod llama;
pub mod paged_attention;
pub mod q4_1;
mod source;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tiny;
pub mod weights;

pub use batch::{BatchInput, SeqView};
pub use config::{Arch, HfConfig, ModelConfig};
pub use error::ModelError;
pub use gguf::GgufFile;
pub use kv_store::{BlockUpload, HostStaged, LayerQkv, PagedKv, StagedKv};
pub use llama::Model;
pub use source::{FINGERPRINT_FULL_BYTES, ModelSource};
pub use weights::WeightSource;

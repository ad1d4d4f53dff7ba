//! Model code of the engine: reads a Hugging Face model directory (config.json and safetensors)
//! into Llama-family or Qwen2 layers and runs a batched forward pass whose attention reads and
//! writes K/V in the paged [`pd_kv_pool::KvPool`] through per-sequence block tables.
//!
//! Brief overview:
//! - [`config`]: the raw `config.json` ([`HfConfig`]) and the resolved [`ModelConfig`].
//! - [`llama`]: one struct per layer ([`llama::Attention`], [`llama::Mlp`],
//!   [`llama::DecoderLayer`], [`Model`]); Qwen2 is the same graph with q/k/v biases.
//! - [`paged_attention`]: the kernels that write a step's K/V into the pool and attend over
//!   block tables (CPU reference implementation; a CUDA version slots in behind the same calls).
//! - [`BatchInput`]: one step's flattened tokens, positions, slots and block tables.
//! - [`tiny`]: writes a real, seeded, tiny HF model directory for tests and the demo.
//!
//! This crate does not schedule, sample, allocate blocks or know about requests: block tables and
//! slots come from the caller, and it only touches the pool memory at those slots.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod batch;
pub mod config;
mod error;
pub mod llama;
pub mod paged_attention;
pub mod tiny;

pub use batch::{BatchInput, SeqView};
pub use config::{Arch, HfConfig, ModelConfig};
pub use error::ModelError;
pub use llama::Model;

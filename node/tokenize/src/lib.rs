//! `pd-tokenize` owns everything between text and token ids for one Hugging Face model
//! directory (or the tokenizer metadata of a GGUF file): loading `tokenizer.json` and `tokenizer_config.json` (plus the optional
//! `generation_config.json`, `config.json` and `chat_template.jinja` for stop ids and the
//! template), rendering the chat template with minijinja the way `transformers` renders it
//! with jinja2, incremental detokenization for streaming, and writing a tiny byte-level
//! tokenizer for generated test models. The nodes and the gateway both use it, so a prompt
//! tokenizes to the same ids everywhere.
//!
//! This crate does not run models, touch the KV cache, or do any I/O besides reading and
//! writing those few files; it depends on neither candle nor tokio.
//!
//! Brief overview:
//! - [`Tokenizer`]: loaded once per model with [`Tokenizer::from_dir`]; `Send + Sync`, share it
//!   behind an `Arc`. [`Tokenizer::files`] and [`Tokenizer::fingerprint`] are what it was built
//!   from, so another process (the gateway) rebuilds the very same tokenizer with
//!   [`Tokenizer::from_files`] without the model directory.
//! - [`Tokenizer::encode`] runs byte-level BPE tokenizers (GPT-2's family, SmolLM2, and the
//!   Llama 3 and Qwen2 pre-tokenizers of GGUF files) on an ids-only path (`byte_level_ids`) that skips the `tokenizers` library's offset bookkeeping
//!   and gives the same ids as its pipeline ([`Tokenizer::encode_reference`]).
//! - [`prompt`]: OpenAI request fields (completions `prompt`, chat `messages`, responses
//!   `input`) to prompt token ids with [`prompt::prompt_tokens`]; one implementation for nodes
//!   and gateway.
//! - [`Tokenizer::apply_chat_template`]: renders [`ChatMessage`]s to prompt text. The template
//!   already contains any BOS token, so encode its output with `add_special_tokens = false`.
//! - [`IncrementalDecoder`]: per-sequence streaming detokenizer, created by
//!   [`Tokenizer::decoder`].
//! - [`GgufVocab`]: a GGUF file's `tokenizer.ggml.*` metadata as plain data (the model crate
//!   reads the file); [`Tokenizer::from_gguf_vocab`] builds from it through the equivalent
//!   `tokenizer.json` / `tokenizer_config.json` / `generation_config.json`, which are then this
//!   tokenizer's [`Tokenizer::files`].
//! - [`write_byte_level_tokenizer`]: writes a 256-byte tokenizer plus ChatML specials.
//! - [`endpoints`]: vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`, one
//!   implementation for nodes and gateway.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod byte_level;
mod byte_level_ids;
mod decoder;
pub mod endpoints;
mod error;
mod gguf;
pub mod prompt;
mod template;
mod tokenizer;

pub use byte_level::{
    BYTE_LEVEL_ENDOFTEXT_ID, BYTE_LEVEL_IM_END_ID, BYTE_LEVEL_IM_START_ID,
    BYTE_LEVEL_MIN_VOCAB_SIZE, byte_level_gguf_vocab, write_byte_level_tokenizer,
};
pub use decoder::IncrementalDecoder;
pub use error::TokenizeError;
pub use gguf::GgufVocab;
pub use tokenizer::{ChatMessage, Tokenizer};

#[cfg(test)]
pub(crate) mod test_util;

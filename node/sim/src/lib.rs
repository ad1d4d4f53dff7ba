//! A node simulator: a benchmark instrument that stands in for thousands of P/D nodes.
//!
//! Each simulated node registers over the real gRPC registry (`pd-report`'s reporter, as a
//! `pd-node` does), streams its load, leases and prefix-cache hashes, and answers
//! `/v1/chat/completions` and `/v1/completions` — plain, streamed, `n > 1`, and the
//! `kv_transfer_params` handoff and pull — with delays from a timing model and text that is a
//! function of the prompt alone, so a split answer equals a whole one. Prefill nodes serve the
//! lease calls of the KV side channel; there are no blocks to read.
//!
//! - `timing.rs`: [`Timing`], sans-IO durations (prefill, pull, time per output token).
//! - `text.rs`: the prompt as read ([`Prompt`]) and the deterministic words.
//! - `state.rs`: a node's load ([`NodeLoad`], its `StateSource`) and the fleet's [`Leases`].
//! - `node.rs`: [`SimNode`]: reading a request into a [`Job`], handoffs, pulls.
//! - `answer.rs`: the OpenAI bodies and stream chunks.
//! - `serve.rs`: the HTTP routes (axum); `kv_peer.rs`: the side channel's lease calls (tonic).
//! - `fleet.rs`: [`Fleet`]: many nodes in one process, each on its own ports and reporter.
//!
//! It is for benchmarks only: no correctness test may use it where a real node can serve, and
//! it never touches a model, a KV pool or UCX.

#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod answer;
mod fleet;
mod kv_peer;
mod node;
mod serve;
mod state;
mod text;
mod timing;

pub use fleet::{Fleet, FleetConfig, SimError};
pub use node::{
    DEFAULT_MAX_TOKENS, Identity, Job, MAX_N, MAX_OUTPUT_TOKENS, Refusal, Served, SimNode, Work,
};
pub use pd_report::Role;
pub use serve::router;
pub use state::{Leases, NodeLoad, Running};
pub use text::{Prompt, completion, word};
pub use timing::Timing;

/// The tokenizer files a fleet registers, read from a model directory (`tokenizer.json`,
/// `tokenizer_config.json`, …), and their fingerprint.
///
/// # Errors
/// The directory holds no readable tokenizer.
pub fn tokenizer_files(
    dir: &std::path::Path,
) -> Result<(std::collections::BTreeMap<String, String>, u64), SimError> {
    let t = pd_tokenize::Tokenizer::from_dir(dir)?;
    Ok((t.files().clone(), t.fingerprint()))
}

/// A byte-level tokenizer's files (the tiny test model's kind), written to a scratch directory
/// and read back: what a fleet registers when no model directory is given.
///
/// # Errors
/// The scratch directory cannot be written.
pub fn byte_level_tokenizer() -> Result<(std::collections::BTreeMap<String, String>, u64), SimError>
{
    let dir = std::env::temp_dir().join(format!("pd-node-sim-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(SimError::Scratch)?;
    pd_tokenize::write_byte_level_tokenizer(&dir, pd_tokenize::BYTE_LEVEL_MIN_VOCAB_SIZE)?;
    let files = tokenizer_files(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    files
}

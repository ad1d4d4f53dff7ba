//! The bodies of the fuzz targets in `fuzz/fuzz_targets` (issue 45), as plain functions of one
//! byte slice: libFuzzer runs them there (`scripts/fuzz.sh`), and this crate's unit tests run
//! each on a few thousand seeded random inputs, so `cargo test --workspace` keeps them compiling
//! and passing without a nightly flag.
//!
//! Each body asserts the property that matters for its surface, and panics when it does not
//! hold (a panic is what libFuzzer reports as a crash):
//! - [`kv_params`]: a request's `kv_transfer_params` read as a node reads them, then planned as
//!   a consumer plans a pull: no panic, reading is idempotent, a plan stays inside the blocks named.
//! - [`handshake`]: a peer's handshake reply (protobuf bytes): refused or an identity whose pool
//!   layout fits its own compatibility info and its registered region.
//! - [`gguf`]: a GGUF file opened as a node opens `--model`, then its config and tokenizer; or a
//!   GGUF vocabulary built into a tokenizer that encodes and decodes.
//! - [`chat_template`]: a hostile chat template renders or fails, within the fuel (no hang).
//! - [`registry`]: a node's registry messages (protobuf bytes) decoded, and a registration's
//!   addresses and tokenizer bundle read as the gateway reads them.
//! - [`sse_capture`] / [`sse_merge`] (feature `gateway`): a decode node's stream cut into random
//!   chunks: no retained turn's `kv_transfer_params` reach an untrusted client, and the bytes
//!   sent do not depend on the chunking.

pub mod chat_template;
pub mod gguf;
pub mod handshake;
pub mod input;
pub mod kv_params;
pub mod registry;
#[cfg(feature = "gateway")]
pub mod sse_capture;
#[cfg(feature = "gateway")]
pub mod sse_merge;
#[cfg(feature = "gateway")]
pub mod sse_stream;

#[cfg(test)]
mod tests;

/// Puts the default panic hook back (once): libFuzzer's hook aborts even on a panic the code
/// under test catches on purpose (`GgufFile::open` around candle's reader, `pd_tokenize` around
/// the `tokenizers` library), and those are errors, not crashes. A panic nobody catches still
/// fails the target: libfuzzer-sys aborts on it at the target's edge.
pub fn caught_panics_are_not_crashes() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let _ = std::panic::take_hook();
    });
}

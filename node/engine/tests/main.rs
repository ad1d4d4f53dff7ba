//! The engine end to end on a generated model, one module per subject, in one test binary (one
//! binary per crate keeps CI's disk and link time down). Greedy output must equal a plain,
//! non-paged forward pass (candle-transformers' stock Llama) token for token.

mod common;
mod consume;
mod exact;
mod lifecycle;
mod produce;
mod prompt_logprobs;
mod structured;

//! The integration tests of pd-model, one module per subject, in one test binary (one binary per
//! crate keeps CI's disk and link time down). `real_gguf_greedy` stays a binary of its own: it
//! sets a process-wide environment variable.

mod common;
mod dtype;
mod gguf;
mod real_gguf;
mod reference;

//! The HTTP wire shared by the gateway and the nodes, typed once (serde only, no IO).
//!
//! Owns: [`kv`] — `kv_transfer_params` in both directions (request and answer, one object or a
//! list of them); [`request`] — the fields of an OpenAI request that routing reads, with the
//! precedence rules (`max_completion_tokens` over `max_tokens`, …) written once; [`error`] —
//! the OpenAI error object; [`handoff`] — the prefill → decode hand-off a proxy drives (the
//! bodies for P and D, P's params read back); [`sse`] — server-sent-event framing and parsing (the whole spec:
//! `\r\n`, `\r`, multi-line data, comments).
//!
//! Must not: validate what only a node can judge (a lease's validity, a prompt's length), or
//! pick bodies apart beyond the fields named here: everything else passes through untouched.

pub mod error;
pub mod handoff;
pub mod kv;
pub mod request;
pub mod sse;

pub use error::{ErrorBody, ErrorObject};
pub use kv::{Hex64, Hex128, KvTransferParams, ParamsError};
pub use request::{Api, FieldError, RoutingFields};

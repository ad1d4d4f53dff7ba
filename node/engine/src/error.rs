//! Errors of the engine crate.

use crate::request::InvalidRequest;

/// Why the engine refused or lost a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is malformed or does not fit the model (400-class).
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    /// A prefill for a decode node would take leases beyond the node's cap
    /// (`--kv-max-leased-fraction`); retry later or on another prefill node (503).
    #[error(
        "this prefill node holds {leased} blocks for decode nodes and {wanted} more would pass \
         its cap of {cap} (--kv-max-leased-fraction); retry later or on another node"
    )]
    LeaseCapacity {
        /// Blocks under lease now.
        leased: usize,
        /// Blocks this prompt would lease.
        wanted: usize,
        /// The cap.
        cap: usize,
    },
    /// The engine thread has stopped; no request can be served.
    #[error("engine is shut down")]
    Shutdown,
    /// Loading or running the model failed.
    #[error("model error: {0}")]
    Model(#[from] pd_model::ModelError),
    /// The tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenize(#[from] pd_tokenize::TokenizeError),
}

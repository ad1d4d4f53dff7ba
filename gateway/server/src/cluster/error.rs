//! Why the cluster refuses a node ([`crate::cluster::Cluster::join`]).

/// Why [`super::Cluster::join`] refused a node.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// Another process, live in the view, registered under this engine id first.
    #[error(
        "engine id `{engine_id}` is taken by the live node at {held_by}; the node at {claimed_by} \
         is refused (give each node its own --engine-id, or none: the default is unique)"
    )]
    EngineIdTaken {
        /// The id both claim.
        engine_id: String,
        /// HTTP address of the node that keeps it.
        held_by: String,
        /// HTTP address of the node refused.
        claimed_by: String,
    },
    /// A node of the other kind (static or registered) holds this engine id.
    #[error("engine id `{engine_id}` is taken by a {kind} node at {held_by}")]
    EngineIdOfOtherKind {
        /// The id both claim.
        engine_id: String,
        /// How the node holding it joined.
        kind: &'static str,
        /// HTTP address of the node that keeps it.
        held_by: String,
    },
    /// The model's nodes are static and this one registered, or the other way round.
    #[error(
        "model `{model}` is served by {held} nodes and node `{engine_id}` is {kind}; one model's \
         nodes are all registered or all static"
    )]
    MixedKinds {
        /// The model.
        model: String,
        /// How the model's nodes joined (`registered` or `static`).
        held: &'static str,
        /// The node refused.
        engine_id: String,
        /// How it joins.
        kind: &'static str,
    },
    /// Its tokenizer (and chat template) is not the one the model's nodes serve.
    #[error(
        "tokenizer fingerprint {fingerprint:016x} of node `{engine_id}` differs from \
         {model_fingerprint:016x}, the one model `{model}` was registered with; nodes of one \
         model must serve the same tokenizer and chat template"
    )]
    TokenizerDiffers {
        /// The node refused.
        engine_id: String,
        /// Its tokenizer's fingerprint.
        fingerprint: u64,
        /// The model.
        model: String,
        /// The model's tokenizer's fingerprint.
        model_fingerprint: u64,
    },
    /// Its prefix-cache hash key is not the model's nodes' (the keys are secrets: never
    /// printed).
    #[error(
        "the prefix-cache hash key (--kv-hash-key) of node `{engine_id}` differs from the one of \
         model `{model}`'s nodes; nodes of one model must share it"
    )]
    HashKeyDiffers {
        /// The node refused.
        engine_id: String,
        /// The model.
        model: String,
    },
    /// The first node of a model came without a usable tokenizer.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerRefused),
    /// A new model while the view already knows [`super::MAX_MODELS`].
    #[error("the gateway already serves {0} models; no more are admitted")]
    TooManyModels(usize),
}

/// Why the tokenizer a model's first node brings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerRefused {
    /// The registration carries none.
    #[error("registration carries no tokenizer")]
    Missing,
    /// Its files do not make a tokenizer.
    #[error("the node's tokenizer: {0}")]
    Invalid(pd_tokenize::TokenizeError),
    /// Its files' fingerprint is not the one it claims.
    #[error(
        "the node's tokenizer files have fingerprint {computed:016x}, not the {claimed:016x} it \
         claims"
    )]
    Fingerprint {
        /// What the registration said.
        claimed: u64,
        /// What the gateway computed from the files.
        computed: u64,
    },
}

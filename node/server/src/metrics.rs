//! The HTTP layer's own metrics (own registry, no global state); the engine's and the transfer
//! layer's live in their crates and are gathered next to these on `/metrics`.

use prometheus::{IntCounterVec, Opts, Registry};

/// `directive` label values of [`NodeMetrics::kv_params_requests`].
const DIRECTIVES: [&str; 3] = ["produce", "consume", "incomplete"];

/// `tokens` label values of [`NodeMetrics::prompts`].
const PROMPT_TOKENS: [&str; 2] = ["given", "computed"];

/// Metrics of one node's request handling.
#[derive(Debug)]
pub(crate) struct NodeMetrics {
    registry: Registry,
    /// Requests whose `kv_transfer_params` asked for a P/D step, by what they asked
    /// (`produce`, `consume`, `incomplete`), counted as soon as the params parse — before the
    /// role, the allowed peers or the prompt are checked. Requests without params, or whose
    /// params ask for nothing, are not counted. `pd_node_kv_params_requests_total`.
    pub(crate) kv_params_requests: IntCounterVec,
    /// Prompts by where their token ids came from: `given` in `prompt_token_ids` (a gateway
    /// tokenized them), or `computed` here (rendered and tokenized, or a token-id `prompt`
    /// checked). `pd_node_prompts_total`.
    pub(crate) prompts: IntCounterVec,
}

impl NodeMetrics {
    /// Creates and registers every metric; every `directive` sample starts at 0.
    pub(crate) fn new() -> Self {
        let registry = Registry::new();
        let kv_params_requests = IntCounterVec::new(
            Opts::new(
                "pd_node_kv_params_requests_total",
                "Requests carrying kv_transfer_params that ask for a P/D step, by directive",
            ),
            &["directive"],
        )
        .expect("valid counter");
        registry
            .register(Box::new(kv_params_requests.clone()))
            .expect("unique metric");
        for d in DIRECTIVES {
            kv_params_requests.with_label_values(&[d]);
        }
        let prompts = IntCounterVec::new(
            Opts::new(
                "pd_node_prompts_total",
                "Prompts by where their token ids came from: given (prompt_token_ids) or computed here",
            ),
            &["tokens"],
        )
        .expect("valid counter");
        registry
            .register(Box::new(prompts.clone()))
            .expect("unique metric");
        for t in PROMPT_TOKENS {
            prompts.with_label_values(&[t]);
        }
        Self {
            registry,
            kv_params_requests,
            prompts,
        }
    }

    /// The registry, for `/metrics`.
    pub(crate) fn registry(&self) -> &Registry {
        &self.registry
    }
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

//! The HTTP layer's own metrics (own registry, no global state); the engine's and the transfer
//! layer's live in their crates and are gathered next to these on `/metrics`.

use prometheus::{IntCounterVec, Opts, Registry};

/// `directive` label values of [`NodeMetrics::kv_params_requests`].
const DIRECTIVES: [&str; 3] = ["produce", "consume", "incomplete"];

/// Metrics of one node's request handling.
#[derive(Debug)]
pub(crate) struct NodeMetrics {
    registry: Registry,
    /// Requests whose `kv_transfer_params` asked for a P/D step, by what they asked
    /// (`produce`, `consume`, `incomplete`), counted as soon as the params parse — before the
    /// role, the allowed peers or the prompt are checked. Requests without params, or whose
    /// params ask for nothing, are not counted. `pd_node_kv_params_requests_total`.
    pub(crate) kv_params_requests: IntCounterVec,
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
        Self {
            registry,
            kv_params_requests,
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

//! Cross-process cluster tests, one module per failure or feature, in one test binary (each test
//! binary links the whole dependency tree; one binary keeps CI's disk and link time down). Run one
//! subject with `cargo test -p pd-cluster-tests --test cluster node_killed::`.

mod across_hosts;
mod admin_api;
mod admission;
mod api_keys;
mod burst;
mod chaos;
mod client_abort;
mod configuration;
mod endpoint_picker;
mod front_door_limits;
mod gateway_failover;
mod gateway_replicas;
mod gateway_restart;
mod kubernetes;
mod kv_partition;
mod multi_turn;
mod node_hung;
mod node_killed;
mod observability;
mod openai_token_exact;
mod policy_contained;
mod policy_hot_swap;
mod policy_languages;
mod policy_sdk;
// Needs the nodes' debug-build weakening of the binding (`PD_INSECURE_BINDING_BITS`).
#[cfg(debug_assertions)]
mod prompt_binding;
mod prompt_scoring;
mod registry_trust;
mod reported_turns;
mod rolling_restart;
mod several_gateways;
mod simulator;
mod spread_params;
mod static_nodes;
mod tls_across_hosts;
mod traces;
mod untrusted_params_and_errors;
mod vllm_router_interop;

//! The gRPC contracts of the system, generated from `proto/` by tonic, so every side builds from
//! one definition:
//!
//! - [`kv`]: the `KvPeer` side channel between nodes that exchange KV blocks.
//! - [`registry`]: the `NodeRegistry` stream a node keeps open to the gateway (registration,
//!   load, lease counters, block-hash events); the node's client is `pd-report`, the gateway
//!   implements the server.
//!
//! This crate holds generated types and stubs only: no service logic, no UCX, no engine.
#![warn(unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

/// The gRPC metadata key carrying the cluster secret on every `KvPeer` call: an owner with a
/// cluster token refuses a call without it (`UNAUTHENTICATED`), so only members of the cluster
/// (nodes, and the gateway releasing leases) read a pool or touch its leases.
pub const CLUSTER_TOKEN_METADATA: &str = "x-pd-cluster-token";

/// `pd.kv.v1`: handshake, leases and pool stats between a KV owner and a puller.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    unreachable_pub,
    missing_debug_implementations
)]
pub mod kv {
    tonic::include_proto!("pd.kv.v1");
}

/// `pd.registry.v1`: a node's registration with the gateway and its state stream.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    unreachable_pub,
    missing_debug_implementations
)]
pub mod registry {
    tonic::include_proto!("pd.registry.v1");
}

//! The gRPC contracts of the system, generated from `proto/` by tonic: today the `KvPeer` side
//! channel between nodes that exchange KV blocks ([`kv`]); the gateway's node registry will live
//! here too, so both sides build from one definition.
//!
//! This crate holds generated types and stubs only: no service logic, no UCX, no engine.
#![warn(unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

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

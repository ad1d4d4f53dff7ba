//! Safe Rust wrapper over UCX's `ucp` layer, just big enough for a KV-cache transfer layer:
//! a [`Context`], a single-thread [`Worker`] and its [`Endpoint`]s, caller-owned memory
//! registered as a [`MemoryRegion`] with packed and unpacked [`RemoteKey`]s, non-blocking
//! get/put/flush [`Request`]s, active messages, and a [`TransportReport`] saying which
//! transports an endpoint actually uses ([`is_tcp_emulated_rma`] flags the slow path).
//!
//! Every `unsafe` call into UCX lives in this crate; [`ucx_sys`] holds the raw bindings.
//!
//! Brief overview:
//! - [`Context`]: one per process is enough; `Send + Sync`; memory regions hang off it.
//! - [`Worker`]: owns progress. `Send` but not `Sync`: drive it from one dedicated thread.
//!   Endpoints, remote keys and requests borrow it.
//! - Pulling many blocks: `post_get` each block, then `flush().wait()` once.
//!
//! UCX 1.13 facts that shape callers (measured on loopback, see the tests):
//! - Gets from memory registered with [`MemoryRegion::map`] are emulated with active messages:
//!   they complete only while the *owner's* worker progresses too. Memory from
//!   [`MemoryRegion::allocate`] (a shared-memory domain) is read truly one-sidedly.
//! - [`EndpointOptions::peer_error_handling`] makes UCX drop shm/cma and use tcp only.
//! - Closing an endpoint (flush mode) needs the peer to progress; drop waits a bounded time.
//!
//! This crate does not know about KV blocks, leases or peers' identities, does no networking
//! besides UCX itself (exchanging worker addresses and keys is the caller's job), does not use
//! tokio or any async runtime, and never sets `UCX_*` environment variables.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod context;
mod endpoint;
mod error;
mod memory;
mod request;
mod transport;
mod worker;

pub use context::{Context, Features, library_version};
pub use endpoint::{Endpoint, EndpointOptions};
pub use error::{Error, Result, status_name};
pub use memory::{MemoryRegion, RemoteAccess, RemoteKey, populate};
pub use request::Request;
pub use transport::{Lane, TransportReport, is_tcp_emulated_rma};
pub use worker::Worker;

/// Re-export of the raw bindings, for callers that need a constant or a call this crate lacks.
pub use ucx_sys;

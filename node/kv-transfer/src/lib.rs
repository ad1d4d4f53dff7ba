//! The data plane that moves KV blocks from the node that computed them to the node that needs
//! them, the side channel that makes it safe, and the consumer that drives a pull:
//!
//! - [`compat`]: what two nodes must agree on before one reads the other's blocks.
//! - [`plan`]: a list of block ids becomes a short list of contiguous byte ranges.
//! - [`copier`]: a helper thread that shares large copies from a peer's pool mapped here.
//! - [`landing`]: where pulled blocks go as they land (a staged node's compute pool).
//! - [`pull`]: the one-sided UCX reads (and, from a peer with another block size or order, the
//!   conversion after them); [`puller`] runs them on a thread that owns the worker, copies
//!   from a peer's pool mapped here on the caller's thread, and pulls one lease's blocks under
//!   its confirmation ([`puller::lease`]).
//! - [`consumer`]: a node's side of a pull, from the params to what arrived — planning and the
//!   confirm decision without IO ([`consumer::plan`], [`consumer::confirm`]), which producers
//!   may be contacted ([`consumer::allowed`]), and the [`Consumer`] that drives the IO (peer
//!   clients and handshakes, lease keeping, the pull, release, failure policy) and records
//!   every metric of a pull.
//! - [`service`] (owner) and [`peer`] (puller): the `KvPeer` gRPC side channel — handshake,
//!   lease renew / confirm / release, pool stats — and the failure policy.
//! - [`tcp_data`]: leased blocks over plain TCP, for peers UCX reaches only over TCP (the
//!   reader's side in [`tcp_data::pull`]).
//! - [`metrics`]: transfer time, bytes, descriptors, failures by reason, lease events.
//! - [`lease_authority`]: the owner-side decisions about leases, behind a trait the engine
//!   implements; [`LocalBlocks`] is the standalone implementation.
//! - [`owner_clock`]: the owner's clock as the handshake states it, against which a consumer
//!   judges the beat on the owner's lease board.
//!
//! This crate does not schedule requests, run models or speak HTTP: it pulls into blocks the
//! engine reserved and says what arrived; which node to pull from is the gateway's choice, and
//! blocks and leases are `pd_kv_pool`'s.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod compat;
pub mod consumer;
pub mod copier;
pub mod landing;
pub mod lease_authority;
pub mod metrics;
pub mod owner_clock;
pub mod peer;
pub mod plan;
pub mod pull;
pub mod puller;
pub mod service;
pub mod tcp_data;

pub use compat::{CompatError, CompatInfo, TRANSFER_PROTOCOL_VERSION, needs_rechunk};
pub use consumer::{AllowedPeers, Consumer, PullConfig};
pub use copier::Copier;
pub use landing::{Landing, LandingError, LandingStep};
pub use lease_authority::{LeaseAuthority, LocalBlocks, PoolStats};
pub use metrics::TransferMetrics;
pub use owner_clock::{OwnerClock, monotonic_ns};
pub use peer::{FailurePolicy, Fallback, HandshakeCache, PeerClient, PeerInfo, TransferError};
pub use plan::{CopyRange, plan_ranges};
pub use pull::{
    LANDING_PART_BYTES, PostedPull, PullError, PullSource, PullStats, Rechunk, copy_pull,
    copy_pull_landing, post_pull, pull_blocks, rechunk_pull,
};
pub use puller::{
    EarlyConfirm, LeaseKeeper, LeasePull, LeaseTrace, LeasedBlocks, MAX_PEERS, MAX_PULLS_PER_PEER,
    PeerPath, PullVia, Pulled, Puller, Unawaited, pull_under_lease, pull_under_lease_with,
};
pub use service::{KvPeerService, OwnerIdentity, constant_time_eq};

//! A node's reports to the gateway: the client side of `pd.registry.v1.NodeRegistry`
//! (`node/rpc/proto/registry.proto`).
//!
//! - [`Reporter`]: a background task that registers the node ([`Registration`]) and streams its
//!   load ([`NodeStateSnapshot`]) and the block hashes of its prefix cache ([`BlockEvent`]),
//!   reconnecting with backoff and resyncing after every reconnect. [`ReporterHandle`] shows its
//!   [`ReporterStatus`], what the gateway pushed (its KV peer list, the cluster token), and
//!   stops it. A registration carries the node's cluster token and tokenizer files.
//! - [`Gateways`]: a node reporting to several gateways at once (active-active): a [`Reporter`]
//!   per gateway address (`--gateway` entries; a DNS name resolved again and again, one
//!   reporter per address it stands for), what they hear merged (the union of their KV peer
//!   lists, one cluster token, the first observed host), [`GatewayLeft`] when a gateway's
//!   stream ends (its leases follow it), refused only once every gateway refused.
//! - [`StateSource`]: what the node implements so the reporter can read it; [`StoredBlocks`] is
//!   the ready-made, never-blocking set of stored hashes with a bounded change feed, and
//!   [`RetainedTurns`] the same for the conversation turns a decode node retains (reported so
//!   that every gateway, not only the one that relayed the answer, routes the next turn).
//! - `test_registry` (feature `testing`): a recording `NodeRegistry` server for tests (here and
//!   in `pd-node`'s).
//!
//! This crate does not depend on the engine or the scheduler and never calls into them: it reads
//! the node only through [`StateSource`], and nothing the node does waits for it (a gateway that
//! is down or slow costs a resync, not a stall). Its public API uses plain Rust types; the
//! protobuf types stay in `pd-rpc`, except in the test registry's records.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod backoff;
mod error;
mod gateways;
mod joined;
mod live;
mod registration;
mod reporter;
mod source;
#[cfg(feature = "testing")]
pub mod test_registry;
mod turns;

pub use error::ReportError;
pub use gateways::{GatewayEntry, Gateways, GatewaysOptions, Resolve, Resolving, SystemResolver};
pub use joined::{GatewayLeft, GatewayView};
pub use registration::{REGISTRY_PROTOCOL_VERSION, Registration, Role};
pub use reporter::{Reporter, ReporterHandle, ReporterOptions, ReporterStatus};
pub use source::{
    BlockEvent, BlockSubscription, LeaseCounters, NodeStateSnapshot, StateSource, StoredBlocks,
};
pub use turns::{
    MAX_RETAINED_TURNS, MAX_TURN_BYTES_PER_MESSAGE, MAX_TURN_PARAMS_BYTES, MAX_TURNS_PER_MESSAGE,
    RetainedTurn, RetainedTurns, TurnEvent, TurnSubscription,
};

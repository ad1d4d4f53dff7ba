//! The data plane that moves KV blocks from the node that computed them to the node that needs
//! them: what two nodes must agree on before a pull ([`compat`]), how a list of block ids becomes
//! a short list of byte ranges ([`plan`]), and the one-sided UCX reads themselves ([`pull`]).
//!
//! This crate does not schedule requests, run models or own the pool's bookkeeping (blocks and
//! leases belong to `pd_kv_pool`, driven by the engine); it never decides *whether* to pull, only
//! how.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod compat;
pub mod plan;
pub mod pull;

pub use compat::{CompatError, CompatInfo, TRANSFER_PROTOCOL_VERSION};
pub use plan::{CopyRange, plan_ranges};
pub use pull::{PullError, PullSource, pull_blocks};

//! The gateway's state that outlives its process: `/v1/responses` turns (with their owners),
//! the installed policy and the one a rollback returns to (components by sha256, spec), the
//! operator's drains, and a minted cluster token.
//!
//! One interface, [`Backend`], with an embedded default ([`embedded::Embedded`], a redb file
//! under `--state-dir`: one gateway survives its restarts with no setup) and a shared one for
//! several gateways ([`postgres::Postgres`], `--state-url`), which announces each change so
//! every replica applies it ([`follow`]). The request path never
//! waits on it except where a restarted gateway must read what it no longer holds in memory (a
//! `previous_response_id` it has not seen since it started): writes go behind the answer,
//! reads fill the in-memory stores ([`crate::conversation::ResponseStore`],
//! [`pd_policy::PolicySlot`], the cluster's drains), which stay what requests read.
//!
//! Records are JSON ([`records`]) under a schema version ([`SCHEMA_VERSION`]) kept in the store:
//! a gateway reads what any earlier version wrote (new fields have defaults) and refuses a store
//! a newer version wrote ([`StateError::TooNew`]) rather than misread it.
//!
//! This module does not decide what is kept (the stores and the admin API do), and never
//! holds a lock of theirs across a call to the backend.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;
use tokio::sync::broadcast;

pub mod embedded;
pub mod follow;
pub mod pg_tls;
pub mod policy;
pub mod postgres;
pub mod records;

pub use records::{PolicyEntry, PolicyRecord, TurnRecord};

/// The version of the records' layout this gateway writes. A store written under a later one
/// is refused; an earlier one is read (and rewritten as records change).
pub const SCHEMA_VERSION: u32 = 1;

/// The state backend a gateway runs with.
pub type State = Arc<dyn Backend>;

/// A state store that could not answer.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The backend itself failed (I/O, a closed connection, a full disk).
    #[error("state store: {0}")]
    Backend(String),
    /// A record is not what this gateway's schema reads.
    #[error("state record `{key}` is unreadable: {source}")]
    Decode {
        /// The record's key.
        key: String,
        /// Why.
        source: serde_json::Error,
    },
    /// A newer gateway wrote this store.
    #[error(
        "the state store was written by schema version {found}, newer than this gateway's {ours}: run a gateway at least as new"
    )]
    TooNew {
        /// The store's version.
        found: u32,
        /// This gateway's ([`SCHEMA_VERSION`]).
        ours: u32,
    },
}

impl StateError {
    /// A backend failure, from anything displayable.
    pub fn backend(e: impl fmt::Display) -> Self {
        StateError::Backend(e.to_string())
    }
}

/// A change another gateway made, announced by a shared store ([`Backend::changes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The policy slot was saved: serve what the store says.
    Policy,
    /// The drains changed.
    Drains,
    /// These stored responses were deleted (or evicted).
    Turns(Vec<String>),
    /// The store may have changed unannounced (the listener reconnected): read all again.
    Resync,
}

/// Where the gateway's durable state lives. Every method may block on I/O for as long as the
/// backend takes; callers on the request path await it off any lock.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug {
    /// What the store is, for logs (`embedded /var/lib/pd-gateway/state.redb`).
    fn describe(&self) -> String;

    /// Changes other gateways make, for a store several share; none for a store one gateway
    /// owns.
    fn changes(&self) -> Option<broadcast::Receiver<Change>> {
        None
    }

    /// What must run (on the gateway's control runtime) for [`Backend::changes`] to receive
    /// anything; none when nothing must.
    fn listener(self: Arc<Self>) -> Option<BoxFuture<'static, ()>> {
        None
    }

    /// Stores turn `id` (replacing it).
    async fn put_turn(&self, id: &str, turn: &TurnRecord) -> Result<(), StateError>;

    /// Turn `id`, if stored.
    async fn turn(&self, id: &str) -> Result<Option<TurnRecord>, StateError>;

    /// Forgets these turns (ids not stored are skipped).
    async fn delete_turns(&self, ids: &[String]) -> Result<(), StateError>;

    /// Forgets turns stored before `unix_ms`, then the oldest until at most `max_bytes` of
    /// turns remain; returns how many went.
    async fn sweep_turns(&self, unix_ms: u64, max_bytes: u64) -> Result<u64, StateError>;

    /// The installed policy and its rollback target, if one was ever saved.
    async fn policy(&self) -> Result<Option<PolicyRecord>, StateError>;

    /// Saves `record` and, first, the component bytes it names that the store lacks
    /// (`(sha256, bytes)`). The store assigns its generation, one past the stored one's, and
    /// returns it (what `record.generation` says is ignored).
    async fn put_policy(
        &self,
        record: &PolicyRecord,
        components: &[(String, Vec<u8>)],
    ) -> Result<u64, StateError>;

    /// A policy component's bytes by hex sha256.
    async fn component(&self, sha256: &str) -> Result<Option<Vec<u8>>, StateError>;

    /// Engine ids the operator drained.
    async fn drains(&self) -> Result<Vec<String>, StateError>;

    /// Records a drain (`on`) or its end.
    async fn set_drain(&self, engine_id: &str, on: bool) -> Result<(), StateError>;

    /// The cluster token minted for this cluster: the stored one, else `minted`, stored now.
    async fn cluster_token(&self, minted: &str) -> Result<String, StateError>;
}

/// Milliseconds since the Unix epoch now.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

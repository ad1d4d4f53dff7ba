//! What the state store keeps, as JSON records. Every field added after schema version 1 has a
//! default (`#[serde(default)]`), so a record an earlier gateway wrote reads as it meant.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One `/v1/responses` turn ([`crate::conversation::ResponseStore`]'s, as stored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// Hex SHA-256 of the bearer key that stored it; none: a request without a key.
    pub owner: Option<String>,
    /// The response it continued (`previous_response_id`).
    pub parent: Option<String>,
    /// Its own input items, then the answer's output items.
    pub items: Vec<Value>,
    /// How many of `items` are its input.
    pub inputs: usize,
    /// The response object as the client got it (`null`: not kept).
    pub response: Value,
    /// The key of the KV a node retained of it, if any.
    pub held: Option<u64>,
    /// When it was stored, ms since the Unix epoch (its age limit counts from here).
    pub stored_unix_ms: u64,
}

/// A policy as the slot holds it: a built-in one by name, or a component by sha256 with the
/// spec it was loaded under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PolicyEntry {
    /// A native policy.
    Native {
        /// Its name.
        name: String,
    },
    /// A WASM component.
    Wasm {
        /// Hex sha256 of the component's bytes (stored beside, by this key).
        sha256: String,
        /// The operator's name for it.
        name: String,
        /// What the guest reads with `host.config`.
        config: BTreeMap<String, String>,
        /// Deadline of one call, µs.
        deadline_us: u64,
        /// Memory limit, bytes.
        memory_limit: usize,
        /// Fuel of one call.
        fuel: u64,
        /// Instances made ahead of calls.
        spares: usize,
    },
}

/// The policy slot: what serves, and what a rollback returns to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyRecord {
    /// One more at every save.
    pub generation: u64,
    /// What serves.
    pub current: PolicyEntry,
    /// What a rollback returns to.
    pub previous: Option<PolicyEntry>,
    /// When it was saved, ms since the Unix epoch.
    pub saved_unix_ms: u64,
    /// The sha256 of the `--policy` file when this was saved, if the gateway had one: at a
    /// start with a file of other content, the file serves (as a change of the file while
    /// running would have installed it); with the same, this record does.
    #[serde(default)]
    pub file_sha256: Option<String>,
}

impl PolicyRecord {
    /// The components the record names (what serves, what a rollback returns to): the ones a
    /// store keeps.
    pub fn components(&self) -> Vec<&str> {
        [Some(&self.current), self.previous.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|e| match e {
                PolicyEntry::Wasm { sha256, .. } => Some(sha256.as_str()),
                PolicyEntry::Native { .. } => None,
            })
            .collect()
    }
}

//! What the gateway remembers between the turns of a conversation (multi-turn, reverse pull).
//!
//! - [`Holdings`]: which node keeps which finished turn's KV under a retained lease (a node
//!   started with `--kv-retain-after-decode` answers a turn with `kv_transfer_params` describing
//!   its blocks). A holding is keyed by the chain hash of the last block it holds
//!   (`remote_last_block_hash`, the same `pd_kv_pool` chain the gateway computes for every
//!   prompt): a next turn that repeats the history — a chat client resending its messages, or a
//!   `/v1/responses` request rebuilt from `previous_response_id` — hashes to that chain, so the
//!   longest match of its block hashes finds the turn, whatever the API or conversation key.
//!   A holding is also found, partially, by the last whole block of the prompt it answered: a
//!   client's resent history whose answer re-encodes to other token ids than the model produced
//!   still meets the holder's prefix cache there (a lease covers its blocks as a whole, so only
//!   an exact match is ever pulled).
//! - [`ResponseStore`]: `/v1/responses` turns by response id (this turn's input items and the
//!   answer's output items, and the response it continued), so a request naming
//!   `previous_response_id` is rebuilt into the whole conversation; and the response object as
//!   the client got it, for `GET /v1/responses/{id}` (`responses.retrieve`), its
//!   `/input_items`, and `DELETE`. Bounded by bytes (least recently used turns go first) and by
//!   age. Each turn belongs to the API key that stored it ([`Owner`]): another key's read,
//!   delete or `previous_response_id` finds nothing, as on OpenAI, where responses belong to a
//!   project.
//!
//! Holdings come from the answers this gateway relayed and from the nodes themselves: a decode
//! node reports the turns it retains on its registry stream ([`ReportedTurns`] applies them), so
//! another gateway, or this one restarted, knows them too.
//!
//! With a state store ([`crate::state`]) every stored turn is also written there, evictions
//! forget it there too, and a turn memory lacks is read back from it (`durable.rs`); a turn
//! whose write failed waits in [`Unsaved`] until the store answers again.
//!
//! Neither talks to nodes: the proxy reads holdings into the policy's view and acts on the
//! policy's `reverse-pull`; leases are released through `lease.rs`.

mod durable;
mod holdings;
mod items;
#[cfg(test)]
mod proptests;
mod reported;
mod store;
mod unsaved;

pub use holdings::{Found, Holding, Holdings};
pub use items::{ItemsQuery, QueryError, as_retrieved, input_items, item_list, output_items};
pub use reported::{Applied, MAX_REPORTED_TURNS, ReportedTurns};
pub use store::{Deleted, HistoryError, NewTurn, Owner, ResponseStore};
pub use unsaved::{MAX_UNSAVED, Unsaved};

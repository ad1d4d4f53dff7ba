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
//! Neither talks to nodes: the proxy reads holdings into the policy's view and acts on the
//! policy's `reverse-pull`; leases are released through `lease.rs`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pd_wire::KvTransferParams;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// A finished turn's KV that a node keeps under a retained lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    /// The node holding it (`remote_engine_id`).
    pub engine_id: Arc<str>,
    /// That node's incarnation (`remote_engine_epoch`; 0 when it did not say): a node restarted
    /// since holds nothing of it.
    pub epoch: u64,
    /// Tokens the blocks hold (`remote_num_tokens`): whole blocks of prompt and answer.
    pub tokens: u32,
    /// Chain hash of the last block held (`remote_last_block_hash`): the key.
    pub last_hash: u64,
    /// When the lease ends (`remote_blocks_expiry_time`).
    pub expires: SystemTime,
    /// The object as the node answered it (`do_remote_decode: true`): what a prefill node is
    /// sent to pull the turn first.
    pub params: KvTransferParams,
    /// Chain hash of the last whole block of the prompt the turn answered, and the tokens up to
    /// it (the partial key; set by the gateway, which hashed that prompt).
    pub prompt_key: Option<(u64, u32)>,
}

/// A holding found for a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    /// Leading blocks of the prompt it covers.
    pub blocks: usize,
    /// Tokens of the prompt it covers.
    pub tokens: u32,
    /// The prompt continues every block held (pullable), not just the answered prompt's.
    pub exact: bool,
    /// The holding.
    pub holding: Holding,
}

impl Holding {
    /// Reads a retained turn's `kv_transfer_params`; `None` for anything else (a handoff to a
    /// decode node, a node too old to name its last block hash).
    pub fn from_params(params: &KvTransferParams) -> Option<Self> {
        if !params.do_remote_decode {
            return None;
        }
        let engine_id: Arc<str> = Arc::from(params.remote_engine_id.as_deref()?);
        let tokens = params.remote_num_tokens?;
        let last_hash = params.remote_last_block_hash?.0;
        let expiry = params.remote_blocks_expiry_time?;
        if tokens == 0 || !expiry.is_finite() || expiry <= 0.0 {
            return None;
        }
        let expires = UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(expiry).ok()?)?;
        params.remote_lease_id.as_ref()?;
        Some(Self {
            engine_id,
            epoch: params.remote_engine_epoch.map_or(0, |e| e.0),
            tokens,
            last_hash,
            expires,
            params: params.clone(),
            prompt_key: None,
        })
    }

    /// Milliseconds until the lease ends (0 once it has), saturated to `u32`.
    pub fn expiry_ms(&self, now: SystemTime) -> u32 {
        let left = self.expires.duration_since(now).unwrap_or(Duration::ZERO);
        u32::try_from(left.as_millis()).unwrap_or(u32::MAX)
    }

    /// The params for a node that pulls this turn and decodes itself (a `whole` route): the
    /// same object as a pull request (`do_remote_prefill: true`). On the holder itself nothing
    /// moves: its prefix cache has the blocks, and it releases its own lease.
    pub fn as_pull(&self) -> KvTransferParams {
        self.params.to_pull()
    }

    /// The params for a prefill node that pulls this turn first, then hands the whole prompt to
    /// `consumers` decode nodes.
    pub fn for_prefill(&self, consumers: u32) -> KvTransferParams {
        let mut p = self.params.to_produce();
        p.num_consumers = (consumers > 1).then_some(consumers);
        p
    }
}

/// Retained turns by the chain hash of their last block, bounded by count (oldest first).
#[derive(Debug)]
pub struct Holdings {
    inner: Mutex<HoldingsInner>,
    cap: usize,
}

#[derive(Debug, Default)]
struct HoldingsInner {
    /// Under its last held block's hash (exact) and its prompt's last block's (partial).
    by_hash: HashMap<u64, Entry>,
    /// Insertion order, with the generation each entry was inserted at (a stale entry of a
    /// removed or replaced hash is skipped).
    order: VecDeque<(u64, u64)>,
    generation: u64,
    /// Holdings (exact keys) indexed.
    holdings: usize,
}

impl Holdings {
    /// An index of at most `cap` holdings.
    pub fn new(cap: usize) -> Self {
        Self {
            inner: Mutex::default(),
            cap: cap.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HoldingsInner> {
        // Plain maps: no invariant a panic elsewhere could break.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holdings indexed now.
    pub fn len(&self) -> usize {
        self.lock().holdings
    }

    /// Whether none is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Indexes `h` (under its last block's hash, and its prompt's last block's when it has
    /// one); returns what it displaced: a holding under the same key, and those evicted to stay
    /// within the bound.
    pub fn insert(&self, h: Holding) -> Vec<Holding> {
        let mut s = self.lock();
        s.generation += 1;
        let generation = s.generation;
        let mut out = Vec::new();
        let mut keys = vec![(h.last_hash, h.tokens, true)];
        if let Some((k, tokens)) = h.prompt_key
            && k != h.last_hash
            && tokens > 0
        {
            keys.push((k, tokens, false));
        }
        for (key, tokens, exact) in keys {
            let entry = Entry {
                holding: h.clone(),
                generation,
                tokens,
                exact,
            };
            s.holdings += usize::from(exact);
            if let Some(old) = s.by_hash.insert(key, entry)
                && old.exact
            {
                s.holdings -= 1;
                s.unlink(&old.holding, key);
                out.push(old.holding);
            }
            s.order.push_back((key, generation));
        }
        while s.holdings > self.cap {
            let Some((k, g)) = s.order.pop_front() else {
                break;
            };
            if s.by_hash
                .get(&k)
                .is_some_and(|e| e.generation == g && e.exact)
                && let Some(old) = s.remove_holding(k)
            {
                out.push(old);
            }
        }
        // Stale order entries (removed keys) are dropped once they outnumber the live ones.
        if s.order.len() > 2 * s.by_hash.len() + 64 {
            let HoldingsInner { by_hash, order, .. } = &mut *s;
            order.retain(|(k, g)| by_hash.get(k).is_some_and(|e| e.generation == *g));
        }
        out
    }

    /// The holding covering the most leading blocks of `hashes` (a prompt's chained block
    /// hashes), and how many expired holdings met on the way were dropped.
    pub fn longest(&self, hashes: &[u64], now: SystemTime) -> (Option<Found>, u32) {
        let mut s = self.lock();
        let mut expired = 0;
        if s.by_hash.is_empty() {
            return (None, 0);
        }
        for (i, h) in hashes.iter().enumerate().rev() {
            let Some(e) = s.by_hash.get(h) else {
                continue;
            };
            if e.holding.expires > now {
                let found = Found {
                    blocks: i + 1,
                    tokens: e.tokens,
                    exact: e.exact,
                    holding: e.holding.clone(),
                };
                return (Some(found), expired);
            }
            let last = e.holding.last_hash;
            expired += u32::from(s.remove_holding(last).is_some());
            if s.by_hash.get(h).is_some_and(|e| e.holding.expires <= now) {
                s.by_hash.remove(h);
            }
        }
        (None, expired)
    }

    /// Takes the holding keyed `last_hash` out of the index (its turn was used or superseded).
    pub fn remove(&self, last_hash: u64) -> Option<Holding> {
        self.lock().remove_holding(last_hash)
    }
}

/// One key of a holding.
#[derive(Debug)]
struct Entry {
    holding: Holding,
    generation: u64,
    /// Tokens of a prompt that reaches this key.
    tokens: u32,
    /// The holding's own last block (not its prompt's).
    exact: bool,
}

impl HoldingsInner {
    /// Removes the holding whose last block hash is `last_hash`, under both its keys.
    fn remove_holding(&mut self, last_hash: u64) -> Option<Holding> {
        let e = self.by_hash.remove(&last_hash)?;
        if !e.exact {
            // A partial key that is some other holding's: put it back.
            self.by_hash.insert(last_hash, e);
            return None;
        }
        self.holdings -= 1;
        self.unlink(&e.holding, last_hash);
        Some(e.holding)
    }

    /// Drops `h`'s partial key if it still names `h` (its exact key `exact_key` is gone).
    fn unlink(&mut self, h: &Holding, exact_key: u64) {
        if let Some((k, _)) = h.prompt_key
            && k != exact_key
            && self
                .by_hash
                .get(&k)
                .is_some_and(|e| !e.exact && e.holding.last_hash == h.last_hash)
        {
            self.by_hash.remove(&k);
        }
    }
}

/// A response [`ResponseStore::delete`] forgot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    /// The key ([`Holding::last_hash`]) of the KV a node retained of that turn, if any.
    pub held: Option<u64>,
}

/// Who stored a response: the SHA-256 of the bearer key its request came with (the key itself
/// is not kept), or nobody (no key). Only the same owner reads, deletes or continues it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Owner(Option<[u8; 32]>);

impl Owner {
    /// The owner of a request with this bearer key.
    pub fn of(bearer: Option<&str>) -> Self {
        Owner(bearer.map(|key| Sha256::digest(key.as_bytes()).into()))
    }
}

/// A turn to store ([`ResponseStore::put`]).
#[derive(Debug, Clone)]
pub struct NewTurn<'a> {
    /// Who stored it.
    pub owner: Owner,
    /// The response it continued (`previous_response_id`).
    pub parent: Option<&'a str>,
    /// This turn's own input items.
    pub input: Vec<Value>,
    /// The answer's output items.
    pub output: Vec<Value>,
    /// The response object as the client got it (`Value::Null`: not kept).
    pub response: Value,
    /// The key ([`Holding::last_hash`]) of the KV a node retained of it, if any.
    pub held: Option<u64>,
}

/// One `/v1/responses` turn.
#[derive(Debug, Clone)]
struct StoredTurn {
    /// Who stored it.
    owner: Owner,
    /// The response this one continued (`previous_response_id`).
    parent: Option<Arc<str>>,
    /// This turn's own input items, then the answer's output items.
    items: Vec<Value>,
    /// How many of `items` are this turn's input.
    inputs: usize,
    /// The response object as the client got it (`Value::Null`: not kept).
    response: Value,
    /// The key ([`Holding::last_hash`]) of the retained KV a node kept of this turn, if any.
    held: Option<u64>,
    bytes: usize,
    stored_at: Instant,
    /// Least-recently-used stamp (key of `lru`).
    stamp: u64,
}

/// Why a conversation cannot be rebuilt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HistoryError {
    /// The id was never stored, or was evicted or expired.
    #[error("Previous response with id '{0}' not found.")]
    NotFound(String),
    /// The id is stored but an earlier turn it continues was evicted or expired.
    #[error(
        "Previous response with id '{id}' continues '{missing}', which is no longer stored: send the whole conversation in `input`."
    )]
    Broken {
        /// The id asked for.
        id: String,
        /// The earliest turn missing.
        missing: String,
    },
}

/// `/v1/responses` turns by id, bounded by bytes (least recently used first) and age.
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<StoreInner>,
    max_bytes: usize,
    ttl: Duration,
}

#[derive(Debug, Default)]
struct StoreInner {
    turns: HashMap<Arc<str>, StoredTurn>,
    lru: BTreeMap<u64, Arc<str>>,
    bytes: usize,
    stamp: u64,
}

/// Turns walked back at most when rebuilding one conversation.
const MAX_TURNS: usize = 10_000;

impl ResponseStore {
    /// A store of at most `max_bytes` (serialized items) whose turns live at most `ttl`.
    pub fn new(max_bytes: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::default(),
            max_bytes,
            ttl,
        }
    }

    fn lock(&self) -> MutexGuard<'_, StoreInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes stored (for metrics).
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Stores response `id` ([`NewTurn`]). A turn larger than the whole store is not kept.
    /// Returns how many turns were evicted to make room.
    pub fn put(&self, id: &str, turn: NewTurn<'_>) -> u64 {
        let NewTurn {
            owner,
            parent,
            input,
            output,
            response,
            held,
        } = turn;
        let inputs = input.len();
        let mut items = input;
        items.extend(output);
        let bytes = items.iter().map(|v| v.to_string().len()).sum::<usize>()
            + id.len()
            + if response.is_null() {
                0
            } else {
                response.to_string().len()
            };
        if bytes > self.max_bytes {
            return 0;
        }
        let mut s = self.lock();
        s.stamp += 1;
        let stamp = s.stamp;
        let key: Arc<str> = Arc::from(id);
        let turn = StoredTurn {
            owner,
            parent: parent.map(Arc::from),
            items,
            inputs,
            response,
            held,
            bytes,
            stored_at: Instant::now(),
            stamp,
        };
        if let Some(old) = s.turns.insert(key.clone(), turn) {
            s.lru.remove(&old.stamp);
            s.bytes -= old.bytes;
        }
        s.lru.insert(stamp, key);
        s.bytes += bytes;
        let mut evicted = 0;
        while s.bytes > self.max_bytes {
            let Some((_, victim)) = s.lru.pop_first() else {
                break;
            };
            if let Some(t) = s.turns.remove(&victim) {
                s.bytes -= t.bytes;
                evicted += 1;
            }
        }
        evicted
    }

    /// Response `id` as the client got it, if `owner` stored it and it is not past the age
    /// limit (a read does not count as a use: only a next turn keeps a conversation alive).
    pub fn response(&self, id: &str, owner: Owner) -> Option<Value> {
        self.fresh(id, owner, |t| t.response.clone())
            .filter(|r| !r.is_null())
    }

    /// The input items response `id` answered (its own, not the earlier turns'), oldest first,
    /// if `owner` stored it.
    pub fn input_items(&self, id: &str, owner: Owner) -> Option<Vec<Value>> {
        self.fresh(id, owner, |t| t.items[..t.inputs].to_vec())
    }

    /// Forgets response `id`: `None` when `owner` did not store it (or it had expired), else
    /// the key of the KV a node retained of it, for the caller to release. A later turn that
    /// continued it can no longer be continued ([`HistoryError::Broken`]).
    pub fn delete(&self, id: &str, owner: Owner) -> Option<Deleted> {
        let mut s = self.lock();
        if s.turns.get(id)?.owner != owner {
            return None;
        }
        let t = s.turns.remove(id)?;
        s.lru.remove(&t.stamp);
        s.bytes -= t.bytes;
        (t.stored_at.elapsed() <= self.ttl).then_some(Deleted { held: t.held })
    }

    /// `read` of turn `id` when `owner` stored it and it is fresh; an expired one is dropped.
    fn fresh<R>(&self, id: &str, owner: Owner, read: impl FnOnce(&StoredTurn) -> R) -> Option<R> {
        let mut s = self.lock();
        match s.turns.get(id) {
            Some(t) if t.owner != owner => None,
            Some(t) if t.stored_at.elapsed() <= self.ttl => Some(read(t)),
            Some(_) => {
                if let Some(t) = s.turns.remove(id) {
                    s.lru.remove(&t.stamp);
                    s.bytes -= t.bytes;
                }
                None
            }
            None => None,
        }
    }

    /// The whole conversation up to and including response `id`, oldest item first: every
    /// turn's input items and output items. Each turn on the way counts as used (it moves to
    /// the back of the eviction order).
    ///
    /// # Errors
    /// [`HistoryError`] when `id` or a turn it continues is not stored (never was, evicted,
    /// or older than the store's age limit), or `owner` did not store it.
    pub fn history(&self, id: &str, owner: Owner) -> Result<Vec<Value>, HistoryError> {
        let mut s = self.lock();
        let now = Instant::now();
        let mut chain: Vec<Arc<str>> = Vec::new();
        let mut at: Arc<str> = Arc::from(id);
        loop {
            let turn = s.turns.get(&at);
            if turn.is_some_and(|t| t.owner != owner) {
                // Not this client's: as if never stored (a turn only continues its own
                // owner's, so this is the first one).
                return Err(HistoryError::NotFound(id.to_owned()));
            }
            let fresh = turn.is_some_and(|t| now.duration_since(t.stored_at) <= self.ttl);
            if !fresh {
                if let Some(t) = s.turns.remove(&at) {
                    s.lru.remove(&t.stamp);
                    s.bytes -= t.bytes;
                }
                return Err(if chain.is_empty() {
                    HistoryError::NotFound(id.to_owned())
                } else {
                    HistoryError::Broken {
                        id: id.to_owned(),
                        missing: at.to_string(),
                    }
                });
            }
            chain.push(at.clone());
            match s.turns.get(&at).and_then(|t| t.parent.clone()) {
                Some(parent) if chain.len() < MAX_TURNS => at = parent,
                _ => break,
            }
        }
        let mut items = Vec::new();
        for key in chain.iter().rev() {
            s.stamp += 1;
            let stamp = s.stamp;
            let StoreInner { turns, lru, .. } = &mut *s;
            if let Some(t) = turns.get_mut(key) {
                lru.remove(&t.stamp);
                t.stamp = stamp;
                lru.insert(stamp, key.clone());
                items.extend(t.items.iter().cloned());
            }
        }
        Ok(items)
    }
}

/// The response object as `GET /v1/responses/{id}` returns it: a node's retained-turn
/// `kv_transfer_params` removed (a lease is nobody's business later), and the two fields the
/// gateway answered for the node: `previous_response_id` (the nodes never see it) and `store`.
pub fn as_retrieved(response: &Value, parent: Option<&str>) -> Value {
    let mut kept = response.clone();
    if let Some(o) = kept.as_object_mut() {
        o.remove("kv_transfer_params");
        o.insert("previous_response_id".into(), json!(parent));
        o.insert("store".into(), Value::Bool(true));
    }
    kept
}

/// A bad query parameter of `GET /v1/responses/{id}/input_items`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryError {
    /// The parameter.
    pub param: &'static str,
    /// What is wrong with it.
    pub message: String,
}

/// `GET /v1/responses/{id}/input_items`' query: `limit` (1–100, default 20), `order` (`asc` or
/// `desc`, the default, as OpenAI's), `after` (an item id: the page after it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemsQuery {
    /// Items per page.
    pub limit: usize,
    /// Newest first.
    pub desc: bool,
    /// The page starts after this item.
    pub after: Option<String>,
}

impl ItemsQuery {
    /// Reads `limit`, `order` and `after` from a query string; other parameters are ignored.
    ///
    /// # Errors
    /// A limit out of 1–100 or not a number, an order other than `asc` / `desc`.
    pub fn parse(query: &str) -> Result<Self, QueryError> {
        let mut q = Self {
            limit: 20,
            desc: true,
            after: None,
        };
        for (key, value) in query
            .split('&')
            .filter(|kv| !kv.is_empty())
            .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
        {
            match key {
                "limit" => {
                    q.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=100).contains(n))
                        .ok_or_else(|| QueryError {
                            param: "limit",
                            message: format!("limit must be a number from 1 to 100, got `{value}`"),
                        })?;
                }
                "order" => {
                    q.desc = match value {
                        "asc" => false,
                        "desc" => true,
                        _ => {
                            return Err(QueryError {
                                param: "order",
                                message: format!("order must be `asc` or `desc`, got `{value}`"),
                            });
                        }
                    };
                }
                "after" => q.after = Some(value.to_owned()),
                _ => {}
            }
        }
        Ok(q)
    }
}

/// The `list` object of `GET /v1/responses/{id}/input_items`: response `id`'s input items as
/// OpenAI items (each with an `id` and a `type`; a `{role, content}` message becomes a
/// `message` item whose text is an `input_text` part, `output_text` for an assistant's), one
/// page of them.
pub fn item_list(id: &str, items: Vec<Value>, q: &ItemsQuery) -> Value {
    let mut items: Vec<Value> = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| as_item(id, i, item))
        .collect();
    if q.desc {
        items.reverse();
    }
    let start = q
        .after
        .as_deref()
        .and_then(|after| items.iter().position(|it| it["id"] == after))
        .map_or(0, |i| i + 1);
    let page: Vec<Value> = items.iter().skip(start).take(q.limit).cloned().collect();
    let has_more = start + page.len() < items.len();
    json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|it| it["id"].clone()),
        "last_id": page.last().map(|it| it["id"].clone()),
        "has_more": has_more,
    })
}

/// Input item `i` of response `id` as an OpenAI item.
fn as_item(id: &str, i: usize, item: Value) -> Value {
    let Value::Object(mut o) = item else {
        return json!({"id": format!("item_{id}_{i}"), "type": "unknown", "value": item});
    };
    if !o.contains_key("type") && o.contains_key("role") {
        o.insert("type".into(), json!("message"));
    }
    if o.get("type").and_then(Value::as_str) == Some("message") {
        let part = if o.get("role").and_then(Value::as_str) == Some("assistant") {
            "output_text"
        } else {
            "input_text"
        };
        if let Some(Value::String(text)) = o.get("content") {
            let content = json!([{"type": part, "text": text}]);
            o.insert("content".into(), content);
        }
        o.entry("status").or_insert(json!("completed"));
    }
    if !o.get("id").is_some_and(Value::is_string) {
        let prefix = if o.get("type").and_then(Value::as_str) == Some("message") {
            "msg"
        } else {
            "item"
        };
        o.insert("id".into(), json!(format!("{prefix}_{id}_{i}")));
    }
    Value::Object(o)
}

/// A `/v1/responses` `input` as a list of items (a string is one user message).
pub fn input_items(input: &Value) -> Vec<Value> {
    match input {
        Value::String(s) => vec![json!({"role": "user", "content": s})],
        Value::Array(items) => items.clone(),
        other => vec![other.clone()],
    }
}

/// The output items of a response object, as input items of the next turn: each `message`
/// item becomes `{"role": "assistant", "content": <its text>}`; each `function_call` item (a
/// tool the model called) is kept as it is, the next turn's `function_call_output` answering it.
pub fn output_items(response: &Value) -> Vec<Value> {
    let Some(output) = response.get("output").and_then(Value::as_array) else {
        return Vec::new();
    };
    output
        .iter()
        .filter_map(|item| match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                let text: String = item
                    .get("content")
                    .and_then(Value::as_array)
                    .map(|parts| {
                        parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect()
                    })
                    .unwrap_or_default();
                let role = item
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or("assistant");
                Some(json!({"role": role, "content": text}))
            }
            Some("function_call") => Some(item.clone()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(engine: &str, tokens: u64, hash: u64, expiry: f64) -> KvTransferParams {
        KvTransferParams::from_value(&raw_params(engine, tokens, hash, expiry)).unwrap()
    }

    fn raw_params(engine: &str, tokens: u64, hash: u64, expiry: f64) -> Value {
        json!({
            "do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": engine, "remote_engine_epoch": "00000000000000ab",
            "remote_block_ids": [1, 2], "remote_request_id": "cmpl-1",
            "remote_host": "127.0.0.1", "remote_port": 7000,
            "remote_num_tokens": tokens, "remote_lease_id": "0123456789abcdef0123456789abcdef",
            "remote_lease_generation": 1, "remote_blocks_expiry_time": expiry,
            "remote_last_block_hash": format!("{hash:016x}"),
        })
    }

    fn in_a_minute() -> f64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            + 60.0
    }

    #[test]
    fn reads_a_retained_turn_and_nothing_else() {
        let h = Holding::from_params(&params("d1", 32, 0xfeed, in_a_minute())).unwrap();
        assert_eq!(&*h.engine_id, "d1");
        assert_eq!((h.tokens, h.last_hash, h.epoch), (32, 0xfeed, 0xab));
        assert!(h.expiry_ms(SystemTime::now()) > 50_000);
        let handoff = params("p1", 32, 1, in_a_minute()).to_pull();
        assert_eq!(Holding::from_params(&handoff), None);
        let mut old_node = params("d1", 32, 1, in_a_minute());
        old_node.remote_last_block_hash = None;
        assert_eq!(Holding::from_params(&old_node), None);
        // The pull forms keep every field and flip the direction.
        assert!(h.as_pull().do_remote_prefill);
        assert_eq!(h.as_pull().remote_lease_id, h.params.remote_lease_id);
        assert_eq!(h.for_prefill(3).to_value()["num_consumers"], 3);
        assert_eq!(h.for_prefill(1).to_value().get("num_consumers"), None);
    }

    #[test]
    fn the_longest_unexpired_holding_wins() {
        let idx = Holdings::new(8);
        let now = SystemTime::now();
        idx.insert(Holding::from_params(&params("d1", 8, 20, in_a_minute())).unwrap());
        idx.insert(Holding::from_params(&params("d2", 16, 40, in_a_minute())).unwrap());
        // A prompt whose chain passes through 20 (block 2) and 40 (block 4).
        let f = idx.longest(&[10, 20, 30, 40, 50], now).0.unwrap();
        assert_eq!(
            (f.blocks, f.tokens, f.exact, &*f.holding.engine_id),
            (4, 16, true, "d2")
        );
        let f = idx.longest(&[10, 20, 31], now).0.unwrap();
        assert_eq!((f.blocks, &*f.holding.engine_id), (2, "d1"));
        assert_eq!(idx.longest(&[11, 21], now), (None, 0));
        // Expired: dropped when met.
        idx.insert(Holding::from_params(&params("d3", 8, 60, 1.0)).unwrap());
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.longest(&[60], now), (None, 1));
        assert_eq!(idx.len(), 2);
        assert_eq!(idx.remove(40).map(|h| h.tokens), Some(16));
        assert_eq!(idx.longest(&[10, 20, 30, 40], now).0.unwrap().blocks, 2);
    }

    #[test]
    fn a_history_that_re_encodes_differently_meets_the_prompt_part() {
        let idx = Holdings::new(8);
        let now = SystemTime::now();
        // The turn's prompt ended at block hash 20 (2 blocks, 32 tokens); its answer filled
        // blocks up to hash 40 (64 tokens held).
        let mut h = Holding::from_params(&params("d1", 64, 40, in_a_minute())).unwrap();
        h.prompt_key = Some((20, 32));
        idx.insert(h);
        assert_eq!(idx.len(), 1);
        // Resent exactly: all 64 tokens, pullable.
        let f = idx.longest(&[10, 20, 30, 40, 50], now).0.unwrap();
        assert_eq!((f.tokens, f.exact), (64, true));
        // The answer re-encoded to other ids: only the prompt part matches, not pullable.
        let f = idx.longest(&[10, 20, 33, 44, 55], now).0.unwrap();
        assert_eq!((f.blocks, f.tokens, f.exact), (2, 32, false));
        // Removing the holding removes both keys.
        assert!(idx.remove(40).is_some());
        assert_eq!(idx.longest(&[10, 20, 33], now), (None, 0));
        // An expired holding met by its partial key is gone under both.
        let mut old = Holding::from_params(&params("d1", 64, 41, 1.0)).unwrap();
        old.prompt_key = Some((21, 32));
        idx.insert(old);
        assert_eq!(idx.longest(&[10, 21], now), (None, 1));
        assert_eq!(idx.longest(&[10, 21, 30, 41], now), (None, 0));
        assert!(idx.is_empty());
    }

    #[test]
    fn the_index_keeps_the_newest_within_its_bound() {
        let idx = Holdings::new(2);
        for k in 0..5u64 {
            let displaced =
                idx.insert(Holding::from_params(&params("d1", 8, 100 + k, in_a_minute())).unwrap());
            assert_eq!(displaced.len(), usize::from(k >= 2), "insert {k}");
        }
        assert_eq!(idx.len(), 2);
        let now = SystemTime::now();
        assert!(idx.longest(&[102], now).0.is_none());
        assert!(idx.longest(&[103], now).0.is_some());
        assert!(idx.longest(&[104], now).0.is_some());
        // Re-keying the same hash displaces the old holding, and is not evicted by its stale
        // order entry.
        let again = idx.insert(Holding::from_params(&params("d2", 8, 104, in_a_minute())).unwrap());
        assert_eq!(again.len(), 1);
        assert_eq!(&*again[0].engine_id, "d1");
        assert_eq!(idx.len(), 2);
        assert_eq!(
            &*idx
                .longest(&[104], SystemTime::now())
                .0
                .unwrap()
                .holding
                .engine_id,
            "d2"
        );
    }

    /// The owner of every turn these tests store, but where another is the point.
    const ME: Owner = Owner(None);

    fn msg(role: &str, text: &str) -> Value {
        json!({"role": role, "content": text})
    }

    /// Stores a turn of one user message, no answer, no response object, no retained KV.
    fn user_turn(store: &ResponseStore, id: &str, parent: Option<&str>, text: &str) -> u64 {
        store.put(
            id,
            NewTurn {
                owner: ME,
                parent,
                input: vec![msg("user", text)],
                output: vec![],
                response: Value::Null,
                held: None,
            },
        )
    }

    #[test]
    fn a_conversation_is_rebuilt_turn_by_turn() {
        let store = ResponseStore::new(1 << 20, Duration::from_secs(60));
        store.put(
            "r1",
            NewTurn {
                owner: ME,
                parent: None,
                input: vec![msg("user", "hi")],
                output: vec![msg("assistant", "hello")],
                response: Value::Null,
                held: None,
            },
        );
        store.put(
            "r2",
            NewTurn {
                owner: ME,
                parent: Some("r1"),
                input: vec![msg("user", "how?")],
                output: vec![msg("assistant", "so")],
                response: json!({"id": "r2", "object": "response"}),
                held: None,
            },
        );
        assert_eq!(
            store.history("r2", ME).unwrap(),
            vec![
                msg("user", "hi"),
                msg("assistant", "hello"),
                msg("user", "how?"),
                msg("assistant", "so")
            ]
        );
        assert_eq!(store.history("r1", ME).unwrap().len(), 2);
        assert_eq!(
            store.history("nope", ME),
            Err(HistoryError::NotFound("nope".into()))
        );
    }

    #[test]
    fn the_store_evicts_least_recently_used_turns_past_its_bytes() {
        let one = {
            let s = ResponseStore::new(1 << 20, Duration::from_secs(60));
            user_turn(&s, "rA", None, "aaaa");
            s.bytes()
        };
        let store = ResponseStore::new(2 * one + one / 2, Duration::from_secs(60));
        user_turn(&store, "rA", None, "aaaa");
        user_turn(&store, "rB", None, "bbbb");
        // rA used: rB is now the least recently used.
        store.history("rA", ME).unwrap();
        assert_eq!(user_turn(&store, "rC", None, "cccc"), 1);
        assert!(store.history("rA", ME).is_ok());
        assert!(store.history("rC", ME).is_ok());
        assert_eq!(
            store.history("rB", ME),
            Err(HistoryError::NotFound("rB".into()))
        );
        // A child whose parent went is refused by name.
        user_turn(&store, "rD", Some("rB"), "d");
        assert!(
            matches!(store.history("rD", ME), Err(HistoryError::Broken { missing, .. }) if missing == "rB")
        );
    }

    #[test]
    fn a_stored_response_is_read_listed_and_deleted() {
        let store = ResponseStore::new(1 << 20, Duration::from_secs(60));
        let r1 = json!({"id": "r1", "object": "response", "output_text": "hello"});
        store.put(
            "r1",
            NewTurn {
                owner: ME,
                parent: None,
                input: vec![msg("system", "be brief"), msg("user", "hi")],
                output: vec![msg("assistant", "hello")],
                response: r1.clone(),
                held: Some(7),
            },
        );
        store.put(
            "r2",
            NewTurn {
                owner: ME,
                parent: Some("r1"),
                input: vec![msg("user", "how?")],
                output: vec![],
                response: Value::Null,
                held: None,
            },
        );
        assert_eq!(store.response("r1", ME), Some(r1));
        assert_eq!(store.response("r2", ME), None, "not kept");
        assert_eq!(
            store.input_items("r1", ME),
            Some(vec![msg("system", "be brief"), msg("user", "hi")])
        );
        assert_eq!(store.input_items("r2", ME), Some(vec![msg("user", "how?")]));
        assert_eq!(store.input_items("nope", ME), None);
        let before = store.bytes();
        assert_eq!(store.delete("r1", ME), Some(Deleted { held: Some(7) }));
        assert_eq!(store.delete("r1", ME), None, "gone already");
        assert!(
            matches!(store.history("r2", ME), Err(HistoryError::Broken { missing, .. }) if missing == "r1")
        );
        assert_eq!(store.delete("r2", ME), Some(Deleted { held: None }));
        assert!(store.bytes() < before);
        assert_eq!(store.response("r1", ME), None);
        let old = ResponseStore::new(1 << 20, Duration::ZERO);
        old.put(
            "r1",
            NewTurn {
                owner: ME,
                parent: None,
                input: vec![],
                output: vec![],
                response: json!({"id": "r1"}),
                held: None,
            },
        );
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(old.response("r1", ME), None);
        assert_eq!(old.bytes(), 0, "an expired turn read is dropped");
    }

    #[test]
    fn another_key_finds_nothing_of_a_stored_response() {
        let store = ResponseStore::new(1 << 20, Duration::from_secs(60));
        let (a, b) = (Owner::of(Some("key-a")), Owner::of(Some("key-b")));
        store.put(
            "r1",
            NewTurn {
                owner: a,
                parent: None,
                input: vec![msg("user", "mine")],
                output: vec![msg("assistant", "yes")],
                response: json!({"id": "r1"}),
                held: Some(3),
            },
        );
        for other in [b, Owner::of(None)] {
            assert_eq!(store.response("r1", other), None);
            assert_eq!(store.input_items("r1", other), None);
            assert_eq!(
                store.history("r1", other),
                Err(HistoryError::NotFound("r1".into()))
            );
            assert_eq!(store.delete("r1", other), None);
        }
        // Untouched for its owner.
        assert_eq!(store.response("r1", a), Some(json!({"id": "r1"})));
        assert_eq!(store.history("r1", a).unwrap().len(), 2);
        assert_eq!(store.delete("r1", a), Some(Deleted { held: Some(3) }));
    }

    #[test]
    fn input_items_are_listed_as_openai_items_page_by_page() {
        let items = vec![
            msg("system", "be brief"),
            msg("user", "hi"),
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}),
            json!({"type": "function_call_output", "call_id": "c1", "output": "rain"}),
        ];
        let all = ItemsQuery::parse("order=asc").unwrap();
        let list = item_list("resp_1", items.clone(), &all);
        assert_eq!(list["object"], "list");
        assert_eq!(list["has_more"], false);
        let data = list["data"].as_array().unwrap();
        assert_eq!(data.len(), 4);
        assert_eq!(
            data[1],
            json!({"id": "msg_resp_1_1", "type": "message", "role": "user", "status": "completed",
                   "content": [{"type": "input_text", "text": "hi"}]})
        );
        assert_eq!(data[2]["content"][0]["text"], "x");
        assert_eq!(data[3]["id"], "item_resp_1_3");
        assert_eq!(data[3]["call_id"], "c1");
        assert_eq!(list["first_id"], "msg_resp_1_0");
        // OpenAI's default order is newest first; pages follow `after`.
        let q = ItemsQuery::parse("limit=3").unwrap();
        let page = item_list("resp_1", items.clone(), &q);
        assert_eq!(page["first_id"], "item_resp_1_3");
        assert_eq!(page["has_more"], true);
        let q = ItemsQuery::parse(&format!(
            "limit=3&after={}",
            page["last_id"].as_str().unwrap()
        ))
        .unwrap();
        let next = item_list("resp_1", items, &q);
        assert_eq!(next["data"].as_array().unwrap().len(), 1);
        assert_eq!(next["first_id"], "msg_resp_1_0");
        assert_eq!(next["has_more"], false);
        for bad in ["limit=0", "limit=101", "limit=x", "order=up"] {
            assert!(ItemsQuery::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_retrieved_response_hides_the_lease_and_names_its_parent() {
        let r = json!({"id": "r2", "object": "response", "previous_response_id": null,
            "kv_transfer_params": {"do_remote_decode": true}, "output": []});
        let kept = as_retrieved(&r, Some("r1"));
        assert!(kept.get("kv_transfer_params").is_none());
        assert_eq!(kept["previous_response_id"], "r1");
        assert_eq!(kept["store"], true);
        assert_eq!(as_retrieved(&r, None)["previous_response_id"], Value::Null);
    }

    #[test]
    fn turns_older_than_the_age_limit_are_gone() {
        let store = ResponseStore::new(1 << 20, Duration::ZERO);
        user_turn(&store, "r1", None, "hi");
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(
            store.history("r1", ME),
            Err(HistoryError::NotFound("r1".into()))
        );
        assert_eq!(store.bytes(), 0);
    }

    #[test]
    fn output_items_become_assistant_messages() {
        let resp = json!({"id": "r", "output": [
            {"type": "message", "id": "m", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Par"}, {"type": "output_text", "text": "is"}]},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather",
             "arguments": "{}", "status": "completed"}
        ]});
        assert_eq!(
            output_items(&resp),
            vec![msg("assistant", "Paris"), resp["output"][2].clone()]
        );
        assert_eq!(input_items(&json!("q")), vec![msg("user", "q")]);
    }
}

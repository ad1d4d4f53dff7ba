//! [`ResponseStore`]: `/v1/responses` turns by response id, owned by the key that stored them,
//! bounded by bytes and age. A turn is kept as compact JSON text ([`Packed`]: its items as one
//! array, its response object), parsed again when read: a `Value` tree takes five to ten times
//! its text in memory (a slot per value, a map entry and index per key), and at a million turns
//! that was 9 KiB a turn for 1.3 KB of JSON (BENCHMARKS.md, "Conversation state at a million
//! turns"). Bytes are what a turn holds: its text, ids and bookkeeping.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

/// What a turn costs beyond its text: the entry in the id map (its `StoredTurn` and key),
/// its owner's LRU entry, and the allocators' headers, about.
const TURN_OVERHEAD: usize = size_of::<StoredTurn>() + 128;

/// A turn's items and response object as compact JSON text.
#[derive(Debug, Clone)]
pub(super) struct Packed {
    /// The items (the turn's input items, then its output items) as one JSON array.
    items: Box<str>,
    /// The response object as the client got it; `None`: not kept.
    response: Option<Box<str>>,
}

impl Packed {
    /// Packs `items` and `response` (`Value::Null`: not kept).
    pub(super) fn new(items: &[Value], response: &Value) -> Self {
        // A slice of `Value`s always serializes.
        let items = serde_json::to_string(items).unwrap_or_else(|_| "[]".into());
        Self {
            items: items.into_boxed_str(),
            response: (!response.is_null()).then(|| response.to_string().into_boxed_str()),
        }
    }

    /// The items, parsed (text this store wrote: it parses).
    pub(super) fn items(&self) -> Vec<Value> {
        serde_json::from_str(&self.items).unwrap_or_default()
    }

    /// The response object, parsed; `Value::Null` when not kept.
    pub(super) fn response(&self) -> Value {
        self.response
            .as_deref()
            .and_then(|r| serde_json::from_str(r).ok())
            .unwrap_or(Value::Null)
    }

    /// Bytes of text held.
    fn len(&self) -> usize {
        self.items.len() + self.response.as_deref().map_or(0, str::len)
    }
}

/// Bytes a turn holds in memory: [`TURN_OVERHEAD`], its packed text, its id (in the map and in
/// its owner's LRU) and its parent's id.
pub(crate) fn turn_bytes(id: &str, parent: Option<&str>, packed: &Packed) -> usize {
    TURN_OVERHEAD + packed.len() + 2 * id.len() + parent.map_or(0, str::len)
}

/// A response [`ResponseStore::delete`] forgot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    /// The key ([`Holding::last_hash`]) of the KV a node retained of that turn, if any.
    pub held: Option<u64>,
}

/// Who stored a response: the SHA-256 of the bearer key its request came with (the key itself
/// is not kept), or nobody (no key). Only the same owner reads, deletes or continues it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Owner(pub(super) Option<[u8; 32]>);

impl Owner {
    /// Nobody: a request without a bearer key.
    pub const NOBODY: Owner = Owner(None);

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
pub(super) struct StoredTurn {
    /// Who stored it.
    pub(super) owner: Owner,
    /// The response this one continued (`previous_response_id`).
    pub(super) parent: Option<Arc<str>>,
    /// This turn's own input items, then the answer's output items, and the response object
    /// as the client got it.
    pub(super) packed: Packed,
    /// How many of the items are this turn's input.
    pub(super) inputs: usize,
    /// The key ([`Holding::last_hash`]) of the retained KV a node kept of this turn, if any.
    pub(super) held: Option<u64>,
    pub(super) bytes: usize,
    pub(super) stored_at: Instant,
    /// Least-recently-used stamp (key of its owner's `Usage::lru`).
    pub(super) stamp: u64,
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

/// A response id another owner's response holds: never overwritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("response id `{0}` is another owner's")]
pub struct IdTaken(pub String);

/// `/v1/responses` turns by id, bounded by bytes and age. Past its bytes, the owner holding the
/// most loses its least recently used turn first, so one key filling the store evicts its own
/// turns, not everyone's.
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<StoreInner>,
    pub(super) max_bytes: usize,
    pub(super) ttl: Duration,
}

#[derive(Debug, Default)]
pub(super) struct StoreInner {
    pub(super) turns: HashMap<Arc<str>, StoredTurn>,
    /// Per owner: bytes held and turns by least-recently-used stamp.
    owners: HashMap<Owner, Usage>,
    pub(super) bytes: usize,
    pub(super) stamp: u64,
}

/// What one owner holds.
#[derive(Debug, Default)]
struct Usage {
    bytes: usize,
    lru: BTreeMap<u64, Arc<str>>,
}

impl StoreInner {
    /// Stores `turn` under `key` (replacing the same owner's turn of that id).
    pub(super) fn insert(&mut self, key: Arc<str>, turn: StoredTurn) {
        self.remove(&key);
        let usage = self.owners.entry(turn.owner).or_default();
        usage.bytes += turn.bytes;
        usage.lru.insert(turn.stamp, key.clone());
        self.bytes += turn.bytes;
        self.turns.insert(key, turn);
    }

    /// Forgets turn `id`.
    pub(super) fn remove(&mut self, id: &str) -> Option<StoredTurn> {
        let t = self.turns.remove(id)?;
        self.bytes -= t.bytes;
        if let Some(usage) = self.owners.get_mut(&t.owner) {
            usage.bytes -= t.bytes;
            usage.lru.remove(&t.stamp);
            if usage.lru.is_empty() {
                self.owners.remove(&t.owner);
            }
        }
        Some(t)
    }

    /// Moves turn `key` to the back of its owner's eviction order.
    fn touch(&mut self, key: &Arc<str>) {
        self.stamp += 1;
        let stamp = self.stamp;
        if let Some(t) = self.turns.get_mut(key)
            && let Some(usage) = self.owners.get_mut(&t.owner)
        {
            usage.lru.remove(&t.stamp);
            t.stamp = stamp;
            usage.lru.insert(stamp, key.clone());
        }
    }

    /// The least recently used turn of the owner holding the most bytes.
    pub(super) fn victim(&self) -> Option<Arc<str>> {
        let usage = self.owners.values().max_by_key(|u| u.bytes)?;
        usage.lru.first_key_value().map(|(_, id)| id.clone())
    }
}

/// Turns walked back at most when rebuilding one conversation.
pub(super) const MAX_TURNS: usize = 10_000;

impl ResponseStore {
    /// A store of at most `max_bytes` (serialized items) whose turns live at most `ttl`.
    pub fn new(max_bytes: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::default(),
            max_bytes,
            ttl,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, StoreInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes stored (for metrics).
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Stores response `id` ([`NewTurn`]). A turn larger than the whole store is not kept.
    /// Returns how many turns were evicted to make room (the biggest owner's least recently
    /// used first).
    ///
    /// # Errors
    /// [`IdTaken`] when another owner's response holds `id`: it is kept, this one is not.
    pub fn put(&self, id: &str, turn: NewTurn<'_>) -> Result<u64, IdTaken> {
        self.put_evicting(id, turn).map(|gone| gone.len() as u64)
    }

    /// [`ResponseStore::put`], returning the ids of the turns evicted to make room (for the
    /// state store to forget too).
    ///
    /// # Errors
    /// As [`ResponseStore::put`].
    pub fn put_evicting(&self, id: &str, turn: NewTurn<'_>) -> Result<Vec<Arc<str>>, IdTaken> {
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
        let packed = Packed::new(&items, &response);
        drop((items, response));
        let bytes = turn_bytes(id, parent, &packed);
        let mut s = self.lock();
        if s.turns.get(id).is_some_and(|t| t.owner != owner) {
            return Err(IdTaken(id.to_owned()));
        }
        if bytes > self.max_bytes {
            return Ok(Vec::new());
        }
        s.stamp += 1;
        let stamp = s.stamp;
        let turn = StoredTurn {
            owner,
            parent: parent.map(Arc::from),
            packed,
            inputs,
            held,
            bytes,
            stored_at: Instant::now(),
            stamp,
        };
        s.insert(Arc::from(id), turn);
        let mut evicted = Vec::new();
        while s.bytes > self.max_bytes {
            let Some(victim) = s.victim() else {
                break;
            };
            s.remove(&victim);
            evicted.push(victim);
        }
        Ok(evicted)
    }

    /// Response `id` as the client got it, if `owner` stored it and it is not past the age
    /// limit (a read does not count as a use: only a next turn keeps a conversation alive).
    pub fn response(&self, id: &str, owner: Owner) -> Option<Value> {
        self.fresh(id, owner, |t| t.packed.response())
            .filter(|r| !r.is_null())
    }

    /// The input items response `id` answered (its own, not the earlier turns'), oldest first,
    /// if `owner` stored it.
    pub fn input_items(&self, id: &str, owner: Owner) -> Option<Vec<Value>> {
        self.fresh(id, owner, |t| {
            let mut items = t.packed.items();
            items.truncate(t.inputs);
            items
        })
    }

    /// Forgets response `id`: `None` when `owner` did not store it (or it had expired), else
    /// the key of the KV a node retained of it, for the caller to release. A later turn that
    /// continued it can no longer be continued ([`HistoryError::Broken`]).
    pub fn delete(&self, id: &str, owner: Owner) -> Option<Deleted> {
        let mut s = self.lock();
        if s.turns.get(id)?.owner != owner {
            return None;
        }
        let t = s.remove(id)?;
        (t.stored_at.elapsed() <= self.ttl).then_some(Deleted { held: t.held })
    }

    /// `read` of turn `id` when `owner` stored it and it is fresh; an expired one is dropped.
    fn fresh<R>(&self, id: &str, owner: Owner, read: impl FnOnce(&StoredTurn) -> R) -> Option<R> {
        let mut s = self.lock();
        match s.turns.get(id) {
            Some(t) if t.owner != owner => None,
            Some(t) if t.stored_at.elapsed() <= self.ttl => Some(read(t)),
            Some(_) => {
                s.remove(id);
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
                s.remove(&at);
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
            s.touch(key);
            if let Some(t) = s.turns.get(key) {
                items.extend(t.packed.items());
            }
        }
        Ok(items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The owner of every turn these tests store, but where another is the point.
    const ME: Owner = Owner(None);

    fn msg(role: &str, text: &str) -> Value {
        json!({"role": role, "content": text})
    }

    /// Stores a turn of one user message, no answer, no response object, no retained KV.
    fn user_turn(store: &ResponseStore, id: &str, parent: Option<&str>, text: &str) -> u64 {
        store
            .put(
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
            .expect("our own id")
    }

    /// Stores a turn of one user message for `owner`.
    fn owned_turn(
        store: &ResponseStore,
        id: &str,
        owner: Owner,
        text: &str,
    ) -> Result<u64, IdTaken> {
        store.put(
            id,
            NewTurn {
                owner,
                parent: None,
                input: vec![msg("user", text)],
                output: vec![],
                response: json!({"id": id, "text": text}),
                held: None,
            },
        )
    }

    /// A turn is held as its JSON text, so what the bound counts is that text (plus a
    /// bounded overhead), and it reads back equal to what was stored.
    #[test]
    fn a_turn_is_held_as_its_text_and_reads_back_equal() {
        let numbers = Value::Array((0..10_000).map(|i| Value::from(i % 10)).collect());
        let wire = numbers.to_string().len();
        let store = ResponseStore::new(64 << 20, Duration::from_secs(60));
        let response = json!({"id": "r-big", "object": "response", "n": 1.5, "s": "é\u{1F600}"});
        let turn = NewTurn {
            owner: ME,
            parent: None,
            input: vec![msg("user", "count")],
            output: vec![numbers.clone()],
            response: response.clone(),
            held: None,
        };
        store.put("r-big", turn).unwrap();
        let counted = store.bytes();
        assert!(
            counted > wire && counted < wire + 1024,
            "{counted} counted for {wire} bytes of text"
        );
        assert_eq!(store.response("r-big", ME), Some(response));
        assert_eq!(
            store.input_items("r-big", ME),
            Some(vec![msg("user", "count")])
        );
        assert_eq!(
            store.history("r-big", ME).unwrap(),
            vec![msg("user", "count"), numbers]
        );
    }

    #[test]
    fn a_put_never_overwrites_another_owners_response() {
        let store = ResponseStore::new(1 << 20, Duration::from_secs(60));
        let (a, b) = (Owner::of(Some("key-a")), Owner::of(Some("key-b")));
        owned_turn(&store, "resp_1", a, "mine").unwrap();
        let taken = owned_turn(&store, "resp_1", b, "theirs").unwrap_err();
        assert_eq!(taken, IdTaken("resp_1".into()));
        assert_eq!(store.response("resp_1", a).unwrap()["text"], "mine");
        assert_eq!(store.response("resp_1", b), None);
        // Its owner may store it again.
        owned_turn(&store, "resp_1", a, "again").unwrap();
        assert_eq!(store.response("resp_1", a).unwrap()["text"], "again");
    }

    #[test]
    fn one_owner_filling_the_store_evicts_its_own_turns_first() {
        let one = {
            let s = ResponseStore::new(1 << 20, Duration::from_secs(60));
            owned_turn(&s, "r-00", ME, "xxxx").unwrap();
            s.bytes()
        };
        let store = ResponseStore::new(10 * one, Duration::from_secs(60));
        let (quiet, loud) = (Owner::of(Some("quiet")), Owner::of(Some("loud")));
        owned_turn(&store, "q-00", quiet, "xxxx").unwrap();
        owned_turn(&store, "q-01", quiet, "xxxx").unwrap();
        // The loud key stores fifty turns, five times the store.
        let mut evicted = 0;
        for i in 0..50 {
            evicted += owned_turn(&store, &format!("l-{i:02}"), loud, "xxxx").unwrap();
        }
        assert!(evicted >= 40, "{evicted}");
        assert!(store.bytes() <= 10 * one);
        // The quiet key's turns are all there; the loud key kept its most recent ones.
        for id in ["q-00", "q-01"] {
            assert!(store.response(id, quiet).is_some(), "{id} was evicted");
        }
        assert!(store.response("l-49", loud).is_some());
        assert!(store.response("l-00", loud).is_none());
    }

    #[test]
    fn a_conversation_is_rebuilt_turn_by_turn() {
        let store = ResponseStore::new(1 << 20, Duration::from_secs(60));
        store
            .put(
                "r1",
                NewTurn {
                    owner: ME,
                    parent: None,
                    input: vec![msg("user", "hi")],
                    output: vec![msg("assistant", "hello")],
                    response: Value::Null,
                    held: None,
                },
            )
            .unwrap();
        store
            .put(
                "r2",
                NewTurn {
                    owner: ME,
                    parent: Some("r1"),
                    input: vec![msg("user", "how?")],
                    output: vec![msg("assistant", "so")],
                    response: json!({"id": "r2", "object": "response"}),
                    held: None,
                },
            )
            .unwrap();
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
        store
            .put(
                "r1",
                NewTurn {
                    owner: ME,
                    parent: None,
                    input: vec![msg("system", "be brief"), msg("user", "hi")],
                    output: vec![msg("assistant", "hello")],
                    response: r1.clone(),
                    held: Some(7),
                },
            )
            .unwrap();
        store
            .put(
                "r2",
                NewTurn {
                    owner: ME,
                    parent: Some("r1"),
                    input: vec![msg("user", "how?")],
                    output: vec![],
                    response: Value::Null,
                    held: None,
                },
            )
            .unwrap();
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
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(old.response("r1", ME), None);
        assert_eq!(old.bytes(), 0, "an expired turn read is dropped");
    }

    #[test]
    fn another_key_finds_nothing_of_a_stored_response() {
        let store = ResponseStore::new(1 << 20, Duration::from_secs(60));
        let (a, b) = (Owner::of(Some("key-a")), Owner::of(Some("key-b")));
        store
            .put(
                "r1",
                NewTurn {
                    owner: a,
                    parent: None,
                    input: vec![msg("user", "mine")],
                    output: vec![msg("assistant", "yes")],
                    response: json!({"id": "r1"}),
                    held: Some(3),
                },
            )
            .unwrap();
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
}

//! The live cluster as the gateway knows it: which nodes are registered, their load, the block
//! hashes each can serve, and the tokenizer of each model. Fed by the registry stream
//! (`registry.rs`), read on every request to build the policy's [`View`].
//!
//! One `RwLock` guards it all: writers are the registry streams (a state update every few hundred
//! milliseconds per node, block events as caches change), readers are requests, which hold the
//! read lock only to copy out a view (no await while held).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime};

use pd_policy::{Measured, Node, Rates, Role, View};
use pd_rpc::registry as pb;
use pd_tokenize::Tokenizer;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

mod error;
mod open;

pub use error::{JoinError, TokenizerRefused};
pub use open::{Counts, OnNode, OpenRequests};

/// The most prefix-cache hashes the gateway keeps of one node (of a pool that says it has
/// more blocks, or does not say).
pub const MAX_HASHES_PER_NODE: usize = 1 << 20;

/// Models the view knows at most (those with nodes in the view, then the rest kept so they
/// answer 503 rather than 404).
pub const MAX_MODELS: usize = 1024;

/// Identifies one registry connection (a node's registration); a reconnect gets a new one.
pub type ConnId = u64;

/// What a node told the gateway at registration, plus what it streamed since.
#[derive(Debug)]
pub struct NodeEntry {
    /// The connection this entry belongs to.
    pub conn: ConnId,
    /// The node's engine id.
    pub engine_id: Arc<str>,
    /// New at every process start.
    pub epoch: u64,
    /// Its role, as the policy sees it.
    pub role: Role,
    /// The served model name.
    pub model: Arc<str>,
    /// Tokens per block.
    pub block_size: u32,
    /// `host:port` of its OpenAI API.
    pub http_addr: Arc<str>,
    /// `host:port` of its KV side channel (empty: none).
    pub kv_addr: Arc<str>,
    /// Longest sequence it accepts.
    pub max_model_len: u32,
    /// The prefix-cache hash key it registered with (secret; 0: none).
    pub hash_key: u64,
    /// Bytes of KV per token as it stores them (0: unknown).
    pub kv_bytes_per_token: u32,
    /// It takes the prompt as token ids (`prompt_token_ids`), so it need not tokenize again.
    pub takes_prompt_token_ids: bool,
    /// The last state it sent.
    pub state: pb::NodeState,
    /// Block hashes it can serve from its prefix cache.
    pub hashes: HashSet<u64>,
    /// The operator drains it: the policy is told, new work goes elsewhere when possible.
    pub draining: bool,
    /// When anything last arrived on its stream.
    pub last_seen: Instant,
    /// When it registered.
    pub registered_at: SystemTime,
    /// Not routed to before this: a node serving KV waits until the decode nodes have had time
    /// to receive the peer list naming it (they refuse producers they do not know).
    pub visible_from: Instant,
    /// Messages to the node (peer lists); dropping it ends the node's stream.
    pub outbox: mpsc::Sender<Result<pb::GatewayMessage, tonic::Status>>,
    /// How the gateway knows it: `registered` over the registry stream, or `static` (named
    /// with `--static-node` and scraped; see [`crate::static_node`]).
    pub source: &'static str,
    /// `Authorization` of requests to it: the cluster token for a registered node, a static
    /// node's own key or none (the cluster token never leaves the cluster unless configured).
    pub bearer: Option<http::HeaderValue>,
    /// The requests the gateway has routed to it and not seen end: what its view adds to the
    /// node's last report (see [`OpenRequests`]).
    pub open: OpenRequests,
    /// Cancelled when this process of the node (engine id and epoch) is taken to be gone:
    /// out of the view for a grace period without coming back. Requests open on it stop
    /// waiting then ([`NodeRef::gone`]). Set by [`Cluster::join`]; a reconnect of the same
    /// process keeps its token.
    pub gone: CancellationToken,
}

impl NodeEntry {
    /// Whether new work should go elsewhere: the operator drains it, or it is shutting down
    /// (it said so in its last state).
    pub fn is_draining(&self) -> bool {
        self.draining || self.state.draining
    }
}

/// A model some node registered, kept after its nodes leave (so it stays 503, not 404).
#[derive(Debug)]
pub struct ModelEntry {
    /// The tokenizer and chat template its nodes serve with.
    pub tokenizer: Arc<Tokenizer>,
    /// Fingerprint of the tokenizer files; nodes of this model must match it.
    pub fingerprint: u64,
    /// Tokens per block of its nodes (the first node's; others must agree).
    pub block_size: u32,
    /// The prefix-cache hash key of its nodes (the first node's; others must agree), so the
    /// gateway's block hashes match theirs.
    pub hash_key: u64,
    /// Whether its nodes registered or are static ([`NodeEntry::source`]): one model's nodes
    /// are all of one kind, since a static node has no hash key, no block events and takes
    /// no token ids, which would silently change routing for registered nodes of its model.
    pub source: &'static str,
}

/// Everything under the lock.
#[derive(Debug, Default)]
pub struct ClusterState {
    /// Live nodes by connection, in registration order (BTreeMap over increasing conn ids).
    pub nodes: BTreeMap<ConnId, NodeEntry>,
    /// Every model ever registered.
    pub models: HashMap<Arc<str>, ModelEntry>,
    /// Nodes out of the view whose requests still wait on them, until they come back or
    /// [`Cluster::cut_departed`] gives up on them.
    departed: Vec<Departed>,
    /// Engine ids the operator drained: a node of one of them is draining from the moment it
    /// (re)joins, until the operator says otherwise.
    drained: HashSet<Arc<str>>,
}

/// A node process that left the view: its requests' token, and since when.
#[derive(Debug)]
struct Departed {
    engine_id: Arc<str>,
    epoch: u64,
    gone: CancellationToken,
    since: Instant,
}

/// One node of a request's view, with what the host needs beyond the policy's [`Node`].
#[derive(Debug, Clone)]
pub struct NodeRef {
    /// Its connection.
    pub conn: ConnId,
    /// Engine id (for logs and `host.node-name`).
    pub engine_id: Arc<str>,
    /// Its incarnation (new at every process start).
    pub epoch: u64,
    /// `host:port` of its OpenAI API.
    pub http_addr: Arc<str>,
    /// [`NodeEntry::bearer`].
    pub bearer: Option<http::HeaderValue>,
    /// Its open and reserved requests ([`OpenRequests`]).
    counts: Arc<Counts>,
    /// [`NodeEntry::gone`].
    gone: CancellationToken,
}

impl NodeRef {
    /// Counts one more request open on this node until the guard drops.
    pub fn open(&self) -> OnNode {
        self.counts.open.fetch_add(1, Ordering::AcqRel);
        OnNode {
            conn: self.conn,
            counts: self.counts.clone(),
            reserved: false,
        }
    }

    /// Reserves this node for a split's decode phase until the guard is sent
    /// ([`OnNode::sent`]) or dropped.
    pub fn reserve(&self) -> OnNode {
        self.counts.reserved.fetch_add(1, Ordering::AcqRel);
        OnNode {
            conn: self.conn,
            counts: self.counts.clone(),
            reserved: true,
        }
    }

    /// Resolves when this node's process is taken to be gone ([`NodeEntry::gone`]): a request
    /// waiting on it selects on this, so a node that hangs (stopped, deadlocked, cut off with
    /// its connections still open) fails its requests over or ends them instead of holding
    /// them forever.
    pub fn gone(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.gone.cancelled()
    }
}

/// A model's nodes at one moment: the policy's view, the prefix holdings of one prompt, and the
/// addresses behind the indices.
#[derive(Debug)]
pub struct Snapshot {
    /// What the policy sees.
    pub view: View,
    /// Same order as `view.nodes`.
    pub nodes: Vec<NodeRef>,
    /// Leading blocks of the prompt each node holds (same order).
    pub prefix_blocks: Vec<u32>,
    /// Engine ids (same order), for the policy's `host.node-name`.
    pub names: Arc<[Arc<str>]>,
    /// What the nodes measured (rates in the same order): a policy's view carries it.
    pub measured: Measured,
    /// The longest sequence any node here accepts (0 when none is live): a longer prompt fits
    /// none of them.
    pub max_model_len: u32,
    /// Every node here takes the prompt as token ids (`prompt_token_ids`): the gateway sends
    /// the ids it computed, whichever of them a request ends up on (failover included).
    pub take_token_ids: bool,
}

/// The cluster, shared by the registry service, the proxy and the admin API.
#[derive(Debug)]
pub struct Cluster {
    state: RwLock<ClusterState>,
    peers: watch::Sender<Vec<String>>,
    /// The next [`ConnId`]: registrations and static nodes draw from one sequence.
    next_conn: AtomicU64,
}

impl Default for Cluster {
    fn default() -> Self {
        Self {
            state: RwLock::default(),
            peers: watch::channel(Vec::new()).0,
            next_conn: AtomicU64::new(1),
        }
    }
}

pub(super) fn sat(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl Cluster {
    /// A fresh connection id, greater than every id handed out before (so the view keeps
    /// joining order).
    pub fn new_conn(&self) -> ConnId {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// The state, for reading. Never held across an await.
    pub fn read(&self) -> RwLockReadGuard<'_, ClusterState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, ClusterState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The registered KV side channels, updated whenever a node joins or leaves.
    pub fn peers(&self) -> watch::Receiver<Vec<String>> {
        self.peers.subscribe()
    }

    fn publish_peers(&self, state: &ClusterState) {
        let mut addrs: Vec<String> = state
            .nodes
            .values()
            .filter(|n| !n.kv_addr.is_empty())
            .map(|n| n.kv_addr.to_string())
            .collect();
        addrs.sort();
        addrs.dedup();
        self.peers.send_if_modified(|old| {
            if *old == addrs {
                false
            } else {
                *old = addrs;
                true
            }
        });
    }

    /// Admits a registered node. The model's tokenizer and block size are set by its first node;
    /// a node whose tokenizer fingerprint or hash key differs is refused with the reason while
    /// any node of the model is in the view (so one registrant cannot change them for the
    /// others); once none is, the next node's replace them (every node then serving it agrees:
    /// a model upgraded with all its nodes). A node
    /// with another block size is admitted — P and D convert KV between block sizes (issue 13)
    /// — but the gateway hashes prompts in the model's block size, so that node's prefix-cache
    /// hits and retained turns are invisible to routing (it is still routed to; a warning says
    /// so once per registration).
    ///
    /// One engine id, one live node: a registration claiming the id of another process (another
    /// epoch, or the same epoch for another model) still in the view is refused
    /// ([`JoinError::EngineIdTaken`]) and the first keeps it, so two nodes sharing a name
    /// (containers that all call themselves the same) are never swapped in and out. The same
    /// process reconnecting (same epoch, same model) replaces its entry.
    ///
    /// # Errors
    /// The refusal, for the node's `Status`.
    pub fn join(
        &self,
        entry: NodeEntry,
        tokenizer: impl FnOnce() -> Result<(Arc<Tokenizer>, u64), TokenizerRefused>,
        fingerprint: u64,
    ) -> Result<(), JoinError> {
        // A model's first node brings its tokenizer, which may take long to parse: parsed
        // before the write lock, so requests reading the view meanwhile wait for nothing. (A
        // model gone between this look and the lock has its tokenizer parsed under it.)
        let known = self.read().models.contains_key(&entry.model);
        let (parsed, tokenizer) = match known {
            true => (None, Some(tokenizer)),
            false => (Some(tokenizer()?), None),
        };
        let tokenizer = move || match (parsed, tokenizer) {
            (Some(parsed), _) => Ok(parsed),
            (None, Some(parse)) => parse(),
            (None, None) => Err(TokenizerRefused::Missing),
        };
        let mut state = self.write();
        if let Some(held) = state
            .nodes
            .values()
            .find(|n| n.engine_id == entry.engine_id && n.source == entry.source)
            // Another process (epoch), or the same epoch claimed for another model: a
            // reconnect of the live node serves the model it served.
            .filter(|n| {
                n.source == "registered" && (n.epoch != entry.epoch || n.model != entry.model)
            })
        {
            return Err(JoinError::EngineIdTaken {
                engine_id: entry.engine_id.to_string(),
                held_by: held.http_addr.to_string(),
                claimed_by: entry.http_addr.to_string(),
            });
        }
        self.admit(&mut state, entry, tokenizer, fingerprint)
    }

    fn admit(
        &self,
        state: &mut ClusterState,
        entry: NodeEntry,
        tokenizer: impl FnOnce() -> Result<(Arc<Tokenizer>, u64), TokenizerRefused>,
        fingerprint: u64,
    ) -> Result<(), JoinError> {
        let differs = state
            .models
            .get(&entry.model)
            .is_some_and(|m| m.fingerprint != fingerprint || m.hash_key != entry.hash_key);
        if differs && !state.nodes.values().any(|n| n.model == entry.model) {
            tracing::info!(
                node = %entry.engine_id,
                model = %entry.model,
                "no node of the model is in the view: its tokenizer and hash key are this node's"
            );
            state.models.remove(&entry.model);
        }
        match state.models.get(&entry.model) {
            Some(m) if m.source != entry.source => {
                return Err(JoinError::MixedKinds {
                    model: entry.model.to_string(),
                    held: m.source,
                    engine_id: entry.engine_id.to_string(),
                    kind: entry.source,
                });
            }
            Some(m) if m.fingerprint != fingerprint => {
                return Err(JoinError::TokenizerDiffers {
                    engine_id: entry.engine_id.to_string(),
                    fingerprint,
                    model: entry.model.to_string(),
                    model_fingerprint: m.fingerprint,
                });
            }
            Some(m) if m.hash_key != entry.hash_key => {
                return Err(JoinError::HashKeyDiffers {
                    engine_id: entry.engine_id.to_string(),
                    model: entry.model.to_string(),
                });
            }
            Some(m) if m.block_size != entry.block_size => {
                tracing::warn!(
                    node = %entry.engine_id,
                    model = %entry.model,
                    block_size = entry.block_size,
                    model_block_size = m.block_size,
                    "node's block size differs from the model's: admitted (KV is converted between \
                     them), but its prefix-cache hits are invisible to routing"
                );
            }
            Some(_) => {}
            None => {
                // Models stay known after their nodes leave: without a bound, registrants
                // naming new models would grow the gateway without end.
                if state.models.len() >= MAX_MODELS {
                    state
                        .models
                        .retain(|name, _| state.nodes.values().any(|n| n.model == *name));
                    if state.models.len() >= MAX_MODELS {
                        return Err(JoinError::TooManyModels(MAX_MODELS));
                    }
                }
                let (tokenizer, fingerprint) = tokenizer()?;
                state.models.insert(
                    entry.model.clone(),
                    ModelEntry {
                        tokenizer,
                        fingerprint,
                        block_size: entry.block_size,
                        hash_key: entry.hash_key,
                        source: entry.source,
                    },
                );
            }
        }
        // One engine id, one node: a static node and a registered one cannot share it (each
        // would push the other out on every scrape or reconnect).
        if let Some(other) = state
            .nodes
            .values()
            .find(|n| n.engine_id == entry.engine_id && n.source != entry.source)
        {
            return Err(JoinError::EngineIdOfOtherKind {
                engine_id: entry.engine_id.to_string(),
                kind: other.source,
                held_by: other.http_addr.to_string(),
            });
        }
        // The same engine registering again (a reconnect racing the old stream's end) replaces it.
        let stale: Vec<ConnId> = state
            .nodes
            .values()
            .filter(|n| n.engine_id == entry.engine_id)
            .map(|n| n.conn)
            .collect();
        let mut entry = entry;
        for conn in stale {
            if let Some(old) = state.nodes.remove(&conn) {
                if old.epoch == entry.epoch {
                    // The same process reconnecting: its open requests go on.
                    entry.gone = old.gone;
                } else {
                    // Restarted (a static node's new incarnation): the old process is gone.
                    old.gone.cancel();
                }
            }
        }
        // Back within the grace period: its requests go on waiting on it. Another epoch of the
        // same engine id out of the view was restarted: its requests end at once.
        state.departed.retain(|d| {
            if d.engine_id != entry.engine_id {
                return true;
            }
            if d.epoch == entry.epoch {
                entry.gone = d.gone.clone();
            } else {
                d.gone.cancel();
            }
            false
        });
        entry.draining = state.drained.contains(&entry.engine_id);
        info!(engine_id = %entry.engine_id, role = ?entry.role, model = %entry.model, http = %entry.http_addr, draining = entry.draining, "node joined");
        state.nodes.insert(entry.conn, entry);
        self.publish_peers(state);
        Ok(())
    }

    /// Removes a node (its stream ended or fell silent). Returns whether it was there.
    pub fn leave(&self, conn: ConnId, why: &str) -> bool {
        let mut state = self.write();
        let Some(n) = state.nodes.remove(&conn) else {
            return false;
        };
        warn!(engine_id = %n.engine_id, why, "node left the view");
        self.publish_peers(&state);
        state.departed.push(Departed {
            engine_id: n.engine_id,
            epoch: n.epoch,
            gone: n.gone,
            since: Instant::now(),
        });
        true
    }

    /// After this gateway itself stalled (frozen, paused, starved of CPU) until `now`: what
    /// it did not hear during the stall is not held against the nodes. Every node counts as
    /// heard from now, and every departed node's grace starts again; a node that really went
    /// away leaves one node timeout later (at once if its stream closed).
    pub fn forgive_stall(&self, now: Instant) {
        let mut state = self.write();
        for n in state.nodes.values_mut() {
            n.last_seen = n.last_seen.max(now);
        }
        for d in &mut state.departed {
            d.since = d.since.max(now);
        }
    }

    /// Gives up on nodes out of the view for longer than `grace` that did not come back (the
    /// same process, by engine id and epoch): requests still open on them stop waiting
    /// ([`NodeRef::gone`]). Returns how many.
    pub fn cut_departed(&self, grace: Duration) -> usize {
        let mut state = self.write();
        let before = state.departed.len();
        state.departed.retain(|d| {
            let keep = d.since.elapsed() < grace;
            if !keep {
                if d.gone.is_cancelled() {
                    return false;
                }
                warn!(engine_id = %d.engine_id, epoch = d.epoch, "node gone: requests open on it end");
                d.gone.cancel();
            }
            keep
        });
        before - state.departed.len()
    }

    /// Applies a state update; false when the node is no longer in the view.
    pub fn state(&self, conn: ConnId, state: pb::NodeState) -> bool {
        let mut guard = self.write();
        let Some(n) = guard.nodes.get_mut(&conn) else {
            return false;
        };
        if state.draining && !n.state.draining {
            info!(engine_id = %n.engine_id, "node shutting down: no new work goes to it");
        }
        n.state = state;
        n.open.at_state = n.open.now();
        n.last_seen = Instant::now();
        true
    }

    /// Whether the connection is still in the view.
    pub fn is_live(&self, conn: ConnId) -> bool {
        self.read().nodes.contains_key(&conn)
    }

    /// Applies block events; false when the node is no longer in the view.
    pub fn blocks(&self, conn: ConnId, events: pb::BlockEvents) -> bool {
        let mut guard = self.write();
        let Some(n) = guard.nodes.get_mut(&conn) else {
            return false;
        };
        {
            if events.resync {
                n.hashes.clear();
            }
            for h in events.removed {
                n.hashes.remove(&h);
            }
            // One hash per block of its pool at most (a report of more grows nothing).
            let cap = match n.state.total_blocks {
                0 => MAX_HASHES_PER_NODE,
                blocks => usize::try_from(blocks)
                    .map_or(MAX_HASHES_PER_NODE, |b| b.min(MAX_HASHES_PER_NODE)),
            };
            for h in events.stored {
                if n.hashes.len() >= cap {
                    break;
                }
                n.hashes.insert(h);
            }
            n.last_seen = Instant::now();
        }
        true
    }

    /// Marks a node as draining or not, from now and whenever it joins again; false (and
    /// nothing recorded) when no live node has that engine id.
    pub fn set_draining(&self, engine_id: &str, draining: bool) -> bool {
        let mut state = self.write();
        let known = state.nodes.values().any(|n| &*n.engine_id == engine_id);
        if !known {
            return false;
        }
        if draining {
            state.drained.insert(Arc::from(engine_id));
        } else {
            state.drained.remove(engine_id);
        }
        let mut found = false;
        for n in state.nodes.values_mut() {
            if &*n.engine_id == engine_id {
                n.draining = draining;
                found = true;
            }
        }
        found
    }

    /// The engine ids the operator drained ([`Cluster::set_draining`]), restored from the
    /// state store at start: their nodes join draining.
    pub fn restore_drains(&self, engine_ids: impl IntoIterator<Item = String>) {
        let mut state = self.write();
        state.drained.extend(engine_ids.into_iter().map(Arc::from));
    }

    /// Takes `engine_ids` as the operator's drains (another gateway changed them): live nodes
    /// drain or resume accordingly.
    pub fn replace_drains(&self, engine_ids: Vec<String>) {
        let mut state = self.write();
        state.drained = engine_ids.into_iter().map(Arc::from).collect();
        let ClusterState { nodes, drained, .. } = &mut *state;
        for n in nodes.values_mut() {
            n.draining = drained.contains(&n.engine_id);
        }
    }

    /// Connections silent for longer than `timeout`.
    pub fn silent_since(&self, deadline: Instant) -> Vec<ConnId> {
        self.read()
            .nodes
            .values()
            .filter(|n| n.last_seen < deadline)
            .map(|n| n.conn)
            .collect()
    }

    /// The tokenizer and block size of `model`, if any node ever registered it.
    pub fn model(&self, model: &str) -> Option<(Arc<Tokenizer>, u32)> {
        self.read()
            .models
            .get(model)
            .map(|m| (m.tokenizer.clone(), m.block_size))
    }

    /// The longest context among `model`'s live nodes (0: none live, or none said).
    pub fn max_model_len(&self, model: &str) -> u32 {
        self.read()
            .nodes
            .values()
            .filter(|n| *n.model == *model)
            .map(|n| n.max_model_len)
            .max()
            .unwrap_or(0)
    }

    /// The prefix-cache hash key of `model`'s nodes (0: none, or no such model).
    pub fn hash_key(&self, model: &str) -> u64 {
        self.read().models.get(model).map_or(0, |m| m.hash_key)
    }

    /// Models served by at least one live node, sorted.
    pub fn live_models(&self) -> Vec<String> {
        let mut models: Vec<String> = self
            .read()
            .nodes
            .values()
            .map(|n| n.model.to_string())
            .collect();
        models.sort();
        models.dedup();
        models
    }

    /// Live nodes per role label, for the `nodes_up` gauge.
    pub fn count_by_role(&self) -> [(Role, usize); 3] {
        let state = self.read();
        let count = |r: Role| state.nodes.values().filter(|n| n.role == r).count();
        [
            (Role::Prefill, count(Role::Prefill)),
            (Role::Decode, count(Role::Decode)),
            (Role::Standalone, count(Role::Standalone)),
        ]
    }

    /// The view of `model`'s live nodes, and how many leading blocks of `hashes` each holds.
    pub fn snapshot(&self, model: &str, hashes: &[u64]) -> Snapshot {
        let state = self.read();
        let now = Instant::now();
        let members = state
            .nodes
            .values()
            .filter(|n| &*n.model == model && n.visible_from <= now);
        let (lower, _) = members.size_hint();
        let mut view = View {
            nodes: Vec::with_capacity(lower),
        };
        let mut nodes = Vec::with_capacity(lower);
        let mut prefix_blocks = Vec::with_capacity(lower);
        let mut measured = Measured {
            rates: Vec::with_capacity(lower),
            kv_bytes_per_token: 0,
        };
        let mut take_token_ids = true;
        let mut max_model_len = 0;
        for n in members {
            take_token_ids &= n.takes_prompt_token_ids;
            max_model_len = max_model_len.max(n.max_model_len);
            let s = &n.state;
            let (waiting, running, waiting_remote_kv) = n.open.adjust(s);
            view.nodes.push(Node {
                role: n.role,
                free_blocks: sat(s.free_blocks),
                total_blocks: sat(s.total_blocks),
                leased_blocks: sat(s.leased_blocks),
                waiting,
                running,
                waiting_remote_kv,
                draining: n.is_draining(),
                conversation_tokens: 0,
                conversation_expiry_ms: 0,
            });
            nodes.push(NodeRef {
                conn: n.conn,
                engine_id: n.engine_id.clone(),
                epoch: n.epoch,
                http_addr: n.http_addr.clone(),
                bearer: n.bearer.clone(),
                counts: n.open.counts.clone(),
                gone: n.gone.clone(),
            });
            measured.rates.push(Rates {
                prefill_tokens_per_s: s.prefill_tokens_per_s,
                pull_mb_per_s: s.pull_mb_per_s,
            });
            if measured.kv_bytes_per_token == 0 {
                measured.kv_bytes_per_token = n.kv_bytes_per_token;
            }
            let held = hashes.iter().take_while(|h| n.hashes.contains(h)).count();
            prefix_blocks.push(sat(held as u64));
        }
        let names = nodes.iter().map(|n| n.engine_id.clone()).collect();
        Snapshot {
            max_model_len,
            take_token_ids: take_token_ids && !nodes.is_empty(),
            view,
            nodes,
            prefix_blocks,
            names,
            measured,
        }
    }
}

/// The policy's role for a registered role.
pub fn role_of(role: pb::Role) -> Option<Role> {
    match role {
        pb::Role::Producer => Some(Role::Prefill),
        pb::Role::Consumer => Some(Role::Decode),
        pb::Role::Standalone | pb::Role::Both => Some(Role::Standalone),
        pb::Role::Unspecified => None,
    }
}

/// The label of a role in metrics and the admin API.
pub fn role_label(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Standalone => "standalone",
    }
}

#[cfg(test)]
mod tests;

//! Prefill/decode disaggregation as one node plays it: its role, what it advertises as a
//! producer, and the consumer's side — wait for blocks, pull them from the producer, confirm
//! and release the lease, then let the engine decode.
//!
//! The consumer path of one request is a task between the engine's [`RequestStream`] and the
//! HTTP body ([`Events::Relayed`]):
//! 1. wait for [`RequestEvent::AwaitingKv`] (blocks reserved; other requests keep running);
//! 2. check the params against the prompt, connect and handshake (cached per peer), renew the
//!    lease while waiting ([`LeaseKeeper`]), pull, confirm the lease;
//! 3. release the lease (in the background), tell the engine what arrived — or, when something
//!    failed, apply the failure policy: fail the request, or recompute and count why;
//! 4. hand the engine's stream over to the HTTP layer ([`Relay::Handover`]), which reads the
//!    rest of the request's events itself. A client that goes away before that aborts the
//!    request and releases the producer's lease at once; a pull already posted is waited for
//!    first, since its writes land in blocks the engine would otherwise reuse.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pd_engine::{EngineHandle, RemoteKv, RequestEvent, RequestId, RequestStream};
use pd_kv_pool::BlockId;
use pd_kv_transfer::{
    CompatInfo, FailurePolicy, Fallback, HandshakeCache, LeaseKeeper, LeasedBlocks, PeerClient,
    PeerInfo, Puller, Rechunk, TransferError, TransferMetrics, pull_under_lease_with,
};
use tokio::sync::{mpsc, watch};

use crate::kv_params::{Advert, RemotePrefill, prompt_hash};
use crate::metrics::NodeMetrics;

/// A pull's blocks, uploaded into the engine's staged compute pool as they land
/// ([`pd_model::BlockUpload`] through [`pd_kv_transfer::Landing`]): on a GPU node each part's
/// copy to the device runs while the next part is read, and the engine copies nothing after
/// the pull (it hears [`EngineHandle::remote_kv_landed`]).
#[derive(Debug)]
struct StagedLanding(Arc<dyn pd_model::BlockUpload>);

impl pd_kv_transfer::Landing for StagedLanding {
    fn begin(&self) -> Result<(), String> {
        self.0.begin().map_err(|e| e.to_string())
    }

    unsafe fn landed(&self, first: BlockId, bytes: &[u8]) -> Result<(), String> {
        // SAFETY: the same contract (`Landing::landed`): the pull owns the run's blocks in both
        // pools and keeps `bytes` until it settles.
        unsafe { self.0.upload(first, bytes) }.map_err(|e| e.to_string())
    }

    fn settle(&self) -> Result<(), String> {
        self.0.settle().map_err(|e| e.to_string())
    }
}

/// A node's part in P/D disaggregation (vLLM's `kv_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvRole {
    /// No KV transfer: `kv_transfer_params` asking for one is refused.
    #[default]
    Standalone,
    /// Prefill node: serves `do_remote_decode` requests (and, as every role but standalone,
    /// `do_remote_prefill` ones).
    Producer,
    /// Decode node: serves `do_remote_prefill` requests.
    Consumer,
    /// Both (vLLM's deprecated `kv_both`).
    Both,
}

impl KvRole {
    /// Whether `do_remote_decode` requests are served.
    pub fn produces(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }

    /// Whether `do_remote_prefill` requests are served: any role but standalone. A prefill
    /// node pulls a conversation's history back from its holder, so it can also pull a turn
    /// and decode it itself (`whole` on P with a reverse pull).
    pub fn pulls(self) -> bool {
        self != KvRole::Standalone
    }

    /// vLLM's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            KvRole::Standalone => "standalone",
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }
}

/// How a consumer pulls.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// This node's engine id (sent to producers with every lease call).
    pub engine_id: String,
    /// What to do when the KV does not arrive.
    pub policy: FailurePolicy,
    /// Compute prompts locally when fewer than this many tokens would be pulled.
    pub recompute_threshold: usize,
    /// Skip the handshake's compatibility check (both sides must agree to).
    pub skip_compat_check: bool,
    /// How often to renew a lease while waiting (the producer's duration / 6).
    pub renew_interval: std::time::Duration,
    /// The time one pull gets (handshake, reads, confirmation), plus
    /// [`PULL_DEADLINE_RATE`] for its bytes; past it the pull is cancelled and fails as
    /// `deadline`.
    pub pull_timeout: std::time::Duration,
    /// How long a request may wait for free local blocks before it fails and releases the
    /// producer's lease.
    pub wait_timeout: std::time::Duration,
    /// A lease is confirmed on the producer's mapped lease board alone when the board beat at
    /// most this long before (`--kv-board-freshness-ms`; `None`: always hear the producer).
    pub board_freshness: Option<std::time::Duration>,
    /// Pulls upload their blocks into a staged compute pool as they land
    /// (`--kv-upload-while-pulling`; see [`StagedLanding`]).
    pub upload_while_pulling: bool,
    /// Producers this node may contact. `remote_host` comes from the request, so a node
    /// reachable by untrusted clients must restrict them (vLLM #47843 was an SSRF through it).
    pub allowed_peers: AllowedPeers,
    /// The cluster token sent on every side-channel call (`--cluster-token`, or the one the
    /// gateway handed out at registration); `None` while there is none.
    pub cluster_token: tokio::sync::watch::Receiver<Option<String>>,
}

impl PullConfig {
    /// Whether `host:port` may be contacted (see [`AllowedPeers::check`]).
    pub fn allows(&self, host: &str, port: u16) -> bool {
        self.allowed_peers.check(host, port).is_ok()
    }

    /// The deadline of a pull of `bytes` starting now: [`PullConfig::pull_timeout`] plus the
    /// bytes at [`PULL_DEADLINE_RATE`].
    pub fn pull_deadline(&self, bytes: usize) -> std::time::Instant {
        let transfer = std::time::Duration::from_secs_f64(bytes as f64 / PULL_DEADLINE_RATE);
        std::time::Instant::now() + self.pull_timeout + transfer
    }
}

/// Bytes per second a pull's deadline grants beyond the base timeout (100 MiB/s: well below
/// even TCP-emulated RMA, so only a stalled peer reaches it).
pub const PULL_DEADLINE_RATE: f64 = 100.0 * 1024.0 * 1024.0;

/// Side-channel clients (and handshakes) a consumer keeps; beyond, one is dropped to make room.
pub const MAX_PEER_CLIENTS: usize = 64;

/// The producers a consumer may contact: `--kv-allowed-peers`, plus, on a node reporting to a
/// gateway, the KV side channels of the gateway's latest `PeerList` (swapped in by the reporter
/// as lists arrive; read on every request).
///
/// - No gateway: the static list; empty allows any producer (the behaviour before gateways).
/// - A gateway: the static list *or* the gateway's list; with an empty static list only the
///   gateway's, and before the gateway sent one, none.
#[derive(Debug, Clone, Default)]
pub struct AllowedPeers {
    /// `--kv-allowed-peers`: `host` or `host:port` (IPv6 in brackets).
    pub fixed: Vec<String>,
    /// The gateway's peer list (`host:port` each; `pd_report::ReporterHandle::peers`), when the
    /// node reports to a gateway: `None` inside until the first list arrives.
    pub gateway: Option<watch::Receiver<Option<Vec<String>>>>,
}

impl AllowedPeers {
    /// Only `--kv-allowed-peers` (no gateway).
    pub fn fixed(peers: Vec<String>) -> Self {
        Self {
            fixed: peers,
            gateway: None,
        }
    }

    /// `Ok` when the producer at `host:port` may be contacted; otherwise why not, for the
    /// client.
    ///
    /// # Errors
    /// The refusal's message.
    pub fn check(&self, host: &str, port: u16) -> Result<(), String> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let listed = |list: &[String]| list.iter().any(|a| peer_matches(a, host, port));
        if listed(&self.fixed) {
            return Ok(());
        }
        let Some(gateway) = &self.gateway else {
            if self.fixed.is_empty() {
                return Ok(());
            }
            return Err(format!(
                "{host}:{port} is not an allowed KV peer of this node (--kv-allowed-peers)"
            ));
        };
        let nor_fixed = if self.fixed.is_empty() {
            ""
        } else {
            " nor in --kv-allowed-peers"
        };
        match &*gateway.borrow() {
            Some(peers) if listed(peers) => Ok(()),
            Some(_) => Err(format!(
                "{host}:{port} is not a KV peer registered with the gateway{nor_fixed}"
            )),
            None => Err(format!(
                "{host}:{port} is not an allowed KV peer: this node is not registered with the \
                 gateway yet (no KV peer list received){nor_fixed}"
            )),
        }
    }
}

/// Whether the allow-list entry `entry` (`host` or `host:port`, IPv6 in brackets) names
/// `host:port` (`host` without brackets).
fn peer_matches(entry: &str, host: &str, port: u16) -> bool {
    let entry = entry.trim();
    match entry
        .rsplit_once(':')
        .filter(|(h, p)| !h.ends_with(':') && p.parse::<u16>().is_ok())
    {
        Some((h, p)) => {
            h.trim_start_matches('[').trim_end_matches(']') == host
                && p.parse::<u16>().ok() == Some(port)
        }
        None => entry.trim_start_matches('[').trim_end_matches(']') == host,
    }
}

/// Everything P/D about one node, shared by the HTTP handlers.
#[derive(Debug)]
pub struct Disagg {
    pub(crate) role: KvRole,
    /// Set when the node has a side channel: how proxies and peers reach it (a prefill's
    /// handoff, a retained turn).
    pub(crate) advert: Option<Advert>,
    pub(crate) loader: Option<Loader>,
    pub(crate) metrics: Arc<TransferMetrics>,
    /// The HTTP layer's own counters.
    pub(crate) node_metrics: NodeMetrics,
}

impl Disagg {
    /// A node without KV transfer.
    pub fn standalone() -> Self {
        Self {
            role: KvRole::Standalone,
            advert: None,
            loader: None,
            metrics: Arc::new(TransferMetrics::new()),
            node_metrics: NodeMetrics::new(),
        }
    }

    /// A node playing `role`, in its incarnation `epoch` (new at every start). A producer needs
    /// `side_channel` (the host, kept current, and port peers reach it at); pulling — a consumer's, or any
    /// node's reverse pull of an earlier turn — needs a `puller` over the engine's pool.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        role: KvRole,
        engine: &EngineHandle,
        engine_id: &str,
        epoch: u64,
        side_channel: Option<(tokio::sync::watch::Receiver<String>, u16)>,
        puller: Option<Puller>,
        pull: PullConfig,
        metrics: Arc<TransferMetrics>,
    ) -> Self {
        let info = engine.info();
        let advert = side_channel.map(|(host, port)| Advert {
            engine_id: engine_id.to_string(),
            epoch,
            host,
            port,
            block_size: info.block_size,
        });
        let loader = puller.map(|puller| Loader {
            puller,
            compat: CompatInfo::new(info.model_name.clone(), &info.kv_layout)
                .with_fingerprint(info.fingerprint.clone()),
            epoch,
            cfg: pull,
            clients: Mutex::new(HashMap::new()),
            handshakes: Mutex::new(HandshakeCache::default()),
        });
        Self {
            role,
            advert,
            loader,
            metrics,
            node_metrics: NodeMetrics::new(),
        }
    }

    /// The transfer metrics (for `/metrics`).
    pub fn metrics(&self) -> &TransferMetrics {
        &self.metrics
    }

    /// Brings the transfer metrics' view of the puller up to date (the path to each peer).
    pub(crate) fn observe_puller(&self) {
        if let Some(loader) = &self.loader {
            self.metrics.observe_peer_paths(&loader.puller.peer_paths());
        }
    }
}

/// The consumer's pulling machinery.
pub(crate) struct Loader {
    puller: Puller,
    compat: CompatInfo,
    epoch: u64,
    cfg: PullConfig,
    /// Side-channel clients per producer address.
    clients: Mutex<HashMap<String, PeerClient>>,
    handshakes: Mutex<HandshakeCache>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("engine_id", &self.cfg.engine_id)
            .finish()
    }
}

/// A request's events as the HTTP layer reads them: straight from the engine, or from the
/// consumer task while it pulls, then — once the engine has the KV — straight from the engine
/// again (the task hands the stream over: no hop per token). Dropping it aborts the request
/// either way.
#[derive(Debug)]
pub(crate) enum Events {
    Engine(RequestStream),
    Relayed(RequestId, mpsc::UnboundedReceiver<Relay>),
    /// Handed over by the consumer task; its first token (or whatever ends the request instead)
    /// is timed as D's `first_token` stage.
    Handed(RequestStream, Option<FirstToken>),
}

/// What the consumer task sends the HTTP layer.
#[derive(Debug)]
pub(crate) enum Relay {
    /// An event (a failure before the engine took over).
    Event(RequestEvent),
    /// The engine has the KV: read the request's events from its stream from now on.
    Handover(RequestStream, FirstToken),
}

/// When the engine was told to decode, to time the first token.
#[derive(Debug)]
pub(crate) struct FirstToken {
    since: std::time::Instant,
    metrics: Arc<TransferMetrics>,
}

impl Events {
    pub(crate) fn id(&self) -> RequestId {
        match self {
            Events::Engine(s) | Events::Handed(s, _) => s.id(),
            Events::Relayed(id, _) => *id,
        }
    }

    /// Next event; `None` when the request ended.
    pub(crate) async fn recv(&mut self) -> Option<RequestEvent> {
        loop {
            let handed = match self {
                Events::Engine(s) => return s.recv().await,
                Events::Handed(s, first) => {
                    let e = s.recv().await;
                    if !matches!(e, Some(RequestEvent::Started { .. }))
                        && let Some(f) = first.take()
                    {
                        f.metrics.record_stage("first_token", f.since.elapsed());
                    }
                    return e;
                }
                Events::Relayed(_, rx) => match rx.recv().await {
                    Some(Relay::Event(e)) => return Some(e),
                    Some(Relay::Handover(stream, first)) => Events::Handed(stream, Some(first)),
                    None => return None,
                },
            };
            *self = handed;
        }
    }
}

/// Why a pull did not happen or failed, before the failure policy.
enum Skip {
    /// Nothing to pull (the local prefix cache had it): not a recompute.
    Nothing,
    /// Fewer tokens than the threshold: computed here on purpose (counted).
    BelowThreshold,
}

impl Loader {
    /// Whether the producer at `host:port` may be contacted (`--kv-allowed-peers`, the
    /// gateway's peers); `Err` says why not.
    pub(crate) fn check_peer(&self, host: &str, port: u16) -> Result<(), String> {
        self.cfg.allowed_peers.check(host, port)
    }

    async fn client(&self, addr: &str) -> Result<PeerClient, TransferError> {
        if let Some(c) = self
            .clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(addr)
        {
            return Ok(c.clone());
        }
        let c = PeerClient::connect(addr, &self.cfg.engine_id)
            .await?
            .with_cluster_token(self.cfg.cluster_token.clone());
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if clients.len() >= MAX_PEER_CLIENTS
            && let Some(old) = clients.keys().find(|k| *k != addr).cloned()
        {
            // Bounded: the dropped producer reconnects (and handshakes) when it is named again.
            clients.remove(&old);
            self.handshakes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .invalidate(&old);
        }
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Forgets a producer after a failure, so the next request connects and handshakes afresh
    /// (and the puller opens a new endpoint to `engine_id`).
    fn forget(&self, addr: &str, engine_id: &str) {
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(addr);
        self.handshakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .invalidate(addr);
        self.puller.forget(engine_id);
    }

    /// A handshake with the producer at `addr` (cached; no lock held across the call).
    async fn handshake(
        &self,
        client: &mut PeerClient,
        addr: &str,
        fresh: bool,
    ) -> Result<PeerInfo, TransferError> {
        if !fresh
            && let Some(p) = self
                .handshakes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .lookup(addr)
        {
            return Ok(p);
        }
        let p = client
            .handshake(&self.compat, self.epoch, self.cfg.skip_compat_check)
            .await?;
        self.handshakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(addr, p.clone());
        Ok(p)
    }

    /// Whether the lease board of `remote`'s producer, mapped here through the cached
    /// handshake of the incarnation the params name, beat (granted a lease) within `within`:
    /// then the board alone is likely to confirm the lease after the reads, and the producer's
    /// answer need not be asked for first.
    fn board_beat_within(&self, remote: &RemotePrefill, within: std::time::Duration) -> bool {
        let Some(epoch) = remote.epoch else {
            return false;
        };
        let cache = self.handshakes.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .cached(&remote.side_channel())
            .filter(|peer| peer.engine_id == remote.engine_id && peer.epoch == epoch)
            .and_then(|peer| peer.owner_clock)
            .zip(self.puller.board_beat(&remote.engine_id, epoch))
            .is_some_and(|(clock, beat)| clock.beat_within(beat, within))
    }

    /// Reaches the producer of `remote` and checks it is the engine the params name
    /// (cancellable: nothing is written locally yet).
    async fn prepare(
        &self,
        remote: &RemotePrefill,
    ) -> Result<(PeerClient, PeerInfo), TransferError> {
        let addr = remote.side_channel();
        let mut client = self.client(&addr).await?;
        let mut peer = self.handshake(&mut client, &addr, false).await?;
        let named = |peer: &PeerInfo| remote.epoch.is_none_or(|e| e == peer.epoch);
        if peer.engine_id != remote.engine_id || !named(&peer) {
            // The producer restarted (another id, or the same id in a new incarnation): the
            // cached handshake's worker and keys are the old process's. Ask again once.
            peer = self.handshake(&mut client, &addr, true).await?;
        }
        if peer.engine_id != remote.engine_id {
            return Err(TransferError::Mismatch(format!(
                "remote_engine_id is {:?} but {addr} is engine {:?}",
                remote.engine_id, peer.engine_id
            )));
        }
        if !named(&peer) {
            // Params from an earlier incarnation: their lease and blocks died with it.
            return Err(TransferError::LeaseLost {
                lease: remote.lease.to_string(),
                reason: "stale_epoch".into(),
            });
        }
        // Lease calls name the incarnation the reads go to; another one refuses them.
        client.name_owner_epoch(peer.epoch);
        Ok((client, peer))
    }
}

/// Checks that `remote` describes `prompt` (block count, token count, prompt hash); `Err` names
/// the field that does not fit. Runs before the request is queued, so a mismatch is a 400.
/// Prompt tokens whose KV `remote` holds: `remote_num_tokens`, else whole blocks, at most the
/// prompt. The prompt's whole KV for a prefill's handoff; a prefix of it for a retained turn.
fn held_tokens(remote: &RemotePrefill, prompt_len: usize, block_size: usize) -> usize {
    remote
        .num_tokens
        .unwrap_or(remote.block_ids.len() * block_size)
        .min(prompt_len)
}

/// What [`plan_pull`] decided.
struct PullPlan {
    /// The producer's blocks to read.
    remote: Vec<BlockId>,
    /// Ours they land in (one per remote block, or, with `rechunk`, ours holding its tokens).
    local: Vec<BlockId>,
    /// The producer's blocks differ from ours in size or order: convert these tokens.
    rechunk: Option<Rechunk>,
}

/// Which of the producer's blocks to read into which of ours: the KV of the tokens from our
/// first block without KV (`first_block`, after our own prefix-cache hits) up to `held`.
/// `local` are our blocks from `first_block` on. The producer's blocks are of the size its
/// handshake says (`theirs`), which must be the size the params were checked with
/// (`said_bs`). Where the producer's block size or order differ from ours, the tokens are
/// converted after the reads ([`Rechunk`]).
fn plan_pull(
    ours: &pd_kv_pool::KvLayout,
    theirs: &pd_kv_pool::KvLayout,
    said_bs: usize,
    remote_ids: &[BlockId],
    local: &[BlockId],
    first_block: usize,
    held: usize,
) -> Result<PullPlan, TransferError> {
    let shape = |l: &pd_kv_pool::KvLayout| (l.num_layers, l.num_kv_heads, l.head_dim, l.dtype);
    if shape(theirs) != shape(ours) {
        // (Only a handshake told to skip the compatibility check gets here.)
        return Err(TransferError::Mismatch(format!(
            "the producer's KV is shaped {:?}, ours {:?}",
            shape(theirs),
            shape(ours)
        )));
    }
    if theirs.block_size != said_bs {
        return Err(TransferError::Mismatch(format!(
            "the params were checked as blocks of {said_bs} tokens, the producer's hold {}",
            theirs.block_size
        )));
    }
    let bs = ours.block_size;
    let short = |what: &str| {
        TransferError::Mismatch(format!(
            "{what} do not cover tokens {}..{held}",
            first_block * bs
        ))
    };
    if !pd_kv_transfer::needs_rechunk(ours, theirs) {
        // Block for block.
        let held_blocks = remote_ids.len().min(held.div_ceil(bs));
        let remote = remote_ids
            .get(first_block..held_blocks)
            .ok_or_else(|| short("the producer's blocks"))?;
        let local = local
            .get(..remote.len())
            .ok_or_else(|| short("our reserved blocks"))?;
        return Ok(PullPlan {
            remote: remote.to_vec(),
            local: local.to_vec(),
            rechunk: None,
        });
    }
    let tokens = first_block * bs..held;
    let rbs = theirs.block_size;
    let remote = remote_ids
        .get(tokens.start / rbs..held.div_ceil(rbs))
        .ok_or_else(|| short("the producer's blocks"))?;
    let local = local
        .get(..held.div_ceil(bs).saturating_sub(first_block))
        .ok_or_else(|| short("our reserved blocks"))?;
    Ok(PullPlan {
        remote: remote.to_vec(),
        local: local.to_vec(),
        rechunk: Some(Rechunk {
            from: *theirs,
            to: *ours,
            tokens,
        }),
    })
}

/// Whether `remote` describes this prompt's KV, or a prefix of it (a retained turn): no more
/// blocks than the prompt has, `remote_num_tokens` within the prompt and filling exactly the
/// blocks named, `remote_prompt_hash` equal to the hash of that prefix. The producer's own
/// word on what its blocks hold is checked again at confirm (`pull_under_lease`).
pub(crate) fn check_prompt(
    remote: &RemotePrefill,
    prompt: &[u32],
    block_size: usize,
) -> Result<(), (&'static str, String)> {
    // The producer's blocks: of the size it said (`remote_block_size`), else of ours.
    let block_size = remote.block_size.unwrap_or(block_size);
    if remote.block_ids.len() > prompt.len().div_ceil(block_size) {
        return Err((
            "remote_block_ids",
            format!(
                "{} remote blocks for a prompt of {} tokens ({} blocks of {block_size})",
                remote.block_ids.len(),
                prompt.len(),
                prompt.len().div_ceil(block_size)
            ),
        ));
    }
    let held = held_tokens(remote, prompt.len(), block_size);
    if let Some(n) = remote.num_tokens
        && (n > prompt.len() || n.div_ceil(block_size) != remote.block_ids.len())
    {
        return Err((
            "remote_num_tokens",
            format!(
                "remote_num_tokens is {n} in {} blocks of {block_size}, the prompt has {} tokens",
                remote.block_ids.len(),
                prompt.len()
            ),
        ));
    }
    if let Some(h) = remote.prompt_hash
        && h != prompt_hash(&prompt[..held])
    {
        return Err((
            "remote_prompt_hash",
            "remote_prompt_hash differs: the producer computed another prompt".into(),
        ));
    }
    Ok(())
}

/// Releases the leases of `remotes` (deduplicated) in the background; unacknowledged releases
/// are counted (the lease then ends by expiry on the producer).
pub(crate) fn release_all(disagg: &Arc<Disagg>, remotes: &[RemotePrefill]) {
    if tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    let mut seen = std::collections::HashSet::new();
    for r in remotes {
        if !seen.insert((r.side_channel(), r.lease, r.generation)) {
            continue;
        }
        let disagg = disagg.clone();
        let r = r.clone();
        tokio::spawn(async move {
            let Some(loader) = disagg.loader.as_ref() else {
                return;
            };
            let result = match loader.client(&r.side_channel()).await {
                Ok(mut c) => {
                    // Name the incarnation the params came from: a restarted producer refuses.
                    c.name_owner_epoch(r.epoch.unwrap_or(0));
                    c.release(r.lease, r.generation).await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                disagg.metrics.notification_failures.inc();
                tracing::warn!(lease = %r.lease, producer = %r.engine_id, error = %e, "releasing a KV lease failed");
            }
        });
    }
}

/// Runs a consumer request: returns the events the HTTP layer reads while a task pulls the KV.
/// `remotes[0]` drives the pull; every distinct lease in `remotes` is released at the end.
///
/// Without a loader (a node that does not consume) the request fails with a clear message.
pub(crate) fn consume(
    disagg: Arc<Disagg>,
    engine: EngineHandle,
    stream: RequestStream,
    remotes: Vec<RemotePrefill>,
    prompt: Vec<u32>,
) -> Events {
    let id = stream.id();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(relay(disagg, engine, stream, remotes, prompt, tx));
    Events::Relayed(id, rx)
}

/// Aborts a task when dropped (on every way out of the relay).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The producer's confirmation of `remote`'s lease, asked for as the request arrives (see
/// [`pd_kv_transfer::pull_under_lease_with`]).
async fn early_confirm(
    disagg: Arc<Disagg>,
    remote: RemotePrefill,
) -> Result<pd_kv_pool::LeaseContents, TransferError> {
    let Some(loader) = disagg.loader.as_ref() else {
        return Err(TransferError::PullerStopped);
    };
    let (mut client, _) = loader.prepare(&remote).await?;
    client.confirm(remote.lease, remote.generation).await
}

/// Renews `remote`'s lease until aborted: every duration / 6 of the producer's lease (read off
/// its expiry time), at most the configured interval.
async fn keep_alive(disagg: Arc<Disagg>, remote: RemotePrefill) {
    let Some(loader) = disagg.loader.as_ref() else {
        return;
    };
    // Capped by our own setting: a producer whose clock runs ahead must not stretch it.
    let interval = remote
        .expiry
        .and_then(|e| e.duration_since(std::time::SystemTime::now()).ok())
        .map_or(loader.cfg.renew_interval, |left| {
            (left / 6)
                .max(std::time::Duration::from_millis(10))
                .min(loader.cfg.renew_interval)
        });
    let Ok(client) = loader.client(&remote.side_channel()).await else {
        return; // the pull will find out and say why
    };
    let _keeper = LeaseKeeper::start(
        client,
        remote.lease,
        remote.generation,
        interval,
        disagg.metrics.clone(),
    );
    std::future::pending::<()>().await;
}

async fn relay(
    disagg: Arc<Disagg>,
    engine: EngineHandle,
    mut stream: RequestStream,
    remotes: Vec<RemotePrefill>,
    prompt: Vec<u32>,
    tx: mpsc::UnboundedSender<Relay>,
) {
    let Some(loader) = disagg.loader.as_ref() else {
        // `kv_directive` admits consumer requests only on a node with a loader.
        let _ = tx.send(Relay::Event(RequestEvent::Failed {
            message: "this node cannot pull KV (no puller)".into(),
        }));
        return;
    };
    let id = stream.id();
    let Some(remote) = remotes.first().cloned() else {
        // `kv_params::parse` never yields an empty list.
        let _ = tx.send(Relay::Event(RequestEvent::Failed {
            message: "kv_transfer_params name no producer".into(),
        }));
        return;
    };
    let arrived = std::time::Instant::now();
    // The copy comes once blocks are reserved: its helper thread may wake now.
    if let Some(epoch) = remote.epoch {
        loader.puller.prepare_copy(
            &remote.engine_id,
            epoch,
            remote.block_ids.len() * engine.info().kv_layout.block_bytes(),
        );
    }
    // Keep the producer's lease alive from now on: the request may wait a while for blocks here.
    let keeper = AbortOnDrop(tokio::spawn(keep_alive(disagg.clone(), remote.clone())));
    // A producer with a lease board: ask it to confirm the lease now, while this request waits
    // for blocks and reads them; the board's record, read after the reads, says the lease had
    // not ended by then (`pull_under_lease_with`). Dropped unused when nothing is pulled. Not
    // asked when its board, mapped here, beat so recently that the record alone will very
    // likely confirm the lease (half the window, to leave room for the wait and the reads;
    // otherwise the producer is asked after the reads).
    let board_will_do = loader
        .cfg
        .board_freshness
        .is_some_and(|w| loader.board_beat_within(&remote, w / 2));
    let mut early = pd_kv_transfer::Unawaited(
        (remote.board_slot.is_some() && !board_will_do)
            .then(|| tokio::spawn(early_confirm(disagg.clone(), remote.clone()))),
    );
    // 1. Blocks reserved? (bounded: a node with no room must not hold P's blocks forever)
    let wait = loader.cfg.wait_timeout;
    let first = tokio::select! {
        () = tx.closed() => None,
        e = tokio::time::timeout(wait, stream.recv()) => match e {
            Ok(e) => Some(e),
            Err(_) => {
                let e = TransferError::BlocksUnavailable(wait);
                disagg.metrics.record_failure(&e);
                tracing::warn!(request = %id, error = %e, "giving up waiting for blocks");
                Some(Some(RequestEvent::Failed { message: e.to_string() }))
            }
        },
    };
    let (blocks, first_block, cached) = match first {
        Some(Some(RequestEvent::AwaitingKv {
            blocks,
            first_block,
            cached_tokens,
        })) => (blocks, first_block, cached_tokens),
        other => {
            // Client gone, engine gone, or a failure (passed on): nothing to pull.
            if let Some(Some(e)) = other {
                let _ = tx.send(Relay::Event(e));
            }
            release_all(&disagg, &remotes);
            return;
        }
    };
    disagg
        .metrics
        .record_stage("wait_blocks", arrived.elapsed());
    let remote = &remote;
    // The KV the producer holds: the whole prompt (a prefill's handoff) or a prefix of it (an
    // earlier turn); what is not pulled is computed here. Block counts below are ours.
    let ours = engine.info().kv_layout;
    let bs = ours.block_size;
    let said_bs = remote.block_size.unwrap_or(bs);
    let held = held_tokens(remote, prompt.len(), said_bs);
    let held_blocks = if said_bs == bs {
        remote.block_ids.len().min(held.div_ceil(bs))
    } else {
        held.div_ceil(bs)
    };
    let wanted = held
        .min(prompt.len().saturating_sub(1))
        .saturating_sub(cached);
    let skip = if wanted == 0 || blocks.is_empty() || first_block >= held_blocks {
        Some(Skip::Nothing)
    } else if wanted < loader.cfg.recompute_threshold {
        Some(Skip::BelowThreshold)
    } else {
        None
    };
    // 2. Pull (into the compute pool too, as the blocks land, on a staged node).
    let landing = engine
        .uploader()
        .filter(|_| loader.cfg.upload_while_pulling)
        .map(|u| Arc::new(StagedLanding(u.clone())) as Arc<dyn pd_kv_transfer::Landing>);
    let mut landed = false;
    let outcome: Result<RemoteKv, TransferError> = match skip {
        Some(Skip::Nothing) => Ok(RemoteKv::Pulled(cached)),
        Some(Skip::BelowThreshold) => {
            disagg
                .metrics
                .recomputes
                .with_label_values(&["below_threshold"])
                .inc();
            tracing::debug!(request = %id, tokens = wanted, "below kv_recompute_threshold: computing locally");
            Ok(RemoteKv::Recompute)
        }
        None => {
            // What the reads move: whole blocks of the producer's size (the params' word until
            // the handshake; a size other than that fails the pull).
            let per_token = ours.block_bytes() / bs.max(1);
            let bytes = if said_bs == bs {
                (held_blocks - first_block) * ours.block_bytes()
            } else {
                (held.div_ceil(said_bs) - first_block * bs / said_bs)
                    .saturating_mul(said_bs)
                    .saturating_mul(per_token)
            };
            let deadline = loader.cfg.pull_deadline(bytes);
            let preparing = std::time::Instant::now();
            let prepared = tokio::select! {
                () = tx.closed() => {
                    release_all(&disagg, &remotes);
                    return;
                }
                p = tokio::time::timeout_at(deadline.into(), loader.prepare(remote)) => {
                    p.unwrap_or_else(|_| Err(TransferError::Deadline(format!(
                        "the producer at {} did not answer the handshake in time",
                        remote.side_channel()
                    ))))
                }
            };
            disagg.metrics.record_stage("prepare", preparing.elapsed());
            match prepared {
                Err(e) => {
                    // (`pull_under_lease` records its own outcomes.)
                    disagg.metrics.record_failure(&e);
                    Err(e)
                }
                Ok((mut client, peer)) => match plan_pull(
                    &ours,
                    &peer.layout,
                    said_bs,
                    &remote.block_ids,
                    &blocks,
                    first_block,
                    held,
                ) {
                    Err(e) => {
                        disagg.metrics.record_failure(&e);
                        Err(e)
                    }
                    Ok(PullPlan {
                        remote: remote_ids,
                        local: local_ids,
                        rechunk,
                    }) => {
                        if rechunk.is_some() {
                            disagg.metrics.rechunked_pulls.inc();
                        }
                        let leased = LeasedBlocks {
                            lease: remote.lease,
                            generation: remote.generation,
                            remote: remote_ids,
                            local: local_ids,
                            rechunk,
                            // The lease's tokens (our prompt's) in the lease's blocks (the ids
                            // the params name, which we read).
                            expect: pd_kv_pool::LeaseContents::of(&prompt[..held])
                                .in_blocks(&remote.block_ids),
                            board_slot: remote.board_slot,
                            board_freshness: loader.cfg.board_freshness,
                            landing: landing.clone(),
                        };
                        // Not cancellable: the reads land in our reserved blocks.
                        let r = pull_under_lease_with(
                            &loader.puller,
                            &mut client,
                            &peer,
                            leased,
                            early.0.take(),
                            deadline,
                            &disagg.metrics,
                        )
                        .await;
                        r.map(|p| {
                            landed = landing.is_some();
                            if let Some((first_token, key)) = p.next_token
                                && held == prompt.len()
                            {
                                // A prefill's first token, vouched for with the blocks: a
                                // request here that would pick it the same way emits it
                                // without computing (the engine decides; anything else
                                // computes the last position as usual).
                                RemoteKv::PulledWithFirstToken {
                                    tokens: held,
                                    first_token,
                                    key,
                                }
                            } else if p.attested {
                                RemoteKv::Pulled(held)
                            } else {
                                // KV nobody vouched for: this request only, never the cache.
                                RemoteKv::PulledUnattested(held)
                            }
                        })
                    }
                },
            }
        }
    };
    drop(early); // (unused when nothing was pulled)
    // 3. Start decoding (or fail), then release the producer's blocks: the engine hears first,
    // so the release's round trip does not compete with the first token.
    drop(keeper);
    let decoding = std::time::Instant::now();
    match outcome {
        Ok(kv) => {
            if landed {
                engine.remote_kv_landed(id, kv);
            } else {
                engine.remote_kv_ready(id, kv);
            }
            release_all(&disagg, &remotes);
        }
        Err(e) => {
            release_all(&disagg, &remotes);
            if !matches!(e, TransferError::Mismatch(_)) {
                // Reconnect and handshake afresh next time.
                loader.forget(&remote.side_channel(), &remote.engine_id);
            }
            let reason = e.reason();
            // An earlier turn's KV (a prefix) only saves compute: without it the prompt is
            // computed here whatever the failure policy, which is for a prefill's handoff.
            let policy = if held < prompt.len() {
                FailurePolicy::Recompute
            } else {
                loader.cfg.policy
            };
            match policy.apply(e) {
                Ok(Fallback::Recompute) => {
                    disagg.metrics.recomputes.with_label_values(&[reason]).inc();
                    engine.remote_kv_ready(id, RemoteKv::Recompute);
                }
                Err(e) => {
                    let _ = tx.send(Relay::Event(RequestEvent::Failed {
                        message: format!("KV transfer failed ({reason}): {e}"),
                    }));
                    return; // dropping `stream` aborts the request and frees its blocks
                }
            }
        }
    }
    // 4. Hand the engine's stream to the HTTP layer: it reads the rest of the request's events
    // itself (a client gone by now drops it with the channel, which aborts the request).
    let _ = tx.send(Relay::Handover(
        stream,
        FirstToken {
            since: decoding,
            metrics: disagg.metrics.clone(),
        },
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(allowed: &[&str]) -> PullConfig {
        PullConfig {
            engine_id: "d".into(),
            policy: FailurePolicy::Fail,
            recompute_threshold: 0,
            skip_compat_check: false,
            renew_interval: std::time::Duration::from_secs(5),
            pull_timeout: std::time::Duration::from_secs(5),
            wait_timeout: std::time::Duration::from_secs(60),
            board_freshness: None,
            upload_while_pulling: true,
            allowed_peers: AllowedPeers::fixed(allowed.iter().map(|s| s.to_string()).collect()),
            cluster_token: tokio::sync::watch::channel(None).1,
        }
    }

    #[test]
    fn allowed_peers_match_host_or_host_and_port() {
        assert!(cfg(&[]).allows("anything", 1));
        let c = cfg(&["10.0.0.1", "p2.local:9100", "[::1]:7000"]);
        assert!(c.allows("10.0.0.1", 5));
        assert!(c.allows("p2.local", 9100));
        assert!(!c.allows("p2.local", 9101));
        assert!(c.allows("::1", 7000));
        assert!(c.allows("[::1]", 7000));
        assert!(!c.allows("::1", 7001));
        assert!(!c.allows("169.254.169.254", 80));
        let e = c.allowed_peers.check("169.254.169.254", 80).unwrap_err();
        assert!(e.contains("--kv-allowed-peers"), "{e}");
    }

    #[test]
    fn with_a_gateway_only_its_peers_and_the_static_ones_are_allowed() {
        let (tx, rx) = watch::channel(None);
        let gw = AllowedPeers {
            fixed: Vec::new(),
            gateway: Some(rx.clone()),
        };
        // Before the first list: nobody, with a message saying why.
        let e = gw.check("10.0.0.1", 9000).unwrap_err();
        assert!(e.contains("not registered with the gateway"), "{e}");

        tx.send_replace(Some(vec!["10.0.0.1:9000".into(), "[::1]:7000".into()]));
        assert!(gw.check("10.0.0.1", 9000).is_ok());
        assert!(gw.check("[::1]", 7000).is_ok());
        let e = gw.check("10.0.0.1", 9001).unwrap_err();
        assert!(
            e.contains("not a KV peer registered with the gateway"),
            "{e}"
        );
        assert!(gw.check("169.254.169.254", 80).is_err());

        // A new list replaces the old one.
        tx.send_replace(Some(vec!["10.0.0.2:9000".into()]));
        assert!(gw.check("10.0.0.1", 9000).is_err());
        assert!(gw.check("10.0.0.2", 9000).is_ok());

        // Static peers are allowed besides the gateway's, even before its first list.
        let (tx, rx) = watch::channel(None);
        let both = AllowedPeers {
            fixed: vec!["p.local".into()],
            gateway: Some(rx),
        };
        assert!(both.check("p.local", 1).is_ok());
        let e = both.check("10.0.0.1", 9000).unwrap_err();
        assert!(e.contains("not registered with the gateway"), "{e}");
        assert!(e.contains("--kv-allowed-peers"), "{e}");
        tx.send_replace(Some(vec!["10.0.0.1:9000".into()]));
        assert!(both.check("10.0.0.1", 9000).is_ok());
        assert!(both.check("p.local", 2).is_ok());
        assert!(both.check("10.0.0.3", 9000).is_err());
    }
}

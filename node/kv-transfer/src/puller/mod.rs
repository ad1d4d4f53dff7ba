//! The puller: a thread that owns a UCX worker (not thread-safe), endpoints and remote keys per
//! peer, and runs the pulls handed to it, so async callers only await a reply. This module is
//! the handle callers hold ([`Puller`]) and the jobs it hands the thread; beside it:
//!
//! - `worker`: the thread's state machine — connecting peers, posting reads, flights and their
//!   deadlines, force-closes — and its bounds;
//! - `mapped`: copies on the caller's own thread from a peer's pool mapped here;
//! - `handing`: handing a pull's blocks to a [`Landing`] as they land;
//! - [`lease`]: the pull of one lease (reads, then the confirmation that the lease was live),
//!   the early confirmation, and the keeper that renews a lease meanwhile.
//!
//! One thread, many pulls at once: a pull is posted (all its reads, then one flush) and the
//! thread goes on taking new jobs and progressing the worker, so a peer that stopped answering
//! (SIGSTOP, a hung host) holds up only its own pulls. Each pull has a deadline; at the
//! deadline the stalled peer's endpoint is force-closed, which cancels its reads, and only once
//! the close completed does the caller hear of it — no read can land in the local blocks after
//! the reply, whatever the caller does with them next. While pulls are in flight but nothing
//! moves, the thread backs off to sleeping (up to [`MAX_IDLE_SLEEP`] between polls), so a
//! stalled peer costs almost no CPU.
//!
//! A peer's pool that UCX maps into this process (shared memory) is copied, not read with gets.
//! Once the thread has connected to such a peer, a pull of up to [`DIRECT_COPY_MAX_BYTES`] is
//! copied on the caller's own thread instead ([`Puller::pull`] returns with the data in place):
//! two thread hand-offs fewer. The thread still owns the key that keeps the mapping, and ends
//! the shared mapping (waiting out copies in progress) before it destroys that key.
//!
//! Bounds: at most [`MAX_PULLS_PER_PEER`] pulls of one peer in flight (the rest queue, their
//! deadlines running), and at most [`MAX_PEERS`] connected peers (the least recently used idle
//! one is closed to make room).

mod handing;
pub mod lease;
mod mapped;
mod worker;

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_kv_pool::BlockId;
use pd_ucx::{Context, MemoryRegion};
use tokio::sync::oneshot;

use crate::copier::{Copier, lock};
use crate::landing::Landing;
use crate::peer::{PeerInfo, TransferError};
use crate::pull::{PullError, PullStats, Rechunk};

use handing::Handing;
pub use lease::{
    EarlyConfirm, LeaseKeeper, LeasePull, LeaseTrace, LeasedBlocks, Unawaited, pull_under_lease,
    pull_under_lease_with,
};
pub use mapped::DIRECT_COPY_MAX_BYTES;
use mapped::Direct;
pub use worker::{MAX_IDLE_SLEEP, MAX_STAGING_BYTES};
use worker::{Shared, run};

/// Pulls of one peer in flight at once; more wait in the puller's queue.
pub const MAX_PULLS_PER_PEER: usize = 4;

/// Connected peers kept; beyond, the least recently used one without pulls is closed.
pub const MAX_PEERS: usize = 64;

/// A peer's incarnation: its engine id and epoch.
type PeerKey = (String, u64);

/// A pull handed to the puller thread.
struct Job {
    peer: PeerInfo,
    remote: Vec<BlockId>,
    local: Vec<BlockId>,
    /// The lease's record on the peer's lease board, read once the blocks are in.
    board_slot: Option<u32>,
    /// A peer with other blocks: convert after reading.
    rechunk: Option<Rechunk>,
    deadline: Instant,
    timeout: Duration,
    /// Told, in order, how many leading local blocks are in as parts of a pull land (gets in
    /// parts of this many blocks, each with its own flush), so the caller hands them on
    /// ([`Landing`]) meanwhile.
    landed: Option<(tokio::sync::mpsc::UnboundedSender<usize>, usize)>,
    reply: oneshot::Sender<Result<Pulled, PullError>>,
}

/// What a pull brought: its reads, and the lease's record on the peer's lease board as read
/// right after them (`None`: no slot named, the peer's board is not mapped here, or the record
/// kept changing — confirm with the owner instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pulled {
    /// The reads.
    pub stats: PullStats,
    /// The record, read after the reads completed.
    pub record: Option<pd_kv_pool::BoardRecord>,
    /// Copied on the caller's thread from the peer's pool mapped here, without the puller
    /// thread ([`DIRECT_COPY_MAX_BYTES`]).
    pub on_caller: bool,
}

/// What the puller thread is asked to do.
enum Msg {
    Pull(Box<Job>),
    /// Close the endpoint of every incarnation of this engine id that has no pull in flight.
    Forget(String),
}

/// How the puller reads a peer's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PullVia {
    /// Copy straight from the peer's pool where UCX maps it into this process (shared memory on
    /// one host: `RemoteKey::local_ptr`), one `memcpy` per run of blocks, shared with a helper
    /// thread ([`Copier`]): on the caller's thread once the puller thread has connected to the
    /// peer (pulls up to [`DIRECT_COPY_MAX_BYTES`]), on the puller thread otherwise. UCX gets
    /// everywhere else.
    #[default]
    Auto,
    /// As [`PullVia::Auto`], without the helper: each copy runs on one thread (for comparison,
    /// or for a node whose cores are all busy computing).
    AutoOneThread,
    /// Always UCX gets (`ucp_get_nbx` + flush), whatever the transport.
    Get,
}

/// Handle to the puller thread; dropping every clone stops the thread.
#[derive(Debug, Clone)]
pub struct Puller {
    jobs: mpsc::Sender<Msg>,
    /// Our pool's registered memory (what pulls write), and its block size.
    local: Arc<MemoryRegion>,
    block_bytes: usize,
    /// Blocks per part handed to a [`Landing`] ([`Puller::with_landing_part_bytes`]).
    per_part: usize,
    /// Peers' pools mapped here, for copies on the caller's thread (`None` with
    /// [`PullVia::Get`]).
    direct: Option<Arc<Direct>>,
    /// The path to each peer connected so far, by engine id (written by the puller thread).
    paths: Arc<Mutex<BTreeMap<String, PeerPath>>>,
    /// Mutual TLS on peers' data ports ([`Puller::with_tls`]).
    tls: Option<pd_tls::ClusterTls>,
}

/// How pulls from one peer travel, as its endpoint was set up: for the operator's report
/// (which interface and transport KV moves over between which nodes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPath {
    /// The endpoint's UCX lanes as `transport/device`, comma-separated (`tcp/eth0`,
    /// `cma/memory,posix/memory`, ...).
    pub transports: String,
    /// `mapped` (the peer's pool is mapped here: copies) or `get` (UCX gets).
    pub via: &'static str,
}

/// Whole blocks of `block_bytes` in a part of about `bytes` (at least one).
fn parts_of(bytes: usize, block_bytes: usize) -> usize {
    (bytes / block_bytes.max(1)).max(1)
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("peer", &self.peer.engine_id)
            .field("blocks", &self.remote.len())
            .finish()
    }
}

impl Puller {
    /// Starts a thread with its own worker on `ctx` that pulls into `local` (the local pool's
    /// registered memory), blocks of `block_bytes`.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn spawn(
        ctx: Context,
        local: Arc<MemoryRegion>,
        block_bytes: usize,
    ) -> std::io::Result<Self> {
        Self::spawn_via(ctx, local, block_bytes, PullVia::Auto)
    }

    /// [`Puller::spawn`], reading peers' pools as `via` says.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn spawn_via(
        ctx: Context,
        local: Arc<MemoryRegion>,
        block_bytes: usize,
        via: PullVia,
    ) -> std::io::Result<Self> {
        let copier = match via {
            PullVia::Auto => Some(Copier::spawn()?),
            PullVia::AutoOneThread => Some(Copier::alone()),
            PullVia::Get => None,
        };
        let direct = copier.map(|c| {
            Arc::new(Direct {
                mappings: Mutex::new(HashMap::new()),
                copier: Arc::new(c),
            })
        });
        let (jobs, rx) = mpsc::channel::<Msg>();
        let thread_direct = direct.clone();
        let thread_local = local.clone();
        let paths = Arc::new(Mutex::new(BTreeMap::new()));
        let thread_paths = paths.clone();
        std::thread::Builder::new()
            .name("pd-kv-puller".into())
            .spawn(move || {
                let shared = Shared {
                    direct: thread_direct,
                    paths: thread_paths,
                };
                run(&ctx, &thread_local, block_bytes, shared, &rx);
            })?;
        Ok(Self {
            jobs,
            local,
            block_bytes,
            per_part: parts_of(crate::pull::LANDING_PART_BYTES, block_bytes),
            direct,
            paths,
            tls: None,
        })
    }

    /// Reads peers' data ports over mutual TLS with `tls`'s CA.
    #[must_use]
    pub fn with_tls(mut self, tls: Option<pd_tls::ClusterTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Whether pulls from `peer` go over its TCP data port ([`crate::tcp_data`]): it has one,
    /// and UCX reaches it only over TCP (every lane of the endpoint an earlier pull connected is
    /// `tcp`, blocks read with gets), where UCX emulates one-sided reads on a socket.
    pub fn over_tcp(&self, peer: &PeerInfo) -> bool {
        peer.data_port != 0
            && !peer.data_host.is_empty()
            && lock(&self.paths).get(&peer.engine_id).is_some_and(|p| {
                p.via != "mapped"
                    && !p.transports.is_empty()
                    && p.transports.split(',').all(|t| t.starts_with("tcp/"))
            })
    }

    /// Reads lease `lease`'s blocks `remote` of `peer` into local blocks `local` over the
    /// owner's TCP data port ([`crate::tcp_data::pull`]), as engine `me` with the cluster
    /// `token` (empty: none). Dropping the future stops the reads and waits for them to end, so
    /// nothing writes the local blocks after it.
    ///
    /// # Errors
    /// The owner could not be reached or refused ([`TransferError::PeerUnreachable`],
    /// [`TransferError::Rpc`]), or the deadline passed.
    #[allow(clippy::too_many_arguments)]
    pub async fn pull_over_tcp(
        &self,
        peer: &PeerInfo,
        who: (String, String),
        lease: pd_kv_pool::LeaseId,
        generation: u64,
        remote: Vec<BlockId>,
        local: Vec<BlockId>,
        deadline: Instant,
    ) -> Result<Pulled, TransferError> {
        let read = crate::tcp_data::pull::DataPull {
            region: self.local.clone(),
            block_bytes: self.block_bytes,
            who,
            lease,
            generation,
            remote,
            local,
            deadline,
            tls: self.tls.clone(),
        };
        let (stats, addr) = read.run(peer).await?;
        if let Some(p) = lock(&self.paths).get_mut(&peer.engine_id)
            && p.via != "tcp"
        {
            p.via = "tcp";
            tracing::info!(
                peer = %peer.engine_id, data_port = %addr,
                connections = crate::tcp_data::pull::TCP_CONNECTIONS,
                "KV pulls from this peer go over its TCP data port (UCX reaches it only over TCP)"
            );
        }
        Ok(Pulled {
            stats,
            record: None,
            on_caller: false,
        })
    }

    /// The path pulls from each peer connected so far take, by engine id (the latest
    /// connection's, for a peer reconnected).
    pub fn peer_paths(&self) -> Vec<(String, PeerPath)> {
        lock(&self.paths)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Pulls with a [`Landing`] hand their blocks on in parts of about `bytes` (whole blocks,
    /// at least one; default [`crate::pull::LANDING_PART_BYTES`]): smaller parts start the
    /// landing's copies sooner, at the cost of a flush (gets) or a copier hand-off (mapped
    /// copies) per part.
    pub fn with_landing_part_bytes(mut self, bytes: usize) -> Self {
        self.per_part = parts_of(bytes, self.block_bytes);
        self
    }

    /// Reads `remote[i]` of `peer` into local block `local[i]`; resolves when the data is in
    /// place (the engine keeps stepping meanwhile), or when the reads were cancelled at
    /// `deadline` — in both cases nothing writes the local blocks any more. With `board_slot`,
    /// the lease's record on the peer's lease board is read right after the blocks, on this
    /// thread, when the board is mapped here (shared memory).
    ///
    /// # Errors
    /// [`TransferError::Transfer`] (with [`PullError::Deadline`] at the deadline) or
    /// [`TransferError::PullerStopped`].
    pub async fn pull(
        &self,
        peer: &PeerInfo,
        remote: Vec<BlockId>,
        local: Vec<BlockId>,
        board_slot: Option<u32>,
        deadline: Instant,
    ) -> Result<Pulled, TransferError> {
        self.pull_converting(peer, remote, local, None, board_slot, None, deadline)
            .await
    }

    /// [`Puller::pull`] from a peer whose blocks differ from ours in size or order: with
    /// `rechunk`, `remote` are the peer's blocks holding `rechunk.tokens` and `local` ours; the
    /// peer's blocks are copied from its pool mapped here, or read whole into a staging buffer
    /// with gets, and converted into ours ([`crate::pull::rechunk_pull`]) before the reply.
    ///
    /// With `landing`, every local block is handed to it ([`Landing`]) before this returns Ok,
    /// part by part as the parts are in (see [`Puller::with_landing_part_bytes`]), on this
    /// task, which yields between parts; it settles before returning, whatever the outcome. On
    /// a CPU a part is a copy of ~1 MiB; on a GPU it is queued, and settling waits for the DMA
    /// of the last parts — this task's worker blocks that long, as for a copy on this thread.
    ///
    /// # Errors
    /// As [`Puller::pull`]; [`PullError::Landing`] when the landing failed.
    #[allow(clippy::too_many_arguments)]
    pub async fn pull_converting(
        &self,
        peer: &PeerInfo,
        remote: Vec<BlockId>,
        local: Vec<BlockId>,
        rechunk: Option<Rechunk>,
        board_slot: Option<u32>,
        landing: Option<Arc<dyn Landing>>,
        deadline: Instant,
    ) -> Result<Pulled, TransferError> {
        if rechunk.is_none()
            && let Some(pulled) = self.copy_here(
                peer,
                &remote,
                &local,
                board_slot,
                landing.as_deref(),
                deadline,
            )
        {
            return Ok(pulled?);
        }
        let (landed_tx, landed_rx) = match &landing {
            Some(_) => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                (Some((tx, self.per_part)), Some((rx, local.clone())))
            }
            None => (None, None),
        };
        let (reply, mut rx) = oneshot::channel();
        let now = Instant::now();
        self.jobs
            .send(Msg::Pull(Box::new(Job {
                peer: peer.clone(),
                remote,
                local,
                board_slot,
                rechunk,
                deadline,
                timeout: deadline.saturating_duration_since(now),
                landed: landed_tx,
                reply,
            })))
            .map_err(|_| TransferError::PullerStopped)?;
        let (Some(landing), Some((mut parts, local))) = (landing, landed_rx) else {
            return Ok(rx.await.map_err(|_| TransferError::PullerStopped)??);
        };
        // Hand the parts on as the puller says they are in; whatever it did not say (a pull
        // copied or converted on its thread, or one part) once the reply came.
        let mut hand = Handing::new(
            &*landing,
            &self.local,
            &local,
            self.block_bytes,
            self.per_part,
        );
        let reply = loop {
            tokio::select! {
                // (The puller sends a flight's parts before its reply: those first.)
                biased;
                Some(upto) = parts.recv() => hand.upto(upto).await,
                r = &mut rx => break r,
            }
        };
        while let Ok(upto) = parts.try_recv() {
            hand.upto(upto).await;
        }
        let early = hand.handed;
        // (A puller gone without a reply writes our blocks no more either.)
        let pulled = reply.map_err(|_| TransferError::PullerStopped);
        match pulled.and_then(|r| r.map_err(TransferError::from)) {
            Ok(mut pulled) => {
                hand.upto(local.len()).await;
                hand.finish()?;
                pulled.stats.landed_blocks = local.len();
                pulled.stats.landed_early = early;
                Ok(pulled)
            }
            Err(e) => {
                let _ = hand.finish();
                Err(e)
            }
        }
    }

    /// Closes the endpoints to `engine_id` that no pull uses (after a failure or a stall on
    /// the side channel), so the next pull connects afresh. From now on no pull of this engine
    /// is copied on its caller's thread until the puller thread has seen to it.
    pub fn forget(&self, engine_id: &str) {
        if let Some(d) = &self.direct {
            lock(&d.mappings).retain(|(id, _), _| id != engine_id);
        }
        let _ = self.jobs.send(Msg::Forget(engine_id.to_string()));
    }
}

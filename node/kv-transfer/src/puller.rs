//! The puller thread: owns a UCX worker (not thread-safe), endpoints and remote keys per peer,
//! and runs the pulls handed to it, so async callers only await a reply.
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
//! the shared [`Mapping`] (waiting out copies in progress) before it destroys that key.
//!
//! Bounds: at most [`MAX_PULLS_PER_PEER`] pulls of one peer in flight (the rest queue, their
//! deadlines running), and at most [`MAX_PEERS`] connected peers (the least recently used idle
//! one is closed to make room).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use pd_kv_pool::BlockId;
use pd_ucx::{Context, Endpoint, MemoryRegion, RemoteKey, Request, Worker};
use tokio::sync::oneshot;

use crate::copier::{Copier, lock};
use crate::landing::Landing;
use crate::peer::{PeerInfo, TransferError};
use crate::pull::{PostedPull, PullError, PullSource, PullStats, Rechunk, post_pull};

/// Pulls of one peer in flight at once; more wait in the puller's queue.
pub const MAX_PULLS_PER_PEER: usize = 4;

/// Connected peers kept; beyond, the least recently used one without pulls is closed.
pub const MAX_PEERS: usize = 64;

/// The longest sleep between polls while pulls are in flight but nothing completes.
pub const MAX_IDLE_SLEEP: Duration = Duration::from_millis(1);

/// The largest staging buffer one converting pull may register (its peer's blocks, whole).
pub const MAX_STAGING_BYTES: usize = 1 << 30;

/// Polls without progress before the thread starts sleeping between polls.
const SPIN_POLLS: u32 = 256;

type PeerKey = (String, u64);

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

/// The blocks of one pull handed to a [`Landing`] as they come in, in order, on the pull's task
/// (a part at a time, yielding between parts); the first failure stops the handing and is
/// returned by [`Handing::finish`], which settles once it began.
struct Handing<'a> {
    landing: &'a dyn Landing,
    region: &'a MemoryRegion,
    local: &'a [BlockId],
    block_bytes: usize,
    per_part: usize,
    begun: bool,
    handed: usize,
    failed: Option<PullError>,
}

impl<'a> Handing<'a> {
    fn new(
        landing: &'a dyn Landing,
        region: &'a MemoryRegion,
        local: &'a [BlockId],
        block_bytes: usize,
        per_part: usize,
    ) -> Self {
        Self {
            landing,
            region,
            local,
            block_bytes,
            per_part,
            begun: false,
            handed: 0,
            failed: None,
        }
    }

    /// The first `upto` local blocks are in: hand on those not handed yet.
    async fn upto(&mut self, upto: usize) {
        let per_part = self.per_part;
        let upto = upto.min(self.local.len());
        while self.failed.is_none() && self.handed < upto {
            if !self.begun {
                self.begun = true;
                if let Err(e) = self.landing.begin() {
                    self.failed = Some(PullError::Landing(e));
                    return;
                }
            }
            let end = upto.min(self.handed + per_part);
            // SAFETY: the puller said these blocks are in (or replied): nothing writes them any
            // more, and they stay this pull's until it returns, after `finish`.
            let r = unsafe {
                crate::landing::land(
                    self.landing,
                    self.region,
                    &self.local[self.handed..end],
                    self.block_bytes,
                )
            };
            match r {
                Ok(()) => self.handed = end,
                Err(e) => self.failed = Some(e),
            }
            if self.handed < upto {
                tokio::task::yield_now().await;
            }
        }
    }

    /// Settles what was handed on; the first failure, if any.
    fn finish(mut self) -> Result<(), PullError> {
        let settled = if self.begun {
            self.begun = false;
            self.landing.settle().map_err(PullError::Landing)
        } else {
            Ok(())
        };
        match self.failed.take() {
            Some(e) => Err(e),
            None => settled,
        }
    }
}

impl Drop for Handing<'_> {
    /// A pull dropped midway (its task cancelled) still waits for the copies it started, so
    /// none runs once its blocks are freed. (A settle failure has nothing left to tell.)
    fn drop(&mut self) {
        if self.begun {
            let _ = self.landing.settle();
        }
    }
}

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

/// Connections a pull over a peer's TCP data port reads over at once.
pub const TCP_CONNECTIONS: usize = 4;

/// Stops a pull's TCP reads when the pull's future is dropped before they ended, and waits
/// until they have (a read interrupted by the shutdown returns at once).
struct StopReads {
    cancel: Arc<crate::tcp_data::Cancel>,
    finished: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl Drop for StopReads {
    fn drop(&mut self) {
        let (done, cv) = &*self.finished;
        let mut finished = done.lock().unwrap_or_else(|e| e.into_inner());
        if *finished {
            return;
        }
        self.cancel.cancel();
        while !*finished {
            finished = cv.wait(finished).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Whole blocks of `block_bytes` in a part of about `bytes` (at least one).
fn parts_of(bytes: usize, block_bytes: usize) -> usize {
    (bytes / block_bytes.max(1)).max(1)
}

/// The largest pull copied on the caller's thread; larger ones go to the puller thread, so an
/// async task never blocks its worker for more than about a millisecond.
pub const DIRECT_COPY_MAX_BYTES: usize = 8 << 20;

/// What a caller needs to copy a pull itself (besides our pool, [`Puller`]'s): the peers' pools
/// mapped here, and the copier. The puller thread adds a peer's [`Mapping`] when it connects and removes it before it
/// destroys the key that keeps the mapping.
struct Direct {
    mappings: Mutex<HashMap<PeerKey, Arc<Mapping>>>,
    copier: Arc<Copier>,
}

impl std::fmt::Debug for Direct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Direct").finish_non_exhaustive()
    }
}

/// A peer's pool (and lease board) as UCX maps it into this process through a remote key the
/// puller thread owns. A copy holds `alive` for reading while it reads the pool; the puller
/// thread takes it for writing and sets it false before it destroys the key, so no copy reads
/// an unmapped pool, and a caller that finds it false hands its pull to the puller thread.
struct Mapping {
    pool: *const u8,
    pool_len: usize,
    board: Option<(*const u8, u32)>,
    alive: RwLock<bool>,
}

// SAFETY: the pointers are only dereferenced while `alive` is held for reading and true, i.e.
// while the key that maps them is alive (see `Mapping`); the mapped memory is plain bytes.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

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
        })
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
    /// owner's TCP data port, [`TCP_CONNECTIONS`] connections at once, as engine `me` with the
    /// cluster `token` (empty: none). Dropping the future stops
    /// the reads and waits for them to end, so nothing writes the local blocks after it.
    ///
    /// # Errors
    /// The owner could not be reached or refused ([`TransferError::PeerUnreachable`],
    /// [`TransferError::Rpc`]), or the deadline passed.
    #[allow(clippy::too_many_arguments)]
    pub async fn pull_over_tcp(
        &self,
        peer: &PeerInfo,
        (me, token): (String, String),
        lease: pd_kv_pool::LeaseId,
        generation: u64,
        remote: Vec<BlockId>,
        local: Vec<BlockId>,
        deadline: Instant,
    ) -> Result<Pulled, TransferError> {
        let host = &peer.data_host;
        let addr = match host.contains(':') {
            true => format!("[{host}]:{}", peer.data_port),
            false => format!("{host}:{}", peer.data_port),
        };
        let region = self.local.clone();
        let block_bytes = self.block_bytes;
        let cancel = Arc::new(crate::tcp_data::Cancel::default());
        let finished = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let guard = StopReads {
            cancel: cancel.clone(),
            finished: finished.clone(),
        };
        let start = Instant::now();
        let target = addr.clone();
        let task = tokio::task::spawn_blocking(move || {
            let req = crate::tcp_data::DataRequest {
                addr: &target,
                token: &token,
                me: &me,
                lease,
                generation,
                remote: &remote,
                local: &local,
                block_bytes,
                connections: TCP_CONNECTIONS,
                deadline,
            };
            // SAFETY: `region` is this node's pool, mapped while the Arc lives; the local blocks
            // are reserved for this pull by the engine, and `StopReads` keeps the pull's future
            // from ending before these reads do.
            let read = unsafe {
                crate::tcp_data::read_blocks_until(&req, region.as_ptr(), region.len(), &cancel)
            };
            let (done, cv) = &*finished;
            *done.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_all();
            read
        });
        let read = task.await.map_err(|_| TransferError::PullerStopped)?;
        drop(guard);
        let bytes = read.map_err(|e| match e {
            // Out of time, as the gets' path says it: the reads are over.
            _ if Instant::now() >= deadline => TransferError::Transfer(PullError::Deadline(
                deadline.saturating_duration_since(start),
            )),
            crate::tcp_data::DataError::Io(io) => TransferError::PeerUnreachable {
                addr: addr.clone(),
                message: format!("KV data port: {io}"),
            },
            other => TransferError::Rpc(other.to_string()),
        })?;
        if let Some(p) = lock(&self.paths).get_mut(&peer.engine_id)
            && p.via != "tcp"
        {
            p.via = "tcp";
            tracing::info!(
                peer = %peer.engine_id, data_port = %addr, connections = TCP_CONNECTIONS,
                "KV pulls from this peer go over its TCP data port (UCX reaches it only over TCP)"
            );
        }
        Ok(Pulled {
            stats: PullStats {
                bytes,
                descriptors: 0,
                post_time: Duration::ZERO,
                total_time: start.elapsed(),
                copied: false,
                tcp: true,
                helper_bytes: 0,
                landed_blocks: 0,
                landed_early: 0,
            },
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

    /// A pull copied on this thread from `peer`'s pool, when the puller thread has it mapped
    /// here and the pull is at most [`DIRECT_COPY_MAX_BYTES`]: no hand-off to the puller thread
    /// and back (two thread wake-ups). `None`: not possible here, hand it to the puller thread.
    fn copy_here(
        &self,
        peer: &PeerInfo,
        remote: &[BlockId],
        local: &[BlockId],
        board_slot: Option<u32>,
        landing: Option<&dyn Landing>,
        deadline: Instant,
    ) -> Option<Result<Pulled, PullError>> {
        let direct = self.direct.as_ref()?;
        if remote.len().saturating_mul(self.block_bytes) > DIRECT_COPY_MAX_BYTES {
            return None;
        }
        let mapping = lock(&direct.mappings)
            .get(&(peer.engine_id.clone(), peer.epoch))
            .cloned()?;
        if Instant::now() >= deadline {
            return Some(Err(PullError::Deadline(Duration::ZERO)));
        }
        let alive = mapping.alive.read().unwrap_or_else(|e| e.into_inner());
        if !*alive {
            return None;
        }
        // SAFETY: the pool stays mapped while `alive` is held and true (see `Mapping`); the
        // local blocks are reserved for this pull by the engine, as for the puller thread.
        let copied = unsafe {
            match landing {
                None => crate::pull::copy_pull(
                    mapping.pool,
                    mapping.pool_len,
                    &self.local,
                    remote,
                    local,
                    self.block_bytes,
                    &direct.copier,
                ),
                Some(l) => crate::pull::copy_pull_landing(
                    mapping.pool,
                    mapping.pool_len,
                    &self.local,
                    remote,
                    local,
                    self.block_bytes,
                    &direct.copier,
                    l,
                    self.per_part,
                ),
            }
        };
        let record = match (copied.is_ok(), mapping.board, board_slot) {
            // SAFETY: the board is mapped through the same key, alive as above.
            (true, Some((base, slots)), Some(slot)) => unsafe {
                pd_kv_pool::read_record(base, slots, slot)
            },
            _ => None,
        };
        drop(alive);
        // The landing's copies touch only our blocks: wait for them outside the mapping's lock
        // (the puller thread takes it to close the peer), after a failed copy too.
        let copied = match landing {
            None => copied,
            Some(l) => {
                let settled = l.settle().map_err(PullError::Landing);
                copied.and_then(|stats| settled.map(|()| stats))
            }
        };
        Some(copied.map(|stats| Pulled {
            stats,
            record,
            on_caller: true,
        }))
    }

    /// Says a pull of `bytes` from `engine_id` in incarnation `epoch` is coming: when its pool
    /// is mapped here, the copier's helper wakes now rather than at the copy
    /// ([`Copier::prepare`]).
    pub fn prepare_copy(&self, engine_id: &str, epoch: u64, bytes: usize) {
        let Some(direct) = self.direct.as_ref() else {
            return;
        };
        if lock(&direct.mappings).contains_key(&(engine_id.to_string(), epoch)) {
            direct.copier.prepare(bytes);
        }
    }

    /// The beat on the lease board of `engine_id` in incarnation `epoch`, where its pool and
    /// board are mapped here (`None` otherwise, or before the puller thread connected): the
    /// owner's clock at its latest grant (0: it never beat). See `pd_kv_pool::LeaseBoard`.
    pub fn board_beat(&self, engine_id: &str, epoch: u64) -> Option<u64> {
        let direct = self.direct.as_ref()?;
        let mapping = lock(&direct.mappings)
            .get(&(engine_id.to_string(), epoch))
            .cloned()?;
        let alive = mapping.alive.read().unwrap_or_else(|e| e.into_inner());
        if !*alive {
            return None;
        }
        let (base, _) = mapping.board?;
        // SAFETY: the board is mapped through the key `alive` vouches for (see `Mapping`); its
        // header's first word is the beat, 8-byte aligned (the board's offset is a multiple
        // of 64).
        let beat = unsafe { pd_kv_pool::read_beat(base) };
        drop(alive);
        Some(beat)
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

/// A connected peer. Field order matters: the key is destroyed before the endpoint closes.
struct Peer<'w> {
    rkey: RemoteKey<'w>,
    /// The peer's lease board as mapped here through `rkey` (shared memory), and its records.
    board: Option<(*const u8, u32)>,
    /// The peer's pool as mapped here through `rkey` (shared memory): pulls copy from it.
    mapped: Option<*const u8>,
    /// The same mapping, shared with callers ([`Direct`]): ended before `rkey` is destroyed.
    mapping: Option<Arc<Mapping>>,
    ep: Endpoint<'w>,
    in_flight: usize,
    queued: VecDeque<Job>,
    last_used: Instant,
}

/// A posted pull waiting for its flush.
struct Flight<'w> {
    key: PeerKey,
    /// `None` for a job whose posting failed: it only waits for its endpoint's close.
    posted: Option<PostedPull<'w>>,
    board_slot: Option<u32>,
    deadline: Instant,
    timeout: Duration,
    reply: oneshot::Sender<Result<Pulled, PullError>>,
    /// Set when its endpoint was force-closed: the error to answer with once the flush (or the
    /// close) completed.
    aborted: Option<PullError>,
    /// A pull from a peer with other blocks: the buffer its reads land in, to convert into
    /// these local blocks once they are in.
    staged: Option<Staged>,
    /// [`Job::landed`].
    landed: Option<tokio::sync::mpsc::UnboundedSender<usize>>,
}

/// The reads of a converting pull ([`Rechunk`]), staged: the peer's blocks, whole and in order
/// (the `i`-th at `i · from.block_bytes()`), land in `buffer` (registered here); once they are
/// in, `rechunk` copies their tokens into `local`.
struct Staged {
    buffer: MemoryRegion,
    /// The peer's blocks in `buffer`.
    blocks: usize,
    rechunk: Rechunk,
    local: Vec<BlockId>,
}

/// A force-close in progress.
struct Closing<'w> {
    close: Option<Request<'w>>,
    started: Instant,
}

/// How long a force close may take before its request is let go (a force close completes
/// locally; this only guards against a UCX that never reports it).
const CLOSE_GRACE: Duration = Duration::from_secs(1);

struct State<'w> {
    ctx: &'w Context,
    worker: &'w Worker,
    local: &'w MemoryRegion,
    block_bytes: usize,
    /// Copies from a peer's pool mapped here instead of posting gets ([`PullVia::Auto`]), and
    /// shares those mappings with callers.
    direct: Option<Arc<Direct>>,
    /// [`Puller::peer_paths`]' map.
    paths: Arc<Mutex<BTreeMap<String, PeerPath>>>,
    peers: HashMap<PeerKey, Peer<'w>>,
    flights: Vec<Flight<'w>>,
    closing: Vec<Closing<'w>>,
}

/// What the puller thread shares with its handle.
struct Shared {
    direct: Option<Arc<Direct>>,
    paths: Arc<Mutex<BTreeMap<String, PeerPath>>>,
}

fn run(
    ctx: &Context,
    local: &MemoryRegion,
    block_bytes: usize,
    shared: Shared,
    jobs: &mpsc::Receiver<Msg>,
) {
    let worker = match Worker::new(ctx) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!(error = %e, "cannot create the puller's UCX worker");
            return;
        }
    };
    let mut st = State {
        ctx,
        worker: &worker,
        local,
        block_bytes,
        direct: shared.direct,
        paths: shared.paths,
        peers: HashMap::new(),
        flights: Vec::new(),
        closing: Vec::new(),
    };
    let mut idle_polls = 0u32;
    loop {
        // Take new jobs: block when nothing is in flight, otherwise wait at most the back-off.
        let busy = !st.flights.is_empty() || !st.closing.is_empty() || st.has_queued();
        let msg = if !busy {
            match jobs.recv() {
                Ok(m) => Some(m),
                Err(_) => break,
            }
        } else if idle_polls < SPIN_POLLS {
            match jobs.try_recv() {
                Ok(m) => Some(m),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            let sleep = MAX_IDLE_SLEEP.min(st.next_deadline().map_or(MAX_IDLE_SLEEP, |d| {
                d.saturating_duration_since(Instant::now())
            }));
            match jobs.recv_timeout(sleep) {
                Ok(m) => Some(m),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        };
        let mut moved = false;
        if let Some(m) = msg {
            moved = true;
            st.take(m);
            while let Ok(m) = jobs.try_recv() {
                st.take(m);
            }
        }
        if st.worker.progress() > 0 {
            moved = true;
        }
        moved |= st.reap();
        idle_polls = if moved {
            0
        } else {
            idle_polls.saturating_add(1)
        };
    }
    // Shutting down: cancel what is still in flight and wait for it, so no read outlives us.
    let keys: Vec<PeerKey> = st.peers.keys().cloned().collect();
    for k in keys {
        st.abort_peer(&k, || PullError::Closed("shutting down"));
    }
    while !st.flights.is_empty() || !st.closing.is_empty() {
        st.worker.progress();
        st.reap();
    }
}

impl<'w> State<'w> {
    fn has_queued(&self) -> bool {
        self.peers.values().any(|p| !p.queued.is_empty())
    }

    fn next_deadline(&self) -> Option<Instant> {
        let flights = self.flights.iter().filter(|f| f.aborted.is_none());
        let queued = self.peers.values().flat_map(|p| p.queued.iter());
        flights
            .map(|f| f.deadline)
            .chain(queued.map(|j| j.deadline))
            .min()
    }

    fn take(&mut self, msg: Msg) {
        match msg {
            Msg::Pull(job) => self.admit(*job),
            Msg::Forget(engine_id) => {
                let idle: Vec<PeerKey> = self
                    .peers
                    .iter()
                    .filter(|(k, p)| k.0 == engine_id && p.in_flight == 0 && p.queued.is_empty())
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in idle {
                    self.abort_peer(&k, || PullError::Closed("endpoint forgotten"));
                }
            }
        }
    }

    /// Connects to the job's peer if needed, then posts the job or queues it behind the peer's
    /// pulls in flight.
    fn admit(&mut self, job: Job) {
        let key = (job.peer.engine_id.clone(), job.peer.epoch);
        if !self.peers.contains_key(&key) {
            // A restarted peer has a new epoch: close the endpoints of its old incarnation.
            let old: Vec<PeerKey> = self
                .peers
                .keys()
                .filter(|(id, _)| id == &key.0)
                .cloned()
                .collect();
            for k in old {
                self.abort_peer(&k, || PullError::Closed("peer restarted"));
            }
            self.make_room();
            match connect(self.worker, &job.peer) {
                Ok((ep, rkey, transports)) => {
                    let board = (job.peer.board_slots > 0)
                        .then(|| {
                            rkey.local_ptr(job.peer.region_base + job.peer.board_offset)
                                .map(|p| (p, job.peer.board_slots))
                        })
                        .flatten();
                    let mapped = if self.direct.is_some() {
                        rkey.local_ptr(job.peer.region_base)
                    } else {
                        None
                    };
                    let mapping = match (&self.direct, mapped) {
                        (Some(direct), Some(pool)) => {
                            let m = Arc::new(Mapping {
                                pool,
                                pool_len: job.peer.region_len as usize,
                                board,
                                alive: RwLock::new(true),
                            });
                            lock(&direct.mappings).insert(key.clone(), m.clone());
                            Some(m)
                        }
                        _ => None,
                    };
                    let path = PeerPath {
                        transports,
                        via: if mapped.is_some() { "mapped" } else { "get" },
                    };
                    lock(&self.paths).insert(job.peer.engine_id.clone(), path);
                    self.peers.insert(
                        key.clone(),
                        Peer {
                            rkey,
                            board,
                            mapped,
                            mapping,
                            ep,
                            in_flight: 0,
                            queued: VecDeque::new(),
                            last_used: Instant::now(),
                        },
                    );
                }
                Err(e) => {
                    let _ = job.reply.send(Err(e.into()));
                    return;
                }
            }
        }
        let Some(peer) = self.peers.get_mut(&key) else {
            return;
        };
        if peer.in_flight >= MAX_PULLS_PER_PEER {
            peer.queued.push_back(job);
        } else {
            self.post(key, job);
        }
    }

    /// Closes the least recently used peer without pulls when [`MAX_PEERS`] are connected.
    fn make_room(&mut self) {
        if self.peers.len() < MAX_PEERS {
            return;
        }
        let lru = self
            .peers
            .iter()
            .filter(|(_, p)| p.in_flight == 0 && p.queued.is_empty())
            .min_by_key(|(_, p)| p.last_used)
            .map(|(k, _)| k.clone());
        if let Some(k) = lru {
            tracing::debug!(peer = %k.0, "closing the least recently used KV peer endpoint");
            self.abort_peer(&k, || PullError::Closed("closed to make room"));
        }
    }

    /// Posts `job`'s reads to its (connected) peer.
    fn post(&mut self, key: PeerKey, job: Job) {
        let Some(peer) = self.peers.get_mut(&key) else {
            let _ = job.reply.send(Err(PullError::Deadline(job.timeout)));
            return;
        };
        if Instant::now() >= job.deadline {
            let _ = job.reply.send(Err(PullError::Deadline(job.timeout)));
            return;
        }
        peer.last_used = Instant::now();
        if let (Some(mapped), Some(direct)) = (peer.mapped, &self.direct) {
            // A peer `forget` left connected (it had pulls in flight): callers may copy again.
            if let Some(m) = &peer.mapping {
                lock(&direct.mappings)
                    .entry(key.clone())
                    .or_insert_with(|| m.clone());
            }
            // SAFETY: the mapping lives as long as `peer.rkey`, which this thread owns for the
            // whole call; the job's local blocks are reserved for it by the engine.
            let copied = unsafe {
                match (&job.rechunk, &job.landed) {
                    (None, None) => crate::pull::copy_pull(
                        mapped,
                        job.peer.region_len as usize,
                        self.local,
                        &job.remote,
                        &job.local,
                        self.block_bytes,
                        &direct.copier,
                    ),
                    // In parts, each said to the caller as it is in.
                    (None, Some((tx, per_part))) => crate::pull::copy_pull_in_parts(
                        mapped,
                        job.peer.region_len as usize,
                        self.local,
                        &job.remote,
                        &job.local,
                        self.block_bytes,
                        &direct.copier,
                        *per_part,
                        // (The last part is said by the reply.)
                        |_, upto| {
                            if upto < job.local.len() {
                                let _ = tx.send(upto);
                            }
                            Ok(())
                        },
                    ),
                    (Some(r), _) => crate::pull::rechunk_pull(
                        mapped,
                        job.peer.region_len as usize,
                        &job.remote,
                        self.local,
                        &job.local,
                        r,
                    ),
                }
            };
            let record = copied
                .is_ok()
                .then(|| self.board_record(&key, job.board_slot));
            let _ = job.reply.send(copied.map(|stats| Pulled {
                stats,
                record: record.flatten(),
                on_caller: false,
            }));
            return;
        }
        let src = PullSource {
            endpoint: &peer.ep,
            rkey: &peer.rkey,
            remote_base: job.peer.region_base,
            remote_len: job.peer.region_len as usize,
        };
        // A converting pull reads the peer's blocks whole into a staging buffer first: checked
        // before anything is posted (a bad list must not cost the reads, nor the endpoint).
        let staged = match job.rechunk {
            None => None,
            Some(rechunk) => {
                let slots: Vec<BlockId> = (0..job.remote.len() as u32).map(BlockId).collect();
                let bytes = job
                    .remote
                    .len()
                    .checked_mul(rechunk.from.block_bytes())
                    .filter(|&b| b <= MAX_STAGING_BYTES);
                let checked = bytes
                    .ok_or(PullError::OutOfBounds { side: "remote" })
                    .and_then(|b| {
                        crate::pull::check_rechunk(
                            &slots,
                            b,
                            &job.local,
                            self.local.len(),
                            &rechunk,
                        )
                        .map(|()| b)
                    });
                let bytes = match checked {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = job.reply.send(Err(e));
                        return;
                    }
                };
                match MemoryRegion::allocate(self.ctx, bytes.max(1)) {
                    Ok(buffer) => Some(Staged {
                        buffer,
                        blocks: job.remote.len(),
                        rechunk,
                        local: job.local.clone(),
                    }),
                    Err(e) => {
                        let _ = job.reply.send(Err(PullError::Ucx(e)));
                        return;
                    }
                }
            }
        };
        let posted = match &staged {
            // Parts with flushes of their own only where someone hands the parts on.
            None if let Some((_, per_part)) = &job.landed => crate::pull::post_pull_in_parts(
                &src,
                self.local,
                &job.remote,
                &job.local,
                self.block_bytes,
                *per_part,
            ),
            None => post_pull(&src, self.local, &job.remote, &job.local, self.block_bytes),
            Some(s) => {
                let slots: Vec<BlockId> = (0..job.remote.len() as u32).map(BlockId).collect();
                let bytes = s.rechunk.from.block_bytes();
                post_pull(&src, &s.buffer, &job.remote, &slots, bytes)
            }
        };
        match posted {
            Ok(posted) => {
                peer.in_flight += 1;
                self.flights.push(Flight {
                    key,
                    posted: Some(posted),
                    board_slot: job.board_slot,
                    deadline: job.deadline,
                    timeout: job.timeout,
                    reply: job.reply,
                    aborted: None,
                    staged,
                    landed: job.landed.map(|(tx, _)| tx),
                });
            }
            Err(e @ (PullError::LengthMismatch { .. } | PullError::OutOfBounds { .. })) => {
                // Nothing was posted.
                let _ = job.reply.send(Err(e));
            }
            Err(e) => {
                // Some reads may be in flight: cancel them before answering. The job answers
                // once the close completed, as an aborted flight without a flush.
                tracing::warn!(peer = %key.0, error = %e, "posting KV reads failed; closing the endpoint");
                self.abort_peer(&key, || PullError::Closed("posting failed"));
                self.closing_reply(job.reply, e);
            }
        }
    }

    /// The lease's record `slot` on `key`'s board, read now (after the pull's reads).
    fn board_record(&self, key: &PeerKey, slot: Option<u32>) -> Option<pd_kv_pool::BoardRecord> {
        let (base, slots) = self.peers.get(key)?.board?;
        // SAFETY: `base` is the peer's board mapped through its key, which lives in
        // `self.peers` (this thread) for the whole call.
        unsafe { pd_kv_pool::read_record(base, slots, slot?) }
    }

    /// Answers `reply` with `err` once every close in progress completed.
    fn closing_reply(&mut self, reply: oneshot::Sender<Result<Pulled, PullError>>, err: PullError) {
        self.flights.push(Flight {
            key: (String::new(), 0),
            posted: None,
            board_slot: None,
            deadline: Instant::now(),
            timeout: Duration::ZERO,
            reply,
            aborted: Some(err),
            staged: None,
            landed: None,
        });
    }

    /// Force-closes `key`'s endpoint: its flights and queued jobs fail with `why()` once the
    /// close completed.
    fn abort_peer(&mut self, key: &PeerKey, why: impl Fn() -> PullError) {
        let Some(peer) = self.peers.remove(key) else {
            return;
        };
        for f in self.flights.iter_mut().filter(|f| &f.key == key) {
            if f.aborted.is_none() {
                f.aborted = Some(why());
            }
        }
        let Peer {
            rkey,
            ep,
            queued,
            mapping,
            ..
        } = peer;
        if let Some(m) = mapping {
            // No caller copies from the mapping once this returns, nor starts to.
            if let Some(direct) = &self.direct {
                lock(&direct.mappings).remove(key);
            }
            *m.alive.write().unwrap_or_else(|e| e.into_inner()) = false;
        }
        drop(rkey);
        match ep.close_force() {
            Ok(close) => self.closing.push(Closing {
                close: Some(close),
                started: Instant::now(),
            }),
            Err(e) => {
                tracing::warn!(peer = %key.0, error = %e, "force-closing a KV endpoint failed")
            }
        }
        for job in queued {
            let _ = job.reply.send(Err(PullError::Deadline(job.timeout)));
        }
    }

    /// Completes what can be completed; returns whether anything did.
    fn reap(&mut self) -> bool {
        let mut moved = false;
        // Closes first: a flight of a closed endpoint may answer once its close is done.
        for c in &mut self.closing {
            if let Some(req) = c.close.as_mut()
                && let Some(r) = req.poll()
            {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "force close of a KV endpoint ended with an error");
                }
                c.close = None;
                moved = true;
            } else if c.started.elapsed() > CLOSE_GRACE
                && let Some(req) = c.close.take()
            {
                tracing::warn!("a KV endpoint's force close did not complete; letting it go");
                std::mem::forget(req);
                moved = true;
            }
        }
        self.closing.retain(|c| c.close.is_some());
        let now = Instant::now();
        // Deadlines: close the endpoints of flights past theirs.
        let late: Vec<(PeerKey, Duration)> = self
            .flights
            .iter()
            .filter(|f| f.aborted.is_none() && now >= f.deadline)
            .map(|f| (f.key.clone(), f.timeout))
            .collect();
        for (key, timeout) in late {
            tracing::warn!(peer = %key.0, ?timeout, "KV pull past its deadline; closing the peer's endpoint");
            self.abort_peer(&key, || PullError::Deadline(timeout));
            moved = true;
        }
        // Queued jobs past their deadline never post.
        for peer in self.peers.values_mut() {
            let (late, keep): (Vec<Job>, Vec<Job>) =
                peer.queued.drain(..).partition(|j| now >= j.deadline);
            peer.queued = keep.into();
            for job in late {
                let _ = job.reply.send(Err(PullError::Deadline(job.timeout)));
                moved = true;
            }
        }
        // Flights whose flush completed, or that were aborted and whose close is done.
        let mut i = 0;
        while i < self.flights.len() {
            let closes_done = self.closing.is_empty();
            let f = &mut self.flights[i];
            // Parts in, in order: say so (a failed part's flush leaves it to the last one's).
            if f.aborted.is_none()
                && let Some(p) = f.posted.as_mut()
            {
                while let Some((req, _)) = p.parts.first_mut() {
                    match req.poll() {
                        None => break,
                        Some(r) => {
                            let (_, blocks) = p.parts.remove(0);
                            if r.is_ok()
                                && let Some(tx) = &f.landed
                            {
                                let _ = tx.send(blocks);
                            }
                            moved = true;
                        }
                    }
                }
            }
            let flushed = f.posted.as_mut().and_then(|p| p.flush.poll());
            let done = match (&flushed, &f.aborted) {
                (Some(_), _) => true,
                (None, Some(_)) => closes_done,
                (None, None) => false,
            };
            if !done {
                i += 1;
                continue;
            }
            moved = true;
            let f = self.flights.swap_remove(i);
            let Flight {
                key,
                posted,
                board_slot,
                reply,
                aborted,
                staged,
                ..
            } = f;
            let was_flushed = flushed.is_some();
            let flush_failed = matches!(flushed, Some(Err(_)));
            let result = match (aborted, flushed, &posted) {
                (Some(e), _, _) => Err(e),
                (None, Some(Ok(())), Some(p)) => {
                    // Staged reads are in: convert them into our blocks.
                    let converted = staged.as_ref().map_or(Ok(()), |s| {
                        let slots: Vec<BlockId> = (0..s.blocks as u32).map(BlockId).collect();
                        // SAFETY: the buffer is ours and its reads completed (flushed); the
                        // local blocks are reserved for this pull by the engine.
                        unsafe {
                            crate::pull::rechunk_pull(
                                s.buffer.as_ptr(),
                                s.buffer.len(),
                                &slots,
                                self.local,
                                &s.local,
                                &s.rechunk,
                            )
                        }
                        .map(|_| ())
                    });
                    converted.map(|()| Pulled {
                        stats: p.stats(),
                        // After the reads, before anyone hears of them: see `read_record`.
                        record: self.board_record(&key, board_slot),
                        on_caller: false,
                    })
                }
                (None, Some(Err(e)), _) => Err(PullError::Ucx(e)),
                // Not done, or a flight without reads that was not aborted: neither exists.
                (None, _, _) => Err(PullError::Closed("no reads")),
            };
            if let Some(mut p) = posted {
                // Parts' flushes still pending guard nothing the last flush or the close does
                // not: let go of those (dropping one would wait for a completion that may
                // never come on a failed endpoint).
                for (mut f, _) in p.parts.drain(..) {
                    if f.poll().is_none() {
                        std::mem::forget(f);
                    }
                }
                if !was_flushed {
                    // The force close cancelled its reads but UCX still holds the flush
                    // request: nothing writes the local blocks after a force close, so let the
                    // handle go. A staging buffer stays mapped for good: a close that failed or
                    // was given up on (`CLOSE_GRACE`) does not prove its reads stopped, and
                    // unmapping memory a read may still land in would be a use after free.
                    std::mem::forget(p.flush);
                    if let Some(s) = staged {
                        std::mem::forget(s);
                    }
                }
            }
            if let Some(peer) = self.peers.get_mut(&key) {
                peer.in_flight = peer.in_flight.saturating_sub(1);
            }
            if flush_failed && self.peers.contains_key(&key) {
                // A failed flush: the endpoint is no good any more. (A conversion refused
                // after good reads says nothing about the endpoint.)
                self.abort_peer(&key, || PullError::Closed("flush failed"));
            }
            let _ = reply.send(result);
            // The peer may take its next queued job.
            if let Some(peer) = self.peers.get_mut(&key)
                && peer.in_flight < MAX_PULLS_PER_PEER
                && let Some(job) = peer.queued.pop_front()
            {
                self.post(key, job);
            }
        }
        moved
    }
}

/// Populates this process's page tables for a peer's pool mapped at `ptr` (shared memory), in
/// the background: otherwise the first read of every page of it — the first pull of each block —
/// takes a page fault (a 2 MiB pull took ~1.2 ms instead of ~0.1 ms). See [`pd_ucx::populate`]
/// for why this is safe while the puller may close the endpoint.
fn prefault(peer: &str, ptr: *const u8, len: usize) {
    let (addr, peer) = (ptr as usize, peer.to_string());
    let spawned = std::thread::Builder::new()
        .name("pd-kv-prefault".into())
        .spawn(move || {
            let t = std::time::Instant::now();
            match pd_ucx::populate(addr as *const u8, len) {
                Ok(()) => {
                    tracing::debug!(%peer, bytes = len, took = ?t.elapsed(), "peer pool pre-faulted");
                }
                Err(e) => tracing::debug!(%peer, error = %e, "pre-faulting the peer pool failed"),
            }
        });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "cannot start the pre-fault thread");
    }
}

/// An endpoint to `peer`, its pool's key, and the endpoint's transports (comma-separated).
fn connect<'w>(
    worker: &'w Worker,
    peer: &PeerInfo,
) -> Result<(Endpoint<'w>, RemoteKey<'w>, String), pd_ucx::Error> {
    let ep = worker.connect(&peer.worker_address)?;
    let rkey = ep.unpack_rkey(&peer.rkey)?;
    if let Some(ptr) = rkey.local_ptr(peer.region_base) {
        prefault(&peer.engine_id, ptr, peer.region_len as usize);
    }
    let mut named = String::new();
    match ep.transport_report() {
        Ok(report) => {
            let transports = report.transports();
            named = transports.join(",");
            if pd_ucx::is_tcp_emulated_rma(&report) {
                tracing::warn!(
                    peer = %peer.engine_id, ?transports,
                    "KV pulls from this peer run over TCP-emulated RMA: expect ~50x lower bandwidth than shared memory"
                );
            } else {
                tracing::info!(peer = %peer.engine_id, ?transports, kv_path = %peer.kv_path, "KV transfer endpoint connected");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot read the endpoint's transports"),
    }
    Ok((ep, rkey, named))
}

/// Blocks of a peer held under one lease, and where they go locally.
#[derive(Debug, Clone)]
pub struct LeasedBlocks {
    /// The lease.
    pub lease: pd_kv_pool::LeaseId,
    /// Its generation.
    pub generation: u64,
    /// The peer's block ids.
    pub remote: Vec<BlockId>,
    /// Our block ids, one per remote block (with `rechunk`: ours holding its tokens).
    pub local: Vec<BlockId>,
    /// The peer's blocks differ from ours in size or order: convert these tokens.
    pub rechunk: Option<Rechunk>,
    /// What the blocks must hold (the reader's prompt), checked against what the owner says at
    /// confirm. Not attested (all zero): no check.
    pub expect: pd_kv_pool::LeaseContents,
    /// The lease's record on the owner's lease board (`remote_lease_slot`), if it said.
    pub board_slot: Option<u32>,
    /// Confirm on the board alone — without waiting for the owner's answer — when the board's
    /// beat shows the owner alive at most this long before the record was read (`None`:
    /// always hear the owner). See [`pull_under_lease_with`].
    pub board_freshness: Option<Duration>,
    /// Where the blocks go as they land (a staged node's compute pool), if anywhere.
    pub landing: Option<Arc<dyn Landing>>,
}

/// The whole pull of one lease: read the blocks, then confirm with the owner that the lease
/// was still live — live now means live during the whole read, since a lease never comes back
/// once ended. If not, the data is discarded (the caller must not use the local blocks) and the
/// error says why. Successes and failures (by reason) are recorded in `metrics`; the caller keeps
/// the lease alive meanwhile with a [`LeaseKeeper`] and releases it afterwards.
///
/// Reads and confirmation end by `deadline`: past it the reads are cancelled (and, when it is the
/// confirmation that hangs, the peer's endpoint is closed) and the error is
/// [`TransferError::Deadline`]. Either way, when this returns nothing writes the local blocks.
///
/// # Errors
/// [`TransferError`] for every way the KV did not arrive intact.
pub async fn pull_under_lease(
    puller: &Puller,
    client: &mut crate::peer::PeerClient,
    peer: &PeerInfo,
    blocks: LeasedBlocks,
    deadline: Instant,
    metrics: &crate::metrics::TransferMetrics,
) -> Result<LeasePull, TransferError> {
    pull_under_lease_with(puller, client, peer, blocks, None, deadline, metrics).await
}

/// The owner's confirmation of a lease, asked for before the pull started (e.g. as soon as the
/// request arrived, while it waited for blocks): [`pull_under_lease_with`] uses it in place of
/// the one it would send alongside its reads.
pub type EarlyConfirm = tokio::task::JoinHandle<Result<pd_kv_pool::LeaseContents, TransferError>>;

/// [`pull_under_lease`], with the owner's confirmation already on its way (`early`). It counts
/// only where the owner has a lease board mapped here — the board's record, read after the
/// reads, shows the lease had not ended by then; elsewhere it is dropped and the owner confirms
/// after the reads as usual.
///
/// Where the board also beats recently enough (`blocks.board_freshness`: the owner granted a
/// lease that long ago at most, by the clock its handshake stated), the record alone confirms
/// the lease and the owner's answer is not waited for (nor asked for alongside the reads, when
/// no `early` one was: with `board_freshness` the caller counts on the board, and the owner is
/// asked after the reads only if the board does not do). What the owner's answer adds is that it
/// is alive; a recent beat says it was a moment ago. An owner that died (or froze) since then
/// left its leased blocks as they were — a dead or stopped process writes nothing, and the
/// record's generation shows the blocks were not handed out before it stopped — so what was
/// read is the lease's KV either way, and its hashes are checked against the prompt below.
///
/// # Errors
/// As [`pull_under_lease`].
pub async fn pull_under_lease_with(
    puller: &Puller,
    client: &mut crate::peer::PeerClient,
    peer: &PeerInfo,
    blocks: LeasedBlocks,
    early: Option<EarlyConfirm>,
    deadline: Instant,
    metrics: &crate::metrics::TransferMetrics,
) -> Result<LeasePull, TransferError> {
    let result = async {
        let handed = std::time::Instant::now();
        let late = || {
            puller.forget(&peer.engine_id);
            TransferError::Deadline(format!(
                "the owner did not confirm lease {} in time",
                blocks.lease
            ))
        };
        // With a lease board mapped here, the owner's confirmation runs alongside the reads (the
        // owner is alive and says what the lease holds) and the lease's record, read right after
        // the reads, shows it had not ended by then: together what a confirmation after the
        // reads says, in the time of the longer of the two. Otherwise the owner confirms after.
        let overlap = blocks.board_slot.is_some() && peer.board_slots > 0;
        let (lease, generation) = (blocks.lease, blocks.generation);
        // Aborted on every way out that does not await it (a failed pull, a fresh board).
        let mut early = Unawaited(early.filter(|_| overlap));
        let tcp = blocks.rechunk.is_none() && blocks.landing.is_none() && puller.over_tcp(peer);
        let who = (client.me().to_owned(), client.token());
        let pull = async {
            match tcp {
                true => {
                    let (remote, local) = (blocks.remote, blocks.local);
                    puller
                        .pull_over_tcp(peer, who, lease, generation, remote, local, deadline)
                        .await
                }
                false => {
                    puller
                        .pull_converting(
                            peer,
                            blocks.remote,
                            blocks.local,
                            blocks.rechunk,
                            blocks.board_slot,
                            blocks.landing,
                            deadline,
                        )
                        .await
                }
            }
        };
        // Without an early confirmation, one goes out alongside the reads — unless the caller
        // counts on a fresh board (then the owner is asked after the reads if it is not).
        let (pulled, mut asked) =
            if overlap && early.0.is_none() && blocks.board_freshness.is_none() {
                let confirm =
                    tokio::time::timeout_at(deadline.into(), client.confirm(lease, generation));
                let (p, c) = tokio::join!(pull, confirm);
                (p, Some(c))
            } else {
                (pull.await, None)
            };
        let read_at = std::time::Instant::now();
        // A failed pull first: it says what became of our blocks.
        let Pulled { stats, record, .. } = pulled?;
        metrics.record_stage("reads", read_at - handed);
        let confirming = read_at;
        // This lease's record (its generation and id), before its deadline, on a board that
        // beat recently: no need to hear the owner.
        let fresh = record.filter(|r| {
            r.generation == generation
                && r.lease_tag == lease.tag()
                && blocks
                    .board_freshness
                    .zip(peer.owner_clock)
                    .is_some_and(|(within, clock)| {
                        clock.beat_within(r.beat, within) && clock.before(r.deadline)
                    })
        });
        if fresh.is_some() {
            drop(early);
            metrics.board_alone.inc();
        } else if asked.is_none()
            && let Some(h) = early.0.take()
        {
            asked = Some(
                tokio::time::timeout_at(deadline.into(), h)
                    .await
                    .map(|joined| {
                        joined.unwrap_or_else(|e| {
                            Err(TransferError::Rpc(format!("confirming lease {lease}: {e}")))
                        })
                    }),
            );
        }
        // The lease's own record, saying what the owner said (anything else: ask again after).
        let on_board = |theirs: &pd_kv_pool::LeaseContents| {
            record.is_some_and(|r| r.generation == generation && r.contents == *theirs)
        };
        let theirs = match (fresh, asked) {
            (Some(r), _) => {
                metrics.confirms.with_label_values(&["board"]).inc();
                r.contents
            }
            (None, Some(Ok(Ok(theirs)))) if on_board(&theirs) => {
                metrics.confirms.with_label_values(&["board"]).inc();
                theirs
            }
            (None, Some(Ok(Err(e)))) => return Err(e),
            (None, Some(Err(_))) => return Err(late()),
            // No board record (not mapped here, or not this lease's any more): the owner says
            // after the reads, and says why not.
            (None, _) => {
                metrics.confirms.with_label_values(&["rpc"]).inc();
                let confirm = client.confirm(lease, generation);
                match tokio::time::timeout_at(deadline.into(), confirm).await {
                    Ok(r) => r?,
                    Err(_) => return Err(late()),
                }
            }
        };
        metrics.record_stage("confirm", confirming.elapsed());
        // An owner that attests its lease must hold exactly the reader's prompt: otherwise the
        // params were forged or mixed up, and the blocks are another prompt's KV.
        if theirs.attested() && blocks.expect.attested() && !theirs.same_contents(&blocks.expect) {
            return Err(TransferError::PromptMismatch {
                lease: lease.to_string(),
                theirs,
                ours: blocks.expect,
            });
        }
        Ok(LeasePull {
            stats,
            attested: theirs.attested(),
            // Only when the owner vouched for exactly the reader's tokens.
            next_token: theirs
                .next_token
                .filter(|_| theirs.attested() && blocks.expect.attested())
                .map(|t| (t, theirs.next_token_key)),
        })
    }
    .await;
    match &result {
        Ok(p) => metrics.record_pull(&p.stats),
        Err(e) => metrics.record_failure(e),
    }
    result
}

/// An early confirmation not (yet) awaited: aborted when dropped, so a request or a pull that
/// ends without it leaves no RPC running. Take it out (`.0.take()`) to await or hand it on.
#[derive(Debug)]
pub struct Unawaited(pub Option<EarlyConfirm>);

impl Drop for Unawaited {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// What [`pull_under_lease`] brought.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePull {
    /// The reads.
    pub stats: PullStats,
    /// Whether the owner attested what the blocks hold (and it matched the reader's prompt).
    /// KV nobody vouched for may serve the request it was pulled for but must never enter a
    /// prefix cache.
    pub attested: bool,
    /// The owner's token after the blocks' tokens (a prefill's first token) and how it was
    /// chosen (`LeaseContents::next_token_key`), when it said and its tokens are the reader's.
    pub next_token: Option<(u32, u64)>,
}

/// Renews a lease every `interval` (duration / 6) until dropped, so a pull that waits in a
/// queue does not lose its blocks. Unacknowledged renewals are counted.
#[derive(Debug)]
pub struct LeaseKeeper {
    task: tokio::task::JoinHandle<()>,
}

impl LeaseKeeper {
    /// Starts renewing `(lease, generation)` through `client`.
    pub fn start(
        mut client: crate::peer::PeerClient,
        lease: pd_kv_pool::LeaseId,
        generation: u64,
        interval: std::time::Duration,
        metrics: Arc<crate::metrics::TransferMetrics>,
    ) -> Self {
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            loop {
                tick.tick().await;
                match client.renew(lease, generation).await {
                    Ok(true) => {}
                    Ok(false) => {
                        metrics.notification_failures.inc();
                        tracing::warn!(%lease, "lease renewal refused: the lease ended");
                        return;
                    }
                    Err(e) => {
                        metrics.notification_failures.inc();
                        tracing::warn!(%lease, error = %e, "lease renewal failed");
                    }
                }
            }
        });
        Self { task }
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Logs what it is asked to do.
    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<String>>);

    impl Landing for Log {
        fn begin(&self) -> Result<(), String> {
            self.0.lock().unwrap().push("begin".into());
            Ok(())
        }

        unsafe fn landed(&self, first: BlockId, bytes: &[u8]) -> Result<(), String> {
            // (Blocks of 64 bytes in the test below.)
            for i in 0..bytes.len() / 64 {
                self.0
                    .lock()
                    .unwrap()
                    .push(format!("landed {}", first.0 + i as u32));
            }
            Ok(())
        }

        fn settle(&self) -> Result<(), String> {
            self.0.lock().unwrap().push("settle".into());
            Ok(())
        }
    }

    /// Handing hands blocks on in parts, each once, up to what it is told is in; finishing
    /// settles once; a handing dropped midway (its pull's task cancelled) settles too, and one
    /// that never began does not.
    #[tokio::test(flavor = "current_thread")]
    async fn handing_settles_once_whether_finished_or_dropped() {
        let ctx = pd_ucx::Context::new().unwrap();
        let region = MemoryRegion::allocate(&ctx, 8 * 64).unwrap();
        let local: Vec<BlockId> = (0..5).map(BlockId).collect();
        let log = Log::default();
        let mut h = Handing::new(&log, &region, &local, 64, 2);
        h.upto(3).await;
        h.upto(3).await;
        h.upto(5).await;
        h.finish().unwrap();
        let want: Vec<String> = ["begin", "landed 0", "landed 1", "landed 2", "landed 3"]
            .into_iter()
            .map(String::from)
            .chain(["landed 4".to_string(), "settle".to_string()])
            .collect();
        assert_eq!(*log.0.lock().unwrap(), want);

        let dropped = Log::default();
        let mut h = Handing::new(&dropped, &region, &local, 64, 2);
        h.upto(1).await;
        drop(h);
        assert_eq!(*dropped.0.lock().unwrap(), ["begin", "landed 0", "settle"]);

        let idle = Log::default();
        drop(Handing::new(&idle, &region, &local, 64, 2));
        assert!(idle.0.lock().unwrap().is_empty());
    }
}

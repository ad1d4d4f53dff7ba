//! The puller thread's state machine. It owns the UCX worker, an endpoint and remote key per
//! connected peer, the flights (posted pulls waiting for their flush) and the force-closes in
//! progress; it takes jobs, connects peers (closing a restarted peer's old incarnation and the
//! least recently used idle one beyond [`super::MAX_PEERS`]), posts reads or copies from a
//! mapped pool, converts staged reads, and answers each pull only once nothing writes its
//! blocks any more: its reads completed, or its endpoint's force-close did.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use pd_kv_pool::BlockId;
use pd_ucx::{Context, Endpoint, MemoryRegion, RemoteKey, Request, Worker};
use tokio::sync::oneshot;

use super::mapped::{Direct, Mapping};
use super::{Job, MAX_PEERS, MAX_PULLS_PER_PEER, Msg, PeerKey, PeerPath, Pulled};
use crate::copier::lock;
use crate::peer::PeerInfo;
use crate::pull::{PostedPull, PullError, PullSource, Rechunk, post_pull};

/// The longest sleep between polls while pulls are in flight but nothing completes.
pub const MAX_IDLE_SLEEP: Duration = Duration::from_millis(1);

/// The largest staging buffer one converting pull may register (its peer's blocks, whole).
pub const MAX_STAGING_BYTES: usize = 1 << 30;

/// Polls without progress before the thread starts sleeping between polls.
const SPIN_POLLS: u32 = 256;

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
pub(super) struct Shared {
    pub(super) direct: Option<Arc<Direct>>,
    pub(super) paths: Arc<Mutex<BTreeMap<String, PeerPath>>>,
}

pub(super) fn run(
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

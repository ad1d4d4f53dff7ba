//! The puller thread: owns a UCX worker (not thread-safe), endpoints and remote keys per peer,
//! and runs pulls handed to it, so async callers only await a reply.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;

use pd_kv_pool::BlockId;
use pd_ucx::{Context, Endpoint, MemoryRegion, RemoteKey, Worker};
use tokio::sync::oneshot;

use crate::peer::{PeerInfo, TransferError};
use crate::pull::{PullError, PullSource, PullStats, pull_blocks};

struct Job {
    peer: PeerInfo,
    remote: Vec<BlockId>,
    local: Vec<BlockId>,
    reply: oneshot::Sender<Result<PullStats, PullError>>,
}

/// Handle to the puller thread; dropping it stops the thread.
#[derive(Debug, Clone)]
pub struct Puller {
    jobs: mpsc::Sender<Job>,
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
        let (jobs, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("pd-kv-puller".into())
            .spawn(move || run(&ctx, &local, block_bytes, &rx))?;
        Ok(Self { jobs })
    }

    /// Reads `remote[i]` of `peer` into local block `local[i]`; resolves when the data is in
    /// place (the engine keeps stepping meanwhile).
    ///
    /// # Errors
    /// [`TransferError::Transfer`] or [`TransferError::PullerStopped`].
    pub async fn pull(
        &self,
        peer: &PeerInfo,
        remote: Vec<BlockId>,
        local: Vec<BlockId>,
    ) -> Result<PullStats, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Job {
                peer: peer.clone(),
                remote,
                local,
                reply,
            })
            .map_err(|_| TransferError::PullerStopped)?;
        Ok(rx.await.map_err(|_| TransferError::PullerStopped)??)
    }
}

fn run(ctx: &Context, local: &MemoryRegion, block_bytes: usize, jobs: &mpsc::Receiver<Job>) {
    let worker = match Worker::new(ctx) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!(error = %e, "cannot create the puller's UCX worker");
            return;
        }
    };
    // (engine id, epoch) → endpoint and the peer pool's key.
    let mut peers: HashMap<(String, u64), (Endpoint<'_>, RemoteKey<'_>)> = HashMap::new();
    while let Ok(job) = jobs.recv() {
        let key = (job.peer.engine_id.clone(), job.peer.epoch);
        if !peers.contains_key(&key) {
            // A restarted peer has a new epoch: drop endpoints of its old incarnation.
            peers.retain(|(id, _), _| id != &key.0);
            match connect(&worker, &job.peer) {
                Ok(ep) => {
                    peers.insert(key.clone(), ep);
                }
                Err(e) => {
                    let _ = job.reply.send(Err(e.into()));
                    continue;
                }
            }
        }
        let Some((ep, rkey)) = peers.get(&key) else {
            continue;
        };
        let src = PullSource {
            endpoint: ep,
            rkey,
            remote_base: job.peer.region_base,
            remote_len: job.peer.region_len as usize,
        };
        let result = pull_blocks(&src, local, &job.remote, &job.local, block_bytes);
        if result.is_err() {
            peers.remove(&key);
        }
        let _ = job.reply.send(result);
    }
}

fn connect<'w>(
    worker: &'w Worker,
    peer: &PeerInfo,
) -> Result<(Endpoint<'w>, RemoteKey<'w>), pd_ucx::Error> {
    let ep = worker.connect(&peer.worker_address)?;
    let rkey = ep.unpack_rkey(&peer.rkey)?;
    match ep.transport_report() {
        Ok(report) => {
            let transports = report.transports();
            if pd_ucx::is_tcp_emulated_rma(&report) {
                tracing::warn!(
                    peer = %peer.engine_id, ?transports,
                    "KV pulls from this peer run over TCP-emulated RMA: expect ~50x lower bandwidth than shared memory"
                );
            } else {
                tracing::info!(peer = %peer.engine_id, ?transports, "KV transfer endpoint connected");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot read the endpoint's transports"),
    }
    Ok((ep, rkey))
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
    /// Our block ids, one per remote block.
    pub local: Vec<BlockId>,
    /// What the blocks must hold (the reader's prompt), checked against what the owner says at
    /// confirm. Not attested (all zero): no check.
    pub expect: pd_kv_pool::LeaseContents,
}

/// The whole pull of one lease: read the blocks, then confirm with the owner that the lease
/// was still live — live now means live during the whole read, since a lease never comes back
/// once ended. If not, the data is discarded (the caller must not use the local blocks) and the
/// error says why. Successes and failures (by reason) are recorded in `metrics`; the caller keeps
/// the lease alive meanwhile with a [`LeaseKeeper`] and releases it afterwards.
///
/// # Errors
/// [`TransferError`] for every way the KV did not arrive intact.
pub async fn pull_under_lease(
    puller: &Puller,
    client: &mut crate::peer::PeerClient,
    peer: &PeerInfo,
    blocks: LeasedBlocks,
    metrics: &crate::metrics::TransferMetrics,
) -> Result<PullStats, TransferError> {
    let result = async {
        let stats = puller.pull(peer, blocks.remote, blocks.local).await?;
        let theirs = client.confirm(blocks.lease, blocks.generation).await?;
        // An owner that attests its lease must hold exactly the reader's prompt: otherwise the
        // params were forged or mixed up, and the blocks are another prompt's KV.
        if theirs.attested() && blocks.expect.attested() && theirs != blocks.expect {
            return Err(TransferError::PromptMismatch {
                lease: blocks.lease.to_string(),
                theirs,
                ours: blocks.expect,
            });
        }
        Ok(stats)
    }
    .await;
    match &result {
        Ok(s) => metrics.record_pull(s),
        Err(e) => metrics.record_failure(e),
    }
    result
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

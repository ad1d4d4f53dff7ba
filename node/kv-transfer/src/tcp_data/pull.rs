//! The reader's side of a pull over an owner's TCP data port: the blocks of a lease read over
//! [`TCP_CONNECTIONS`] connections at once, on the blocking pool, straight into our own blocks.
//! Cancel-safe: a pull whose future is dropped stops its reads and waits until they ended
//! (`StopReads`), so nothing writes the local blocks after it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pd_kv_pool::{BlockId, LeaseId};
use pd_ucx::MemoryRegion;

use super::{Cancel, DataError, DataRequest, read_blocks_until};
use crate::peer::{PeerInfo, TransferError};
use crate::pull::{PullError, PullStats};

/// Connections a pull over a peer's TCP data port reads over at once.
pub const TCP_CONNECTIONS: usize = 4;

/// Stops a pull's TCP reads when the pull's future is dropped before they ended, and waits
/// until they have (a read interrupted by the shutdown returns at once).
struct StopReads {
    cancel: Arc<Cancel>,
    finished: Arc<(Mutex<bool>, Condvar)>,
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

/// One pull of a lease's blocks over the owner's data port.
#[derive(Debug)]
pub(crate) struct DataPull {
    /// Our pool's registered memory, which the reads write.
    pub(crate) region: Arc<MemoryRegion>,
    /// Bytes per block (ours and the owner's: a converting pull never comes here).
    pub(crate) block_bytes: usize,
    /// Our engine id (the lease's grantee) and the cluster token (empty: none).
    pub(crate) who: (String, String),
    /// The lease and its generation.
    pub(crate) lease: LeaseId,
    pub(crate) generation: u64,
    /// The owner's blocks, and ours they land in (one each).
    pub(crate) remote: Vec<BlockId>,
    pub(crate) local: Vec<BlockId>,
    /// Past it the reads stop and the pull fails as `deadline`.
    pub(crate) deadline: Instant,
    /// Mutual TLS with the cluster CA; `None`: plain TCP.
    pub(crate) tls: Option<pd_tls::ClusterTls>,
}

impl DataPull {
    /// Reads the blocks from `peer`'s data port; returns what moved and the port's address.
    ///
    /// # Errors
    /// The owner could not be reached ([`TransferError::PeerUnreachable`]) or refused
    /// ([`TransferError::Rpc`]), or the deadline passed ([`PullError::Deadline`]).
    pub(crate) async fn run(self, peer: &PeerInfo) -> Result<(PullStats, String), TransferError> {
        let Self {
            region,
            block_bytes,
            who: (me, token),
            lease,
            generation,
            remote,
            local,
            deadline,
            tls,
        } = self;
        let host = &peer.data_host;
        let addr = match host.contains(':') {
            true => format!("[{host}]:{}", peer.data_port),
            false => format!("{host}:{}", peer.data_port),
        };
        let cancel = Arc::new(Cancel::default());
        let finished = Arc::new((Mutex::new(false), Condvar::new()));
        let guard = StopReads {
            cancel: cancel.clone(),
            finished: finished.clone(),
        };
        let start = Instant::now();
        let target = addr.clone();
        let task = tokio::task::spawn_blocking(move || {
            let req = DataRequest {
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
                tls: tls.as_ref(),
            };
            // SAFETY: `region` is this node's pool, mapped while the Arc lives; the local blocks
            // are reserved for this pull by the engine, and `StopReads` keeps the pull's future
            // from ending before these reads do.
            let read = unsafe { read_blocks_until(&req, region.as_ptr(), region.len(), &cancel) };
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
            DataError::Io(io) => TransferError::PeerUnreachable {
                addr: addr.clone(),
                message: format!("KV data port: {io}"),
            },
            other => TransferError::Rpc(other.to_string()),
        })?;
        let stats = PullStats {
            bytes,
            descriptors: 0,
            post_time: Duration::ZERO,
            total_time: start.elapsed(),
            copied: false,
            tcp: true,
            helper_bytes: 0,
            landed_blocks: 0,
            landed_early: 0,
        };
        Ok((stats, addr))
    }
}

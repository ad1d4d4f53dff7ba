//! One-sided reads of a peer's blocks into ours.

use std::time::{Duration, Instant};

use pd_kv_pool::BlockId;
use pd_ucx::{Endpoint, MemoryRegion, RemoteKey};

use crate::plan::plan_ranges;

/// A peer's pool as reachable from this worker.
#[derive(Debug)]
pub struct PullSource<'e, 'w> {
    /// Endpoint to the peer's worker.
    pub endpoint: &'e Endpoint<'w>,
    /// The peer's pool key, unpacked for `endpoint`.
    pub rkey: &'e RemoteKey<'w>,
    /// Address of the peer's pool (its block 0).
    pub remote_base: u64,
    /// Bytes in the peer's pool.
    pub remote_len: usize,
}

/// What a pull did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullStats {
    /// Bytes read.
    pub bytes: usize,
    /// Contiguous reads posted (after coalescing).
    pub descriptors: usize,
    /// Time to post every read.
    pub post_time: Duration,
    /// Time from the first post to completion of all reads.
    pub total_time: Duration,
}

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// Remote and local block lists differ in length.
    #[error("{remote} remote blocks but {local} local blocks")]
    LengthMismatch {
        /// Remote ids given.
        remote: usize,
        /// Local ids given.
        local: usize,
    },
    /// A block id lies outside the remote or local pool.
    #[error("block range outside the {side} pool")]
    OutOfBounds {
        /// `remote` or `local`.
        side: &'static str,
    },
    /// UCX failed to post or complete a read (peer gone, transport error).
    #[error("transfer failed: {0}")]
    Ucx(#[from] pd_ucx::Error),
}

/// Reads `remote[i]` of the peer into `local[i]` of `dst` for every `i`, one descriptor per run of
/// blocks consecutive on both sides, then waits (progressing this thread's worker) until all
/// reads completed.
///
/// # Errors
/// [`PullError`]; on error the contents of the local blocks are unspecified.
pub fn pull_blocks(
    src: &PullSource<'_, '_>,
    dst: &MemoryRegion,
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
) -> Result<PullStats, PullError> {
    if remote.len() != local.len() {
        return Err(PullError::LengthMismatch {
            remote: remote.len(),
            local: local.len(),
        });
    }
    let ranges = plan_ranges(remote, local, block_bytes);
    if ranges
        .iter()
        .any(|r| r.remote_offset + r.len > src.remote_len)
    {
        return Err(PullError::OutOfBounds { side: "remote" });
    }
    if ranges.iter().any(|r| r.local_offset + r.len > dst.len()) {
        return Err(PullError::OutOfBounds { side: "local" });
    }
    let start = Instant::now();
    for r in &ranges {
        src.endpoint.post_get(
            dst,
            r.local_offset,
            r.len,
            src.remote_base + r.remote_offset as u64,
            src.rkey,
        )?;
    }
    let post_time = start.elapsed();
    src.endpoint.flush()?.wait()?;
    Ok(PullStats {
        bytes: ranges.iter().map(|r| r.len).sum(),
        descriptors: ranges.len(),
        post_time,
        total_time: start.elapsed(),
    })
}

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
    /// Whether the blocks were copied from the peer's pool mapped here ([`copy_pull`]) rather
    /// than read with UCX gets.
    pub copied: bool,
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
    /// The peer's endpoint was closed under the pull (the reason says why: the peer restarted,
    /// a failed post or flush, shutdown); its reads were cancelled before this was returned.
    #[error("the peer's endpoint was closed ({0}); reads cancelled")]
    Closed(&'static str),
    /// The reads did not complete by the pull's deadline; they were cancelled (the endpoint
    /// force-closed) before this error was returned.
    #[error("pull did not complete within {0:?}; the peer's endpoint was closed")]
    Deadline(Duration),
}

/// Reads `remote[i]` of the peer into `local[i]` of `dst` for every `i`, one descriptor per run of
/// blocks consecutive on both sides, then waits (progressing this thread's worker) until all
/// reads completed.
///
/// # Errors
/// [`PullError`]; on error the contents of the local blocks are unspecified, and reads posted
/// before a failed post may still be in flight: the caller must close the endpoint (and wait
/// for the close) before the local blocks are used again.
pub fn pull_blocks(
    src: &PullSource<'_, '_>,
    dst: &MemoryRegion,
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
) -> Result<PullStats, PullError> {
    let PostedPull {
        flush,
        bytes,
        descriptors,
        start,
        post_time,
    } = post_pull(src, dst, remote, local, block_bytes)?;
    flush.wait()?;
    Ok(PullStats {
        bytes,
        descriptors,
        post_time,
        total_time: start.elapsed(),
        copied: false,
    })
}

/// The runs of `remote[i]` → `local[i]` block pairs ([`plan_ranges`]), checked against both
/// pools' sizes.
fn checked_ranges(
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
    remote_len: usize,
    local_len: usize,
) -> Result<Vec<crate::plan::CopyRange>, PullError> {
    if remote.len() != local.len() {
        return Err(PullError::LengthMismatch {
            remote: remote.len(),
            local: local.len(),
        });
    }
    let ranges = plan_ranges(remote, local, block_bytes);
    if ranges.iter().any(|r| r.remote_offset + r.len > remote_len) {
        return Err(PullError::OutOfBounds { side: "remote" });
    }
    if ranges.iter().any(|r| r.local_offset + r.len > local_len) {
        return Err(PullError::OutOfBounds { side: "local" });
    }
    Ok(ranges)
}

/// Copies `remote[i]` of a peer's pool that UCX mapped into this process at `mapped` (its block
/// 0; `remote_len` bytes — `RemoteKey::local_ptr`, shared memory on one host) into `local[i]` of
/// `dst`, one `memcpy` per run of blocks consecutive on both sides. What a shared-memory get
/// does, without a system call per read or pinning the peer's pages each time.
///
/// # Errors
/// [`PullError::LengthMismatch`] / [`PullError::OutOfBounds`]; nothing is copied then.
///
/// # Safety
/// `mapped` must be valid for reads of `remote_len` bytes for the whole call (the key that
/// mapped it must outlive it), and nothing else may access `local`'s blocks in `dst` meanwhile.
pub unsafe fn copy_pull(
    mapped: *const u8,
    remote_len: usize,
    dst: &MemoryRegion,
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
) -> Result<PullStats, PullError> {
    let ranges = checked_ranges(remote, local, block_bytes, remote_len, dst.len())?;
    let start = Instant::now();
    for r in &ranges {
        // SAFETY: both ranges were checked against their regions above; the regions are
        // distinct allocations (a peer's pool, ours), so they do not overlap; validity and
        // exclusive access per the caller.
        unsafe {
            std::ptr::copy_nonoverlapping(
                mapped.add(r.remote_offset),
                dst.as_ptr().add(r.local_offset),
                r.len,
            );
        }
    }
    let took = start.elapsed();
    Ok(PullStats {
        bytes: ranges.iter().map(|r| r.len).sum(),
        descriptors: ranges.len(),
        post_time: took,
        total_time: took,
        copied: true,
    })
}

/// Reads posted by [`post_pull`], completed by one flush of their endpoint.
#[derive(Debug)]
pub struct PostedPull<'w> {
    /// Completes after every read (progress its worker, or poll it).
    pub flush: pd_ucx::Request<'w>,
    /// Bytes being read.
    pub bytes: usize,
    /// Contiguous reads posted.
    pub descriptors: usize,
    /// When the first read was posted.
    pub start: Instant,
    /// Time to post every read.
    pub post_time: Duration,
}

impl PostedPull<'_> {
    /// The pull's statistics, as of now (call once the flush completed).
    pub fn stats(&self) -> PullStats {
        PullStats {
            bytes: self.bytes,
            descriptors: self.descriptors,
            post_time: self.post_time,
            total_time: self.start.elapsed(),
            copied: false,
        }
    }
}

/// Checks the block lists and posts the reads of [`pull_blocks`] without waiting: the returned
/// flush completes once all of them have.
///
/// # Errors
/// [`PullError`]. When a post fails after others succeeded, those are in flight: close the
/// endpoint (and wait for the close) before the local blocks are used again.
pub fn post_pull<'w>(
    src: &PullSource<'_, 'w>,
    dst: &MemoryRegion,
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
) -> Result<PostedPull<'w>, PullError> {
    let ranges = checked_ranges(remote, local, block_bytes, src.remote_len, dst.len())?;
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
    let flush = src.endpoint.flush()?;
    Ok(PostedPull {
        flush,
        bytes: ranges.iter().map(|r| r.len).sum(),
        descriptors: ranges.len(),
        start,
        post_time,
    })
}

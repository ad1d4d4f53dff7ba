//! One-sided reads of a peer's blocks into ours.

use std::ops::Range;
use std::time::{Duration, Instant};

use pd_kv_pool::{BlockId, KvLayout};
use pd_ucx::{Endpoint, MemoryRegion, RemoteKey};

use crate::copier::{Copier, Span};
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
    /// Whether the blocks came over the owner's TCP data port ([`crate::tcp_data`]).
    pub tcp: bool,
    /// Of `bytes`, those the copy helper thread moved ([`Copier`]; 0 for gets).
    pub helper_bytes: usize,
    /// Blocks handed on as they landed ([`crate::landing::Landing`]; 0 without one).
    pub landed_blocks: usize,
    /// Of `landed_blocks`, those handed on before the pull's last block was in: the part of
    /// the landing's work that overlapped the pull.
    pub landed_early: usize,
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
    /// The peer's blocks cannot be converted into ours (see [`Rechunk`]).
    #[error("converting the peer's blocks: {0}")]
    Rechunk(#[from] pd_kv_pool::RechunkError),
    /// A local block named twice in one pull.
    #[error("local block {0} named twice")]
    RepeatedBlock(u32),
    /// The blocks could not be handed on as they landed ([`crate::landing::Landing`]: a staged
    /// node's upload into its compute pool).
    #[error("uploading pulled blocks into the compute pool: {0}")]
    Landing(#[from] crate::landing::LandingError),
}

/// A pull from a peer whose blocks differ from ours in size or order
/// (`pd_kv_transfer::needs_rechunk`): the peer's blocks are read whole, then the K/V of
/// `tokens` are copied into ours where our layout puts them ([`pd_kv_pool::rechunk`]).
///
/// The remote ids of such a pull start at the peer's block holding token `tokens.start`, the
/// local ids at ours holding it; each list covers the tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rechunk {
    /// The peer's layout (from its handshake).
    pub from: KvLayout,
    /// Ours.
    pub to: KvLayout,
    /// The sequence's token positions to copy.
    pub tokens: Range<usize>,
}

/// Everything [`rechunk_pull`] needs to hold before it touches a byte: the layouts differ only
/// in block size and order, both lists cover the tokens, every remote block lies inside the
/// `src_len` bytes it reads from and every local one inside our `dst_len` (without overflow,
/// whatever a peer's handshake said), and no local block is named twice. A puller checks this
/// before posting a converting pull's reads, too.
///
/// # Errors
/// [`PullError::Rechunk`], [`PullError::OutOfBounds`], [`PullError::RepeatedBlock`].
pub fn check_rechunk(
    remote: &[BlockId],
    src_len: usize,
    local: &[BlockId],
    dst_len: usize,
    r: &Rechunk,
) -> Result<(), PullError> {
    pd_kv_pool::check_rechunk(&r.from, remote.len(), &r.to, local.len(), &r.tokens)?;
    // A block's bytes and its end, refusing what overflows (a peer's layout is its word).
    let end = |b: &BlockId, l: &KvLayout| {
        let bytes = l
            .num_layers
            .checked_mul(2)?
            .checked_mul(l.num_kv_heads)?
            .checked_mul(l.block_size)?
            .checked_mul(l.head_dim)?
            .checked_mul(l.dtype.size())?;
        (b.index() + 1).checked_mul(bytes)
    };
    if remote
        .iter()
        .any(|b| end(b, &r.from).is_none_or(|e| e > src_len))
    {
        return Err(PullError::OutOfBounds { side: "remote" });
    }
    if local
        .iter()
        .any(|b| end(b, &r.to).is_none_or(|e| e > dst_len))
    {
        return Err(PullError::OutOfBounds { side: "local" });
    }
    no_repeats(local)?;
    Ok(())
}

/// Converts `r.tokens` from the blocks `remote` of a pool laid out as `r.from` at `src`
/// (`src_len` bytes: a peer's pool mapped here, or a staging buffer the blocks were read into)
/// into our blocks `local` of `dst`.
///
/// # Errors
/// [`PullError::OutOfBounds`], [`PullError::RepeatedBlock`], [`PullError::Rechunk`]; nothing is
/// copied then.
///
/// # Safety
/// `src` must be valid for reads of `src_len` bytes for the whole call, and nothing else may
/// access `local`'s blocks in `dst` meanwhile.
pub unsafe fn rechunk_pull(
    src: *const u8,
    src_len: usize,
    remote: &[BlockId],
    dst: &MemoryRegion,
    local: &[BlockId],
    r: &Rechunk,
) -> Result<PullStats, PullError> {
    check_rechunk(remote, src_len, local, dst.len(), r)?;
    let (sb, db) = (r.from.block_bytes(), r.to.block_bytes());
    let start = Instant::now();
    // SAFETY: every block lies inside its region (checked above); the peer's blocks are only
    // read (validity per the caller); our blocks are distinct (checked above), so the mutable
    // views do not overlap each other, and nothing else accesses them (per the caller).
    let src_blocks: Vec<&[u8]> = remote
        .iter()
        .map(|b| unsafe { std::slice::from_raw_parts(src.add(b.index() * sb), sb) })
        .collect();
    let mut dst_blocks: Vec<&mut [u8]> = local
        .iter()
        .map(|b| unsafe { std::slice::from_raw_parts_mut(dst.as_ptr().add(b.index() * db), db) })
        .collect();
    pd_kv_pool::rechunk(
        &r.from,
        &src_blocks,
        &r.to,
        &mut dst_blocks,
        r.tokens.clone(),
    )?;
    let took = start.elapsed();
    Ok(PullStats {
        bytes: remote.len() * sb,
        descriptors: remote.len(),
        post_time: took,
        total_time: took,
        copied: true,
        tcp: false,
        helper_bytes: 0,
        landed_blocks: 0,
        landed_early: 0,
    })
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
        parts,
        bytes,
        descriptors,
        start,
        post_time,
    } = post_pull(src, dst, remote, local, block_bytes)?;
    drop(parts); // (none: one part)
    flush.wait()?;
    Ok(PullStats {
        bytes,
        descriptors,
        post_time,
        total_time: start.elapsed(),
        copied: false,
        tcp: false,
        helper_bytes: 0,
        landed_blocks: 0,
        landed_early: 0,
    })
}

/// [`PullError::RepeatedBlock`] when a local block is named twice (two writes into one block).
fn no_repeats(local: &[BlockId]) -> Result<(), PullError> {
    let mut seen = local.to_vec();
    seen.sort_unstable();
    match seen.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(PullError::RepeatedBlock(w[0].0)),
        None => Ok(()),
    }
}

/// The runs of `remote[i]` → `local[i]` block pairs ([`plan_ranges`]), checked against both
/// pools' sizes; no local block may be named twice (two writers of one block).
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
    no_repeats(local)?;
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
/// `dst`, one span per run of blocks consecutive on both sides, on this thread and `copier`'s
/// helper. What a shared-memory get does, without a system call per read or pinning the peer's
/// pages each time.
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
    copier: &Copier,
) -> Result<PullStats, PullError> {
    let ranges = checked_ranges(remote, local, block_bytes, remote_len, dst.len())?;
    let start = Instant::now();
    let spans: Vec<Span> = ranges
        .iter()
        .map(|r| Span {
            src: mapped.wrapping_add(r.remote_offset),
            dst: dst.as_ptr().wrapping_add(r.local_offset),
            len: r.len,
        })
        .collect();
    // SAFETY: both ranges of each span were checked against their regions above; the regions
    // are distinct allocations (a peer's pool, ours), and `plan_ranges` gives disjoint local
    // ranges for distinct local blocks, so no destination overlaps another span; validity and
    // exclusive access per the caller.
    let helper_bytes = unsafe { copier.copy(&spans) };
    let took = start.elapsed();
    Ok(PullStats {
        bytes: ranges.iter().map(|r| r.len).sum(),
        descriptors: ranges.len(),
        post_time: took,
        total_time: took,
        copied: true,
        tcp: false,
        helper_bytes,
        landed_blocks: 0,
        landed_early: 0,
    })
}

/// Bytes copied per part of a [`copy_pull_landing`]: each part is handed on as soon as it is
/// in, so a GPU's upload of one part overlaps the copy of the next.
pub const LANDING_PART_BYTES: usize = 1 << 20;

/// [`copy_pull`] in parts of `per_part` blocks (about [`LANDING_PART_BYTES`] by default),
/// handing each part's blocks to `landing` as soon as the part is in. It does **not** settle the
/// landing: the caller calls [`crate::Landing::settle`] after it, whatever it returned (outside
/// any lock it holds for the copy: settling may wait for a device).
///
/// # Errors
/// As [`copy_pull`] (nothing is copied then), and [`PullError::Landing`] (the copy stops).
///
/// # Safety
/// As [`copy_pull`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn copy_pull_landing(
    mapped: *const u8,
    remote_len: usize,
    dst: &MemoryRegion,
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
    copier: &Copier,
    landing: &dyn crate::landing::Landing,
    per_part: usize,
) -> Result<PullStats, PullError> {
    landing.begin().map_err(PullError::Landing)?;
    let mut early = 0;
    let on_part = |part: &[BlockId], upto: usize| {
        // SAFETY: the part's blocks are in, owned by this pull (per the caller).
        unsafe { crate::landing::land(landing, dst, part, block_bytes) }?;
        if upto < local.len() {
            early = upto;
        }
        Ok(())
    };
    // SAFETY: per the caller.
    let copied = unsafe {
        copy_pull_in_parts(
            mapped,
            remote_len,
            dst,
            remote,
            local,
            block_bytes,
            copier,
            per_part,
            on_part,
        )
    };
    let mut total = copied?;
    total.landed_blocks = local.len();
    total.landed_early = early;
    Ok(total)
}

/// [`copy_pull`] in parts of `per_part` blocks, calling `on_part(part's local blocks, blocks in
/// so far)` after each part; an error from it stops the copy.
///
/// # Errors
/// As [`copy_pull`], and `on_part`'s.
///
/// # Safety
/// As [`copy_pull`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn copy_pull_in_parts(
    mapped: *const u8,
    remote_len: usize,
    dst: &MemoryRegion,
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
    copier: &Copier,
    per_part: usize,
    mut on_part: impl FnMut(&[BlockId], usize) -> Result<(), PullError>,
) -> Result<PullStats, PullError> {
    // The whole pull is checked before anything moves (each part checks only itself).
    checked_ranges(remote, local, block_bytes, remote_len, dst.len())?;
    let start = Instant::now();
    let mut total = PullStats {
        bytes: 0,
        descriptors: 0,
        post_time: Duration::ZERO,
        total_time: Duration::ZERO,
        copied: true,
        tcp: false,
        helper_bytes: 0,
        landed_blocks: 0,
        landed_early: 0,
    };
    let mut upto = 0;
    for (r, l) in remote
        .chunks(per_part.max(1))
        .zip(local.chunks(per_part.max(1)))
    {
        // SAFETY: per the caller; a part of a checked pull.
        let p = unsafe { copy_pull(mapped, remote_len, dst, r, l, block_bytes, copier) }?;
        total.bytes += p.bytes;
        total.descriptors += p.descriptors;
        total.helper_bytes += p.helper_bytes;
        upto += l.len();
        on_part(l, upto)?;
    }
    total.total_time = start.elapsed();
    total.post_time = total.total_time;
    Ok(total)
}

/// Reads posted by [`post_pull`], completed by one flush of their endpoint.
#[derive(Debug)]
pub struct PostedPull<'w> {
    /// Completes after every read (progress its worker, or poll it).
    pub flush: pd_ucx::Request<'w>,
    /// Flushes posted between parts ([`post_pull_in_parts`]), in order, each with the count of
    /// leading local blocks that are in once it completes. Empty for one part.
    pub parts: Vec<(pd_ucx::Request<'w>, usize)>,
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
            tcp: false,
            helper_bytes: 0,
            landed_blocks: 0,
            landed_early: 0,
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
    post_pull_in_parts(src, dst, remote, local, block_bytes, usize::MAX)
}

/// [`post_pull`] in parts of `per_part` blocks, each part but the last followed by a flush of
/// its own ([`PostedPull::parts`]): a flush completes once every read posted before it has, so
/// the parts' flushes say, in order, which leading blocks are in while later ones still move.
///
/// # Errors
/// As [`post_pull`] (a failed post leaves the earlier parts' flushes to the endpoint's close).
pub fn post_pull_in_parts<'w>(
    src: &PullSource<'_, 'w>,
    dst: &MemoryRegion,
    remote: &[BlockId],
    local: &[BlockId],
    block_bytes: usize,
    per_part: usize,
) -> Result<PostedPull<'w>, PullError> {
    let all = checked_ranges(remote, local, block_bytes, src.remote_len, dst.len())?;
    let start = Instant::now();
    let per_part = per_part.max(1);
    let mut parts = Vec::new();
    let mut descriptors = 0;
    let mut post = || -> Result<pd_ucx::Request<'w>, PullError> {
        let mut upto = 0;
        for (r, l) in remote.chunks(per_part).zip(local.chunks(per_part)) {
            if upto > 0 {
                // The parts before this one are in once this completes.
                parts.push((src.endpoint.flush()?, upto));
            }
            // (A part of a checked pull: its ranges lie inside both regions.)
            for c in plan_ranges(r, l, block_bytes) {
                src.endpoint.post_get(
                    dst,
                    c.local_offset,
                    c.len,
                    src.remote_base + c.remote_offset as u64,
                    src.rkey,
                )?;
                descriptors += 1;
            }
            upto += l.len();
        }
        Ok(src.endpoint.flush()?)
    };
    let flush = match post() {
        Ok(f) => f,
        Err(e) => {
            // The close of the endpoint, which the caller owes, completes these.
            parts.into_iter().for_each(|(f, _)| std::mem::forget(f));
            return Err(e);
        }
    };
    let post_time = start.elapsed();
    Ok(PostedPull {
        flush,
        parts,
        bytes: all.iter().map(|r| r.len).sum(),
        descriptors,
        start,
        post_time,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_kv_pool::{KvDtype, KvOrder};

    /// Copies and gets check their block lists the same way: two writers of one local block
    /// (possible once a copy is shared by two threads) are refused before anything moves.
    #[test]
    fn a_pull_naming_a_local_block_twice_is_refused() {
        let ids = |v: &[u32]| v.iter().copied().map(BlockId).collect::<Vec<_>>();
        let bb = 64;
        assert!(matches!(
            checked_ranges(&ids(&[0, 1, 2]), &ids(&[5, 3, 5]), bb, 8 * bb, 8 * bb),
            Err(PullError::RepeatedBlock(5))
        ));
        let ranges =
            checked_ranges(&ids(&[0, 1, 2]), &ids(&[5, 6, 3]), bb, 8 * bb, 8 * bb).unwrap();
        assert_eq!(ranges.iter().map(|r| r.len).sum::<usize>(), 3 * bb);
        assert!(matches!(
            checked_ranges(&ids(&[0, 1]), &ids(&[5, 8]), bb, 8 * bb, 8 * bb),
            Err(PullError::OutOfBounds { side: "local" })
        ));
    }

    fn rechunk_of(from: KvLayout, to: KvLayout) -> Rechunk {
        Rechunk {
            from,
            to,
            tokens: 0..40,
        }
    }

    fn layout(block_size: usize, head_dim: usize) -> KvLayout {
        KvLayout {
            num_blocks: 8,
            block_size,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim,
            dtype: KvDtype::F16,
            order: KvOrder::Hnd,
        }
    }

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&i| BlockId(i)).collect()
    }

    #[test]
    fn a_converting_pull_is_checked_before_anything_is_read() {
        let r = rechunk_of(layout(16, 8), layout(32, 8));
        let (sb, db) = (r.from.block_bytes(), r.to.block_bytes());
        // 40 tokens: 3 blocks of 16, 2 of 32.
        let ok = check_rechunk(&ids(&[4, 0, 7]), 8 * sb, &ids(&[1, 0]), 8 * db, &r);
        assert!(ok.is_ok(), "{ok:?}");
        assert!(matches!(
            check_rechunk(&ids(&[4, 0]), 8 * sb, &ids(&[1, 0]), 8 * db, &r),
            Err(PullError::Rechunk(_))
        ));
        assert!(matches!(
            check_rechunk(&ids(&[4, 0, 8]), 8 * sb, &ids(&[1, 0]), 8 * db, &r),
            Err(PullError::OutOfBounds { side: "remote" })
        ));
        assert!(matches!(
            check_rechunk(&ids(&[4, 0, 7]), 8 * sb, &ids(&[1, 8]), 8 * db, &r),
            Err(PullError::OutOfBounds { side: "local" })
        ));
        assert!(matches!(
            check_rechunk(&ids(&[4, 0, 7]), 8 * sb, &ids(&[1, 1]), 8 * db, &r),
            Err(PullError::RepeatedBlock(1))
        ));
        // A peer's layout whose block bytes overflow is out of bounds, not a wrapped size.
        let huge = rechunk_of(layout(16, usize::MAX / 8), layout(32, usize::MAX / 8));
        assert!(matches!(
            check_rechunk(
                &ids(&[0, 1, 2]),
                usize::MAX,
                &ids(&[0, 1]),
                usize::MAX,
                &huge
            ),
            Err(PullError::OutOfBounds { side: "remote" })
        ));
    }
}

//! Copies from a peer's pool that UCX maps into this process (shared memory on one host), on
//! the caller's own thread: the peers' mappings the puller thread shares with its handle, the
//! copy of a small pull without a hand-off to the thread, the copier's wake-up ahead of a copy,
//! and the beat on a mapped lease board.
//!
//! The puller thread owns the remote key that keeps a mapping; it ends the shared [`Mapping`]
//! (waiting out copies in progress) before it destroys that key, so no copy here reads an
//! unmapped pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use pd_kv_pool::BlockId;

use super::{PeerKey, Pulled, Puller};
use crate::copier::{Copier, lock};
use crate::landing::Landing;
use crate::peer::PeerInfo;
use crate::pull::PullError;

/// The largest pull copied on the caller's thread; larger ones go to the puller thread, so an
/// async task never blocks its worker for more than about a millisecond.
pub const DIRECT_COPY_MAX_BYTES: usize = 8 << 20;

/// What a caller needs to copy a pull itself (besides our pool, [`Puller`]'s): the peers' pools
/// mapped here, and the copier. The puller thread adds a peer's [`Mapping`] when it connects and
/// removes it before it destroys the key that keeps the mapping.
pub(super) struct Direct {
    pub(super) mappings: Mutex<HashMap<PeerKey, Arc<Mapping>>>,
    pub(super) copier: Arc<Copier>,
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
pub(super) struct Mapping {
    pub(super) pool: *const u8,
    pub(super) pool_len: usize,
    pub(super) board: Option<(*const u8, u32)>,
    pub(super) alive: RwLock<bool>,
}

// SAFETY: the pointers are only dereferenced while `alive` is held for reading and true, i.e.
// while the key that maps them is alive (see `Mapping`); the mapped memory is plain bytes.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Puller {
    /// A pull copied on this thread from `peer`'s pool, when the puller thread has it mapped
    /// here and the pull is at most [`DIRECT_COPY_MAX_BYTES`]: no hand-off to the puller thread
    /// and back (two thread wake-ups). `None`: not possible here, hand it to the puller thread.
    pub(super) fn copy_here(
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
}

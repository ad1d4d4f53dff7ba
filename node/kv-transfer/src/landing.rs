//! Where pulled blocks go once they are in: a node that computes on a staged pool (a GPU's
//! device memory; `pd-node --kv-staged` on the CPU) uploads each block into it as it lands,
//! from the pull's own thread, so the uploads overlap the rest of the pull and the engine does
//! not copy after it. The node implements [`Landing`] over its engine's uploader; this crate
//! only calls it, in order, for the blocks it wrote.

use pd_kv_pool::BlockId;
use pd_ucx::MemoryRegion;

use crate::pull::PullError;

/// Why a [`Landing`] could not take a pull's blocks (the pull then fails as `staging`).
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct LandingError {
    /// Which call failed.
    pub step: LandingStep,
    /// Why: the node's error (a device's, the compute pool's).
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// The [`Landing`] call that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LandingStep {
    /// [`Landing::begin`].
    Begin,
    /// [`Landing::landed`] of the run starting at this block.
    Landed(BlockId),
    /// [`Landing::settle`].
    Settle,
}

impl LandingError {
    /// `step` failed because of `source`.
    pub fn new(
        step: LandingStep,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            step,
            source: source.into(),
        }
    }
}

/// The next stop of pulled blocks (see the module's doc). One pull calls
/// [`Landing::begin`] once, then [`Landing::landed`] for each block it wrote, each exactly once,
/// in the pull's order, then [`Landing::settle`] — on every way out once it began, so no copy
/// is under way when the pull returns.
pub trait Landing: Send + Sync + std::fmt::Debug {
    /// A pull is about to hand over blocks.
    ///
    /// # Errors
    /// Why the blocks cannot be taken (the pull fails).
    fn begin(&self) -> Result<(), LandingError>;

    /// Local blocks `first`, `first + 1`, … — a run of consecutive blocks, whose bytes are
    /// `bytes` (a whole number of blocks, in order) — are in: nothing writes them any more.
    /// (One call per run, so a device copies a run at once.)
    ///
    /// # Errors
    /// As [`Landing::begin`].
    ///
    /// # Safety
    /// The caller's pull owns those blocks (the engine touches them in neither pool until the
    /// pull returns), and `bytes` stays valid and unchanged until [`Landing::settle`] returned.
    unsafe fn landed(&self, first: BlockId, bytes: &[u8]) -> Result<(), LandingError>;

    /// Returns once everything [`Landing::landed`] started has finished (at once when nothing
    /// began). It may wait for a device: call it outside locks.
    ///
    /// # Errors
    /// As [`Landing::begin`].
    fn settle(&self) -> Result<(), LandingError>;
}

/// [`Landing::landed`] for each run of consecutive blocks of `local`, in order (after `begin`,
/// before `settle`).
///
/// # Errors
/// [`PullError::Landing`], [`PullError::OutOfBounds`].
///
/// # Safety
/// The caller's pull owns every block of `local`, all inside `region`, and written.
pub(crate) unsafe fn land(
    landing: &dyn Landing,
    region: &MemoryRegion,
    local: &[BlockId],
    block_bytes: usize,
) -> Result<(), PullError> {
    let mut rest = local;
    while let Some(&first) = rest.first() {
        let run = 1 + rest
            .windows(2)
            .take_while(|w| w[1].0 == w[0].0.wrapping_add(1))
            .count();
        let (off, len) = (first.index() * block_bytes, run * block_bytes);
        if off + len > region.len() {
            return Err(PullError::OutOfBounds { side: "local" });
        }
        // SAFETY: inside the region (checked); the pull owns these blocks and is done writing
        // them, and keeps them so until the landing settles (per the caller).
        let bytes = unsafe { std::slice::from_raw_parts(region.as_ptr().add(off), len) };
        // SAFETY: as above.
        unsafe { landing.landed(first, bytes) }.map_err(PullError::Landing)?;
        rest = &rest[run..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::copier::Copier;
    use crate::pull::copy_pull_landing;

    /// The test's block size.
    const BLOCK: usize = 256 << 10;

    /// Records what a pull hands on, run by run and block by block; fails at the `fail_at`-th
    /// block if set.
    #[derive(Debug, Default)]
    struct Recorder {
        log: Mutex<Vec<String>>,
        blocks: Mutex<Vec<(BlockId, Vec<u8>)>>,
        fail_at: Option<usize>,
        /// The first byte of the pull's last local block (an address), and what that byte
        /// was when the first block was handed on.
        last_block: usize,
        last_at_first: Mutex<Option<u8>>,
    }

    impl Landing for Recorder {
        fn begin(&self) -> Result<(), LandingError> {
            self.log.lock().unwrap().push("begin".into());
            Ok(())
        }

        unsafe fn landed(&self, first: BlockId, bytes: &[u8]) -> Result<(), LandingError> {
            let mut blocks = self.blocks.lock().unwrap();
            if blocks.is_empty() && self.last_block != 0 {
                // SAFETY: a byte of the test's region; nothing writes it now (the copy of the
                // last part has not begun, or the copy has ended).
                let b = unsafe { *(self.last_block as *const u8) };
                *self.last_at_first.lock().unwrap() = Some(b);
            }
            let mut log = self.log.lock().unwrap();
            log.push(format!("run of {}", bytes.len() / BLOCK));
            for (i, block) in bytes.chunks(BLOCK).enumerate() {
                if Some(blocks.len()) == self.fail_at {
                    return Err(LandingError::new(
                        LandingStep::Landed(first),
                        "the device is on fire",
                    ));
                }
                let b = BlockId(first.0 + i as u32);
                blocks.push((b, block.to_vec()));
                log.push(format!("landed {}", b.0));
            }
            Ok(())
        }

        fn settle(&self) -> Result<(), LandingError> {
            self.log.lock().unwrap().push("settle".into());
            Ok(())
        }
    }

    /// A mapped copy with a landing hands every local block on exactly once, in the pull's
    /// order, holding the peer's bytes (so only once it is in), part by part, between one begin
    /// and one settle; a landing that fails stops the
    /// copy, still settles, and fails the pull as `Landing`.
    #[test]
    fn a_copy_hands_on_each_block_once_in_order_as_its_part_lands() {
        let block_bytes = BLOCK;
        let ctx = pd_ucx::Context::new().unwrap();
        let region = MemoryRegion::allocate(&ctx, 16 * block_bytes).unwrap();
        // SAFETY: the region is ours, 16 blocks long.
        unsafe { std::ptr::write_bytes(region.as_ptr(), 0xee, region.len()) };
        // The peer's pool: block b filled with byte b + 1.
        let peer: Vec<u8> = (0..10)
            .flat_map(|b| std::iter::repeat_n(b as u8 + 1, block_bytes))
            .collect();
        let remote: Vec<BlockId> = [3, 4, 5, 6, 0, 1, 9, 8, 7, 2].map(BlockId).to_vec();
        let local: Vec<BlockId> = [10, 11, 12, 13, 14, 15, 0, 1, 2, 3].map(BlockId).to_vec();
        let copier = Copier::spawn().unwrap();
        let rec = Recorder {
            // Local block 3, the last one pulled.
            last_block: region.as_ptr() as usize + 3 * block_bytes,
            ..Default::default()
        };
        // The pull in parts of 4 blocks, then the settle its caller owes.
        let pull = |landing: &Recorder| {
            // SAFETY: `peer` outlives the call; nothing else touches the region.
            let r = unsafe {
                copy_pull_landing(
                    peer.as_ptr(),
                    peer.len(),
                    &region,
                    &remote,
                    &local,
                    block_bytes,
                    &copier,
                    landing,
                    4,
                )
            };
            landing.settle().unwrap();
            r
        };
        let stats = pull(&rec).unwrap();
        assert_eq!(stats.landed_blocks, 10);
        assert_eq!(
            stats.landed_early, 8,
            "parts of 4, 4 and 2: all but the last early"
        );
        assert_eq!(stats.bytes, 10 * block_bytes);
        let log = rec.log.lock().unwrap().clone();
        // Parts of 4 blocks: [10 11 12 13] [14 15 | 0 1] [2 3], each run of consecutive
        // blocks handed on at once.
        let mut want = vec!["begin".to_string(), "run of 4".into()];
        for (i, b) in local.iter().enumerate() {
            if [4, 6, 8].contains(&i) {
                want.push("run of 2".into());
            }
            want.push(format!("landed {}", b.0));
        }
        want.push("settle".into());
        assert_eq!(log, want);
        assert_eq!(
            *rec.last_at_first.lock().unwrap(),
            Some(0xee),
            "the first part was handed on before the last one was copied"
        );
        for ((b, bytes), r) in rec.blocks.lock().unwrap().iter().zip(&remote) {
            assert!(
                bytes.iter().all(|&x| x == r.0 as u8 + 1),
                "block {b:?} handed on before its bytes were in"
            );
        }

        let failing = Recorder {
            fail_at: Some(5),
            ..Default::default()
        };
        let err = pull(&failing).unwrap_err();
        assert!(
            matches!(err, PullError::Landing(ref m) if m.to_string().contains("on fire")),
            "{err}"
        );
        let log = failing.log.lock().unwrap().clone();
        assert_eq!(log.first().map(String::as_str), Some("begin"));
        assert_eq!(log.last().map(String::as_str), Some("settle"));
        assert_eq!(
            log.len(),
            2 + 2 + 5,
            "stopped at the failing block: {log:?}"
        );
        assert_eq!(
            crate::TransferError::Transfer(err).reason(),
            "staging",
            "counted as its own reason"
        );
    }
}

//! The lease board: one record per live lease, in memory peers read one-sidedly, so a reader
//! confirms its lease with a memory read instead of a round trip to the owner.
//!
//! The board starts with a header of [`BOARD_HEADER_BYTES`], whose first word is the owner's
//! **beat**: its monotonic clock (nanoseconds, the clock the owner states in its handshake) at
//! its latest grant. A reader that finds a recent beat knows the owner was alive a moment ago
//! without asking it (see [`read_record`]).
//!
//! The records follow the header. A record is [`BOARD_SLOT_WORDS`] little-endian `u64` words:
//! `[generation, num_tokens | (next_token + 1) << 32, tokens_digest (low), tokens_digest
//! (high), blocks_hash, next_token_key, lease_tag, deadline]` — one cache line; the lease's
//! generation (0: the slot is free), its
//! [`LeaseContents`], its id folded to 64 bits ([`LeaseId::tag`]), and its deadline on the
//! owner's clock (moved by renewals; `u64::MAX` on a board without a clock). The owner writes a record's
//! contents, then its generation ([`LeaseBoard::publish`], at grant), and clears the generation
//! when the lease ends ([`LeaseBoard::clear`]), *before* the lease's blocks go back to the
//! allocator. Generations are never reused, so a reader that read the blocks and then finds its
//! lease's generation in the record knows the blocks were not handed out meanwhile, and what
//! they hold ([`read_record`]).
//!
//! Pure memory: no I/O, no clock (the owner's clock reaches it as a [`BeatClock`], an anchor
//! the caller read). The board's memory belongs to whoever registered it for peers (UCX); this
//! module only reads and writes it.

use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::time::Instant;

use crate::lease::{LeaseContents, LeaseId};

/// Words per record.
pub const BOARD_SLOT_WORDS: usize = 8;

/// Bytes per record.
pub const BOARD_SLOT_BYTES: usize = BOARD_SLOT_WORDS * 8;

/// Bytes before the first record: the beat, alone on its cache line.
pub const BOARD_HEADER_BYTES: usize = 64;

const HEADER_WORDS: usize = BOARD_HEADER_BYTES / 8;

/// Bytes a board of `slots` records needs (header included).
pub fn board_bytes(slots: usize) -> usize {
    BOARD_HEADER_BYTES + slots * BOARD_SLOT_BYTES
}

/// The owner's monotonic clock, as nanoseconds, anchored to an [`Instant`]: `ns` is the clock's
/// reading at `at` (read together by the caller). Converts the instants the lease table is
/// given into the beats peers compare with the clock the owner's handshake states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BeatClock {
    /// When the clock was read.
    pub at: Instant,
    /// What it read, nanoseconds.
    pub ns: u64,
}

impl BeatClock {
    /// The clock's reading at `t`.
    pub fn ns_at(&self, t: Instant) -> u64 {
        if t >= self.at {
            let ahead = u64::try_from(t.duration_since(self.at).as_nanos()).unwrap_or(u64::MAX);
            self.ns.saturating_add(ahead)
        } else {
            let behind = u64::try_from(self.at.duration_since(t).as_nanos()).unwrap_or(u64::MAX);
            self.ns.saturating_sub(behind)
        }
    }
}

/// The owner's side: records of live leases, with a free list of slots.
pub struct LeaseBoard {
    /// The header's first word; the records follow the header.
    words: std::ptr::NonNull<AtomicU64>,
    slots: u32,
    clock: Option<BeatClock>,
    free: Vec<u32>,
    _owner: Box<dyn std::any::Any + Send>,
}

// SAFETY: the board's memory is only written through `&mut self` (the lease table's owner, under
// its lock) with atomic stores; peers in other processes only read it.
unsafe impl Send for LeaseBoard {}

impl std::fmt::Debug for LeaseBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseBoard")
            .field("slots", &self.slots)
            .field("free", &self.free.len())
            .finish()
    }
}

impl LeaseBoard {
    /// A board over `bytes` bytes at `ptr` (the header, then as many whole records as fit, at
    /// most `u32::MAX`), every slot cleared, beating on `clock` at every grant (`None`: the
    /// beat stays 0, and readers always ask the owner).
    ///
    /// # Safety
    /// `ptr` must be 8-byte aligned and valid for reads and writes of `bytes` bytes for as long as
    /// `owner` lives; nothing else in this process may write it while the board exists (peers may
    /// read it).
    pub unsafe fn from_raw(
        ptr: *mut u8,
        bytes: usize,
        owner: Box<dyn std::any::Any + Send>,
        clock: Option<BeatClock>,
    ) -> Self {
        let aligned = !ptr.is_null() && ptr.cast::<AtomicU64>().is_aligned();
        let slots = if aligned && bytes >= BOARD_HEADER_BYTES {
            u32::try_from((bytes - BOARD_HEADER_BYTES) / BOARD_SLOT_BYTES).unwrap_or(u32::MAX)
        } else {
            0
        };
        let words = std::ptr::NonNull::new(ptr.cast::<AtomicU64>())
            .filter(|_| aligned)
            .unwrap_or(std::ptr::NonNull::dangling());
        let board = Self {
            words,
            slots,
            clock,
            // Lowest slots first (popped from the end).
            free: (0..slots).rev().collect(),
            _owner: owner,
        };
        if slots > 0 {
            board.header(0).store(0, Ordering::Relaxed);
        }
        for i in 0..slots as usize * BOARD_SLOT_WORDS {
            board.word(i).store(0, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        board
    }

    /// Word `i` of the records (past the header).
    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < self.slots as usize * BOARD_SLOT_WORDS);
        // SAFETY: `i` is within the board (callers index slots < `self.slots`), the memory is
        // valid and aligned (`from_raw`).
        unsafe { &*self.words.as_ptr().add(HEADER_WORDS + i) }
    }

    /// Word `i` of the header (only called on a board with records, so the header is there).
    fn header(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < HEADER_WORDS && self.slots > 0);
        // SAFETY: a board with records has its whole header (`from_raw`).
        unsafe { &*self.words.as_ptr().add(i) }
    }

    /// Records in all.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Free records.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Publishes lease `id` of `generation` (non-zero) holding `contents` in a free slot,
    /// granted at `now` (the beat) until `deadline`; `None` when the board is full (the lease is
    /// then confirmed by asking the owner).
    pub fn publish(
        &mut self,
        generation: u64,
        id: LeaseId,
        contents: &LeaseContents,
        now: Instant,
        deadline: Instant,
    ) -> Option<u32> {
        if generation == 0 {
            return None;
        }
        let slot = self.free.pop()?;
        let at = slot as usize * BOARD_SLOT_WORDS;
        let next = contents.next_token.map_or(0, |t| u64::from(t) + 1);
        self.word(at + 1).store(
            u64::from(contents.num_tokens) | next << 32,
            Ordering::Relaxed,
        );
        self.word(at + 2)
            .store(contents.tokens_digest as u64, Ordering::Relaxed);
        self.word(at + 3)
            .store((contents.tokens_digest >> 64) as u64, Ordering::Relaxed);
        self.word(at + 4)
            .store(contents.blocks_hash, Ordering::Relaxed);
        self.word(at + 5)
            .store(contents.next_token_key, Ordering::Relaxed);
        self.word(at + 6).store(id.tag(), Ordering::Relaxed);
        self.word(at + 7)
            .store(self.clock_ns(deadline), Ordering::Relaxed);
        // Contents before the generation that vouches for them.
        self.word(at).store(generation, Ordering::Release);
        if let Some(clock) = self.clock {
            // Never backwards (grants may come with instants a little out of order).
            self.header(0)
                .fetch_max(clock.ns_at(now), Ordering::Release);
        }
        Some(slot)
    }

    /// The lease in `slot` was renewed: it now lasts until `deadline`.
    pub fn extend(&mut self, slot: u32, deadline: Instant) {
        if slot >= self.slots {
            return;
        }
        let ns = self.clock_ns(deadline);
        self.word(slot as usize * BOARD_SLOT_WORDS + 7)
            .store(ns, Ordering::Release);
    }

    /// `t` on the owner's clock; `u64::MAX` without one (readers then never judge by it).
    fn clock_ns(&self, t: Instant) -> u64 {
        self.clock.map_or(u64::MAX, |c| c.ns_at(t))
    }

    /// Clears `slot` (its lease ended) and frees it. Call before the lease's blocks go back to
    /// the allocator: once this returns, a reader no longer finds the lease live.
    pub fn clear(&mut self, slot: u32) {
        if slot >= self.slots {
            return;
        }
        self.word(slot as usize * BOARD_SLOT_WORDS)
            .store(0, Ordering::SeqCst);
        // The blocks' next writes (after the caller frees them) come after this store.
        fence(Ordering::SeqCst);
        self.free.push(slot);
    }
}

/// A record as a reader found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoardRecord {
    /// The generation of the lease in the slot (0: none).
    pub generation: u64,
    /// What its blocks hold.
    pub contents: LeaseContents,
    /// Its id folded to 64 bits ([`LeaseId::tag`]).
    pub lease_tag: u64,
    /// Its deadline on the owner's clock (nanoseconds; `u64::MAX` on a board without a clock).
    /// The owner ends a lease some time after its deadline passed (its next housekeeping), so
    /// a reader that confirms on the board checks the deadline itself.
    pub deadline: u64,
    /// The board's beat, read after the record: the owner's clock (nanoseconds) at its latest
    /// grant, 0 when it never beat. Not part of the record: it says when the owner was last
    /// seen alive, whichever lease it granted then.
    pub beat: u64,
}

/// The beat of a board whose memory (header included) is mapped at `base`: the owner's clock at
/// its latest grant, 0 when it never beat (or `base` is not aligned).
///
/// # Safety
/// As [`read_record`], for the header.
pub unsafe fn read_beat(base: *const u8) -> u64 {
    if !base.cast::<AtomicU64>().is_aligned() {
        return 0;
    }
    // SAFETY: aligned (checked above), valid per the caller.
    unsafe { &*base.cast::<AtomicU64>() }.load(Ordering::Acquire)
}

/// Reads record `slot` of a board whose memory (header included) is mapped at `base` (`slots`
/// records), after the reads of the lease's blocks completed: a consistent record with the
/// board's beat, or `None` when the slot is outside the board or kept changing under the read.
///
/// The generation is read before and after the contents; when both equal the same non-zero
/// generation, the record is that lease's and the lease had not ended when the second read
/// happened — so blocks read before this call were the lease's, untouched.
///
/// # Safety
/// `base` must be 8-byte aligned and valid for reads of `slots` records for the duration of the
/// call (a peer's board mapped into this process, e.g. through UCX's `rkey_ptr`).
pub unsafe fn read_record(base: *const u8, slots: u32, slot: u32) -> Option<BoardRecord> {
    if slot >= slots || !base.cast::<AtomicU64>().is_aligned() {
        return None;
    }
    // SAFETY: within the board, aligned (checked above), valid per the caller.
    let beat = unsafe { &*base.cast::<AtomicU64>() };
    // SAFETY: as above.
    let words = unsafe {
        base.cast::<AtomicU64>()
            .add(HEADER_WORDS + slot as usize * BOARD_SLOT_WORDS)
    };
    // SAFETY: as above, for each of the record's words.
    let word = |i: usize| unsafe { &*words.add(i) };
    // Order against the block reads that completed before this call.
    fence(Ordering::SeqCst);
    for _ in 0..4 {
        let generation = word(0).load(Ordering::Acquire);
        let w1 = word(1).load(Ordering::Relaxed);
        let digest_low = word(2).load(Ordering::Relaxed);
        let digest_high = word(3).load(Ordering::Relaxed);
        let blocks_hash = word(4).load(Ordering::Relaxed);
        let next_token_key = word(5).load(Ordering::Relaxed);
        let lease_tag = word(6).load(Ordering::Relaxed);
        let deadline = word(7).load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if word(0).load(Ordering::Relaxed) != generation {
            continue;
        }
        let next = w1 >> 32;
        return Some(BoardRecord {
            generation,
            contents: LeaseContents {
                num_tokens: w1 as u32,
                tokens_digest: u128::from(digest_low) | u128::from(digest_high) << 64,
                blocks_hash,
                next_token: (next != 0).then(|| (next - 1) as u32),
                next_token_key,
            },
            lease_tag,
            deadline,
            beat: beat.load(Ordering::Acquire),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contents of blocks holding `tokens`, under a test key.
    fn of(tokens: &[u32]) -> LeaseContents {
        LeaseContents::of(&crate::BindingKey::from_cluster_token("t"), tokens)
    }

    fn board(slots: usize, clock: Option<BeatClock>) -> (LeaseBoard, *const u8) {
        let mut mem = vec![0u64; board_bytes(slots) / 8].into_boxed_slice();
        let ptr = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: the boxed slice is aligned, sized and owned by the board.
        let b = unsafe { LeaseBoard::from_raw(ptr, board_bytes(slots), Box::new(mem), clock) };
        (b, ptr)
    }

    #[test]
    fn a_published_record_reads_back_until_cleared_and_slots_are_reused() {
        let (mut b, base) = board(2, None);
        let now = Instant::now();
        let c = of(&[1, 2, 3])
            .in_blocks(&[crate::BlockId(4)])
            .with_next_token(Some(0), 0xfeed_beef);
        let id = LeaseId(0x1234_0000_0000_0000_0000_0000_0000_5678);
        let s = b.publish(7, id, &c, now, now).unwrap();
        let slots = b.slots();
        // SAFETY: `base` is the board's memory, alive while `b` is.
        let read = |slot| unsafe { read_record(base, slots, slot) };
        assert_eq!(
            read(s),
            Some(BoardRecord {
                generation: 7,
                contents: c,
                lease_tag: 0x1234_0000_0000_5678,
                deadline: u64::MAX,
                beat: 0,
            })
        );
        let s2 = b.publish(8, id, &of(&[9]), now, now).unwrap();
        assert_ne!(s, s2);
        assert_eq!(b.publish(9, id, &c, now, now), None, "full");
        b.clear(s);
        assert_eq!(read(s).map(|r| r.generation), Some(0));
        // The slot comes back, under a new generation and contents.
        let s3 = b.publish(10, LeaseId(3), &of(&[5]), now, now).unwrap();
        assert_eq!(s3, s);
        let r = read(s3).unwrap();
        assert_eq!(r.generation, 10);
        assert_eq!(r.contents, of(&[5]));
        assert_eq!(r.lease_tag, 3);
        assert_eq!(read(5), None, "outside the board");
    }

    /// The beat is the owner's clock at its latest grant, on the clock the caller anchored; it
    /// never goes back, and clearing a record leaves it. A record's deadline is on that clock
    /// too, and renewals move it.
    #[test]
    fn the_beat_is_the_owners_clock_at_its_latest_grant() {
        let t0 = Instant::now();
        let clock = BeatClock {
            at: t0,
            ns: 5_000_000_000,
        };
        let (mut b, base) = board(4, Some(clock));
        let slots = b.slots();
        assert_eq!(slots, 4);
        // SAFETY: `base` is the board's memory, alive while `b` is.
        let read = |slot| unsafe { read_record(base, slots, slot) }.unwrap();
        let c = of(&[1]);
        let later = t0 + std::time::Duration::from_millis(7);
        let s = b
            .publish(
                1,
                LeaseId(1),
                &c,
                later,
                later + std::time::Duration::from_secs(2),
            )
            .unwrap();
        assert_eq!(read(s).beat, 5_007_000_000);
        assert_eq!(
            read(s).deadline,
            7_007_000_000,
            "the deadline on the same clock"
        );
        b.extend(s, t0 + std::time::Duration::from_secs(9));
        assert_eq!(read(s).deadline, 14_000_000_000, "renewed");
        // SAFETY: as above.
        assert_eq!(unsafe { read_beat(base) }, 5_007_000_000);
        // An earlier instant (a grant racing another) does not move it back.
        let s2 = b.publish(2, LeaseId(2), &c, t0, t0).unwrap();
        assert_eq!(read(s2).beat, 5_007_000_000);
        b.clear(s);
        assert_eq!(read(s).beat, 5_007_000_000, "a record's end is no beat");
        assert_eq!(read(s).generation, 0);
        // The beat sits in the header: it never overlaps the first record.
        assert_eq!(read(s2).contents, c);
        assert_eq!(
            clock.ns_at(t0 - std::time::Duration::from_nanos(10)),
            4_999_999_990
        );
    }
}

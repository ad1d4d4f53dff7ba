//! Leases: blocks handed to a peer stay untouched until the peer says it is done or the lease
//! expires.
//!
//! A lease holds one allocator reference on each of its blocks, so a leased block is never on
//! the free list and never reused while the lease lives. The table does not touch the allocator:
//! the caller hands a reference over at [`LeaseTable::grant`] and drops the references of every
//! lease [`LeaseTable::release`] and [`LeaseTable::expire`] return. That lets the table live
//! behind its own lock (answering a peer at once) while the allocator stays with the one thread
//! that owns it. Ids are 128-bit random (unguessable: a
//! peer cannot read blocks leased to someone else by guessing). Each grant also gets a fresh
//! generation number, so a stale `(id, generation)` pair is told apart from a live one.
//!
//! The table never reads the clock: every call takes `now`.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use crate::board::LeaseBoard;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

#[cfg(doc)]
use crate::allocator::BlockAllocator;
use crate::allocator::BlockId;

/// Unguessable lease id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(pub u128);

impl LeaseId {
    /// The id folded to 64 bits, as the lease board records it: a reader that confirms a lease
    /// on the board checks the lease it names is the one in the record, without the board
    /// showing the ids themselves.
    pub fn tag(&self) -> u64 {
        (self.0 as u64) ^ ((self.0 >> 64) as u64)
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl std::str::FromStr for LeaseId {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u128::from_str_radix(s, 16).map(LeaseId)
    }
}

/// Why a lease operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// No lease with this id (never granted, released, or expired and collected).
    #[error("unknown lease {0}")]
    Unknown(LeaseId),
    /// The id exists but with another generation: the caller holds a stale reference.
    #[error("stale lease {id}: generation {given}, live generation {live}")]
    Stale {
        /// The lease.
        id: LeaseId,
        /// Generation the caller gave.
        given: u64,
        /// Generation of the live lease.
        live: u64,
    },
    /// The deadline passed.
    #[error("lease {0} expired")]
    Expired(LeaseId),
    /// The lease belongs to another peer.
    #[error("lease {id} is not granted to peer {peer}")]
    WrongPeer {
        /// The lease.
        id: LeaseId,
        /// The peer that asked.
        peer: String,
    },
}

/// What a lease's blocks hold, as their owner computed them: `num_tokens` token ids bound with
/// [`crate::prompt_binding`]. The owner tells a reader on confirm, so the reader can check the
/// blocks hold its own prompt: request params are forgeable, the owner is not.
/// All zero: the owner does not say (not attested).
///
/// The owner also binds the lease to its block ids (`blocks_hash`): a reader checks that the
/// blocks it read are the lease's, so params splicing one lease's id with another's blocks are
/// caught.
///
/// A prefill's handoff of a greedy request also carries `next_token`: the token the owner
/// sampled (argmax) right after those tokens, i.e. the completion's first token. A reader whose
/// own request is greedy emits it instead of computing the last prompt position again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseContents {
    /// Tokens the blocks hold.
    pub num_tokens: u32,
    /// [`crate::prompt_binding`] of the tokens under the cluster's key (0: the owner does not
    /// say).
    pub tokens_digest: u128,
    /// [`blocks_hash`] of the lease's block ids, in order (0: the owner does not say).
    pub blocks_hash: u64,
    /// The token after `num_tokens` (a prefill's first token), when the owner says.
    pub next_token: Option<u32>,
    /// How `next_token` was chosen: 0 for the argmax (good for any greedy reader), else a key
    /// of the sampling parameters and seed it was drawn with (good only for a reader whose own
    /// parameters give the same key). Opaque here; the engine computes it.
    pub next_token_key: u64,
}

impl LeaseContents {
    /// The contents of blocks holding `tokens`, bound to them under `key`.
    pub fn of(key: &crate::BindingKey, tokens: &[u32]) -> Self {
        Self {
            num_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            tokens_digest: crate::prompt_binding(key, tokens),
            blocks_hash: 0,
            next_token: None,
            next_token_key: 0,
        }
    }

    /// The same, held in `blocks` (in order).
    #[must_use]
    pub fn in_blocks(self, blocks: &[BlockId]) -> Self {
        Self {
            blocks_hash: blocks_hash(blocks),
            ..self
        }
    }

    /// The same, saying that `token` is the token after them, chosen as `key` says (see
    /// [`LeaseContents::next_token_key`]).
    #[must_use]
    pub fn with_next_token(self, token: Option<u32>, key: u64) -> Self {
        Self {
            next_token: token,
            next_token_key: if token.is_some() { key } else { 0 },
            ..self
        }
    }

    /// Whether the owner said what the blocks hold.
    pub fn attested(&self) -> bool {
        self.num_tokens != 0 || self.tokens_digest != 0
    }

    /// Whether `self` and `other` say the same tokens are held in the same blocks
    /// (`next_token` aside; blocks are compared only when both say; the bindings in constant
    /// time).
    pub fn same_contents(&self, other: &Self) -> bool {
        self.num_tokens == other.num_tokens
            && crate::bindings_equal(self.tokens_digest, other.tokens_digest)
            && (self.blocks_hash == 0
                || other.blocks_hash == 0
                || self.blocks_hash == other.blocks_hash)
    }
}

/// Whether every block of `asked` is one of `leased` (a lease's blocks).
pub fn lease_covers(leased: &[BlockId], asked: &[BlockId]) -> bool {
    let mut sorted: Vec<u32> = leased.iter().map(|b| b.0).collect();
    sorted.sort_unstable();
    asked.iter().all(|b| sorted.binary_search(&b.0).is_ok())
}

/// A lease's block ids, hashed in order (xxh3 of their little-endian bytes; never 0).
pub fn blocks_hash(blocks: &[BlockId]) -> u64 {
    let mut bytes = Vec::with_capacity(blocks.len() * 4);
    for b in blocks {
        bytes.extend_from_slice(&b.0.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes).max(1)
}

/// A live lease.
#[derive(Debug, Clone)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// Generation at grant.
    pub generation: u64,
    /// Engine id of the peer allowed to read the blocks (empty: any registered peer).
    pub peer: String,
    /// The leased blocks, in the order they were handed out.
    pub blocks: Vec<BlockId>,
    /// What they hold, as the owner computed it.
    pub contents: LeaseContents,
    /// When it ends unless renewed.
    pub deadline: Instant,
    /// How long it was granted for (a renewal extends by 2/3 of it).
    pub duration: Duration,
    /// Its record on the table's [`LeaseBoard`], if it has one (readers confirm it there).
    pub slot: Option<u32>,
}

/// Counters of what happened to leases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseCounts {
    /// Leases granted.
    pub granted: u64,
    /// Successful renewals.
    pub renewed: u64,
    /// Successful confirmations asked of the owner ([`LeaseTable::confirm`]; a reader that
    /// confirmed on the lease board alone asked nothing).
    pub confirmed: u64,
    /// Leases released by their peer.
    pub released: u64,
    /// Leases that reached their deadline.
    pub expired: u64,
    /// Leases their owner took back before the deadline (it needed the blocks).
    pub revoked: u64,
}

/// All leases of one node.
#[derive(Debug)]
pub struct LeaseTable {
    duration: Duration,
    leases: HashMap<LeaseId, Lease>,
    next_generation: u64,
    rng: ChaCha20Rng,
    counts: LeaseCounts,
    board: Option<LeaseBoard>,
}

impl LeaseTable {
    /// An empty table whose leases last `duration` (vLLM's `kv_lease_duration`, default 30 s).
    /// `seed` feeds the id generator; pass OS randomness (e.g. `rand::random()`) in production.
    pub fn new(duration: Duration, seed: [u8; 32]) -> Self {
        Self {
            duration,
            leases: HashMap::new(),
            next_generation: 1,
            rng: ChaCha20Rng::from_seed(seed),
            counts: LeaseCounts::default(),
            board: None,
        }
    }

    /// Publishes leases granted from now on on `board` (peers confirm them there), and clears
    /// each one's record when it ends, before its blocks are handed back.
    pub fn attach_board(&mut self, board: LeaseBoard) {
        self.board = Some(board);
    }

    /// Ends `lease` on the board (if it is there).
    fn unpublish(&mut self, lease: &Lease) {
        if let (Some(board), Some(slot)) = (self.board.as_mut(), lease.slot) {
            board.clear(slot);
        }
    }

    /// Lease duration.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// How often a holder should renew: every duration / 6.
    pub fn renew_interval(&self) -> Duration {
        self.duration / 6
    }

    /// Live leases.
    pub fn live(&self) -> usize {
        self.leases.len()
    }

    /// Blocks held by live leases (a block leased twice counts twice).
    pub fn leased_blocks(&self) -> usize {
        self.leases.values().map(|l| l.blocks.len()).sum()
    }

    /// Distinct blocks held by the live leases `counted` keeps: what they pin of the pool (a
    /// block two leases share counts once).
    pub fn held_blocks(&self, counted: impl Fn(&Lease) -> bool) -> usize {
        let mut held = std::collections::HashSet::new();
        for l in self.leases.values().filter(|l| counted(l)) {
            held.extend(l.blocks.iter().copied());
        }
        held.len()
    }

    /// What happened so far.
    pub fn counts(&self) -> LeaseCounts {
        self.counts
    }

    /// Grants `peer` a lease on `blocks`, which hold `contents`. The caller hands over one
    /// allocator reference per block (e.g. taken with [`BlockAllocator::share`]); it is dropped
    /// when the lease ends.
    pub fn grant(
        &mut self,
        blocks: Vec<BlockId>,
        contents: LeaseContents,
        peer: &str,
        now: Instant,
    ) -> Lease {
        let duration = self.duration;
        self.grant_for(blocks, contents, peer, now, duration)
    }

    /// As [`LeaseTable::grant`], for `duration` instead of the table's.
    pub fn grant_for(
        &mut self,
        blocks: Vec<BlockId>,
        contents: LeaseContents,
        peer: &str,
        now: Instant,
        duration: Duration,
    ) -> Lease {
        let mut id = LeaseId(self.rng.random());
        while self.leases.contains_key(&id) {
            id = LeaseId(self.rng.random());
        }
        let generation = self.next_generation;
        // A lease bound to one peer is not put on the board: only the owner checks who asks.
        let slot = self
            .board
            .as_mut()
            .filter(|_| peer.is_empty())
            .and_then(|b| b.publish(generation, id, &contents, now, now + duration));
        let lease = Lease {
            id,
            generation,
            peer: peer.to_string(),
            blocks,
            contents,
            deadline: now + duration,
            duration,
            slot,
        };
        self.next_generation += 1;
        self.counts.granted += 1;
        self.leases.insert(id, lease.clone());
        lease
    }

    /// The live lease `(id, generation)`, checked against `peer` when the lease names one.
    ///
    /// # Errors
    /// [`LeaseError`] saying why it is not live.
    pub fn check(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        now: Instant,
    ) -> Result<&Lease, LeaseError> {
        let l = self.leases.get(&id).ok_or(LeaseError::Unknown(id))?;
        if l.generation != generation {
            return Err(LeaseError::Stale {
                id,
                given: generation,
                live: l.generation,
            });
        }
        if l.deadline <= now {
            return Err(LeaseError::Expired(id));
        }
        if !l.peer.is_empty() && l.peer != peer {
            return Err(LeaseError::WrongPeer {
                id,
                peer: peer.to_string(),
            });
        }
        Ok(l)
    }

    /// [`LeaseTable::check`] for a reader that asks the owner to confirm the lease, counted
    /// when it is live.
    ///
    /// # Errors
    /// As [`LeaseTable::check`].
    pub fn confirm(
        &mut self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        now: Instant,
    ) -> Result<&Lease, LeaseError> {
        self.check(id, generation, peer, now)?;
        self.counts.confirmed += 1;
        self.leases.get(&id).ok_or(LeaseError::Unknown(id))
    }

    /// Extends a live lease to at least `now + 2/3 ×` its duration; returns the new deadline.
    ///
    /// # Errors
    /// [`LeaseError`] when the lease is not live (an expired lease cannot be revived).
    pub fn renew(
        &mut self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        now: Instant,
    ) -> Result<Instant, LeaseError> {
        self.check(id, generation, peer, now)?;
        let l = self.leases.get_mut(&id).ok_or(LeaseError::Unknown(id))?;
        l.deadline = l.deadline.max(now + l.duration * 2 / 3);
        if let (Some(board), Some(slot)) = (self.board.as_mut(), l.slot) {
            board.extend(slot, l.deadline);
        }
        self.counts.renewed += 1;
        Ok(l.deadline)
    }

    /// The peer is done with the blocks: ends the lease. The caller must drop one reference on
    /// each of the returned lease's blocks.
    ///
    /// # Errors
    /// [`LeaseError`] when the lease is not live (expired leases were already ended).
    #[must_use = "the returned lease's block references must be dropped"]
    pub fn release(
        &mut self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        now: Instant,
    ) -> Result<Lease, LeaseError> {
        self.check(id, generation, peer, now)?;
        let l = self.leases.remove(&id).ok_or(LeaseError::Unknown(id))?;
        self.unpublish(&l);
        self.counts.released += 1;
        Ok(l)
    }

    /// The owner takes lease `id` back before its deadline (whoever holds it): from now on it is
    /// unknown, so a reader's confirm fails and data read meanwhile is discarded. The caller
    /// must drop one reference on each block of the returned lease. `None`: not live.
    #[must_use = "the returned lease's block references must be dropped"]
    pub fn revoke(&mut self, id: LeaseId) -> Option<Lease> {
        let l = self.leases.remove(&id)?;
        self.unpublish(&l);
        self.counts.revoked += 1;
        Some(l)
    }

    /// Whether lease `id` is in the table (live, or past its deadline and not yet expired).
    pub fn contains(&self, id: LeaseId) -> bool {
        self.leases.contains_key(&id)
    }

    /// Lease `id` as the table holds it, unchecked (owner-side bookkeeping).
    pub fn get(&self, id: LeaseId) -> Option<&Lease> {
        self.leases.get(&id)
    }

    /// Ends every lease whose deadline is at or before `now`; the caller must drop one reference
    /// on each block of each returned lease.
    #[must_use = "the returned leases' block references must be dropped"]
    pub fn expire(&mut self, now: Instant) -> Vec<Lease> {
        let gone: Vec<LeaseId> = self
            .leases
            .values()
            .filter(|l| l.deadline <= now)
            .map(|l| l.id)
            .collect();
        let mut out = Vec::with_capacity(gone.len());
        for id in gone {
            if let Some(l) = self.leases.remove(&id) {
                self.unpublish(&l);
                self.counts.expired += 1;
                out.push(l);
            }
        }
        out
    }

    /// Earliest deadline of any live lease (when to call [`LeaseTable::expire`] next).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.leases.values().map(|l| l.deadline).min()
    }
}

/// A monotonic `deadline` as wall-clock time, for peers in other processes: `now` and `wall`
/// are the two clocks read at the same moment by the caller (this crate reads no clock).
pub fn deadline_on_wall_clock(deadline: Instant, now: Instant, wall: SystemTime) -> SystemTime {
    if deadline >= now {
        wall + (deadline - now)
    } else {
        wall - (now - deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::allocator::BlockAllocator;

    #[test]
    fn deadlines_move_to_the_wall_clock_by_their_distance_from_now() {
        let (now, wall) = (
            Instant::now(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(1000),
        );
        let ahead = now + Duration::from_millis(2500);
        assert_eq!(
            deadline_on_wall_clock(ahead, now, wall),
            wall + Duration::from_millis(2500)
        );
        let later = now + Duration::from_secs(3);
        assert_eq!(
            deadline_on_wall_clock(now, later, wall),
            wall - Duration::from_secs(3)
        );
    }

    /// Grants like a node does: one reference handed over per block.
    fn grant(
        a: &mut BlockAllocator,
        t: &mut LeaseTable,
        blocks: &[BlockId],
        peer: &str,
        now: Instant,
    ) -> Lease {
        for &b in blocks {
            a.share(b);
        }
        t.grant(blocks.to_vec(), LeaseContents::default(), peer, now)
    }

    fn free_all(a: &mut BlockAllocator, leases: &[Lease]) {
        for l in leases {
            for &b in &l.blocks {
                a.free(b);
            }
        }
    }

    fn setup() -> (BlockAllocator, LeaseTable, Vec<BlockId>, Instant) {
        let mut a = BlockAllocator::new(4);
        let blocks = vec![a.allocate().unwrap(), a.allocate().unwrap()];
        (
            a,
            LeaseTable::new(Duration::from_secs(30), [7; 32]),
            blocks,
            Instant::now(),
        )
    }

    /// Every way a lease ends clears its board record before the caller gets the blocks back,
    /// and a live lease's record says what it holds.
    #[test]
    fn the_board_shows_exactly_the_live_leases() {
        let (mut a, mut t, blocks, now) = setup();
        let mut mem = vec![0u64; crate::board_bytes(4) / 8].into_boxed_slice();
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: the boxed slice is aligned and sized for 4 records and owned by the board.
        let board =
            unsafe { LeaseBoard::from_raw(base, crate::board_bytes(4), Box::new(mem), None) };
        t.attach_board(board);
        // SAFETY: the board's memory lives in `t` for the rest of the test.
        let record = |slot| unsafe { crate::read_record(base, 4, slot) }.unwrap();
        let contents = LeaseContents::of(&crate::BindingKey::from_cluster_token("t"), &[1, 2, 3])
            .in_blocks(&blocks);
        let mut live = Vec::new();
        for _ in 0..3 {
            for &b in &blocks {
                a.share(b);
            }
            live.push(t.grant(blocks.clone(), contents, "", now));
        }
        for l in &live {
            let r = record(l.slot.expect("a slot"));
            assert_eq!((r.generation, r.contents), (l.generation, contents));
            assert_eq!(r.lease_tag, l.id.tag());
        }
        let released = t.release(live[0].id, live[0].generation, "", now).unwrap();
        assert_eq!(record(live[0].slot.unwrap()).generation, 0);
        let revoked = t.revoke(live[1].id).unwrap();
        assert_eq!(record(live[1].slot.unwrap()).generation, 0);
        let expired = t.expire(now + Duration::from_secs(31));
        assert_eq!(record(live[2].slot.unwrap()).generation, 0);
        free_all(&mut a, &[released, revoked]);
        free_all(&mut a, &expired);
        // A slot comes back under a new generation, never an old one.
        for &b in &blocks {
            a.share(b);
        }
        let again = t.grant(blocks.clone(), contents, "", now);
        assert!(again.generation > live[2].generation);
        assert_eq!(record(again.slot.unwrap()).generation, again.generation);
        // The record names the lease; renewing keeps it (and would move its deadline: `u64::MAX`
        // on this board without a clock; `board.rs` checks the clocked case).
        t.renew(again.id, again.generation, "", now).unwrap();
        let r = record(again.slot.unwrap());
        assert_eq!((r.lease_tag, r.deadline), (again.id.tag(), u64::MAX));
        // A lease bound to one peer stays off the board: only the owner checks who asks.
        for &b in &blocks {
            a.share(b);
        }
        let bound = t.grant(blocks.clone(), contents, "d1", now);
        assert_eq!(bound.slot, None);
    }

    #[test]
    fn leased_blocks_outlive_their_owner_until_release() {
        let (mut a, mut t, blocks, now) = setup();
        let l = grant(&mut a, &mut t, &blocks, "d1", now);
        assert_eq!(t.leased_blocks(), 2);
        // The sequence that computed them finishes and frees its references.
        for &b in &blocks {
            a.free(b);
        }
        assert_eq!(a.num_free(), 2, "leased blocks must not be free");
        let got: Vec<_> = (0..2).map(|_| a.allocate().unwrap()).collect();
        assert!(got.iter().all(|b| !blocks.contains(b)));
        assert!(a.allocate().is_err());
        let l = t.release(l.id, l.generation, "d1", now).unwrap();
        free_all(&mut a, &[l]);
        assert_eq!(a.num_free(), 2);
        assert_eq!(t.counts().released, 1);
        assert_eq!(t.leased_blocks(), 0);
    }

    #[test]
    fn expiry_frees_and_counts_and_renewal_extends() {
        let (mut a, mut t, blocks, now) = setup();
        let l = grant(&mut a, &mut t, &blocks, "d1", now);
        for &b in &blocks {
            a.free(b);
        }
        // Renew at 25 s: deadline becomes 25 + 20 = 45 s, past the first deadline of 30 s.
        let d = t
            .renew(l.id, l.generation, "d1", now + Duration::from_secs(25))
            .unwrap();
        assert_eq!(d, now + Duration::from_secs(45));
        assert!(t.expire(now + Duration::from_secs(31)).is_empty());
        assert!(
            t.check(l.id, l.generation, "d1", now + Duration::from_secs(31))
                .is_ok()
        );
        let gone = t.expire(now + Duration::from_secs(45));
        assert_eq!(gone.len(), 1);
        free_all(&mut a, &gone);
        assert_eq!(a.num_free(), 4);
        assert_eq!(t.counts().expired, 1);
        assert_eq!(
            t.renew(l.id, l.generation, "d1", now + Duration::from_secs(46)),
            Err(LeaseError::Unknown(l.id))
        );
    }

    /// Only a confirmation of a live lease counts; a refused one does not.
    #[test]
    fn confirmations_count_only_live_leases() {
        let (mut a, mut t, blocks, now) = setup();
        let l = grant(&mut a, &mut t, &blocks, "d1", now);
        assert!(t.confirm(l.id, l.generation, "d1", now).is_ok());
        assert!(t.confirm(l.id, l.generation + 1, "d1", now).is_err());
        assert!(t.confirm(l.id, l.generation, "d2", now).is_err());
        assert!(t.check(l.id, l.generation, "d1", now).is_ok());
        assert_eq!(t.counts().confirmed, 1);
    }

    #[test]
    fn stale_wrong_peer_and_expired_are_refused() {
        let (mut a, mut t, blocks, now) = setup();
        let l = grant(&mut a, &mut t, &blocks, "d1", now);
        assert!(matches!(
            t.check(l.id, l.generation + 1, "d1", now),
            Err(LeaseError::Stale { .. })
        ));
        assert!(matches!(
            t.check(l.id, l.generation, "d2", now),
            Err(LeaseError::WrongPeer { .. })
        ));
        assert_eq!(
            t.check(l.id, l.generation, "d1", now + Duration::from_secs(30))
                .err(),
            Some(LeaseError::Expired(l.id))
        );
        assert!(matches!(
            t.release(l.id, l.generation, "d1", now + Duration::from_secs(31)),
            Err(LeaseError::Expired(_))
        ));
    }

    #[test]
    fn ids_are_distinct_and_round_trip_as_hex() {
        let (mut a, mut t, blocks, now) = setup();
        let x = grant(&mut a, &mut t, &blocks, "", now);
        let y = grant(&mut a, &mut t, &blocks, "", now);
        assert_ne!(x.id, y.id);
        assert_ne!(x.generation, y.generation);
        assert_eq!(x.id.to_string().parse::<LeaseId>().unwrap(), x.id);
        assert_eq!(x.id.to_string().len(), 32);
    }
}

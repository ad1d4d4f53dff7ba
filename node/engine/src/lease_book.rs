//! The leases this node granted on its blocks (as a prefill node), shared between the engine
//! thread and the side channel that answers peers.
//!
//! Split of duties, so no block is ever touched by two threads:
//! - The lease table lives here, behind one small lock: a peer's renew / confirm / release is
//!   answered at once, without waiting for the engine to finish a step.
//! - Block references stay with the engine thread's allocator. A grant hands one reference per
//!   block over to the lease (taken by the engine before [`LeaseBook::grant`]). A release or an
//!   expiry only moves the lease's blocks to `to_free`; the engine drops those references at its
//!   next loop turn ([`LeaseBook::collect`]). Until then the blocks stay referenced, so a block
//!   under a live lease — or just released — is never reused early.
//!
//! Two kinds of lease share the table: a prefill's handoff to decode nodes, which only its
//! reader or the deadline ends, and a finished conversation turn kept for the next turn
//! (*retained*, `--kv-retain-after-decode`), which the engine may also revoke when it needs the
//! blocks ([`LeaseBook::revoke_oldest_retained`]): evicted before anything is preempted.
//!
//! A handoff lease may be tagged with the gateway its request came through; when that gateway
//! leaves (its registry stream ended), [`LeaseBook::release_gateway`] releases its leases as
//! their readers would: nobody will hand them to a decode node any more. Retained leases are
//! never tagged: a conversation's next turn may come through any gateway.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_kv_pool::{BlockId, Lease, LeaseContents, LeaseCounts, LeaseError, LeaseId, LeaseTable};

/// Live leases and their counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Leases live now.
    pub live: usize,
    /// Of those, retained conversation turns.
    pub retained: usize,
    /// Blocks held by retained leases (not in `leased_blocks`: revocable, so they do not count
    /// against `kv_max_leased_fraction`).
    pub retained_blocks: usize,
    /// Blocks held by the live leases for decode nodes, each once however many leases share it
    /// (what counts against `kv_max_leased_fraction`).
    pub leased_blocks: usize,
    /// Lifetime counters.
    pub counts: LeaseCounts,
    /// Leases released because the gateway they were granted for left
    /// ([`crate::EngineHandle::release_gateway_leases`]; also counted in `counts.released`).
    pub gateway_left: u64,
}

#[derive(Debug)]
struct Book {
    table: LeaseTable,
    /// Blocks of ended leases whose references the engine has not dropped yet.
    to_free: Vec<BlockId>,
    /// Retained leases, oldest first (ids of ended ones are pruned lazily).
    retained: VecDeque<LeaseId>,
    /// The gateway each tagged live lease was granted for (ended leases leave at once).
    gateways: HashMap<LeaseId, Arc<str>>,
    /// Leases released because their gateway left.
    gateway_left: u64,
}

/// The node's lease table; see the module docs.
#[derive(Debug)]
pub struct LeaseBook {
    inner: Mutex<Book>,
}

impl LeaseBook {
    pub(crate) fn new(duration: Duration, seed: [u8; 32]) -> Self {
        Self {
            inner: Mutex::new(Book {
                table: LeaseTable::new(duration, seed),
                to_free: Vec::new(),
                retained: VecDeque::new(),
                gateways: HashMap::new(),
                gateway_left: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        // A panic while holding this lock cannot leave the table half-updated in a way that
        // matters more than stopping the node would; keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes every lease granted from now on on `board`, where peers confirm it with a
    /// one-sided read (the side channel's pool registration owns the memory).
    pub fn attach_board(&self, board: pd_kv_pool::LeaseBoard) {
        self.lock().table.attach_board(board);
    }

    /// How long a lease lasts unless renewed.
    pub fn duration(&self) -> Duration {
        self.lock().table.duration()
    }

    /// Grants a lease on `blocks`, tagged with the `gateway` its request came through if any;
    /// the caller handed one reference per block over to it.
    pub(crate) fn grant(
        &self,
        blocks: Vec<BlockId>,
        contents: LeaseContents,
        peer: &str,
        now: Instant,
        gateway: Option<Arc<str>>,
    ) -> Lease {
        let mut book = self.lock();
        let lease = book.table.grant(blocks, contents, peer, now);
        if let Some(g) = gateway {
            book.gateways.insert(lease.id, g);
        }
        lease
    }

    /// Grants a retained lease on a finished turn's `blocks` for `ttl`; revocable by
    /// [`LeaseBook::revoke_oldest_retained`]. The caller handed one reference per block over.
    pub(crate) fn grant_retained(
        &self,
        blocks: Vec<BlockId>,
        contents: LeaseContents,
        now: Instant,
        ttl: Duration,
    ) -> Lease {
        let mut book = self.lock();
        let lease = book.table.grant_for(blocks, contents, "", now, ttl);
        book.retained.push_back(lease.id);
        lease
    }

    /// Takes back the oldest live retained lease (its reader's confirm fails from now on) and
    /// returns its blocks, whose references the caller drops now. `None`: nothing retained.
    pub(crate) fn revoke_oldest_retained(&self) -> Option<Vec<BlockId>> {
        let mut book = self.lock();
        while let Some(id) = book.retained.pop_front() {
            if let Some(lease) = book.table.revoke(id) {
                tracing::debug!(lease = %id, blocks = lease.blocks.len(), "retained KV revoked: blocks needed");
                return Some(lease.blocks);
            }
        }
        None
    }

    /// Those of `ids` that are no longer live (released, revoked, or expired and collected),
    /// under one lock.
    pub fn ended(&self, ids: &[LeaseId]) -> Vec<LeaseId> {
        let book = self.lock();
        ids.iter()
            .copied()
            .filter(|id| !book.table.contains(*id))
            .collect()
    }

    /// Extends a live lease; returns the new deadline.
    ///
    /// # Errors
    /// [`LeaseError`] saying why the lease is not live.
    pub fn renew(&self, id: LeaseId, generation: u64, peer: &str) -> Result<Instant, LeaseError> {
        self.lock()
            .table
            .renew(id, generation, peer, Instant::now())
    }

    /// Whether the lease is live now; returns its deadline. A lease never comes back once ended,
    /// so live now means live since it was granted.
    ///
    /// # Errors
    /// [`LeaseError`] saying why it is not.
    pub fn confirm(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
    ) -> Result<(Instant, LeaseContents), LeaseError> {
        self.lock()
            .table
            .confirm(id, generation, peer, Instant::now())
            .map(|l| (l.deadline, l.contents))
    }

    /// Whether every one of `blocks` is a block of the lease, live now for `peer` (what that
    /// peer may read); not a confirmation.
    ///
    /// # Errors
    /// [`LeaseError`] saying why the lease is not live.
    pub fn covers(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        blocks: &[pd_kv_pool::BlockId],
    ) -> Result<bool, LeaseError> {
        self.lock()
            .table
            .check(id, generation, peer, Instant::now())
            .map(|l| pd_kv_pool::lease_covers(&l.blocks, blocks))
    }

    /// Ends a live lease; its blocks are freed at the engine's next loop turn (wake it).
    ///
    /// # Errors
    /// [`LeaseError`] saying why it was not live.
    pub(crate) fn release(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
    ) -> Result<(), LeaseError> {
        let mut book = self.lock();
        let lease = book.table.release(id, generation, peer, Instant::now())?;
        book.gateways.remove(&id);
        book.to_free.extend(lease.blocks);
        Ok(())
    }

    /// Gateway `gateway` left: releases every live lease tagged with it, as its reader would
    /// (the board record cleared, the blocks freed at the engine's next loop turn: wake it).
    /// Returns how many; leases of other gateways, untagged and retained ones stay.
    pub(crate) fn release_gateway(&self, gateway: &str, now: Instant) -> usize {
        let mut book = self.lock();
        let tagged: Vec<LeaseId> = book
            .gateways
            .iter()
            .filter(|(_, g)| ***g == *gateway)
            .map(|(id, _)| *id)
            .collect();
        let mut released = 0;
        for id in tagged {
            book.gateways.remove(&id);
            let Some((generation, peer)) =
                book.table.get(id).map(|l| (l.generation, l.peer.clone()))
            else {
                continue;
            };
            // Past its deadline (not collected yet): the expiry ends it instead.
            if let Ok(lease) = book.table.release(id, generation, &peer, now) {
                tracing::debug!(lease = %id, blocks = lease.blocks.len(), gateway, "lease released: its gateway left");
                book.to_free.extend(lease.blocks);
                released += 1;
            }
        }
        book.gateway_left += released as u64;
        released
    }

    /// Expires due leases and returns every block reference the engine must drop now.
    pub(crate) fn collect(&self, now: Instant) -> Vec<BlockId> {
        let mut book = self.lock();
        let expired = book.table.expire(now);
        for l in &expired {
            if book.retained.contains(&l.id) {
                // The conversation did not come back in time: normal.
                tracing::debug!(lease = %l.id, blocks = l.blocks.len(), "retained KV expired");
            } else {
                tracing::warn!(lease = %l.id, blocks = l.blocks.len(), "KV lease expired unreleased");
            }
        }
        for l in &expired {
            book.gateways.remove(&l.id);
        }
        let mut out = std::mem::take(&mut book.to_free);
        out.extend(expired.into_iter().flat_map(|l| l.blocks));
        if !out.is_empty() {
            // Something ended: forget ended retained leases (not on every loop turn).
            let Book {
                table, retained, ..
            } = &mut *book;
            retained.retain(|id| table.contains(*id));
        }
        out
    }

    /// When the next lease expires, if any.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.lock().table.next_deadline()
    }

    /// Live leases and counters.
    pub fn stats(&self) -> LeaseStats {
        let book = self.lock();
        let (retained, retained_blocks) = book
            .retained
            .iter()
            .filter_map(|id| book.table.get(*id))
            .fold((0, 0), |(n, b), l| (n + 1, b + l.blocks.len()));
        LeaseStats {
            live: book.table.live(),
            retained,
            retained_blocks,
            leased_blocks: {
                let retained: std::collections::HashSet<_> = book.retained.iter().collect();
                book.table.held_blocks(|l| !retained.contains(&l.id))
            },
            counts: book.table.counts(),
            gateway_left: book.gateway_left,
        }
    }
}

//! Which sequences run in the next step, and with how many tokens.
//!
//! Continuous batching with a per-step token budget, as in vLLM's v1 scheduler:
//! 1. Running sequences go first, oldest first. Each gets what it still lacks (one token when
//!    decoding, the rest of its prompt when prefilling), capped by the remaining budget: long
//!    prompts are prefilled in chunks across steps.
//! 2. If a running sequence needs a block and the pool is empty, the newest running sequence is
//!    preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
//!    (prompt + what it generated) later. No request is lost.
//! 3. If nothing was preempted, waiting sequences are admitted while budget, sequence slots and
//!    blocks last. Admission first reuses cached full blocks of the same prefix.
//!
//! Sequences waiting for KV from another node sit apart (`remote`: [`Scheduler::park_pending`])
//! and hold their blocks without taking part in steps until [`Scheduler::remote_kv_ready`].
//! Leases hold blocks through [`Scheduler::hold_for_lease`] / [`Scheduler::release_lease_refs`].

mod remote;

use std::collections::{HashSet, VecDeque};

use pd_kv_pool::{AllocatorError, BlockAllocator, BlockId, block_hash, hash_full_blocks_from};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::request::RequestId;
use crate::sequence::{PROMPT_ROWS_CHUNK, Sequence};

/// Gives up block references held by something revocable (a retained conversation turn), one
/// holder at a time; `None` when nothing is left to give up.
pub(crate) type Reclaim<'a> = dyn FnMut() -> Option<Vec<BlockId>> + 'a;

/// Limits of one step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SchedulerConfig {
    pub(crate) block_size: usize,
    pub(crate) max_num_batched_tokens: usize,
    pub(crate) max_num_seqs: usize,
    pub(crate) enable_prefix_caching: bool,
}

/// One scheduled sequence: `running[index]` computes `num_tokens` tokens from `num_computed`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scheduled {
    pub(crate) index: usize,
    pub(crate) num_tokens: usize,
}

/// What the next forward pass runs, and pool work to do before it.
#[derive(Debug, Default)]
pub(crate) struct StepPlan {
    pub(crate) scheduled: Vec<Scheduled>,
    /// Copy-on-write: copy block `.0` into block `.1` before the step, then drop one reference
    /// on `.0` ([`Scheduler::finish_copies`]).
    pub(crate) copies: Vec<(BlockId, BlockId)>,
    /// Sequences admitted for the first time this step: (request, prompt tokens found cached).
    pub(crate) admitted: Vec<(RequestId, usize)>,
    /// Sequences preempted this step.
    pub(crate) preempted: usize,
}

/// Queues and block bookkeeping of one engine: the one owner of block references. Every
/// reference a sequence, a fork, a lease or the prefix cache holds is taken and dropped by a
/// method of this type; the engine reads sequences and edits their own state (tokens, text,
/// generator) but moves no sequence between queues and touches no allocator.
#[derive(Debug)]
pub(crate) struct Scheduler {
    cfg: SchedulerConfig,
    allocator: BlockAllocator,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// Parked: blocks reserved, waiting for a peer's KV.
    remote: Vec<Sequence>,
    /// Waiting for remote KV but not parked yet (no free blocks for the prompt).
    remote_pending: VecDeque<Sequence>,
}

/// Sequence counts for the gauges.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueLengths {
    pub(crate) running: usize,
    pub(crate) waiting: usize,
    /// Parked for a peer's KV, or waiting to be.
    pub(crate) remote: usize,
    pub(crate) free_blocks: usize,
}

impl Scheduler {
    pub(crate) fn new(cfg: SchedulerConfig, num_blocks: usize) -> Self {
        Self {
            cfg,
            allocator: BlockAllocator::new(num_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            remote: Vec::new(),
            remote_pending: VecDeque::new(),
        }
    }

    /// Has the allocator record prefix-cache changes (for the gateway's placement).
    pub(crate) fn recording_cache_events(mut self) -> Self {
        self.allocator.record_cache_events();
        self
    }

    /// The running sequences, in step order.
    pub(crate) fn running(&self) -> &[Sequence] {
        &self.running
    }

    /// `running[index]`: a sequence of the current step.
    pub(crate) fn seq(&self, index: usize) -> &Sequence {
        &self.running[index]
    }

    /// `running[index]`, to record what it generated (its blocks stay the scheduler's).
    pub(crate) fn seq_mut(&mut self, index: usize) -> &mut Sequence {
        &mut self.running[index]
    }

    /// Sequence counts and free blocks, for the gauges.
    pub(crate) fn lengths(&self) -> QueueLengths {
        QueueLengths {
            running: self.running.len(),
            waiting: self.waiting.len(),
            remote: self.remote.len() + self.remote_pending.len(),
            free_blocks: self.allocator.num_free(),
        }
    }

    /// Hashes of every block in the prefix cache (a subscriber's starting point).
    pub(crate) fn cached_hashes(&self) -> Vec<pd_kv_pool::BlockHash> {
        self.allocator.cached_hashes()
    }

    /// Prefix-cache changes since the last call.
    pub(crate) fn take_cache_events(&mut self) -> Vec<pd_kv_pool::CacheEvent> {
        self.allocator.take_cache_events()
    }

    /// Blocks freed since the last call, for the pool to poison before anyone writes them.
    pub(crate) fn take_freed(&mut self) -> Vec<BlockId> {
        self.allocator.take_poison_list()
    }

    /// Queues a new request's sequence: for admission, or, when its prompt's KV comes from a
    /// peer, to be parked for it ([`Scheduler::park_pending`]).
    pub(crate) fn enqueue(&mut self, seq: Sequence, remote_kv: bool) {
        if remote_kv {
            self.remote_pending.push_back(seq);
        } else {
            self.waiting.push_back(seq);
        }
    }

    /// One more reference on each of `blocks`, held by a lease (a prefill's handoff, a retained
    /// turn) until [`Scheduler::release_lease_refs`].
    pub(crate) fn hold_for_lease(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.allocator.share(b);
        }
    }

    /// Drops the references of ended leases ([`Scheduler::hold_for_lease`]).
    pub(crate) fn release_lease_refs(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            self.allocator.free(b);
        }
    }

    /// Forks `running[index]`, whose first token is about to be sampled, into children `1..n`
    /// sharing every block (copy-on-write for the partial last one); child `c` draws from
    /// `seed + c`. Returns the running indices of all `n` (the parent first) and the children
    /// with no room to run yet: they take their first token with their siblings, then wait at
    /// the queue's front holding only the shared blocks ([`Scheduler::retire`]).
    ///
    /// Room: a sequence slot each, and a block each for their first write (a copy of the shared
    /// partial block, or a fresh block), but for one sharer of a partial block, which writes it
    /// in place.
    pub(crate) fn fork(
        &mut self,
        index: usize,
        n: usize,
        seed: u64,
    ) -> (Vec<usize>, Vec<(RequestId, usize)>) {
        let parent = &self.running[index];
        let id = parent.request;
        let partial = !parent.num_computed.is_multiple_of(self.cfg.block_size);
        let slots = self.cfg.max_num_seqs.saturating_sub(self.running.len());
        // Less the parent's own.
        let blocks = (self.allocator.num_free() + usize::from(partial)).saturating_sub(1);
        let mut may_run = slots.min(blocks);
        let mut children = vec![index];
        let mut parked = Vec::new();
        for c in 1..n {
            let parent = &self.running[index];
            for &b in &parent.blocks {
                self.allocator.share(b);
            }
            let child = parent.fork(c, ChaCha8Rng::seed_from_u64(seed.wrapping_add(c as u64)));
            if may_run == 0 {
                parked.push((id, c));
            } else {
                may_run -= 1;
            }
            self.running.push(child);
            children.push(self.running.len() - 1);
        }
        (children, parked)
    }

    /// After a step's tokens are out: forked children parked by [`Scheduler::fork`] go to the
    /// queue's front, in child order, keeping their shared blocks (unless they finished or
    /// their request is gone); finished sequences leave and free their blocks.
    pub(crate) fn retire(
        &mut self,
        finished: &HashSet<(RequestId, usize)>,
        parked: &[(RequestId, usize)],
        gone: &HashSet<RequestId>,
    ) {
        if finished.is_empty() && parked.is_empty() {
            return; // most decode steps: nothing leaves the running list
        }
        let mut waiting = Vec::new();
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            let key = (s.request, s.child);
            if finished.contains(&key) {
                done.push(self.running.remove(i));
            } else if parked.contains(&key) && !gone.contains(&s.request) {
                waiting.push(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        for s in waiting.into_iter().rev() {
            self.waiting.push_front(s);
        }
        for mut s in done {
            self.release(&mut s);
        }
    }

    /// Takes `request`'s sequence from the queue's front (where
    /// [`Scheduler::remote_kv_ready`] put it) into the running list, for one token emitted
    /// without a forward pass; its running index. Undone by [`Scheduler::end_emit`].
    pub(crate) fn emit_from_front(&mut self, request: RequestId) -> Option<usize> {
        if self.waiting.front().map(|s| s.request) != Some(request) {
            return None;
        }
        let seq = self.waiting.pop_front()?;
        self.running.push(seq);
        Some(self.running.len() - 1)
    }

    /// Ends [`Scheduler::emit_from_front`]: the sequence goes back to the queue's front, or,
    /// when `done` (finished, or its client gone), leaves and frees its blocks.
    pub(crate) fn end_emit(&mut self, index: usize, done: bool) {
        let mut seq = self.running.swap_remove(index);
        if done {
            self.release(&mut seq);
        } else {
            self.waiting.push_front(seq);
        }
    }

    pub(crate) fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.remote_pending.is_empty()
    }

    /// Plans the next step (nothing to reclaim: see [`Scheduler::schedule_with`]).
    #[cfg(test)]
    pub(crate) fn schedule(&mut self) -> StepPlan {
        self.schedule_with(&mut || None)
    }

    /// Plans the next step. When blocks run out, `reclaim` is asked first (it gives up blocks
    /// others hold but may lose: retained conversation turns) and each reference it returns is
    /// dropped; only when it has nothing left is a running sequence preempted or a waiting one
    /// kept waiting.
    pub(crate) fn schedule_with(&mut self, reclaim: &mut Reclaim<'_>) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        // Logits rows for prompt logprobs, shared by every sequence of the step.
        let mut rows = PROMPT_ROWS_CHUNK;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let need = self.running[i].tokens.len() - self.running[i].num_computed;
            let wants_rows = self.running[i].wants_rows();
            let n = if wants_rows {
                need.min(budget).min(rows)
            } else {
                need.min(budget)
            };
            if n == 0 {
                i += 1; // out of rows this step: it goes on in the next
                continue;
            }
            let mut scheduled_self = true;
            loop {
                let upto = self.running[i].num_computed + n;
                if ensure_blocks(
                    &mut self.allocator,
                    self.cfg.block_size,
                    &mut self.running[i],
                    upto,
                    &mut plan.copies,
                )
                .is_ok()
                {
                    break;
                }
                // Out of blocks: evict what may be evicted, then preempt the newest running
                // sequence (maybe this one).
                if self.reclaim(reclaim) {
                    continue;
                }
                let Some(victim) = self.running.pop() else {
                    break;
                };
                let was_self = self.running.len() == i;
                self.preempt(victim);
                plan.preempted += 1;
                if was_self {
                    scheduled_self = false;
                    break;
                }
            }
            if !scheduled_self {
                break;
            }
            plan.scheduled.push(Scheduled {
                index: i,
                num_tokens: n,
            });
            budget -= n;
            if wants_rows {
                rows -= n;
            }
            i += 1;
        }
        if plan.preempted > 0 {
            return plan;
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let wants_rows = seq.wants_rows();
            if wants_rows && rows == 0 {
                // Out of rows this step: admitted in a later one, in its turn.
                self.waiting.push_front(seq);
                break;
            }
            let first_time =
                seq.num_computed == 0 && seq.blocks.is_empty() && seq.num_generated() == 0;
            // A forked child waits holding its computed, shared blocks; anything else holds none.
            let held = !seq.blocks.is_empty();
            let cached = self.take_cached_prefix(&mut seq);
            let n = (seq.tokens.len() - seq.num_computed).min(budget);
            let n = if wants_rows { n.min(rows) } else { n };
            let upto = seq.num_computed + n;
            let bs = self.cfg.block_size;
            let mut fits;
            loop {
                fits = ensure_blocks(&mut self.allocator, bs, &mut seq, upto, &mut plan.copies)
                    .is_ok();
                if fits || !self.reclaim(reclaim) {
                    break;
                }
            }
            if !fits {
                // Not enough blocks now: wait. A sequence gives back the cached prefix it just
                // took; a forked child keeps the computed, shared blocks it came with.
                if !held {
                    self.release(&mut seq);
                }
                self.waiting.push_front(seq);
                break;
            }
            if first_time {
                plan.admitted.push((seq.request, cached));
            }
            self.running.push(seq);
            plan.scheduled.push(Scheduled {
                index: self.running.len() - 1,
                num_tokens: n,
            });
            budget -= n;
            if wants_rows {
                rows -= n;
            }
        }
        plan
    }

    /// Called after the forward pass: `running[index]` now has `num_tokens` more computed tokens.
    /// Registers blocks that became full in the prefix cache.
    pub(crate) fn commit(&mut self, s: Scheduled) {
        let bs = self.cfg.block_size;
        let seq = &mut self.running[s.index];
        seq.num_computed += s.num_tokens;
        if !self.cfg.enable_prefix_caching || !seq.cacheable {
            return;
        }
        while seq.hashes.len() < seq.num_computed / bs {
            let k = seq.hashes.len();
            let h = block_hash(
                seq.hashes.last().copied().or(seq.root),
                &seq.tokens[k * bs..(k + 1) * bs],
            );
            self.allocator.register(seq.blocks[k], h);
            seq.hashes.push(h);
        }
    }

    /// Drops the reference each copy-on-write source kept until its copy was made.
    pub(crate) fn finish_copies(&mut self, copies: &[(BlockId, BlockId)]) {
        for &(src, _) in copies {
            self.allocator.free(src);
        }
    }

    /// Frees a sequence's blocks, last block first (so a prefix's head is evicted last).
    pub(crate) fn release(&mut self, seq: &mut Sequence) {
        for b in seq.blocks.drain(..).rev() {
            self.allocator.free(b);
        }
        seq.hashes.clear();
        seq.num_computed = 0;
    }

    /// Removes every sequence of `request` from all queues, freeing their blocks.
    pub(crate) fn remove_request(&mut self, request: RequestId) -> usize {
        // Keep the order of the queues: preemption takes the newest, re-admission the oldest.
        let mut removed = Vec::new();
        let (gone, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.remote_pending)
            .into_iter()
            .partition(|s| s.request == request);
        self.remote_pending = kept;
        removed.extend(gone);
        for q in [&mut self.running, &mut self.remote] {
            let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(q)
                .into_iter()
                .partition(|s| s.request == request);
            *q = kept;
            removed.extend(gone);
        }
        let (gone, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|s| s.request == request);
        self.waiting = kept;
        removed.extend(gone);
        let n = removed.len();
        for mut s in removed {
            self.release(&mut s);
        }
        n
    }

    /// Drops the block references `reclaim` gives up; false when it had none.
    fn reclaim(&mut self, reclaim: &mut Reclaim<'_>) -> bool {
        let Some(blocks) = reclaim() else {
            return false;
        };
        for b in blocks {
            self.allocator.free(b);
        }
        true
    }

    /// Blocks referenced by sequences of `request` (for tests and the transfer layer).
    #[allow(dead_code)]
    pub(crate) fn blocks_of(&self, request: RequestId) -> Vec<BlockId> {
        self.running
            .iter()
            .chain(self.remote.iter())
            .chain(self.waiting.iter())
            .filter(|s| s.request == request)
            .flat_map(|s| s.blocks.iter().copied())
            .collect()
    }

    fn preempt(&mut self, mut seq: Sequence) {
        tracing::debug!(request = %seq.request, child = seq.child, "preempting sequence (recompute)");
        self.release(&mut seq);
        self.waiting.push_front(seq);
    }

    /// For a newly admitted sequence: takes references on the longest cached prefix of its
    /// tokens (never the whole of them: the last token must be computed for its logits).
    /// Returns the number of tokens found. None for a sequence that wants every prompt
    /// position's logits (`prompt_rows`).
    fn take_cached_prefix(&mut self, seq: &mut Sequence) -> usize {
        if !self.cfg.enable_prefix_caching
            || seq.num_computed > 0
            || !seq.blocks.is_empty()
            || seq.prompt_rows.is_some()
        {
            return 0;
        }
        let bs = self.cfg.block_size;
        let hashes = hash_full_blocks_from(seq.root, &seq.tokens, bs);
        let mut found = self.allocator.lookup(&hashes);
        if found.len() * bs >= seq.tokens.len() {
            found.pop();
        }
        for &b in &found {
            self.allocator.share(b);
        }
        seq.num_computed = found.len() * bs;
        seq.hashes = hashes[..found.len()].to_vec();
        seq.blocks = found;
        seq.num_computed
    }
}

/// Makes `seq.blocks` cover positions `0..upto`, copying a shared partial block first
/// (copy-on-write). All or nothing.
fn ensure_blocks(
    allocator: &mut BlockAllocator,
    bs: usize,
    seq: &mut Sequence,
    upto: usize,
    copies: &mut Vec<(BlockId, BlockId)>,
) -> Result<(), AllocatorError> {
    let needed = upto.div_ceil(bs);
    let extra = needed.saturating_sub(seq.blocks.len());
    let write_block = seq.num_computed / bs;
    // Copy only while someone else keeps the block: references that copies already planned this
    // step will drop (`finish_copies`) do not count, so the last sharer writes in place.
    let cow = !seq.num_computed.is_multiple_of(bs) && write_block < seq.blocks.len() && {
        let b = seq.blocks[write_block];
        let leaving = copies.iter().filter(|&&(src, _)| src == b).count();
        allocator.ref_count(b) as usize > 1 + leaving
    };
    if extra + usize::from(cow) > allocator.num_free() {
        return Err(AllocatorError::Exhausted {
            total: allocator.num_total(),
        });
    }
    if cow {
        let old = seq.blocks[write_block];
        let new = allocator.allocate()?;
        copies.push((old, new));
        // The reference on `old` is dropped by the engine after the copy ran
        // (`Scheduler::finish_copies`): freed now, it could be poisoned before being copied.
        seq.blocks[write_block] = new;
    }
    for _ in 0..extra {
        seq.blocks.push(allocator.allocate()?);
    }
    Ok(())
}

#[cfg(test)]
mod tests;

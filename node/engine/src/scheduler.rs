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
//! Sequences waiting for KV from another node sit apart ([`Scheduler::park_for_remote_kv`]) and
//! hold their blocks without taking part in steps until [`Scheduler::remote_kv_ready`].

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

    /// Parks sequences waiting for remote KV, oldest first, while their prompts' blocks are free.
    /// Returns what each parked one must receive: (request, local blocks, first prompt block
    /// they stand for, prompt tokens already cached here).
    pub(crate) fn park_pending(
        &mut self,
        reclaim: &mut Reclaim<'_>,
    ) -> Vec<(RequestId, Vec<BlockId>, usize, usize)> {
        let mut parked = Vec::new();
        while let Some(seq) = self.remote_pending.pop_front() {
            match self.park_for_remote_kv(seq) {
                Ok(p) => parked.push(p),
                Err(seq) => {
                    self.remote_pending.push_front(*seq);
                    if !self.reclaim(reclaim) {
                        break;
                    }
                }
            }
        }
        parked
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

    /// Puts `seq` aside until its prompt's KV arrives from another node: reuses the prompt's
    /// blocks found in the local prefix cache, takes fresh blocks for the rest now (so the pull
    /// has somewhere to write), and leaves it out of every step.
    ///
    /// # Errors
    /// When the prompt's blocks are not free, `seq` is handed back holding nothing.
    fn park_for_remote_kv(
        &mut self,
        mut seq: Sequence,
    ) -> Result<(RequestId, Vec<BlockId>, usize, usize), Box<Sequence>> {
        let need = seq.prompt_len.div_ceil(self.cfg.block_size);
        let cached = self.take_cached_prefix(&mut seq);
        let first = seq.blocks.len();
        match self.allocator.allocate_n(need - first) {
            Ok(blocks) => {
                seq.blocks.extend_from_slice(&blocks);
                let request = seq.request;
                self.remote.push(seq);
                Ok((request, blocks, first, cached))
            }
            Err(_) => {
                self.release(&mut seq);
                Err(Box::new(seq))
            }
        }
    }

    /// The KV of the first `num_tokens` prompt tokens of `request` is in its blocks (or, with
    /// `num_tokens` at most what was cached, nothing arrived): it joins the queue at the front
    /// and computes only what it still lacks — at least the last prompt token, for its logits,
    /// unless `whole_prompt`: the caller has the first token from elsewhere (a greedy
    /// prefill's, attested by its producer) and the whole prompt's KV may count as held.
    /// Returns (prompt length, tokens now held, of which pulled) or `None` for an unknown request.
    ///
    /// `cacheable: false` (KV nobody vouched for) keeps this sequence out of the prefix cache
    /// for good: neither the pulled blocks nor any computed after them are registered.
    pub(crate) fn remote_kv_ready(
        &mut self,
        request: RequestId,
        num_tokens: usize,
        cacheable: bool,
        whole_prompt: bool,
    ) -> Option<(usize, usize, usize)> {
        let pos = self.remote.iter().position(|s| s.request == request)?;
        let mut seq = self.remote.swap_remove(pos);
        let cached = seq.num_computed;
        // The last prompt position is computed here for its logits, unless the caller has the
        // first token already (`whole_prompt`).
        let most = if whole_prompt {
            seq.prompt_len
        } else {
            seq.prompt_len.saturating_sub(1)
        };
        seq.num_computed = num_tokens.min(most).max(cached);
        let pulled = seq.num_computed - cached;
        if pulled > 0 && !cacheable {
            seq.cacheable = false;
        }
        let bs = self.cfg.block_size;
        if self.cfg.enable_prefix_caching && seq.cacheable {
            for k in seq.hashes.len()..seq.num_computed / bs {
                let h = block_hash(
                    seq.hashes.last().copied().or(seq.root),
                    &seq.tokens[k * bs..(k + 1) * bs],
                );
                self.allocator.register(seq.blocks[k], h);
                seq.hashes.push(h);
            }
        }
        let out = (seq.prompt_len, seq.num_computed, pulled);
        self.waiting.push_front(seq);
        Some(out)
    }

    /// The blocks of `request`'s waiting sequence that hold its tokens `from..to` (what a pull
    /// just wrote), in order; empty when it is not waiting.
    pub(crate) fn waiting_blocks(
        &self,
        request: RequestId,
        from: usize,
        to: usize,
    ) -> Vec<BlockId> {
        let bs = self.cfg.block_size.max(1);
        self.waiting
            .iter()
            .find(|s| s.request == request)
            .map(|s| {
                let end = to.div_ceil(bs).min(s.blocks.len());
                s.blocks[(from / bs).min(end)..end].to_vec()
            })
            .unwrap_or_default()
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
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn seq(request: u64, len: usize, tok: &pd_tokenize::Tokenizer) -> Sequence {
        Sequence {
            request: RequestId(request),
            child: 0,
            tokens: (0..len as u32)
                .map(|i| (i + request as u32 * 7) % 256)
                .collect(),
            prompt_len: len,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            root: None,
            cacheable: true,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(0),
            decoder: tok.decoder(true),
            text: String::new(),
            sent: 0,
            stop_floor: 0,
            last_token_at: None,
            grammar: None,
            prompt_rows: None,
        }
    }

    /// One tokenizer for all tests of this module (they run in parallel threads: writing the
    /// files once avoids one test reading them while another rewrites them).
    fn tokenizer() -> &'static pd_tokenize::Tokenizer {
        static TOK: std::sync::OnceLock<pd_tokenize::Tokenizer> = std::sync::OnceLock::new();
        TOK.get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("pd-sched-tok-{}", std::process::id()));
            pd_tokenize::write_byte_level_tokenizer(&dir, 300).unwrap();
            pd_tokenize::Tokenizer::from_dir(&dir).unwrap()
        })
    }

    fn cfg(budget: usize) -> SchedulerConfig {
        SchedulerConfig {
            block_size: 4,
            max_num_batched_tokens: budget,
            max_num_seqs: 8,
            enable_prefix_caching: true,
        }
    }

    /// Runs `plan` as if the forward pass happened, appending a token to finished prefills.
    fn complete(s: &mut Scheduler, plan: &StepPlan) {
        for sc in &plan.scheduled {
            s.commit(*sc);
            let q = &mut s.running[sc.index];
            if q.num_computed == q.tokens.len() {
                q.tokens.push(1);
            }
        }
    }

    #[test]
    fn chunked_prefill_respects_the_budget() {
        let tok = tokenizer();
        let mut s = Scheduler::new(cfg(8), 32);
        s.waiting.push_back(seq(1, 20, tok));
        let mut steps = Vec::new();
        for _ in 0..3 {
            let plan = s.schedule();
            steps.push(plan.scheduled.iter().map(|x| x.num_tokens).sum::<usize>());
            complete(&mut s, &plan);
        }
        assert_eq!(steps, vec![8, 8, 4]);
    }

    #[test]
    fn a_sequence_wanting_prompt_rows_computes_its_whole_prompt_in_bounded_chunks() {
        let tok = tokenizer();
        let len = PROMPT_ROWS_CHUNK + 100;
        let mut s = Scheduler::new(cfg(2048), 1024);
        // Its prompt in the prefix cache first.
        s.waiting.push_back(seq(1, len, tok));
        while s.running.first().is_none_or(|q| q.num_computed < len) {
            let plan = s.schedule();
            complete(&mut s, &plan);
        }
        let mut q = seq(1, len, tok);
        q.prompt_rows = Some(1);
        s.waiting.push_back(q);
        let plan = s.schedule();
        let mine = plan.scheduled.last().unwrap();
        assert_eq!(
            plan.admitted.last(),
            Some(&(RequestId(1), 0)),
            "no cache hit"
        );
        assert_eq!(mine.num_tokens, PROMPT_ROWS_CHUNK);
        complete(&mut s, &plan);
        let plan = s.schedule();
        assert_eq!(plan.scheduled.last().unwrap().num_tokens, 100);
    }

    #[test]
    fn the_sequences_wanting_prompt_rows_share_one_bound_per_step() {
        let tok = tokenizer();
        let mut s = Scheduler::new(cfg(4096), 2048);
        for r in 1..=3 {
            let mut q = seq(r, 400, tok);
            q.prompt_rows = Some(1);
            s.waiting.push_back(q);
        }
        s.waiting.push_back(seq(4, 300, tok)); // wants no rows
        let mut computed = [0usize; 4];
        for step in 0..4 {
            let plan = s.schedule();
            let mut rows = 0;
            for x in &plan.scheduled {
                let q = &s.running[x.index];
                if q.wants_rows() {
                    rows += x.num_tokens;
                }
                computed[q.request.0 as usize - 1] += x.num_tokens;
            }
            assert!(rows <= PROMPT_ROWS_CHUNK, "step {step}: {rows} rows");
            complete(&mut s, &plan);
        }
        assert!(
            computed[..3].iter().all(|&c| c > 400) && computed[3] > 300,
            "every prompt computed: {computed:?}"
        );
    }

    #[test]
    fn sequence_waiting_for_remote_kv_does_not_block_others() {
        let tok = tokenizer();
        let mut s = Scheduler::new(cfg(64), 32);
        s.remote_pending.push_back(seq(1, 10, tok));
        let got = s.park_pending(&mut || None);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].2, got[0].3), (0, 0), "nothing cached locally");
        let parked = s.blocks_of(RequestId(1));
        assert_eq!(parked.len(), 3);
        assert_eq!(got[0].1, parked);
        s.waiting.push_back(seq(2, 6, tok));
        for _ in 0..5 {
            let plan = s.schedule();
            assert!(
                plan.scheduled
                    .iter()
                    .all(|x| s.running[x.index].request == RequestId(2))
            );
            assert!(!plan.scheduled.is_empty());
            complete(&mut s, &plan);
            // The parked sequence's blocks are never handed to anyone else.
            for r in &s.running {
                assert!(r.blocks.iter().all(|b| !parked.contains(b)));
            }
        }
        // KV for all 10 prompt tokens arrived: it computes just the last one for its logits.
        assert_eq!(
            s.remote_kv_ready(RequestId(1), 10, true, false),
            Some((10, 9, 9))
        );
        let plan = s.schedule();
        let mine: Vec<_> = plan
            .scheduled
            .iter()
            .filter(|x| s.running[x.index].request == RequestId(1))
            .collect();
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].num_tokens, 1);
        assert_eq!(s.running[mine[0].index].blocks, parked);
    }

    #[test]
    fn unattested_remote_kv_never_enters_the_prefix_cache() {
        let tok = tokenizer();
        for (attested, want_cached) in [(true, true), (false, false)] {
            let mut s = Scheduler::new(cfg(64), 32);
            s.remote_pending.push_back(seq(1, 10, tok));
            assert_eq!(s.park_pending(&mut || None).len(), 1);
            assert_eq!(
                s.remote_kv_ready(RequestId(1), 10, attested, false),
                Some((10, 9, 9))
            );
            // Compute the last prompt token and a few more: blocks 0..=2 fill up.
            for _ in 0..4 {
                let plan = s.schedule();
                complete(&mut s, &plan);
                let r = &mut s.running[0];
                r.tokens.push(1);
            }
            assert_eq!(
                !s.allocator.cached_hashes().is_empty(),
                want_cached,
                "attested: {attested}"
            );
        }
    }

    #[test]
    fn exhausted_pool_preempts_the_newest_and_frees_its_blocks() {
        let tok = tokenizer();
        // 6 blocks; two prompts of 8 tokens take 2 blocks each, decoding needs one more each.
        let mut s = Scheduler::new(cfg(64), 5);
        s.waiting.push_back(seq(1, 8, tok));
        s.waiting.push_back(seq(2, 8, tok));
        let plan = s.schedule();
        assert_eq!(plan.scheduled.len(), 2);
        complete(&mut s, &plan);
        let plan = s.schedule(); // seq 1 takes the 5th block; seq 2 finds none and is preempted
        assert_eq!(plan.preempted, 1);
        assert_eq!(s.waiting.front().map(|q| q.request), Some(RequestId(2)));
        assert!(s.waiting[0].blocks.is_empty() && s.waiting[0].num_computed == 0);
        assert_eq!(s.allocator.num_free(), 5 - 3);
    }

    #[test]
    fn the_last_sharer_of_a_partial_block_writes_it_in_place() {
        let tok = tokenizer();
        let mut s = Scheduler::new(cfg(64), 16);
        // Three children of one prompt: 6 tokens, 5 computed, sharing b0 and the partial p.
        let b0 = s.allocator.allocate().unwrap();
        let p = s.allocator.allocate().unwrap();
        let mut children = Vec::new();
        for c in 0..3 {
            if c > 0 {
                s.allocator.share(b0);
                s.allocator.share(p);
            }
            let mut q = seq(1, 6, tok);
            q.child = c;
            q.num_computed = 5;
            q.blocks = vec![b0, p];
            children.push(q);
        }
        s.running = children;
        let plan = s.schedule();
        assert_eq!(plan.scheduled.len(), 3);
        // Two copies for three sharers: the last one keeps p.
        assert_eq!(plan.copies.len(), 2, "{:?}", plan.copies);
        assert!(plan.copies.iter().all(|&(src, _)| src == p));
        s.finish_copies(&plan.copies);
        assert_eq!(s.allocator.ref_count(p), 1);
        let holders = s.running.iter().filter(|q| q.blocks[1] == p).count();
        assert_eq!(holders, 1, "exactly one child still writes p");
    }

    #[test]
    fn copy_on_write_source_stays_valid_until_copied_even_if_its_sharer_is_preempted() {
        let tok = tokenizer();
        let mut s = Scheduler::new(cfg(64), 5);
        // c0 and c1: 6 tokens, 5 computed, sharing full block b0 and partial block p.
        let b0 = s.allocator.allocate().unwrap();
        let p = s.allocator.allocate().unwrap();
        let mut c0 = seq(1, 6, tok);
        c0.num_computed = 5;
        c0.blocks = vec![b0, p];
        s.allocator.share(b0);
        s.allocator.share(p);
        let mut c1 = seq(1, 6, tok);
        c1.child = 1;
        c1.num_computed = 5;
        c1.blocks = vec![b0, p];
        // x: 9 tokens, 8 computed in two blocks, needs a third.
        let mut x = seq(2, 9, tok);
        x.num_computed = 8;
        x.blocks = s.allocator.allocate_n(2).unwrap();
        s.running = vec![c0, x, c1];
        let _ = s.allocator.take_poison_list();
        // c0 copies p into the last free block; x then preempts c1 (the newest).
        let plan = s.schedule();
        assert_eq!(plan.copies.len(), 1);
        assert_eq!(plan.copies[0].0, p);
        assert!(plan.preempted >= 1);
        assert!(
            !s.allocator.take_poison_list().contains(&p),
            "p is about to be copied: it must not be invalidated before the copy"
        );
        s.finish_copies(&plan.copies);
        assert_eq!(s.allocator.ref_count(p), 0);
    }
}

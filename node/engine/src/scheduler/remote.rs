//! Sequences whose prompt's KV comes from another node: parked with their blocks reserved
//! ([`Scheduler::park_pending`]) and out of every step until the pull ends
//! ([`Scheduler::remote_kv_ready`]).

use pd_kv_pool::{BlockId, block_hash};

use super::{Reclaim, Scheduler};
use crate::request::RequestId;
use crate::sequence::Sequence;

impl Scheduler {
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
}

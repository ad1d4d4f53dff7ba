//! KV the engine hands to others under a lease: a prefill's computed prompt for the decode nodes
//! that will pull it ([`Engine::hand_off`]), and a finished turn kept for the conversation's next
//! ([`Engine::retain_turn`]). Either way the blocks go to the transfer pool first
//! ([`stage_down`]), then the scheduler takes one reference per block per lease.

use std::time::Instant;

use pd_kv_pool::{BlockId, KvPool};
use pd_model::StagedKv;

use super::Engine;
use crate::metrics::EngineMetrics;
use crate::request::{FinishReason, KvHandoff, KvTransfer, RequestEvent, RequestId};
use crate::sampler;

impl Engine {
    /// A prefill's computed prompt: leases its blocks to each decode node that will pull them,
    /// once for all `n` children (they would share them anyway). Each lease holds its own
    /// reference per block, so one consumer's release never frees blocks another still reads.
    /// Nothing for other requests, or for a client already gone (nobody could hand a lease to
    /// a decode node).
    pub(super) fn hand_off(&mut self, id: RequestId, index: usize, row: &[f32]) {
        let Some(state) = self.requests.get(&id) else {
            return;
        };
        let (KvTransfer::Produce { consumers } | KvTransfer::PullThenProduce { consumers }) =
            state.kv
        else {
            return;
        };
        if state.events.is_closed() {
            return;
        }
        let seq = self.scheduler.seq(index);
        let blocks = seq.blocks[..seq.prompt_len.div_ceil(self.info.block_size)].to_vec();
        let num_tokens = seq.prompt_len;
        // Bound to what the blocks hold: a reader checks it on confirm. A single completion's
        // first token goes with it — the token `emit_token` picks next, picked here the same
        // way (`sampler::pick`) on copies of the sequence's generator and matcher in the same
        // state — so a reader that wants nothing else from the logits need not compute the
        // last prompt position again.
        let first = (state.params.n == 1 && state.params.logprobs.is_none())
            .then(|| {
                let mut rng = seq.rng.clone();
                let mut grammar = seq.grammar.clone();
                sampler::pick(
                    row,
                    grammar.as_mut(),
                    &state.params,
                    sampler::History::of(&seq.tokens, seq.prompt_len),
                    state.banned(0),
                    &mut rng,
                )
                .ok()
                .map(|(token, _)| token)
            })
            .flatten();
        let contents =
            pd_kv_pool::LeaseContents::of(&self.info.binding_key, &seq.tokens[..seq.prompt_len])
                .in_blocks(&blocks)
                .with_next_token(first, state.first_token_key);
        // A peer reads the transfer pool: the computed KV goes there before any lease names it.
        if let Err(e) = stage_down(&mut self.staged, &mut self.pool, &self.metrics, &blocks) {
            tracing::error!(request = %id, error = %e, "staging the prompt's KV for its lease failed; no lease");
            return;
        }
        for _ in 0..consumers.max(1) {
            self.scheduler.hold_for_lease(&blocks);
            let lease = self.leases.grant(
                blocks.clone(),
                contents,
                "",
                Instant::now(),
                state.gateway.clone(),
            );
            tracing::debug!(request = %id, lease = %lease.id, blocks = lease.blocks.len(), "prompt KV leased");
            let _ = state.events.send(RequestEvent::KvReady(KvHandoff {
                lease: lease.id,
                generation: lease.generation,
                deadline: to_system_time(lease.deadline),
                block_ids: lease.blocks,
                num_tokens,
                last_block_hash: None,
                prompt_key: None,
                board_slot: lease.slot,
            }));
        }
    }

    /// `running[index]` just finished (`reason`): a single completion may be kept for the
    /// conversation's next turn ([`crate::EngineConfig::kv_retain_after_decode`]): its full,
    /// computed blocks (the last sampled token has no KV yet) under a retained lease, bound to
    /// the tokens they hold ([`RequestEvent::Retained`]). Not for KV nobody vouched for, nor for
    /// a prefill's handoff, nor for an aborted child.
    pub(super) fn retain_turn(&mut self, index: usize, reason: FinishReason) {
        let Some(ttl) = self.retain_after_decode else {
            return;
        };
        let seq = self.scheduler.seq(index);
        let id = seq.request;
        let Some(state) = self.requests.get(&id) else {
            return;
        };
        if state.params.n != 1
            || !seq.cacheable
            || matches!(
                state.kv,
                KvTransfer::Produce { .. } | KvTransfer::PullThenProduce { .. }
            )
            || matches!(reason, FinishReason::Abort)
        {
            return;
        }
        let full = seq.num_computed / self.info.block_size;
        if full == 0 {
            return;
        }
        let blocks = seq.blocks[..full].to_vec();
        let num_tokens = full * self.info.block_size;
        let contents =
            pd_kv_pool::LeaseContents::of(&self.info.binding_key, &seq.tokens[..num_tokens])
                .in_blocks(&blocks);
        let hash_at = |blocks: usize| match seq.hashes.get(blocks - 1) {
            Some(h) => h.0,
            None => pd_kv_pool::hash_full_blocks_from(
                seq.root,
                &seq.tokens[..blocks * self.info.block_size],
                self.info.block_size,
            )
            .last()
            .map_or(0, |h| h.0),
        };
        let last_block_hash = hash_at(full);
        let prompt_blocks = (seq.prompt_len / self.info.block_size).min(full);
        let prompt_key = (prompt_blocks > 0)
            .then(|| (hash_at(prompt_blocks), prompt_blocks * self.info.block_size));
        if let Err(e) = stage_down(&mut self.staged, &mut self.pool, &self.metrics, &blocks) {
            tracing::error!(request = %id, error = %e, "staging a finished turn's KV failed; not retained");
            return;
        }
        self.scheduler.hold_for_lease(&blocks);
        let lease = self
            .leases
            .grant_retained(blocks, contents, Instant::now(), ttl);
        self.metrics.kv_retained.inc();
        let _ = state.events.send(RequestEvent::Retained(KvHandoff {
            lease: lease.id,
            generation: lease.generation,
            deadline: to_system_time(lease.deadline),
            block_ids: lease.blocks,
            num_tokens,
            last_block_hash: Some(last_block_hash),
            prompt_key,
            board_slot: lease.slot,
        }));
    }
}

/// A monotonic deadline as wall-clock time (for peers in other processes), reading both clocks
/// now.
fn to_system_time(deadline: Instant) -> std::time::SystemTime {
    pd_kv_pool::deadline_on_wall_clock(deadline, Instant::now(), std::time::SystemTime::now())
}

/// Copies `blocks` from the compute pool, when the model computes on one, to the transfer
/// pool, before a lease names them; counted and timed.
fn stage_down(
    staged: &mut Option<Box<dyn StagedKv>>,
    pool: &mut KvPool,
    metrics: &EngineMetrics,
    blocks: &[BlockId],
) -> Result<(), pd_model::ModelError> {
    let Some(s) = staged else {
        return Ok(());
    };
    let t = Instant::now();
    s.download(pool, blocks)?;
    metrics.kv_staged_down.inc_by(blocks.len() as u64);
    metrics
        .kv_staging_down_seconds
        .observe(t.elapsed().as_secs_f64());
    Ok(())
}

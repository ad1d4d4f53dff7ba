//! One engine step, in its phases: plan (what runs, and the pool work before it), batch,
//! forward, the scheduler's commit, prompt logprobs, sample (handoffs, forks, tokens out), and
//! the scheduler's retire.

use std::collections::HashSet;
use std::time::Instant;

use pd_model::{BatchInput, PagedKv};

use super::Engine;
use super::emit::Pick;
use crate::request::{RequestEvent, RequestId};
use crate::sampler;
use crate::scheduler::StepPlan;

impl Engine {
    /// One step, in its phases: [`Engine::plan`] (what runs, pool work before it),
    /// [`Engine::batch`], [`Engine::forward`], the scheduler's `commit`, [`Engine::sample`]
    /// (handoffs, forks, tokens out), then the scheduler's `retire`. False when nothing could
    /// be scheduled.
    pub(super) fn step(&mut self) -> bool {
        let plan = self.plan();
        if plan.scheduled.is_empty() {
            return false; // (`plan` updated the gauges)
        }
        let (batch, rows, prefill_tokens) = self.batch(&plan);
        let Some((logits, vocab)) = self.forward(&plan, &batch, prefill_tokens) else {
            return true;
        };
        for s in &plan.scheduled {
            self.scheduler.commit(*s);
        }
        self.prompt_logprobs(&logits, vocab, &rows);
        let out = self.sample(&logits, vocab, &rows);
        self.scheduler.retire(&out.finished, &out.parked, &out.gone);
        for id in out.gone {
            self.abort(id);
        }
        self.update_gauges();
        true
    }

    /// Plans the step (reclaiming retained turns before preempting), tells newly admitted
    /// requests they started, poisons freed blocks and makes the copy-on-write copies.
    fn plan(&mut self) -> StepPlan {
        let leases = &self.leases;
        let plan = self
            .scheduler
            .schedule_with(&mut || leases.revoke_oldest_retained());
        self.metrics.preemptions.inc_by(plan.preempted as u64);
        for &(id, cached) in &plan.admitted {
            if let Some(state) = self.requests.get_mut(&id)
                && state.scheduled_at.is_none()
            {
                state.scheduled_at = Some(Instant::now());
                let prompt_tokens = self
                    .scheduler
                    .running()
                    .iter()
                    .find(|s| s.request == id)
                    .map_or(0, |s| s.prompt_len);
                self.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
                self.metrics
                    .prefix_cache_queries
                    .inc_by(prompt_tokens as u64);
                self.metrics.prefix_cache_hits.inc_by(cached as u64);
                let _ = state.events.send(RequestEvent::Started {
                    prompt_tokens,
                    cached_tokens: cached,
                    pulled_tokens: 0,
                });
            }
        }
        for b in self.scheduler.take_freed() {
            self.pool.poison_block(b);
        }
        for &(src, dst) in &plan.copies {
            match &mut self.staged {
                None => self.pool.copy_block(src, dst),
                Some(s) => {
                    if let Err(e) = s.copy_block(src, dst) {
                        // Blocks come from the scheduler, inside the pool: a device failure.
                        // The step must not read the block it did not fill: it fails.
                        tracing::error!(error = %e, "copy-on-write on the compute pool failed");
                        self.compute_fault = Some(e.to_string());
                    }
                }
            }
        }
        self.scheduler.finish_copies(&plan.copies);
        // Gauges show this step's allocations before any of its events goes out.
        self.update_gauges();
        plan
    }

    /// The step's input; what each logits row is for, in row order; and the prompt tokens it
    /// computes (decode rows are one token past the prompt).
    fn batch(&self, plan: &StepPlan) -> (BatchInput, Vec<Row>, usize) {
        let bs = self.info.block_size;
        let mut batch = BatchInput::default();
        let mut rows = Vec::new();
        let mut prefill_tokens = 0;
        for s in &plan.scheduled {
            let seq = self.scheduler.seq(s.index);
            let start = seq.num_computed;
            let end = start + s.num_tokens;
            let want_logits = end == seq.tokens.len();
            // Prompt logprobs: the row at position p scores prompt token p + 1; rows of the
            // positions still unsent, short of the last prompt position (that row is sampled).
            let prompt_rows = seq.prompt_rows.map_or(0..0, |next| {
                start.max(next - 1)..end.min(seq.prompt_len - 1)
            });
            if let Err(e) = batch.push_seq_with_rows(
                &seq.tokens[start..end],
                start,
                &seq.blocks,
                bs,
                prompt_rows.clone(),
                want_logits,
            ) {
                tracing::error!(error = %e, "scheduler produced an invalid batch");
            }
            rows.extend(prompt_rows.map(|position| Row::Prompt {
                index: s.index,
                position,
            }));
            if want_logits {
                rows.push(Row::Sample(s.index));
            }
            prefill_tokens += (start + s.num_tokens)
                .min(seq.prompt_len)
                .saturating_sub(start);
        }
        (batch, rows, prefill_tokens)
    }

    /// Runs the model: `(rows, vocab)` logits copied out once for the whole step, read row by
    /// row. On a model error every request in the step fails and leaves (`None`).
    fn forward(
        &mut self,
        plan: &StepPlan,
        batch: &BatchInput,
        prefill_tokens: usize,
    ) -> Option<(Vec<f32>, usize)> {
        let started = Instant::now();
        let kv: &mut dyn PagedKv = match &mut self.staged {
            Some(s) => s.as_mut(),
            None => &mut self.pool,
        };
        let logits = match self.compute_fault.take() {
            Some(e) => Err(pd_model::ModelError::Device(e)),
            None => self.model.forward(batch, kv).and_then(|l| {
                let vocab = l.dim(1)?;
                Ok((l.flatten_all()?.to_vec1::<f32>()?, vocab))
            }),
        };
        match logits {
            Ok(l) => {
                if prefill_tokens >= crate::metrics::PREFILL_RATE_MIN_TOKENS {
                    let secs = started.elapsed().as_secs_f64();
                    crate::metrics::ewma(
                        &self.metrics.prefill_tokens_per_second,
                        prefill_tokens as f64 / secs,
                    );
                }
                Some(l)
            }
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed");
                let ids: HashSet<RequestId> = plan
                    .scheduled
                    .iter()
                    .map(|s| self.scheduler.seq(s.index).request)
                    .collect();
                for id in ids {
                    if let Some(state) = self.requests.remove(&id) {
                        let _ = state.events.send(RequestEvent::Failed {
                            message: format!("model error: {e}"),
                        });
                    }
                    self.scheduler.remove_request(id);
                }
                self.update_gauges();
                None
            }
        }
    }

    /// Scores the prompt rows of the step: one [`RequestEvent::PromptLogprobs`] per sequence
    /// and step, for the prompt tokens its rows score, in order. A sequence preempted and
    /// computed again sends nothing twice (`prompt_rows` only moves forward).
    fn prompt_logprobs(&mut self, logits: &[f32], vocab: usize, rows: &[Row]) {
        // (rows, vocab) logits, row r for rows[r].
        let mut r = 0;
        while r < rows.len() {
            let Row::Prompt { index, position } = rows[r] else {
                r += 1;
                continue;
            };
            let run = rows[r..]
                .iter()
                .take_while(|row| matches!(row, Row::Prompt { index: i, .. } if *i == index))
                .count();
            let seq = self.scheduler.seq_mut(index);
            let Some(state) = self.requests.get(&seq.request) else {
                r += run;
                continue;
            };
            let k = state.params.prompt_logprobs.unwrap_or(0);
            let scored: Vec<crate::TokenLogprob> = (0..run)
                .filter_map(|j| {
                    let row = logits.get((r + j) * vocab..(r + j + 1) * vocab)?;
                    let token = *seq.tokens.get(position + j + 1)?;
                    Some(sampler::logprobs(row, token, k))
                })
                .collect();
            let next = position + run + 1;
            seq.prompt_rows = (next < seq.prompt_len).then_some(next);
            let _ = state.events.send(RequestEvent::PromptLogprobs {
                first: position + 1,
                logprobs: scored,
            });
            r += run;
        }
    }

    /// Turns each sampled row into tokens. A request's first sample also hands its prompt's KV
    /// off ([`Engine::hand_off`]) and forks its `n` children, who all take a token from the
    /// same row.
    fn sample(&mut self, logits: &[f32], vocab: usize, rows: &[Row]) -> StepOutcome {
        let mut out = StepOutcome::default();
        let sampled = rows
            .iter()
            .zip(logits.chunks_exact(vocab.max(1)))
            .filter_map(|(r, row)| match r {
                Row::Sample(index) => Some((row, index)),
                Row::Prompt { .. } => None,
            });
        for (row, &index) in sampled {
            let id = self.scheduler.seq(index).request;
            let Some(state) = self.requests.get_mut(&id) else {
                continue;
            };
            let mut children = vec![index];
            if !state.forked {
                state.forked = true;
                let (n, seed) = (state.params.n, state.params.seed.unwrap_or(0));
                self.hand_off(id, index, row);
                let (all, parked) = self.scheduler.fork(index, n, seed);
                children = all;
                out.parked.extend(parked);
            }
            for i in children {
                match self.emit_token(i, Pick::Sample(row)) {
                    Ok(true) => {
                        let s = self.scheduler.seq(i);
                        out.finished.insert((s.request, s.child));
                    }
                    Ok(false) => {}
                    Err(()) => {
                        out.gone.insert(id);
                    }
                }
            }
        }
        out
    }
}

/// What one logits row of a step is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    /// Sampled for `running[.0]`: its next token.
    Sample(usize),
    /// Scores prompt token `position + 1` of `running[index]` (prompt logprobs).
    Prompt { index: usize, position: usize },
}

/// What [`Engine::sample`] leaves for the scheduler's `retire`.
#[derive(Default)]
struct StepOutcome {
    /// Children that finished this step: (request, child).
    finished: HashSet<(RequestId, usize)>,
    /// Children forked with no room to run yet ([`crate::scheduler::Scheduler::fork`]).
    parked: Vec<(RequestId, usize)>,
    /// Requests whose client went away.
    gone: HashSet<RequestId>,
}

//! One token out of a child, in named steps: pick it (or take the one given), advance the
//! structured-output constraint, measure, detokenize, look for what ends the child (an ending
//! token, a stop string, a complete constraint, its length), hold back what could start a stop
//! string, send the token, and on a finish retain the turn, measure and send `Finished`.

use std::time::Instant;

use pd_grammar::{GrammarError, TokenMatcher};
use pd_tokenize::Tokenizer;
use tokio::sync::mpsc as tokio_mpsc;

use super::{Engine, RequestState};
use crate::metrics::EngineMetrics;
use crate::request::{FinishReason, RequestEvent, RequestId, SamplingParams, TokenLogprob};
use crate::sampler;
use crate::sequence::Sequence;

/// How [`Engine::emit_token`] gets its token.
#[derive(Clone, Copy)]
pub(super) enum Pick<'a> {
    /// Sampled from this row of logits (vocab,) with the request's parameters.
    Sample(&'a [f32]),
    /// Given: the producer's first token, attested ([`crate::RemoteKv::PulledWithFirstToken`]).
    Given(u32),
}

impl Engine {
    /// Emits `token` as the first token of `request`'s single sequence, which waits at the
    /// queue's front with its whole prompt held: no forward pass. The sequence then decodes from
    /// the next step like any other (its first step computes this token's KV), or, when this
    /// token finished it, ends here.
    pub(super) fn emit_first_token(&mut self, request: RequestId, token: u32) {
        // Emitting works on running sequences; this one is there only for the call.
        let Some(index) = self.scheduler.emit_from_front(request) else {
            return;
        };
        let outcome = self.emit_token(index, Pick::Given(token));
        self.scheduler.end_emit(index, outcome != Ok(false));
        if outcome.is_err() {
            self.abort(request);
        }
        self.update_gauges();
    }

    /// Picks a token for `running[index]` (samples it, or takes the one given), updates its
    /// text and sends the events. `Ok(true)`: the child finished. `Err(())`: the client is gone,
    /// or its structured output could not be followed (the caller aborts the request).
    pub(super) fn emit_token(&mut self, index: usize, pick: Pick<'_>) -> Result<bool, ()> {
        let seq = self.scheduler.seq_mut(index);
        let Some(state) = self.requests.get_mut(&seq.request) else {
            return Err(());
        };
        let picked = pick_token(seq, state, pick, self.info.vocab_size)
            .and_then(|(token, logprob)| advance(seq, token).map(|()| (token, logprob)));
        let (token, logprob) = match picked {
            Ok(picked) => picked,
            Err(e) => {
                fail_structured(&state.events, &self.metrics, seq.request, &e);
                return Err(());
            }
        };
        observe_latency(&self.metrics, state, seq);
        let reason = ending_token(token, &state.params, seq, &self.eos)
            .or_else(|| write_text(seq, state, &self.tokenizer, token))
            .or_else(|| length_reached(seq, state, &self.tokenizer, self.info.max_model_len));
        let text = releasable_text(seq, state.max_stop_len, reason.is_some());
        let event = RequestEvent::Token {
            child: seq.child,
            token_id: token,
            text,
            logprob,
        };
        if state.events.send(event).is_err() {
            return Err(());
        }
        let Some(reason) = reason else {
            return Ok(false);
        };
        self.finish_child(index, reason);
        Ok(true)
    }

    /// `running[index]` finished (`reason`; its last token is out): its turn retained when
    /// kept ([`Engine::retain_turn`]), the finish measured, [`RequestEvent::Finished`] sent, and
    /// the request closed with its last child.
    fn finish_child(&mut self, index: usize, reason: FinishReason) {
        let seq = self.scheduler.seq(index);
        let (id, child) = (seq.request, seq.child);
        let (prompt_tokens, completion_tokens) = (seq.prompt_len, seq.num_generated());
        self.retain_turn(index, reason);
        let Some(state) = self.requests.get_mut(&id) else {
            return;
        };
        // Measured before the client hears of it, so a scrape after the answer counts it.
        self.metrics.observe_finished(
            reason,
            prompt_tokens,
            completion_tokens,
            state.arrival,
            state.scheduled_at,
            state.first_token_at,
        );
        let _ = state.events.send(RequestEvent::Finished {
            child,
            reason,
            text: String::new(),
            completion_tokens,
        });
        state.open -= 1;
        if state.open == 0 {
            self.metrics
                .e2e_latency
                .observe(state.arrival.elapsed().as_secs_f64());
            self.metrics.requests_finished.inc();
            self.requests.remove(&id);
        }
    }
}

/// The child's next token: picked from the row ([`sampler::pick`]: masked by its constraint,
/// with the logprobs asked for), or the one given ([`take_given`]).
fn pick_token(
    seq: &mut Sequence,
    state: &RequestState,
    pick: Pick<'_>,
    vocab_size: usize,
) -> Result<(u32, Option<TokenLogprob>), GrammarError> {
    match pick {
        Pick::Sample(logits) => {
            let banned = state.banned(seq.num_generated());
            sampler::pick(
                logits,
                seq.grammar.as_mut(),
                &state.params,
                sampler::History::of(&seq.tokens, seq.prompt_len),
                banned,
                &mut seq.rng,
            )
        }
        Pick::Given(token) => {
            take_given(seq, &state.params, token, vocab_size).map(|()| (token, None))
        }
    }
}

/// A token given rather than picked here (the producer's first): the generator skips the draw a
/// pick would have taken; under a constraint, as one node would have, this position's mask is
/// computed (so the matcher and its caches stand where they would) and the token checked
/// against it.
fn take_given(
    seq: &mut Sequence,
    params: &SamplingParams,
    token: u32,
    vocab_size: usize,
) -> Result<(), GrammarError> {
    sampler::skip_draw(params, &mut seq.rng);
    let Some(grammar) = &mut seq.grammar else {
        return Ok(());
    };
    let mut scratch = vec![0.0f32; vocab_size];
    grammar.mask(&mut scratch)?;
    match scratch.get(token as usize) {
        Some(l) if l.is_finite() => Ok(()),
        _ => Err(GrammarError::Failed(format!(
            "the producer's first token {token} breaks the constraint"
        ))),
    }
}

/// Appends `token` to the child: its constraint moves past it first.
fn advance(seq: &mut Sequence, token: u32) -> Result<(), GrammarError> {
    if let Some(grammar) = &mut seq.grammar {
        grammar.accept(token)?;
    }
    seq.tokens.push(token);
    Ok(())
}

/// Time to first token or between tokens, and the token counted.
fn observe_latency(metrics: &EngineMetrics, state: &mut RequestState, seq: &mut Sequence) {
    let now = Instant::now();
    match (state.first_token_at, seq.last_token_at) {
        (None, _) => {
            state.first_token_at = Some(now);
            metrics
                .time_to_first_token
                .observe((now - state.arrival).as_secs_f64());
        }
        (_, Some(prev)) => metrics
            .inter_token_latency
            .observe((now - prev).as_secs_f64()),
        _ => {}
    }
    seq.last_token_at = Some(now);
    metrics.generation_tokens.inc();
}

/// [`FinishReason::Stop`] when `token` ends the child by itself, without text: an EOS (unless
/// `ignore_eos`) or one of `stop_token_ids`. A constrained output allows EOS only where it is
/// complete: it ends there even under `ignore_eos`.
fn ending_token(
    token: u32,
    params: &SamplingParams,
    seq: &Sequence,
    eos: &[u32],
) -> Option<FinishReason> {
    let eos_ends = !params.ignore_eos || seq.grammar.is_some();
    ((eos_ends && eos.contains(&token)) || params.stop_token_ids.contains(&token))
        .then_some(FinishReason::Stop)
}

/// Detokenizes `token` onto the child's text: [`FinishReason::Stop`] when a stop string turned
/// up in it ([`append_until_stop`]), or when the constraint is complete — nothing may follow
/// (the JSON value is closed, the choice made): done, without another step to pick the only
/// token left, EOS.
fn write_text(
    seq: &mut Sequence,
    state: &RequestState,
    tokenizer: &Tokenizer,
    token: u32,
) -> Option<FinishReason> {
    let piece = seq.decoder.step(tokenizer, token).unwrap_or_else(|e| {
        tracing::warn!(error = %e, token, "detokenization failed");
        String::new()
    });
    let stopped = append_until_stop(seq, state, &piece);
    (stopped || seq.grammar.as_ref().is_some_and(TokenMatcher::is_complete))
        .then_some(FinishReason::Stop)
}

/// Appends `piece` to the child's text and cuts it at the first stop string found; true when
/// one was. Stop strings count from `min_tokens` on (vLLM's rule), this token included, and
/// only where they start in text written from then on (earlier text was let through unchecked,
/// and may have been sent).
fn append_until_stop(seq: &mut Sequence, state: &RequestState, piece: &str) -> bool {
    let generated = seq.num_generated();
    let may_stop = generated >= state.params.min_tokens;
    if generated == state.params.min_tokens {
        seq.stop_floor = seq.text.len();
    }
    let search_from = seq
        .sent
        .saturating_sub(state.max_stop_len)
        .max(seq.stop_floor);
    seq.text.push_str(piece);
    let Some(at) = may_stop
        .then(|| find_stop(&seq.text, search_from, &state.params.stop))
        .flatten()
    else {
        return false;
    };
    seq.text.truncate(at);
    true
}

/// [`FinishReason::Length`] when the child generated `max_tokens` or filled the context; the
/// text the decoder still held is written out then.
fn length_reached(
    seq: &mut Sequence,
    state: &RequestState,
    tokenizer: &Tokenizer,
    max_model_len: usize,
) -> Option<FinishReason> {
    if seq.num_generated() < state.max_tokens && seq.tokens.len() < max_model_len {
        return None;
    }
    if let Ok(rest) = seq.decoder.flush(tokenizer) {
        seq.text.push_str(&rest);
    }
    Some(FinishReason::Length)
}

/// The child's text the client may have now, marked sent: all of it once `finished` or without
/// stop strings, else all but what could be the start of a stop string (held back).
fn releasable_text(seq: &mut Sequence, max_stop_len: usize, finished: bool) -> String {
    let mut upto = if finished || max_stop_len == 0 {
        seq.text.len()
    } else {
        seq.text.len().saturating_sub(max_stop_len - 1)
    };
    while !seq.text.is_char_boundary(upto) {
        upto -= 1;
    }
    let text = if upto > seq.sent {
        seq.text[seq.sent..upto].to_string()
    } else {
        String::new()
    };
    seq.sent = seq.sent.max(upto);
    text
}

/// Byte index of the first stop string found in `text[from..]` (earliest match wins).
fn find_stop(text: &str, mut from: usize, stops: &[String]) -> Option<usize> {
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| i + from))
        .min()
}

/// Ends a request whose structured output could not be followed: the client gets the reason
/// ([`RequestEvent::Failed`]) and the caller aborts it (the `Err` of `emit_token`).
fn fail_structured(
    events: &tokio_mpsc::UnboundedSender<RequestEvent>,
    metrics: &EngineMetrics,
    request: RequestId,
    e: &GrammarError,
) {
    tracing::warn!(%request, error = %e, "structured output failed");
    metrics.structured_failures.inc();
    let _ = events.send(RequestEvent::Failed {
        message: e.to_string(),
    });
}

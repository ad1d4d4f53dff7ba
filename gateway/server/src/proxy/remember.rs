//! Phase 5: after a served turn, what the gateway keeps — the turn a node retained (indexed by
//! its block hashes), the earlier turn it continues retired, a `/v1/responses` answer stored
//! for `previous_response_id` (and written to the state store, now or, when it is out, once it
//! is back: [`write_unsaved_turns`]).

use std::sync::Arc;

use serde_json::Value;

use super::exchange::{Outcome, Progress};
use super::prepare::{Prepared, ResponsesTurn};
use super::{Gateway, Shared};
use crate::conversation::{self, Holding, NewTurn};
use crate::error::GatewayError;
use crate::state::StateError;

impl Gateway {
    /// What a request that ended with `outcome` leaves behind. A batch's answers are several
    /// turns, none of them one conversation's next: nothing is kept of them.
    pub(super) fn remember(
        &self,
        req: &mut Prepared,
        st: &mut Progress,
        outcome: &Result<Outcome, GatewayError>,
    ) {
        let pulled = req.pulled().is_some();
        if !(matches!(outcome, Ok(Outcome::Ok)) && req.analyzed.prompts == 1) {
            if let Some(h) = req.held.as_ref().filter(|_| pulled) {
                // Pulled or not, that lease may be gone now: do not offer it again.
                self.0.holdings.remove(h.holding.last_hash);
            }
            return;
        }
        let s = &self.0;
        let m = &s.metrics;
        let captured = std::mem::take(&mut st.captured);
        if captured.hidden {
            m.retained_params_hidden.inc();
        }
        let kept = captured
            .params
            .as_ref()
            .and_then(Holding::from_params)
            .map(|mut k| {
                k.prompt_key = req.prompt_key;
                k
            });
        if let Some(h) = &req.held
            && (pulled || kept.is_some())
        {
            // The earlier turn was pulled (its lease ended there) or this turn supersedes it: its
            // blocks are a prefix of the new holding's. Release a lease nobody pulled.
            s.holdings.remove(h.holding.last_hash);
            if !pulled {
                self.release(Some(&h.holding.params), "superseded");
            }
        }
        let held = kept.as_ref().map(|k| k.last_hash);
        if let Some(k) = kept {
            m.retained_turns.inc();
            s.holdings.insert(k);
        }
        m.conversation_holdings.set(s.holdings.len() as i64);
        if !st.turn_kept
            && let (Some(turn), Some(response)) = (req.turn.take(), &captured.response)
            && let Some((id, evicted)) = self.store_turn(turn, response, held)
        {
            self.persist_turn(&id, evicted);
        }
    }

    /// Stores the `/v1/responses` turn `req` answered with `response` in memory (`held`: the
    /// key of the KV a node retained of it); its id and the turns evicted for it, when kept.
    fn store_turn(
        &self,
        turn: ResponsesTurn,
        response: &Value,
        held: Option<u64>,
    ) -> Option<(String, Vec<Arc<str>>)> {
        let s = &self.0;
        if !turn.store {
            return None;
        }
        let id = response.get("id").and_then(Value::as_str)?;
        let output = conversation::output_items(response);
        let kept = conversation::as_retrieved(response, turn.parent.as_deref());
        let stored = s.responses.put_evicting(
            id,
            NewTurn {
                owner: turn.owner,
                parent: turn.parent.as_deref(),
                input: turn.input,
                output,
                response: kept,
                held,
            },
        );
        s.metrics
            .responses_stored_bytes
            .set(s.responses.bytes() as i64);
        match stored {
            Ok(evicted) => {
                s.metrics.responses_evicted.inc_by(evicted.len() as u64);
                Some((id.to_owned(), evicted))
            }
            // A node answered with an id another key's response holds: that one stays.
            Err(taken) => {
                tracing::warn!("response not stored: {taken}");
                None
            }
        }
    }

    /// With a state store: stores the `/v1/responses` turn `req` answered (`captured` from its
    /// answer) in memory and in the store, awaited, before the client gets the end of the
    /// answer, so another gateway (or this one, restarted) finds it as soon as the client can
    /// name it; then [`Gateway::remember`] does not store it again. A failed write is counted
    /// and logged: the answer still goes out, the turn stays in memory.
    pub(super) async fn keep_turn_now(
        &self,
        req: &Prepared,
        captured: &crate::answer::Captured,
        st_kept: &mut bool,
    ) {
        let (Some(state), Some(response)) = (&self.0.state, &captured.response) else {
            return;
        };
        if *st_kept || req.analyzed.prompts != 1 {
            return;
        }
        let held = captured
            .params
            .as_ref()
            .and_then(Holding::from_params)
            .map(|k| k.last_hash);
        *st_kept = true;
        let Some(turn) = req.turn.clone() else {
            return;
        };
        let Some((id, evicted)) = self.store_turn(turn, response, held) else {
            return;
        };
        if let Some(record) = self.0.responses.record(&id) {
            let r = state.put_turn(&id, &record).await;
            self.count_state("write_turn", &r);
            self.unsaved_if_failed(&id, &r);
        }
        self.persist_turn_evictions(evicted);
    }

    /// A turn whose write failed waits for [`write_unsaved_turns`].
    fn unsaved_if_failed(&self, id: &str, r: &Result<(), StateError>) {
        if r.is_err() && !self.0.unsaved.add(id) {
            tracing::warn!(
                "too many turns wait for the state store: the oldest stays in memory only"
            );
        }
    }

    /// Counts a state store call's outcome.
    pub(super) fn count_state<T>(&self, op: &str, r: &Result<T, StateError>) {
        let outcome = if r.is_ok() { "ok" } else { "error" };
        self.0
            .metrics
            .state_calls
            .with_label_values(&[op, outcome])
            .inc();
        if let Err(e) = r {
            tracing::warn!(op, error = %e, "state store call failed");
        }
    }

    /// Makes memory hold response `id` and the turns it continues, reading what it lacks from
    /// the state store (a restart, or another replica answered them). Nothing without one.
    ///
    /// # Errors
    /// [`GatewayError::StateUnavailable`] when the store does not answer.
    pub(super) async fn fill_responses(&self, id: &str) -> Result<(), GatewayError> {
        let Some(state) = &self.0.state else {
            return Ok(());
        };
        let r = self.0.responses.fill_from(state, id).await;
        self.count_state("read_turn", &r);
        r.map(|_| ())
            .map_err(|e| GatewayError::StateUnavailable(e.to_string()))
    }

    /// Writes response `id` to the state store and forgets the `evicted` ones there, behind
    /// the answer (a failure is counted and logged: the turn stays in memory).
    fn persist_turn(&self, id: &str, evicted: Vec<Arc<str>>) {
        let Some(state) = self.0.state.clone() else {
            return;
        };
        let record = self.0.responses.record(id);
        let (id, me) = (id.to_owned(), self.clone());
        tokio::spawn(async move {
            if let Some(record) = record {
                let r = state.put_turn(&id, &record).await;
                me.count_state("write_turn", &r);
                me.unsaved_if_failed(&id, &r);
            }
        });
        self.persist_turn_evictions(evicted);
    }

    /// Forgets `evicted` turns in the state store, behind the answer.
    fn persist_turn_evictions(&self, evicted: Vec<Arc<str>>) {
        let Some(state) = self.0.state.clone() else {
            return;
        };
        if evicted.is_empty() {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let ids: Vec<String> = evicted.iter().map(|e| e.to_string()).collect();
            let r = state.delete_turns(&ids).await;
            me.count_state("delete_turns", &r);
        });
    }
}

/// With a state store: every second, writes the turns whose write failed ([`Shared::unsaved`]),
/// oldest first, stopping at the first failure (the store is still out); a turn gone from
/// memory meanwhile (deleted, evicted) is not written. Runs for the gateway's life.
pub async fn write_unsaved_turns(shared: Arc<Shared>) {
    let Some(state) = shared.state.clone() else {
        return;
    };
    let gateway = Gateway(shared);
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut ids = gateway.0.unsaved.take().into_iter();
        while let Some(id) = ids.next() {
            let Some(record) = gateway.0.responses.record(&id) else {
                continue;
            };
            let r = state.put_turn(&id, &record).await;
            gateway.count_state("write_turn_retry", &r);
            if r.is_err() {
                gateway
                    .0
                    .unsaved
                    .put_back(std::iter::once(id).chain(ids).collect());
                break;
            }
        }
    }
}

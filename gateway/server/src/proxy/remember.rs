//! Phase 5: after a served turn, what the gateway keeps — the turn a node retained (indexed by
//! its block hashes), the earlier turn it continues retired, a `/v1/responses` answer stored
//! for `previous_response_id`.

use std::sync::Arc;

use serde_json::Value;

use super::Gateway;
use super::exchange::{Outcome, Progress};
use super::prepare::Prepared;
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
        if let (Some(turn), Some(response)) = (req.turn.take(), captured.response)
            && turn.store
            && let Some(id) = response.get("id").and_then(Value::as_str)
        {
            let output = conversation::output_items(&response);
            let kept = conversation::as_retrieved(&response, turn.parent.as_deref());
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
            match stored {
                Ok(evicted) => {
                    m.responses_evicted.inc_by(evicted.len() as u64);
                    self.persist_turn(id, evicted);
                }
                // A node answered with an id another key's response holds: that one stays.
                Err(taken) => tracing::warn!("response not stored: {taken}"),
            }
            m.responses_stored_bytes.set(s.responses.bytes() as i64);
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
            }
            if !evicted.is_empty() {
                let ids: Vec<String> = evicted.iter().map(|e| e.to_string()).collect();
                let r = state.delete_turns(&ids).await;
                me.count_state("delete_turns", &r);
            }
        });
    }
}

//! Phase 5: after a served turn, what the gateway keeps — the turn a node retained (indexed by
//! its block hashes), the earlier turn it continues retired, a `/v1/responses` answer stored
//! for `previous_response_id`.

use serde_json::Value;

use super::Gateway;
use super::exchange::{Outcome, Progress};
use super::prepare::Prepared;
use crate::conversation::{self, Holding, NewTurn};
use crate::error::GatewayError;

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
            let stored = s.responses.put(
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
                Ok(evicted) => m.responses_evicted.inc_by(evicted),
                // A node answered with an id another key's response holds: that one stays.
                Err(taken) => tracing::warn!("response not stored: {taken}"),
            }
            m.responses_stored_bytes.set(s.responses.bytes() as i64);
        }
    }
}

//! The small endpoints answered at the front door: health, metrics, the model list, stored
//! `/v1/responses` turns, and vLLM's tokenizer endpoints.

use pingora::prelude::Session;
use serde_json::{Value, json};

use super::{Gateway, Placed, bearer_key, respond, respond_error};
use crate::conversation::{self, Owner};
use crate::error::GatewayError;
use crate::tokenizer_api;

/// A model's card on `/v1/models`.
fn model_card(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "pd-serve"})
}

impl Gateway {
    /// Every route but the generation APIs and the tokenizer endpoints.
    pub(super) async fn endpoint(&self, session: &mut Session, method: &str, path: &str) {
        match (method, path) {
            ("GET", "/health") => {
                let nodes = self.0.cluster.read().nodes.len();
                let (status, word) = if self.0.drain.is_draining() {
                    (503, "draining")
                } else {
                    (200, "ok")
                };
                let body = json!({"status": word, "nodes": nodes}).to_string();
                respond(session, status, "application/json", body.into()).await;
            }
            ("GET", "/metrics") => {
                for (role, n) in self.0.cluster.count_by_role() {
                    self.0
                        .metrics
                        .nodes_up
                        .with_label_values(&[crate::cluster::role_label(role)])
                        .set(n as i64);
                }
                let m = &self.0.metrics;
                m.in_flight.set(self.0.admission.in_flight() as i64);
                m.queued.set(self.0.admission.queued() as i64);
                let body = m.render();
                respond(session, 200, "text/plain; version=0.0.4", body.into()).await;
            }
            ("GET", "/v1/models") => {
                let data: Vec<Value> = self
                    .0
                    .cluster
                    .live_models()
                    .into_iter()
                    .map(|m| model_card(&m))
                    .collect();
                let body = json!({"object": "list", "data": data}).to_string();
                respond(session, 200, "application/json", body.into()).await;
            }
            ("GET", p) if p.starts_with("/v1/models/") => {
                // The SDKs' `models.retrieve`; the id may hold slashes (`org/name`).
                let id = &p["/v1/models/".len()..];
                if self.0.cluster.live_models().iter().any(|m| **m == *id) {
                    let body = model_card(id).to_string();
                    respond(session, 200, "application/json", body.into()).await;
                } else {
                    respond_error(session, &GatewayError::ModelNotFound(id.to_owned())).await;
                }
            }
            ("GET" | "DELETE", p) if p.starts_with("/v1/responses/") => {
                self.stored_response(session, method, path).await;
            }
            _ => {
                let e = GatewayError::UnknownRoute {
                    method: method.to_owned(),
                    path: path.to_owned(),
                };
                respond_error(session, &e).await;
            }
        }
    }

    /// `GET /v1/responses/{id}` (the SDKs' `responses.retrieve`), `GET
    /// /v1/responses/{id}/input_items` (`responses.input_items.list`) and `DELETE
    /// /v1/responses/{id}` (`responses.delete`), from the turns kept for
    /// `previous_response_id`.
    async fn stored_response(&self, session: &mut Session, method: &str, path: &str) {
        let store = &self.0.responses;
        // Another key's response is not found, as if it never was.
        let owner = Owner::of(bearer_key(session));
        let rest = &path["/v1/responses/".len()..];
        let (id, sub) = match rest.split_once('/') {
            Some((id, sub)) => (id, Some(sub)),
            None => (rest, None),
        };
        if self.0.state.is_some()
            && store.input_items(id, owner).is_none()
            && let Err(e) = self.fill_responses(id).await
        {
            respond_error(session, &e).await;
            return;
        }
        let answer = match (method, sub) {
            ("GET", None) => store.response(id, owner).map(|r| r.to_string()),
            ("GET", Some("input_items")) => {
                let query = session.req_header().uri.query().unwrap_or_default();
                match conversation::ItemsQuery::parse(query) {
                    Ok(q) => store
                        .input_items(id, owner)
                        .map(|items| conversation::item_list(id, items, &q).to_string()),
                    Err(e) => {
                        respond_error(session, &GatewayError::invalid(e.param, e.message)).await;
                        return;
                    }
                }
            }
            ("DELETE", None) => {
                let deleted = self.delete_response(id, owner);
                if let Some(state) = &self.0.state
                    && deleted.is_some()
                {
                    // From the store too (which tells the other gateways): else a restart, or
                    // another gateway, would bring it back.
                    let r = state.delete_turns(&[id.to_owned()]).await;
                    self.count_state("delete_turns", &r);
                    if let Err(e) = r {
                        let e = GatewayError::StateUnavailable(e.to_string());
                        respond_error(session, &e).await;
                        return;
                    }
                }
                deleted
            }
            _ => {
                let e = GatewayError::UnknownRoute {
                    method: method.to_owned(),
                    path: path.to_owned(),
                };
                respond_error(session, &e).await;
                return;
            }
        };
        self.0
            .metrics
            .responses_stored_bytes
            .set(store.bytes() as i64);
        match answer {
            Some(body) => respond(session, 200, "application/json", body.into()).await,
            None => respond_error(session, &GatewayError::ResponseNotFound(id.to_owned())).await,
        }
    }

    /// `DELETE /v1/responses/{id}` in memory: the answer's body when `owner` stored it; the
    /// KV a node still retains of that turn is released with it.
    fn delete_response(&self, id: &str, owner: Owner) -> Option<String> {
        self.0.responses.delete(id, owner).map(|deleted| {
            // The KV a node still retains of that turn goes with it.
            if let Some(h) = deleted.held.and_then(|key| self.0.holdings.remove(key)) {
                self.release(Some(&h.params), "response_deleted");
                self.0
                    .metrics
                    .conversation_holdings
                    .set(self.0.holdings.len() as i64);
            }
            json!({"id": id, "object": "response", "deleted": true}).to_string()
        })
    }

    /// vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info`, answered here
    /// ([`tokenizer_api`]), admitted as a generation request is (one slot: tokenizing a long
    /// prompt is real work) with the smaller body limit.
    pub(super) async fn tokenizer_endpoint(
        &self,
        session: &mut Session,
        endpoint: tokenizer_api::Endpoint,
    ) {
        let answered = async {
            let limit = self.0.config.max_small_body;
            let (_slot, body) = match self.take_place(session, limit).await? {
                Placed::Admitted(slot, body) => (slot, body),
                Placed::Gone => return Ok(None),
            };
            let query = session.req_header().uri.query().map(str::to_owned);
            let cluster = self.0.cluster.clone();
            tokio::task::spawn_blocking(move || {
                tokenizer_api::answer(&cluster, endpoint, query.as_deref(), &body)
            })
            .await?
            .map(Some)
        }
        .await;
        match answered {
            Ok(Some(body)) => respond(session, 200, "application/json", body.into()).await,
            Ok(None) => {}
            Err(e) => respond_error(session, &e).await,
        }
    }
}

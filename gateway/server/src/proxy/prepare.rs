//! Phase 2: everything before the first node is called — the body read as JSON, untrusted
//! `kv_transfer_params` stripped, routing fields read, a `previous_response_id` conversation
//! rebuilt, the prompt tokenized and hashed, the retained turn it continues looked up, the
//! policy asked, and its decision interpreted into a [`Plan`].

use std::time::SystemTime;

use pd_policy::{Api, Request, Route};
use pd_tokenize::Tokenizer;
use pd_tokenize::prompt::{GIVEN_IDS_FIELD, PromptInput, PromptKind};
use pingora::prelude::Session;
use serde_json::{Map, Value};
use tracing::{Instrument, debug, warn};

use super::exchange::PhaseClock;
use super::plan::{self, Facts, HeldTurn, Plan};
use super::{Gateway, bearer_key, request_id};
use crate::answer::Capture;
use crate::cluster::{NodeRef, OnNode, Snapshot};
use crate::conversation::{self, Holding, Owner};
use crate::error::GatewayError;
use crate::openai::{self, Analyzed, KV_FIELD};

/// Everything read and decided about one request.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(super) api: Api,
    /// The body as it goes to the nodes (the client's, with the gateway's token ids).
    pub(super) body: Map<String, Value>,
    pub(super) analyzed: Analyzed,
    pub(super) snapshot: Snapshot,
    /// The decision, interpreted.
    pub(super) plan: Plan,
    /// How the plan uses the retained turn the prompt continues (`reverse_pulls_total{how}`).
    pub(super) continued: Option<&'static str>,
    /// The client may see `kv_transfer_params` in answers.
    pub(super) trusted: bool,
    /// The retained turn this prompt continues, when a live node holds one.
    pub(super) held: Option<Held>,
    /// A `/v1/responses` request: what to store with its answer.
    pub(super) turn: Option<ResponsesTurn>,
    /// The prompt's last whole block's chain hash and the tokens up to it: the partial key of
    /// the turn a node may keep from this request.
    pub(super) prompt_key: Option<(u64, u32)>,
}

impl Prepared {
    /// What to take from the answer.
    pub(super) fn capture(&self) -> Capture {
        Capture {
            api: self.api,
            hide_params: !self.trusted,
            want_response: self.turn.as_ref().is_some_and(|t| t.store),
        }
    }

    /// The node path of the request's API.
    pub(super) fn path(&self) -> &'static str {
        openai::api_path(self.api)
    }

    /// The retained turn the plan pulls, if it pulls one.
    pub(super) fn pulled(&self) -> Option<&Holding> {
        let pull = match &self.plan {
            Plan::Whole { pull, .. } => *pull,
            Plan::Split(s) => s.pull,
            Plan::Reject { .. } => false,
        };
        self.held.as_ref().filter(|_| pull).map(|h| &h.holding)
    }
}

/// A retained turn a request's prompt continues.
#[derive(Debug)]
pub(super) struct Held {
    /// The holder's index in the view.
    pub(super) index: u32,
    /// The prompt continues every block held: the turn can be pulled. Otherwise (a resent
    /// history that re-encodes differently) only the holder's prefix cache serves it.
    pub(super) exact: bool,
    pub(super) holding: Holding,
}

/// A `/v1/responses` request, as it will be stored once answered.
#[derive(Debug, Clone)]
pub(super) struct ResponsesTurn {
    /// The API key it came with: the stored turn is that key's alone.
    pub(super) owner: Owner,
    /// `previous_response_id`.
    pub(super) parent: Option<String>,
    /// This turn's own input items.
    pub(super) input: Vec<Value>,
    /// `store` (default true).
    pub(super) store: bool,
}

fn tokenize_inline(tokenizer: &Tokenizer, prompt: PromptKind) -> Result<Vec<u32>, GatewayError> {
    Ok(pd_tokenize::prompt::prompt_tokens(tokenizer, prompt)?)
}

/// The body as a JSON object.
pub(crate) fn json_object(raw: &[u8]) -> Result<Map<String, Value>, GatewayError> {
    match serde_json::from_slice::<Value>(raw) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(GatewayError::invalid(
            "body",
            "the body must be a JSON object",
        )),
        Err(e) => Err(GatewayError::InvalidRequest {
            message: format!("the body is not valid JSON: {e}"),
            param: None,
        }),
    }
}

impl Gateway {
    /// A model no node serves: a 404, but a 503 to retry while the gateway has only just
    /// started and no node has registered yet (a restarted replica behind a balancer must not
    /// tell clients the model does not exist).
    fn unknown_model(&self, model: &str) -> GatewayError {
        let s = &self.0;
        if std::time::Instant::now() < s.config.settled_at && s.cluster.live_models().is_empty() {
            return GatewayError::NoCapacity {
                model: model.to_owned(),
                why: "the gateway has just started and its nodes are still registering".into(),
            };
        }
        GatewayError::ModelNotFound(model.to_owned())
    }

    /// The prompt's tokens (tokenized with the model's registered tokenizer, on the blocking
    /// pool when long), its full blocks' chain hashes (from the deployment's key and the
    /// request's salt, exactly as on the nodes), and the model's block size.
    pub(crate) async fn prompt_blocks(
        &self,
        analyzed: &Analyzed,
    ) -> Result<(Vec<u32>, Vec<u64>, u32), GatewayError> {
        let s = &self.0;
        let (tokenizer, block_size) = s
            .cluster
            .model(&analyzed.model)
            .ok_or_else(|| self.unknown_model(&analyzed.model))?;
        let prompt = analyzed.prompt.clone();
        let tokens = if pd_tokenize::prompt::tokenize_inline_ok(&prompt) {
            tokenize_inline(&tokenizer, prompt)?
        } else {
            tokio::task::spawn_blocking(move || tokenize_inline(&tokenizer, prompt)).await??
        };
        let root = pd_kv_pool::root_hash(
            s.cluster.hash_key(&analyzed.model),
            analyzed.cache_salt.as_deref(),
        );
        let hashes = pd_kv_pool::hash_full_blocks_from(root, &tokens, block_size as usize)
            .into_iter()
            .map(|h| h.0)
            .collect();
        Ok((tokens, hashes, block_size))
    }

    /// Phase 2; also returns the decode nodes reserved from the decision on (their sends come
    /// only after P's phase), so the next decisions see them.
    pub(super) async fn prepare(
        &self,
        session: &mut Session,
        api: Api,
        raw: &[u8],
    ) -> Result<(Prepared, Vec<OnNode>), GatewayError> {
        let s = &self.0;
        let mut clock = PhaseClock::new(&s.metrics);
        let mut body = json_object(raw)?;
        // The prompt's ids are the gateway's to send (below), computed from the prompt fields;
        // a client's own never reach a node.
        body.remove(GIVEN_IDS_FIELD);
        let trusted = self.trusted(session);
        let mut client_params = body.get(KV_FIELD).filter(|v| !v.is_null()).cloned();
        if client_params.is_some() && !trusted {
            body.remove(KV_FIELD);
            client_params = None;
            s.metrics.kv_params_stripped.inc();
            warn!(
                "stripped kv_transfer_params from an untrusted client (only --trusted-client-token may send them)"
            );
        }
        let session_key = session
            .req_header()
            .headers
            .get("x-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        // An unknown model is a 404 whatever else is wrong with the request.
        if let Some(Value::String(model)) = body.get("model")
            && s.cluster.model(model).is_none()
        {
            return Err(self.unknown_model(model));
        }
        let turn = match api {
            Api::Responses => Some(
                self.responses_turn(&mut body, Owner::of(bearer_key(session)))
                    .await?,
            ),
            _ => None,
        };
        let mut analyzed = openai::analyze(api, &body, session_key.as_deref())?;
        if let Some(parent) = turn.as_ref().and_then(|t| t.parent.clone()) {
            analyzed.conversation_key = Some(parent);
        }
        let tokenize = pd_telemetry::phase!("tokenize", request_id(session).unwrap_or_default());
        let (tokens, hashes, block_size) =
            self.prompt_blocks(&analyzed).instrument(tokenize).await?;
        clock.lap("tokenize");
        let prompt_key = hashes.last().map(|&h| {
            let tokens = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
            (h, tokens.saturating_mul(block_size))
        });
        let mut snapshot = s.cluster.snapshot(&analyzed.model, &hashes);
        check_fits(&snapshot, &analyzed, tokens.len())?;
        let given_as_ids = matches!(
            analyzed.prompt,
            PromptKind::Completion(PromptInput::Tokens(_))
        );
        if snapshot.take_token_ids && !given_as_ids && analyzed.prompts == 1 {
            // Tokenized once for the cluster: P and D take these ids instead of rendering and
            // tokenizing the prompt again (the same ids: the nodes' own tokenizer and template,
            // from their registration, through the same `pd_tokenize::prompt` code). A
            // completions prompt sent as ids already is one: nothing to add.
            let ids = tokens.iter().map(|&t| Value::from(t)).collect();
            body.insert(GIVEN_IDS_FIELD.to_owned(), Value::Array(ids));
        }
        let held = match client_params {
            None => self.held(&hashes, &mut snapshot),
            Some(_) => None,
        };
        let request = Request {
            seq: s.router.next_seq(),
            api,
            prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            block_size,
            block_hashes: hashes,
            prefix_blocks: snapshot.prefix_blocks.clone(),
            n: analyzed.n,
            max_tokens: analyzed.max_tokens,
            stream: analyzed.stream,
            conversation_key: analyzed.conversation_key.clone(),
        };
        clock.lap("view");
        let policy = pd_telemetry::phase!("policy", request_id(session).unwrap_or_default());
        let decided = policy.in_scope(|| {
            s.router.decide(
                &request,
                &snapshot.view,
                &snapshot.measured,
                &snapshot.names,
            )
        })?;
        drop(policy);
        clock.lap("policy");
        debug!(policy = %decided.policy, version = %decided.version, route = ?decided.decision.route, "decided");
        self.count_prefix_hit(&snapshot, &decided.decision.route, block_size);
        if let Route::Split(_) = &decided.decision.route
            && !snapshot
                .view
                .nodes
                .iter()
                .any(|n| n.role == pd_policy::Role::Decode)
        {
            return Err(GatewayError::NoCapacity {
                model: analyzed.model.clone(),
                why: "no decode node is live".into(),
            });
        }
        let facts = Facts {
            held: held.as_ref().map(|h| HeldTurn {
                index: h.index,
                exact: h.exact,
                tokens: h.holding.tokens,
            }),
            reverse_pull: decided.decision.reverse_pull,
            one_node: analyzed.scores_prompt || analyzed.prompts > 1,
            client_asks_prefill: client_params
                .as_ref()
                .map(|p| p.get("do_remote_decode") == Some(&Value::Bool(true))),
            n: analyzed.n,
        };
        let planned = plan::plan(decided.decision.route, &facts);
        if let Some(how) = planned.how {
            s.metrics.reverse_pulls.with_label_values(&[how]).inc();
        }
        let reserved = match &planned.plan {
            Plan::Split(sp) => sp
                .reserved_nodes()
                .filter_map(|i| snapshot.nodes.get(i as usize))
                .map(NodeRef::reserve)
                .collect(),
            _ => Vec::new(),
        };
        let prepared = Prepared {
            api,
            body,
            analyzed,
            snapshot,
            plan: planned.plan,
            continued: planned.how,
            trusted,
            held,
            turn,
            prompt_key,
        };
        Ok((prepared, reserved))
    }

    /// Counts the prefix-cache hit of the node that computes the prompt.
    fn count_prefix_hit(&self, snapshot: &Snapshot, route: &Route, block_size: u32) {
        let first = match route {
            Route::Split(sp) => sp.prefill.first().copied(),
            Route::Whole(c) => c.first().copied(),
            Route::Reject(_) => None,
        };
        if let Some(i) = first {
            let held = snapshot.prefix_blocks.get(i as usize).copied().unwrap_or(0);
            self.0
                .metrics
                .prefix_hit_tokens
                .inc_by(u64::from(held) * u64::from(block_size));
        }
    }

    /// A `/v1/responses` request: what to store with its answer; with `previous_response_id`,
    /// its `input` becomes the stored conversation followed by the new items (the field itself
    /// is removed: the nodes keep no conversations).
    async fn responses_turn(
        &self,
        body: &mut Map<String, Value>,
        owner: Owner,
    ) -> Result<ResponsesTurn, GatewayError> {
        let store = !matches!(body.get("store"), Some(Value::Bool(false)));
        let input = body
            .get("input")
            .map(conversation::input_items)
            .unwrap_or_default();
        let parent = match body.remove("previous_response_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) => Some(id),
            Some(v) => {
                return Err(GatewayError::invalid(
                    "previous_response_id",
                    format!("previous_response_id must be a string, got {v}"),
                ));
            }
        };
        if let Some(id) = &parent {
            let mut history = self.0.responses.history(id, owner);
            if history.is_err() && self.0.state.is_some() {
                // Not in memory: this gateway restarted, or another replica answered it.
                self.fill_responses(id).await?;
                history = self.0.responses.history(id, owner);
            }
            let mut items =
                history.map_err(|e| GatewayError::PreviousResponseNotFound(e.to_string()))?;
            items.extend(input.iter().cloned());
            body.insert("input".into(), Value::Array(items));
        }
        Ok(ResponsesTurn {
            owner,
            parent,
            input,
            store,
        })
    }

    /// The retained turn `hashes` (a prompt's block hashes) continues, if its holder is live and
    /// has not restarted since; shown to the policy on the holder's node
    /// (`conversation-tokens`, `conversation-expiry-ms`).
    fn held(&self, hashes: &[u64], snapshot: &mut Snapshot) -> Option<Held> {
        let now = SystemTime::now();
        let (found, expired) = self.0.holdings.longest(hashes, now);
        if expired > 0 {
            self.0
                .metrics
                .conversation_dropped
                .with_label_values(&["expired"])
                .inc_by(u64::from(expired));
        }
        let found = found?;
        debug!(holder = %found.holding.engine_id, tokens = found.tokens, exact = found.exact, "the prompt continues a retained turn");
        let holding = found.holding;
        // Not live now: it may come back (a reconnect); the lease expires on its own.
        let index = snapshot
            .nodes
            .iter()
            .position(|n| n.engine_id == holding.engine_id)?;
        // Epoch 0 on either side: unknown (a node that reports none, e.g. a static node).
        let node_epoch = snapshot.nodes[index].epoch;
        if holding.epoch != 0 && node_epoch != 0 && node_epoch != holding.epoch {
            // Restarted: whatever it held is gone.
            self.0.holdings.remove(holding.last_hash);
            self.0
                .metrics
                .conversation_dropped
                .with_label_values(&["holder_restarted"])
                .inc();
            return None;
        }
        let node = &mut snapshot.view.nodes[index];
        node.conversation_tokens = found.tokens;
        node.conversation_expiry_ms = holding.expiry_ms(now);
        Some(Held {
            index: u32::try_from(index).ok()?,
            exact: found.exact,
            holding,
        })
    }
}

/// Refuses a request no live node can take: none of its model is live, or its prompt leaves
/// no room for an answer (the nodes' own 400, answered before any of them is asked; a
/// `max_model_len` of 0: no node said, they answer for themselves).
pub(crate) fn check_fits(
    snapshot: &Snapshot,
    analyzed: &Analyzed,
    prompt_len: usize,
) -> Result<(), GatewayError> {
    if snapshot.view.nodes.is_empty() {
        return Err(GatewayError::NoCapacity {
            model: analyzed.model.clone(),
            why: "no node of this model is live".into(),
        });
    }
    if snapshot.max_model_len > 0 && prompt_len >= snapshot.max_model_len as usize {
        return Err(GatewayError::invalid(
            openai::prompt_param(analyzed.api),
            format!(
                "This model's maximum context length is {} tokens. However, your prompt has {} tokens \
                 (at least one token must be left for the completion).",
                snapshot.max_model_len, prompt_len
            ),
        ));
    }
    Ok(())
}

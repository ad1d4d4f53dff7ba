//! The front door: a pingora [`ProxyHttp`] whose `request_filter` answers every route itself.
//!
//! pingora proxies one upstream per request and cannot easily rewrite a large body before
//! choosing it (DESIGN §7), while a P/D request needs the whole body before routing and then
//! two upstream calls. So the LLM routes are served in `request_filter`: read the body, ask the
//! policy, call P then D over pooled keep-alive HTTP, stream D's answer back with
//! `write_response_body`, and return `Ok(true)` ("response already sent"). `upstream_peer` is
//! never reached.
//!
//! One request, phase by phase (each a small method below):
//! 1. [`Gateway::prepare`]: body → JSON, untrusted `kv_transfer_params` stripped, routing
//!    fields read, prompt tokenized, block hashes, the view, the policy's decision.
//! 2. [`Gateway::whole`]: one node serves the request; ranked failover before any byte is sent.
//! 3. [`Gateway::prefill`]: P with `do_remote_decode`, failover over the prefill ranking.
//! 4. D with P's params, through [`Gateway::whole`]: failover over the decode ranking. With
//!    n>1 spread over several decode nodes, [`Gateway::spread`] sends one request per group at
//!    once, each with its own lease of P's ([`crate::spread`]).
//! 5. [`Gateway::relay`]: D's status, headers and body, chunk by chunk, to the client (merged
//!    from several, for spread children). On the way out ([`crate::answer`]) a retained turn's
//!    `kv_transfer_params` are taken into the conversation index (and removed for an untrusted
//!    client), and a `/v1/responses` answer is kept for `previous_response_id`
//!    ([`Gateway::remember`]).
//!
//! Multi-turn: [`Gateway::prepare`] rebuilds a `previous_response_id` request from the stored
//! turns, looks the prompt's block hashes up in the conversation index, and shows the policy
//! which node holds the earlier turn (`conversation-tokens`); a decision with `reverse-pull`
//! from that node makes P pull it first (split), or the `whole` node pull it (or, on the holder
//! itself, find it in its prefix cache).
//!
//! A client that leaves while P or D works is noticed (the downstream connection closes):
//! D's connection is dropped (the node aborts the request) and P's lease is released at once
//! over P's KV side channel, so nothing waits for the lease to expire.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use pd_policy::{Api, Request, ReversePull, Route, Split};
use pd_tokenize::Tokenizer;
use pd_tokenize::prompt::{GIVEN_IDS_FIELD, PromptInput, PromptKind};
use pingora::http::ResponseHeader;
use pingora::prelude::{HttpPeer, ProxyHttp, Session};
use serde_json::{Map, Value, json};
use tracing::{Instrument, debug, warn};

use crate::admission::Admission;
use crate::answer::{Capture, Captured, SseCapture};
use crate::cluster::{Cluster, NodeRef, OnNode, Snapshot};
use crate::conversation::{self, Holding, Holdings, NewTurn, Owner, ResponseStore};
use crate::drain::Drain;
use crate::error::GatewayError;
use crate::lease::LeaseReleaser;
use crate::metrics::Metrics;
use crate::openai::{self, Analyzed, KV_FIELD, api_label, api_path};
use crate::route::Router;
use crate::secret;
use crate::spread;
use crate::tokenizer_api;
use crate::upstream::{NodeClient, NodeResponse, REQUEST_ID, UpstreamError};
use pd_wire::KvTransferParams;

/// Settings of the front door.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Largest request body accepted.
    pub max_body: usize,
    /// A client whose bearer key equals this may send `kv_transfer_params`.
    pub trusted_client_token: Option<String>,
    /// Keys a client must send as its bearer key to use `/v1/` (the trusted client token also
    /// does); empty: `/v1/` is open.
    pub api_keys: Vec<String>,
}

/// State shared by every request.
#[derive(Debug)]
pub struct Shared {
    /// The live cluster.
    pub cluster: Arc<Cluster>,
    /// The policy.
    pub router: Arc<Router>,
    /// Metrics.
    pub metrics: Metrics,
    /// Pooled keep-alive HTTP to the nodes.
    pub http: NodeClient,
    /// Releases P's leases nobody will pull.
    pub leases: LeaseReleaser,
    /// Which node holds which finished turn's KV.
    pub holdings: Arc<Holdings>,
    /// `/v1/responses` turns, for `previous_response_id`.
    pub responses: Arc<ResponseStore>,
    /// How many generation requests are served at once.
    pub admission: Admission,
    /// Requests open now, and whether the gateway drains (`SIGTERM`).
    pub drain: Arc<Drain>,
    /// Settings.
    pub config: ProxyConfig,
}

/// The pingora service.
#[derive(Debug, Clone)]
pub struct Gateway(pub Arc<Shared>);

/// How a generation request ended, when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// The client left; whatever was in flight was cancelled.
    Aborted,
}

/// Time spent waiting on nodes, subtracted from end-to-end time for the added-latency metric.
#[derive(Debug)]
struct Timing {
    start: Instant,
    waiting: Duration,
    first_byte: Option<Instant>,
    /// When routing was decided (nothing before it waits on nodes).
    prepared: Option<Instant>,
    /// How a retained turn this request continues was used (`pd_gateway_reverse_pulls_total`'s
    /// `how`); none when it continues none.
    continued: Option<&'static str>,
}

impl Timing {
    async fn wait<T>(&mut self, fut: impl std::future::Future<Output = T>) -> T {
        let t = Instant::now();
        let out = fut.await;
        self.waiting += t.elapsed();
        out
    }
}

/// Laps of the gateway's own phases, into `pd_gateway_phase_seconds{phase}`.
struct PhaseClock<'a> {
    metrics: &'a Metrics,
    last: Instant,
}

impl<'a> PhaseClock<'a> {
    fn new(metrics: &'a Metrics) -> Self {
        Self {
            metrics,
            last: Instant::now(),
        }
    }

    fn lap(&mut self, phase: &'static str) {
        let now = Instant::now();
        self.metrics
            .phase
            .with_label_values(&[phase])
            .observe((now - self.last).as_secs_f64());
        self.last = now;
    }
}

/// Everything routing decided about one request.
#[derive(Debug)]
struct Prepared {
    api: Api,
    body: Map<String, Value>,
    analyzed: Analyzed,
    snapshot: Snapshot,
    route: Route,
    /// The policy's ask to move an earlier turn's KV.
    reverse_pull: Option<ReversePull>,
    /// A trusted client's own `kv_transfer_params`: forwarded untouched to one node.
    client_params: Option<Value>,
    /// The client may see `kv_transfer_params` in answers.
    trusted: bool,
    /// The retained turn this prompt continues, when a live node holds one.
    held: Option<Held>,
    /// A `/v1/responses` request: what to store with its answer.
    turn: Option<ResponsesTurn>,
    /// The prompt's last whole block's chain hash and the tokens up to it: the partial key of
    /// the turn a node may keep from this request.
    prompt_key: Option<(u64, u32)>,
    /// A split's decode nodes, reserved for this request from the decision on (their sends
    /// come only after P's phase), so the next decisions see them: each group's first
    /// candidate ([`spread::plan`]), in group order.
    reserved: Vec<OnNode>,
}

/// A retained turn a request's prompt continues.
#[derive(Debug)]
struct Held {
    /// The holder's index in the view.
    index: u32,
    /// The prompt continues every block held: the turn can be pulled. Otherwise (a resent
    /// history that re-encodes differently) only the holder's prefix cache serves it.
    exact: bool,
    holding: Holding,
}

/// A `/v1/responses` request, as it will be stored once answered.
#[derive(Debug)]
struct ResponsesTurn {
    /// The API key it came with: the stored turn is that key's alone.
    owner: Owner,
    /// `previous_response_id`.
    parent: Option<String>,
    /// This turn's own input items.
    input: Vec<Value>,
    /// `store` (default true).
    store: bool,
}

/// Why a node was not used.
enum Failed {
    /// Connection refused, reset or timed out, or a 5xx: try the next candidate.
    Next(String),
    /// The client left.
    Gone,
}

async fn client_gone(session: &mut Session) {
    loop {
        match session.read_body_or_idle(true).await {
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return,
        }
    }
}

/// Longest client-chosen request id kept; longer or unprintable ones are replaced.
const MAX_REQUEST_ID: usize = 128;

/// The request's id: the client's `x-request-id` when it is printable ASCII of at most
/// [`MAX_REQUEST_ID`] bytes, else a fresh one put in its place, so every later phase (the
/// node requests, the answer's headers, the logs) reads the same id from the session.
fn assign_request_id(session: &mut Session) -> String {
    if let Some(id) = request_id(session) {
        return id.to_owned();
    }
    let id = format!("gw-{:032x}", rand::random::<u128>());
    let _ = session.req_header_mut().insert_header(REQUEST_ID, &id);
    id
}

/// The id [`assign_request_id`] settled on (or the client's, if still unchecked).
fn request_id(session: &Session) -> Option<&str> {
    let v = session
        .req_header()
        .headers
        .get(REQUEST_ID)?
        .to_str()
        .ok()?;
    (!v.is_empty() && v.len() <= MAX_REQUEST_ID && v.bytes().all(|b| b.is_ascii_graphic()))
        .then_some(v)
}

fn header(
    status: u16,
    content_type: &str,
    len: Option<usize>,
    request: Option<&str>,
) -> Box<ResponseHeader> {
    // A status from a node or a validated policy decision is always a valid one; fall back to
    // 500 rather than panic if it was not.
    let mut h = ResponseHeader::build(status, Some(5))
        .or_else(|_| ResponseHeader::build(500, Some(5)))
        .expect("500 is a valid status");
    let _ = h.insert_header("content-type", content_type);
    if let Some(id) = request {
        let _ = h.insert_header(REQUEST_ID, id);
    }
    if let Some(len) = len {
        let _ = h.insert_header("content-length", len.to_string());
    }
    if content_type.starts_with("text/event-stream") {
        let _ = h.insert_header("cache-control", "no-cache");
    }
    Box::new(h)
}

/// A model's card on `/v1/models`.
fn model_card(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "pd-serve"})
}

/// The client's `Authorization: Bearer KEY`.
fn bearer_key(session: &Session) -> Option<&str> {
    let header = session.req_header().headers.get("authorization");
    secret::bearer(header.and_then(|v| v.to_str().ok()))
}

async fn respond(session: &mut Session, status: u16, content_type: &str, body: Bytes) {
    let h = header(status, content_type, Some(body.len()), request_id(session));
    send_whole(session, h, body).await;
}

async fn send_whole(session: &mut Session, h: Box<ResponseHeader>, body: Bytes) {
    if session.write_response_header(h, false).await.is_ok() {
        let _ = session.write_response_body(Some(body), true).await;
    }
}

async fn respond_error(session: &mut Session, e: &GatewayError) {
    let body = e.body();
    let mut h = header(
        e.status(),
        "application/json",
        Some(body.len()),
        request_id(session),
    );
    if let GatewayError::Overloaded(_) = e {
        // The OpenAI SDKs wait this long before they retry.
        let _ = h.insert_header("retry-after", "1");
    }
    send_whole(session, h, body).await;
}

async fn read_body(session: &mut Session, limit: usize) -> Result<Vec<u8>, GatewayError> {
    let mut body = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Err(GatewayError::PayloadTooLarge { limit });
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => {
                return Err(GatewayError::invalid(
                    "body",
                    format!("reading the body: {e}"),
                ));
            }
        }
    }
}

fn tokenize_inline(tokenizer: &Tokenizer, prompt: PromptKind) -> Result<Vec<u32>, GatewayError> {
    Ok(pd_tokenize::prompt::prompt_tokens(tokenizer, prompt)?)
}

impl Gateway {
    fn shared(&self) -> &Shared {
        &self.0
    }

    fn trusted(&self, session: &Session) -> bool {
        let Some(token) = &self.0.config.trusted_client_token else {
            return false;
        };
        bearer_key(session).is_some_and(|key| secret::same_secret(key, token))
    }

    /// Whether the client may use `/v1/`: always when the gateway has no API keys, else with
    /// one of them, or the trusted client token, as its bearer key.
    fn authorized(&self, session: &Session) -> bool {
        let config = &self.0.config;
        if config.api_keys.is_empty() {
            return true;
        }
        bearer_key(session).is_some_and(|key| {
            config
                .api_keys
                .iter()
                .chain(&config.trusted_client_token)
                .any(|k| secret::same_secret(key, k))
        })
    }

    async fn serve(&self, session: &mut Session) {
        let method = session.req_header().method.as_str().to_owned();
        let path = session.req_header().uri.path().to_owned();
        let guarded = path.starts_with("/v1/") || pd_tokenize::endpoints::is_tokenizer_path(&path);
        if guarded && !self.authorized(session) {
            self.0.metrics.unauthorized.inc();
            respond_error(session, &GatewayError::Unauthorized).await;
            return;
        }
        match (method.as_str(), path.as_str()) {
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
                self.stored_response(session, &method, &path).await;
            }
            ("POST", p) if openai::api_of(p).is_some() => {
                if let Some(api) = openai::api_of(p) {
                    self.generate(session, api).await;
                }
            }
            (m, p) if tokenizer_api::Endpoint::of(m, p).is_some() => {
                if let Some(endpoint) = tokenizer_api::Endpoint::of(m, p) {
                    self.tokenizer_endpoint(session, endpoint).await;
                }
            }
            _ => {
                respond_error(session, &GatewayError::UnknownRoute { method, path }).await;
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
            ("DELETE", None) => store.delete(id, owner).map(|deleted| {
                // The KV a node still retains of that turn goes with it.
                if let Some(h) = deleted.held.and_then(|key| self.0.holdings.remove(key)) {
                    self.release(Some(&h.params), "response_deleted");
                    self.0
                        .metrics
                        .conversation_holdings
                        .set(self.0.holdings.len() as i64);
                }
                json!({"id": id, "object": "response", "deleted": true}).to_string()
            }),
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

    /// vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info`, answered here
    /// ([`tokenizer_api`]).
    async fn tokenizer_endpoint(&self, session: &mut Session, endpoint: tokenizer_api::Endpoint) {
        let answered = async {
            let body = read_body(session, self.0.config.max_body).await?;
            let query = session.req_header().uri.query().map(str::to_owned);
            let cluster = self.0.cluster.clone();
            tokio::task::spawn_blocking(move || {
                tokenizer_api::answer(&cluster, endpoint, query.as_deref(), &body)
            })
            .await
            .map_err(internal)?
        }
        .await;
        match answered {
            Ok(body) => respond(session, 200, "application/json", body.into()).await,
            Err(e) => respond_error(session, &e).await,
        }
    }

    async fn generate(&self, session: &mut Session, api: Api) {
        let id = assign_request_id(session);
        self.generate_as(session, api)
            .instrument(tracing::info_span!("request", id = %id))
            .await;
    }

    async fn generate_as(&self, session: &mut Session, api: Api) {
        let mut t = Timing {
            start: Instant::now(),
            waiting: Duration::ZERO,
            first_byte: None,
            prepared: None,
            continued: None,
        };
        let label = api_label(api);
        let outcome = match self.admit_and_serve(session, api, &mut t).await {
            Ok(Outcome::Ok) => "ok",
            Ok(Outcome::Aborted) => "aborted",
            Err(e) => {
                debug!(api = label, status = e.status(), "request failed: {e}");
                if t.first_byte.is_none() {
                    respond_error(session, &e).await;
                }
                e.outcome()
            }
        };
        let m = &self.0.metrics;
        m.requests.with_label_values(&[label, outcome]).inc();
        let e2e = t.start.elapsed();
        m.e2e.with_label_values(&[label]).observe(e2e.as_secs_f64());
        if let Some(first) = t.first_byte {
            let ttfb = (first - t.start).as_secs_f64();
            m.ttft.with_label_values(&[label]).observe(ttfb);
            if let Some(how) = t.continued {
                m.continued_ttft.with_label_values(&[how]).observe(ttfb);
            }
        }
        let own = e2e.saturating_sub(t.waiting);
        m.added
            .with_label_values(&[label])
            .observe(own.as_secs_f64());
        if let Some(p) = t.prepared {
            m.phase
                .with_label_values(&["respond"])
                .observe(own.saturating_sub(p - t.start).as_secs_f64());
        }
    }

    /// Reads the body (bounded by `--max-body`), then, under `--max-concurrent-requests`, waits
    /// for a slot while watching the client: one that leaves gives its place up at once, and a
    /// slow upload holds no slot. Waiting for a slot is waiting on the cluster, not the
    /// gateway's own time. The slot is held until the answer's last byte.
    async fn admit_and_serve(
        &self,
        session: &mut Session,
        api: Api,
        t: &mut Timing,
    ) -> Result<Outcome, GatewayError> {
        let s = self.shared();
        let read = Instant::now();
        let raw = read_body(session, s.config.max_body).await?;
        s.metrics
            .phase
            .with_label_values(&["read"])
            .observe(read.elapsed().as_secs_f64());
        if !s.admission.limited() {
            return self.generate_inner(session, api, raw, t).await;
        }
        // A completions request listing several prompts weighs as many (read here only when
        // admission is limited; a body that does not parse weighs 1 and fails later).
        let weight = match api {
            Api::Completions => openai::prompts_listed(&raw),
            _ => 1,
        };
        let admitted = tokio::select! {
            a = t.wait(s.admission.admit_weighted(weight)) => a,
            () = client_gone(session) => return Ok(Outcome::Aborted),
        };
        s.metrics.queue_wait.observe(t.waiting.as_secs_f64());
        let _slot = admitted.map_err(|why| {
            s.metrics
                .admission_refused
                .with_label_values(&[why.label()])
                .inc();
            GatewayError::Overloaded(why)
        })?;
        self.generate_inner(session, api, raw, t).await
    }

    async fn generate_inner(
        &self,
        session: &mut Session,
        api: Api,
        raw: Vec<u8>,
        t: &mut Timing,
    ) -> Result<Outcome, GatewayError> {
        let p = self.prepare(session, api, &raw).await?;
        t.prepared = Some(Instant::now());
        let Prepared {
            api,
            body,
            analyzed,
            snapshot,
            route,
            reverse_pull,
            client_params,
            trusted,
            held,
            turn,
            prompt_key,
            reserved,
        } = p;
        let path = api_path(api);
        // The earlier turn is moved only when the policy asks for it, from the node holding it,
        // it is worth the policy's threshold, and the prompt continues all of it (a lease is
        // pulled whole).
        let asked = match (&held, &reverse_pull) {
            (Some(h), Some(rp)) => rp.from == h.index && h.holding.tokens >= rp.min_tokens,
            _ => false,
        };
        // A request one node must compute itself (it scores its prompt, or lists several)
        // takes no KV from elsewhere: no pull.
        let one_node = analyzed.scores_prompt || analyzed.prompts > 1;
        let pull = held
            .as_ref()
            .filter(|h| asked && h.exact && !one_node)
            .map(|h| &h.holding);
        let capture = Capture {
            api,
            hide_params: !trusted,
            want_response: turn.as_ref().is_some_and(|t| t.store),
        };
        let mut captured = Captured::default();
        let outcome = match route {
            Route::Reject(r) => Err(GatewayError::Rejected {
                status: r.status,
                message: r.message,
            }),
            Route::Whole(candidates) => {
                let bytes = match pull {
                    // On the holder nothing moves (its prefix cache has the blocks, and it
                    // releases its own lease); any other node pulls the turn, then decodes.
                    Some(h) => openai::decode_bytes(&body, &h.as_pull()),
                    None => serde_json::to_vec(&body),
                };
                let bytes = Bytes::from(bytes.map_err(internal)?);
                if let Some(h) = &held
                    && asked
                {
                    let how = if candidates.first() == Some(&h.index) {
                        // Pulled or not, the holder serves the history from its prefix cache.
                        "holder"
                    } else if pull.is_some() {
                        "decode_pulls"
                    } else {
                        "partial"
                    };
                    self.count_reverse_pull(t, how);
                }
                self.whole(
                    session,
                    t,
                    path,
                    &snapshot,
                    &candidates,
                    bytes,
                    "whole",
                    (capture, &mut captured),
                    None,
                )
                .await
            }
            Route::Split(split) => {
                // Served by one node of the split's rankings, in two cases.
                let direct = if let Some(params) = &client_params {
                    // A trusted client drives P/D itself: forward to the role its params ask for.
                    let candidates: Vec<u32> =
                        if params.get("do_remote_decode") == Some(&json!(true)) {
                            split.prefill.clone()
                        } else {
                            split.decode.iter().map(|d| d.node).collect()
                        };
                    Some((candidates, "trusted"))
                } else if one_node {
                    // Prompt logprobs come from the node that computes the prompt, and a
                    // batch's prompts are answered together: one node serves it, a prefill
                    // node first (it is a prompt's work), then the decode ranking, as
                    // failover.
                    let mut candidates = split.prefill.clone();
                    for d in &split.decode {
                        if !candidates.contains(&d.node) {
                            candidates.push(d.node);
                        }
                    }
                    Some((candidates, "one_node"))
                } else {
                    None
                };
                if let Some((candidates, stage)) = direct {
                    drop(reserved);
                    let bytes = Bytes::from(serde_json::to_vec(&body).map_err(internal)?);
                    return self
                        .whole(
                            session,
                            t,
                            path,
                            &snapshot,
                            &candidates,
                            bytes,
                            stage,
                            (capture, &mut captured),
                            None,
                        )
                        .await;
                }
                if pull.is_some() {
                    // A prefill node that holds the turn itself (it decoded and kept it) serves
                    // the history from its prefix cache, as a holder taking it whole does.
                    let from_itself =
                        held.as_ref().map(|h| h.index) == split.prefill.first().copied();
                    self.count_reverse_pull(
                        t,
                        if from_itself {
                            "holder"
                        } else {
                            "prefill_pulls"
                        },
                    );
                } else if asked {
                    self.count_reverse_pull(t, "partial");
                }
                self.split(
                    session,
                    t,
                    path,
                    &body,
                    &analyzed,
                    &snapshot,
                    &split,
                    pull,
                    (capture, &mut captured),
                    reserved,
                )
                .await
            }
        };
        if held.is_some() && !asked {
            self.count_reverse_pull(t, "not_used");
        }
        let used = pull.is_some();
        if matches!(outcome, Ok(Outcome::Ok)) && analyzed.prompts == 1 {
            // (A batch's answers are several turns; none is one conversation's next.)
            self.remember(held, used, captured, turn, prompt_key);
        } else if let Some(h) = held.filter(|_| used) {
            // Pulled or not, that lease may be gone now: do not offer it again.
            self.0.holdings.remove(h.holding.last_hash);
        }
        outcome
    }

    /// Counts how the retained turn a request continues was used, and keeps it for the
    /// request's time to first byte.
    fn count_reverse_pull(&self, t: &mut Timing, how: &'static str) {
        t.continued = Some(how);
        self.0.metrics.reverse_pulls.with_label_values(&[how]).inc();
    }

    /// After a served turn: index the turn the node kept (if it did), retire the earlier turn
    /// it continued, and store a `/v1/responses` answer for `previous_response_id`.
    fn remember(
        &self,
        held: Option<Held>,
        used: bool,
        captured: Captured,
        turn: Option<ResponsesTurn>,
        prompt_key: Option<(u64, u32)>,
    ) {
        let s = self.shared();
        let m = &s.metrics;
        if captured.hidden {
            m.retained_params_hidden.inc();
        }
        let kept = captured
            .params
            .as_ref()
            .and_then(Holding::from_params)
            .map(|mut k| {
                k.prompt_key = prompt_key;
                k
            });
        if let Some(h) = held
            && (used || kept.is_some())
        {
            // The earlier turn was pulled (its lease ended there) or this turn supersedes it: its
            // blocks are a prefix of the new holding's. Release a lease nobody pulled.
            s.holdings.remove(h.holding.last_hash);
            if !used {
                self.release(Some(&h.holding.params), "superseded");
            }
        }
        let held = kept.as_ref().map(|k| k.last_hash);
        if let Some(k) = kept {
            m.retained_turns.inc();
            s.holdings.insert(k);
        }
        m.conversation_holdings.set(s.holdings.len() as i64);
        if let (Some(turn), Some(response)) = (turn, captured.response)
            && turn.store
            && let Some(id) = response.get("id").and_then(Value::as_str)
        {
            let output = conversation::output_items(&response);
            let kept = conversation::as_retrieved(&response, turn.parent.as_deref());
            let evicted = s.responses.put(
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
            m.responses_evicted.inc_by(evicted);
            m.responses_stored_bytes.set(s.responses.bytes() as i64);
        }
    }

    /// A `/v1/responses` request: what to store with its answer; with `previous_response_id`,
    /// its `input` becomes the stored conversation followed by the new items (the field itself
    /// is removed: the nodes keep no conversations).
    fn responses_turn(
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
            let mut items = self
                .0
                .responses
                .history(id, owner)
                .map_err(|e| GatewayError::PreviousResponseNotFound(e.to_string()))?;
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

    /// Phase 1: everything before the first node is called.
    async fn prepare(
        &self,
        session: &mut Session,
        api: Api,
        raw: &[u8],
    ) -> Result<Prepared, GatewayError> {
        let s = self.shared();
        let mut clock = PhaseClock::new(&s.metrics);
        let mut body = match serde_json::from_slice::<Value>(raw) {
            Ok(Value::Object(m)) => m,
            Ok(_) => {
                return Err(GatewayError::invalid(
                    "body",
                    "the body must be a JSON object",
                ));
            }
            Err(e) => {
                return Err(GatewayError::InvalidRequest {
                    message: format!("the body is not valid JSON: {e}"),
                    param: None,
                });
            }
        };
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
            return Err(GatewayError::ModelNotFound(model.clone()));
        }
        let turn = match api {
            Api::Responses => Some(self.responses_turn(&mut body, Owner::of(bearer_key(session)))?),
            _ => None,
        };
        let mut analyzed = openai::analyze(api, &body, session_key.as_deref())?;
        if let Some(parent) = turn.as_ref().and_then(|t| t.parent.clone()) {
            analyzed.conversation_key = Some(parent);
        }
        let (tokenizer, block_size) = s
            .cluster
            .model(&analyzed.model)
            .ok_or_else(|| GatewayError::ModelNotFound(analyzed.model.clone()))?;
        let prompt = analyzed.prompt.clone();
        let tokens = if pd_tokenize::prompt::tokenize_inline_ok(&prompt) {
            tokenize_inline(&tokenizer, prompt)?
        } else {
            tokio::task::spawn_blocking(move || tokenize_inline(&tokenizer, prompt))
                .await
                .map_err(internal)??
        };
        // Chained from the deployment's key and the request's salt, exactly as on the nodes.
        let root = pd_kv_pool::root_hash(
            s.cluster.hash_key(&analyzed.model),
            analyzed.cache_salt.as_deref(),
        );
        let hashes: Vec<u64> =
            pd_kv_pool::hash_full_blocks_from(root, &tokens, block_size as usize)
                .into_iter()
                .map(|h| h.0)
                .collect();
        clock.lap("tokenize");
        let prompt_key = hashes.last().map(|&h| {
            let tokens = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
            (h, tokens.saturating_mul(block_size))
        });
        let mut snapshot = s.cluster.snapshot(&analyzed.model, &hashes);
        if snapshot.view.nodes.is_empty() {
            return Err(GatewayError::NoCapacity {
                model: analyzed.model.clone(),
                why: "no node of this model is live".into(),
            });
        }
        if snapshot.max_model_len > 0 && tokens.len() >= snapshot.max_model_len as usize {
            // No node could take it: the nodes' own 400, answered before any of them is asked.
            // (0: no node said; they answer for themselves.)
            return Err(GatewayError::invalid(
                openai::prompt_param(api),
                format!(
                    "This model's maximum context length is {} tokens. However, your prompt has {} tokens \
                     (at least one token must be left for the completion).",
                    snapshot.max_model_len,
                    tokens.len()
                ),
            ));
        }
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
        let decided = s.router.decide(
            &request,
            &snapshot.view,
            &snapshot.measured,
            &snapshot.names,
        )?;
        clock.lap("policy");
        let first = match &decided.decision.route {
            Route::Split(sp) => sp.prefill.first().copied(),
            Route::Whole(c) => c.first().copied(),
            Route::Reject(_) => None,
        };
        if let Some(i) = first {
            let held = snapshot.prefix_blocks.get(i as usize).copied().unwrap_or(0);
            s.metrics
                .prefix_hit_tokens
                .inc_by(u64::from(held) * u64::from(block_size));
        }
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
        debug!(policy = %decided.policy, version = %decided.version, route = ?decided.decision.route, "decided");
        let reserved = match &decided.decision.route {
            Route::Split(sp) => spread::plan(&sp.decode, analyzed.n)
                .iter()
                .filter_map(|g| snapshot.nodes.get(*g.candidates.first()? as usize))
                .map(NodeRef::reserve)
                .collect(),
            _ => Vec::new(),
        };
        Ok(Prepared {
            api,
            body,
            analyzed,
            snapshot,
            route: decided.decision.route,
            reverse_pull: decided.decision.reverse_pull,
            client_params,
            trusted,
            held,
            turn,
            prompt_key,
            reserved,
        })
    }

    /// Sends `body` to node `addr`, watching the client. A connection failure or a 5xx is
    /// [`Failed::Next`]; any other answer is returned for relaying.
    async fn send(
        &self,
        session: &mut Session,
        t: &mut Timing,
        node: &NodeRef,
        path: &str,
        body: Bytes,
    ) -> Result<NodeResponse, Failed> {
        let addr = &*node.http_addr;
        let id = session.req_header().headers.get(REQUEST_ID).cloned();
        let send = self.0.http.post_json(addr, path, body, id);
        let result = tokio::select! {
            r = t.wait(send) => r,
            () = client_gone(session) => return Err(Failed::Gone),
            () = node.gone() => return Err(Failed::Next(format!("{addr} left the view and did not come back"))),
        };
        match result {
            Ok(resp) if resp.status().is_server_error() => {
                let status = resp.status();
                let text = resp.text().await;
                Err(Failed::Next(format!("{addr} answered {status}: {text}")))
            }
            Ok(resp) => Ok(resp),
            Err(e) => Err(Failed::Next(format!("{addr}: {e}"))),
        }
    }

    /// Phase 2 (and 4, for D): one node serves the request, the first of `candidates` that
    /// answers; failover before any byte reaches the client. `stage` labels failovers; what
    /// `capture` asks for is taken from the answer.
    #[allow(clippy::too_many_arguments)]
    async fn whole(
        &self,
        session: &mut Session,
        t: &mut Timing,
        path: &str,
        snapshot: &Snapshot,
        candidates: &[u32],
        body: Bytes,
        stage: &'static str,
        capture: (Capture, &mut Captured),
        mut reserved: Option<OnNode>,
    ) -> Result<Outcome, GatewayError> {
        let mut why = Vec::new();
        for &i in candidates {
            let Some(node) = snapshot.nodes.get(i as usize) else {
                continue;
            };
            // Counted on this node while it serves: the decision's reservation when it is the
            // node reserved, else from now.
            let _open = match reserved.take() {
                Some(r) if r.conn() == node.conn => r.sent(),
                _ => node.open(),
            };
            match self.send(session, t, node, path, body.clone()).await {
                Ok(resp) => return self.relay(session, t, node, resp, capture).await,
                Err(Failed::Gone) => return Ok(Outcome::Aborted),
                Err(Failed::Next(e)) => {
                    warn!(node = %node.engine_id, stage, "failing over: {e}");
                    self.0.metrics.failovers.with_label_values(&[stage]).inc();
                    why.push(e);
                }
            }
        }
        Err(GatewayError::NoCapacity {
            model: String::new(),
            why: format!("every {stage} candidate failed: {}", why.join("; ")),
        })
    }

    /// Phases 3–5 for a split decision: one decode group (all children on one node, forked
    /// there) or several ([`Gateway::spread`]).
    #[allow(clippy::too_many_arguments)]
    async fn split(
        &self,
        session: &mut Session,
        t: &mut Timing,
        path: &str,
        body: &Map<String, Value>,
        analyzed: &Analyzed,
        snapshot: &Snapshot,
        split: &Split,
        pull: Option<&Holding>,
        capture: (Capture, &mut Captured),
        reserved: Vec<OnNode>,
    ) -> Result<Outcome, GatewayError> {
        let groups = spread::plan(&split.decode, analyzed.n);
        let consumers = match groups.len() {
            k @ 2..=spread::MAX_GROUPS => k as u32,
            _ => 1,
        };
        let Some(mut params) = self
            .prefill(
                session,
                t,
                path,
                body,
                analyzed,
                snapshot,
                &split.prefill,
                consumers,
                pull,
            )
            .await?
        else {
            return Ok(Outcome::Aborted);
        };
        if consumers > 1 && params.len() >= groups.len() {
            for extra in params.drain(groups.len()..) {
                self.release(Some(&extra), "unused");
            }
            return self
                .spread(session, t, path, body, snapshot, &groups, params, reserved)
                .await;
        }
        // One group, or a P that granted one lease for several (a node without
        // `num_consumers`): all children on one decode node, the rest of the list failover.
        let first = params.remove(0);
        for extra in &params {
            self.release(Some(extra), "unused");
        }
        let mut candidates: Vec<u32> = Vec::with_capacity(split.decode.len());
        for d in &split.decode {
            if !candidates.contains(&d.node) {
                candidates.push(d.node);
            }
        }
        let d_body = Bytes::from(openai::decode_bytes(body, &first).map_err(internal)?);
        // Phase 4: D pulls and decodes; failover while nothing reached the client.
        let outcome = self
            .whole(
                session,
                t,
                path,
                snapshot,
                &candidates,
                d_body,
                "decode",
                capture,
                // The first group's node; the other groups' reservations end here.
                reserved.into_iter().next(),
            )
            .await;
        match &outcome {
            Ok(Outcome::Ok) => {}
            Ok(Outcome::Aborted) => self.release(Some(&first), "client_left"),
            Err(_) => self.release(Some(&first), "decode_failed"),
        }
        outcome
    }

    /// Releases the lease `params` name at P, counted by `why`.
    fn release(&self, params: Option<&KvTransferParams>, why: &'static str) {
        if let Some(lease) = params.and_then(openai::lease_of) {
            self.0.leases.release(lease, why);
        }
    }

    /// Phases 4–5 with the children spread: one decode request per group, each with its own
    /// lease and failover list, sent at once; their answers merged into one.
    #[allow(clippy::too_many_arguments)]
    async fn spread(
        &self,
        session: &mut Session,
        t: &mut Timing,
        path: &str,
        body: &Map<String, Value>,
        snapshot: &Snapshot,
        groups: &[spread::Group],
        params: Vec<KvTransferParams>,
        reserved: Vec<OnNode>,
    ) -> Result<Outcome, GatewayError> {
        self.0
            .metrics
            .spread
            .with_label_values(&[&groups.len().to_string()])
            .inc();
        // The client's seed, or one drawn here: children on different nodes must not share one.
        let seed = body
            .get("seed")
            .and_then(Value::as_i64)
            .unwrap_or_else(rand::random);
        let mut bodies = Vec::with_capacity(groups.len());
        for (g, p) in groups.iter().zip(&params) {
            let b = spread::group_body(&openai::decode_body(body, p), g, seed);
            bodies.push(Bytes::from(serde_json::to_vec(&b).map_err(internal)?));
        }
        let release_all = |why| {
            for p in &params {
                self.release(Some(p), why);
            }
        };
        let id = session.req_header().headers.get(REQUEST_ID).cloned();
        let mut reserved = reserved.into_iter();
        let sends = groups.iter().zip(bodies).map(|(g, b)| {
            let r = reserved.next();
            self.send_ranked(snapshot, &g.candidates, path, b, id.clone(), r)
        });
        let answers = tokio::select! {
            r = t.wait(futures::future::join_all(sends)) => r,
            () = client_gone(session) => {
                release_all("client_left");
                return Ok(Outcome::Aborted);
            }
        };
        let mut resps = Vec::with_capacity(answers.len());
        // Each group's node stays counted busy until the merged answer is over.
        let mut _open = Vec::with_capacity(answers.len());
        let mut nodes = Vec::with_capacity(answers.len());
        for a in answers {
            match a {
                Ok((r, open, node)) => {
                    resps.push(r);
                    _open.push(open);
                    nodes.push(node);
                }
                Err(why) => {
                    release_all("decode_failed");
                    return Err(GatewayError::NoCapacity {
                        model: String::new(),
                        why,
                    });
                }
            }
        }
        if let Some(i) = resps.iter().position(|r| !r.status().is_success()) {
            // A node refused its part (a 4xx): the client's fault, the same on every node.
            release_all("decode_failed");
            let r = resps.swap_remove(i);
            let status = r.status().as_u16();
            let body = r.bytes().await.unwrap_or_default();
            return Err(GatewayError::Node { status, body });
        }
        let offsets: Vec<u32> = groups.iter().map(|g| g.offset).collect();
        let streamed = resps.iter().any(|r| {
            r.content_type()
                .is_some_and(|c| c.starts_with("text/event-stream"))
        });
        let outcome = if streamed {
            self.relay_merged_stream(session, t, &nodes, resps, offsets)
                .await
        } else {
            self.relay_merged_whole(session, t, &nodes, resps, offsets)
                .await
        };
        match &outcome {
            Ok(Outcome::Ok) => {}
            Ok(Outcome::Aborted) => release_all("client_left"),
            Err(_) => release_all("decode_failed"),
        }
        outcome
    }

    /// Sends `body` to the first of `candidates` that answers (not a 5xx), without watching the
    /// client (the caller does, over all groups at once).
    async fn send_ranked(
        &self,
        snapshot: &Snapshot,
        candidates: &[u32],
        path: &str,
        body: Bytes,
        request: Option<http::HeaderValue>,
        mut reserved: Option<OnNode>,
    ) -> Result<(NodeResponse, OnNode, NodeRef), String> {
        let mut why = Vec::new();
        for &i in candidates {
            let Some(node) = snapshot.nodes.get(i as usize) else {
                continue;
            };
            // Counted on this node while it serves: the decision's reservation when it is the
            // node reserved, else from now.
            let open = match reserved.take() {
                Some(r) if r.conn() == node.conn => r.sent(),
                _ => node.open(),
            };
            let sent = tokio::select! {
                r = self.0.http.post_json(&node.http_addr, path, body.clone(), request.clone()) => r,
                () = node.gone() => Err(UpstreamError::Gone),
            };
            let e = match sent {
                Ok(r) if r.status().is_server_error() => {
                    let status = r.status();
                    let text = r.text().await;
                    format!("{} answered {status}: {text}", node.http_addr)
                }
                Ok(r) => return Ok((r, open, node.clone())),
                Err(e) => format!("{}: {e}", node.http_addr),
            };
            warn!(node = %node.engine_id, stage = "decode", "failing over: {e}");
            self.0
                .metrics
                .failovers
                .with_label_values(&["decode"])
                .inc();
            why.push(e);
        }
        Err(format!("every decode candidate failed: {}", why.join("; ")))
    }

    /// Phase 5 for spread children, not streamed: every group's body, merged.
    async fn relay_merged_whole(
        &self,
        session: &mut Session,
        t: &mut Timing,
        nodes: &[NodeRef],
        resps: Vec<NodeResponse>,
        offsets: Vec<u32>,
    ) -> Result<Outcome, GatewayError> {
        let reads = futures::future::join_all(resps.into_iter().map(NodeResponse::bytes));
        let bodies = tokio::select! {
            b = t.wait(reads) => b,
            () = client_gone(session) => return Ok(Outcome::Aborted),
            () = any_gone(nodes) => return Err(GatewayError::BadGateway(UpstreamError::Gone.to_string())),
        };
        let mut parts = Vec::with_capacity(bodies.len());
        for (b, &offset) in bodies.iter().zip(&offsets) {
            match b {
                Ok(b) => parts.push((offset, b.as_ref())),
                Err(e) => return Err(GatewayError::BadGateway(format!("a decode node: {e}"))),
            }
        }
        let merged = spread::merge_json(&parts).map_err(GatewayError::BadGateway)?;
        let bytes = Bytes::from(serde_json::to_vec(&merged).map_err(internal)?);
        t.first_byte.get_or_insert_with(Instant::now);
        respond(session, 200, "application/json", bytes).await;
        Ok(Outcome::Ok)
    }

    /// Phase 5 for spread children, streamed: events from every group as they arrive, indices
    /// moved, one `[DONE]` at the end.
    async fn relay_merged_stream(
        &self,
        session: &mut Session,
        t: &mut Timing,
        nodes: &[NodeRef],
        resps: Vec<NodeResponse>,
        offsets: Vec<u32>,
    ) -> Result<Outcome, GatewayError> {
        use futures::StreamExt;
        let h = header(200, "text/event-stream", None, request_id(session));
        if session.write_response_header(h, false).await.is_err() {
            return Ok(Outcome::Aborted);
        }
        let mut merge = spread::SseMerge::new(offsets);
        let mut streams = futures::stream::select_all(
            resps
                .into_iter()
                .enumerate()
                .map(|(j, r)| r.bytes_stream().map(move |b| (j, b)).boxed()),
        );
        // Made once, not per event (it boxes a future per node).
        let gone = any_gone(nodes);
        tokio::pin!(gone);
        loop {
            let next = tokio::select! {
                n = t.wait(streams.next()) => n.map(|(j, b)| (j, b.map_err(UpstreamError::from))),
                () = client_gone(session) => return Ok(Outcome::Aborted),
                () = &mut gone => Some((0, Err(UpstreamError::Gone))),
            };
            let out = match next {
                Some((j, Ok(bytes))) => merge.feed(j, &bytes),
                Some((_, Err(e))) => {
                    warn!("decode stream broke: {e}");
                    let err = GatewayError::BadGateway(format!("node stream broke: {e}"));
                    // Children spread over nodes (n > 1) exist on chat and completions only,
                    // whose error frame is the same.
                    let _ = session
                        .write_response_body(Some(err.stream_event(Api::Completions)), true)
                        .await;
                    return Err(err);
                }
                None => break,
            };
            if !out.is_empty() {
                t.first_byte.get_or_insert_with(Instant::now);
                if session
                    .write_response_body(Some(Bytes::from(out)), false)
                    .await
                    .is_err()
                {
                    return Ok(Outcome::Aborted);
                }
            }
        }
        if !merge.complete() {
            // A node ended its stream without `[DONE]` (it reported an error frame): end the
            // merged stream the same way.
            let _ = session.write_response_body(None, true).await;
            return Err(GatewayError::BadGateway(
                "a decode node's stream ended early".into(),
            ));
        }
        let tail = merge.finish();
        t.first_byte.get_or_insert_with(Instant::now);
        let _ = session
            .write_response_body(Some(Bytes::from(tail)), true)
            .await;
        Ok(Outcome::Ok)
    }

    /// Phase 3: P prefills and answers with the params naming its leased blocks, one object
    /// per consumer asked for (or fewer, from a node that grants one). `None`: the client left.
    #[allow(clippy::too_many_arguments)]
    async fn prefill(
        &self,
        session: &mut Session,
        t: &mut Timing,
        path: &str,
        body: &Map<String, Value>,
        analyzed: &Analyzed,
        snapshot: &Snapshot,
        candidates: &[u32],
        consumers: u32,
        pull: Option<&Holding>,
    ) -> Result<Option<Vec<KvTransferParams>>, GatewayError> {
        let held = pull.map(|h| h.for_prefill(consumers));
        let p_body = Bytes::from(
            openai::prefill_bytes(analyzed.api, body, consumers, held).map_err(internal)?,
        );
        let mut why = Vec::new();
        for &i in candidates {
            let Some(node) = snapshot.nodes.get(i as usize) else {
                continue;
            };
            let _open = node.open();
            let resp = match self.send(session, t, node, path, p_body.clone()).await {
                Ok(r) => r,
                Err(Failed::Gone) => return Ok(None),
                Err(Failed::Next(e)) => {
                    warn!(node = %node.engine_id, "prefill failing over: {e}");
                    self.0
                        .metrics
                        .failovers
                        .with_label_values(&["prefill"])
                        .inc();
                    why.push(e);
                    continue;
                }
            };
            let status = resp.status().as_u16();
            let mut read = Box::pin(resp.bytes());
            let bytes = tokio::select! {
                b = t.wait(&mut read) => b,
                () = client_gone(session) => {
                    // P may have leased blocks already: finish reading its answer in the
                    // background and release the lease it names.
                    let leases = self.0.leases.clone();
                    tokio::spawn(async move {
                        if let Ok(body) = read.await
                            && let Ok(params) = openai::prefill_params(&body)
                        {
                            for lease in params.iter().filter_map(openai::lease_of) {
                                leases.release(lease, "client_left");
                            }
                        }
                    });
                    return Ok(None);
                }
                () = node.gone() => {
                    // P hung mid-answer and did not come back: the next one. (A lease it
                    // granted expires there.)
                    why.push(format!("{} left the view and did not come back", node.http_addr));
                    continue;
                }
            };
            let bytes = match bytes {
                Ok(b) => b,
                Err(e) => {
                    why.push(format!("{}: {e}", node.http_addr));
                    continue;
                }
            };
            if status >= 400 {
                // The node refused the request itself (too long a prompt, a bad field): the
                // client's fault, the same on every node.
                return Err(GatewayError::Node {
                    status,
                    body: bytes,
                });
            }
            match openai::prefill_params(&bytes) {
                Ok(params) => return Ok(Some(params)),
                Err(e) => {
                    warn!(node = %node.engine_id, "prefill failing over: {e}");
                    self.0
                        .metrics
                        .failovers
                        .with_label_values(&["prefill"])
                        .inc();
                    why.push(e);
                }
            }
        }
        Err(GatewayError::NoCapacity {
            model: analyzed.model.clone(),
            why: format!(
                "no prefill node could serve the request: {}",
                why.join("; ")
            ),
        })
    }

    /// Phase 5: the node's answer to the client as it arrives. A whole (not streamed) answer is
    /// read first when it succeeded, so that what `capture` takes out of it is gone from what
    /// the client gets; a stream passes event by event.
    async fn relay(
        &self,
        session: &mut Session,
        t: &mut Timing,
        node: &NodeRef,
        mut resp: NodeResponse,
        (capture, captured): (Capture, &mut Captured),
    ) -> Result<Outcome, GatewayError> {
        let left = || {
            GatewayError::BadGateway(format!(
                "{} left the view mid-answer and did not come back",
                node.engine_id
            ))
        };
        let status = resp.status().as_u16();
        let content_type = resp.content_type().unwrap_or("application/json").to_owned();
        let streamed = content_type.starts_with("text/event-stream");
        if status == 200 && !streamed {
            let read = tokio::select! {
                b = t.wait(resp.bytes()) => b,
                () = node.gone() => return Err(left()),
            };
            let body = match read {
                Ok(b) => b,
                Err(e) => return Err(GatewayError::BadGateway(format!("node answer broke: {e}"))),
            };
            let body = match capture.json(&body, captured) {
                Some(changed) => Bytes::from(changed),
                None => body,
            };
            t.first_byte.get_or_insert_with(Instant::now);
            respond(session, status, &content_type, body).await;
            return Ok(Outcome::Ok);
        }
        let api = capture.api;
        let mut sse = (status == 200).then(|| SseCapture::new(capture));
        let len = resp.content_length().and_then(|l| usize::try_from(l).ok());
        let h = header(status, &content_type, len, request_id(session));
        if session.write_response_header(h, false).await.is_err() {
            return Ok(Outcome::Aborted);
        }
        // Watch the client between chunks only for a chunked (streamed) answer: the client
        // cannot send its next request before the final chunk, which is written after this
        // loop. With a content length, the last body write completes the answer and a
        // keep-alive client may send its next request at once; an idle read would eat it.
        let mut watch = len.is_none();
        // The answer's last event went out: a break after it costs the client nothing.
        let mut answered = false;
        // Made once, not per chunk: it registers with the node's token when first polled.
        let gone = node.gone();
        tokio::pin!(gone);
        loop {
            let chunk = if watch {
                tokio::select! {
                    c = t.wait(resp.chunk()) => c,
                    () = client_gone(session) => return Ok(Outcome::Aborted),
                    () = &mut gone => Err(UpstreamError::Gone),
                }
            } else {
                tokio::select! {
                    c = t.wait(resp.chunk()) => c,
                    () = &mut gone => Err(UpstreamError::Gone),
                }
            };
            match chunk {
                Ok(Some(bytes)) => {
                    let bytes = match &mut sse {
                        Some(sse) => sse.feed(bytes),
                        None => bytes,
                    };
                    if bytes.is_empty() {
                        continue;
                    }
                    t.first_byte.get_or_insert_with(Instant::now);
                    // Once the answer's last event is out, the client has all of it and may
                    // close at once (the SDKs do on `[DONE]`): that is no abort, so stop
                    // watching for it while the node's stream ends.
                    if !answered && pd_wire::sse::ends_answer(&bytes) {
                        answered = true;
                        watch = false;
                    }
                    if session
                        .write_response_body(Some(bytes), false)
                        .await
                        .is_err()
                    {
                        return Ok(Outcome::Aborted);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    // The node broke off mid-answer. An event stream ends with an error event
                    // (no `[DONE]`), so the client knows its answer is cut; another body is
                    // cut where it stands.
                    warn!("node stream broke: {e}");
                    let err = match e {
                        UpstreamError::Gone => left(),
                        e => GatewayError::BadGateway(format!("node stream broke: {e}")),
                    };
                    let last = (sse.is_some() && !answered).then(|| err.stream_event(api));
                    let _ = session.write_response_body(last, true).await;
                    return Err(err);
                }
            }
        }
        t.first_byte.get_or_insert_with(Instant::now);
        if let Some(mut sse) = sse {
            let tail = sse.finish();
            if !tail.is_empty()
                && session
                    .write_response_body(Some(tail), false)
                    .await
                    .is_err()
            {
                return Ok(Outcome::Aborted);
            }
            *captured = sse.captured;
        }
        let _ = session.write_response_body(None, true).await;
        Ok(Outcome::Ok)
    }
}

/// Resolves when any of `nodes` is gone ([`NodeRef::gone`]); never when `nodes` is empty.
async fn any_gone(nodes: &[NodeRef]) {
    if nodes.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(nodes.iter().map(|n| Box::pin(n.gone()))).await;
}

fn internal(e: impl std::fmt::Display) -> GatewayError {
    GatewayError::Internal(e.to_string())
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    /// Never reached: `request_filter` answers every request.
    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut Self::CTX,
    ) -> pingora::Result<Box<HttpPeer>> {
        Err(pingora::Error::explain(
            pingora::ErrorType::InternalError,
            "every route is answered in request_filter",
        ))
    }

    /// Serves the request and returns `Ok(true)`: the response was sent here.
    async fn request_filter(
        &self,
        session: &mut Session,
        _ctx: &mut Self::CTX,
    ) -> pingora::Result<bool> {
        let _open = self.0.drain.enter();
        self.serve(session).await;
        Ok(true)
    }
}

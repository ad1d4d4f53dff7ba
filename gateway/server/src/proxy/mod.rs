//! The front door: a pingora [`ProxyHttp`] whose `request_filter` answers every route itself,
//! with each request's state in one [`Exchange`] (pingora's per-request `CTX`) and its metrics
//! recorded in the `logging` phase.
//!
//! pingora proxies one upstream per request and cannot easily rewrite a large body before
//! choosing it, while a P/D request needs the whole body before routing and then two upstream
//! calls. So the LLM routes are served in `request_filter`: read the body, ask the policy, call
//! P then D over pooled keep-alive HTTP, stream D's answer back with `write_response_body`,
//! and return `Ok(true)` ("response already sent"). `upstream_peer` is never reached.
//!
//! One generation request, phase by phase, a file each:
//! 0. [`front`]: the connection cap and the head deadline, before pingora reads a request.
//! 1. [`admit`](Gateway::admit): a slot under `--max-concurrent-requests`, the body read
//!    meanwhile (bounded in size per route and in time); the whole request under
//!    `--request-timeout-secs`.
//! 2. [`prepare`]: body → JSON, untrusted `kv_transfer_params` stripped, routing fields read,
//!    prompt tokenized, block hashes, the view, the policy's decision, interpreted once into a
//!    [`plan::Plan`] (which P, which Ds with how many children, pull-back, one node).
//! 3. [`execute`]: the plan run: one node ([`whole`](Gateway::whole)), or P
//!    ([`prefill`](Gateway::prefill)) then D — one decode request, or one per group with n>1
//!    spread ([`spread`](Gateway::spread)); every candidate list walked by one failover loop.
//! 4. [`relay`]: the node's answer to the client as it arrives (merged from several for spread
//!    children); on the way out ([`crate::answer`]) a retained turn's `kv_transfer_params` are
//!    taken (and removed for an untrusted client).
//! 5. [`remember`]: the retained turn indexed, the earlier one retired, a `/v1/responses`
//!    answer stored for `previous_response_id`.
//!
//! A client that leaves while P or D works is noticed (the downstream connection closes):
//! D's connection is dropped (the node aborts the request) and P's lease is released at once
//! over P's KV side channel, so nothing waits for the lease to expire.

mod endpoints;
mod exchange;
mod execute;
pub mod front;
pub(crate) mod plan;
pub(crate) mod prepare;
mod relay;
mod remember;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use pd_policy::Api;
use pingora::http::ResponseHeader;
use pingora::prelude::{HttpPeer, ProxyHttp, Session};
use tracing::{Instrument, debug};

use crate::admission::Admission;
use crate::cluster::Cluster;
use crate::conversation::{Holdings, ResponseStore};
use crate::drain::Drain;
use crate::error::GatewayError;
use crate::lease::LeaseReleaser;
use crate::metrics::Metrics;
use crate::openai;
use crate::route::Router;
use crate::secret;
use crate::tokenizer_api;
use crate::upstream::{NodeClient, REQUEST_ID};

pub use exchange::Exchange;
use exchange::Outcome;
pub use remember::write_unsaved_turns;

/// Settings of the front door.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Largest body of a generation request (`--max-body`).
    pub max_body: usize,
    /// Until this instant (the start plus twice the node timeout) the nodes may still be
    /// registering: a model no node serves yet is a 503 to retry, not a 404.
    pub settled_at: std::time::Instant,
    /// Largest body of any other route: the tokenizer endpoints and the rest
    /// (`--max-small-body`).
    pub max_small_body: usize,
    /// The whole body must be read within this (`None`: pingora's per-read timeout only).
    pub body_timeout: Option<Duration>,
    /// A generation request must end within this (`None`: no limit).
    pub request_timeout: Option<Duration>,
    /// A node must send its answer's head within this (P's always; D's and a whole node's when
    /// the answer is streamed: a whole answer's head comes with its end).
    pub node_first_byte_timeout: Option<Duration>,
    /// A node must send the next piece of its answer within this.
    pub node_idle_timeout: Option<Duration>,
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
    /// Where stored responses also go, and are read back from when memory lacks them
    /// (`--state-dir`); none: memory only.
    pub state: Option<crate::state::State>,
    /// Turns whose write to `state` failed, written by [`write_unsaved_turns`] once it answers.
    pub unsaved: Arc<crate::conversation::Unsaved>,
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

/// How [`Gateway::take_place`] ended, when the request was not refused.
enum Placed {
    Admitted(crate::admission::Admitted, Vec<u8>),
    /// The client left while waiting for its slot.
    Gone,
}

/// The client port's service: pingora's HTTP proxy running `gateway`, behind the connection
/// cap and the head deadline ([`front`]).
pub fn service(
    conf: &Arc<pingora::server::configuration::ServerConf>,
    gateway: Gateway,
    limits: front::FrontLimits,
) -> pingora::services::listening::Service<front::Front<pingora::proxy::HttpProxy<Gateway>>> {
    let proxy = pingora::proxy::http_proxy(conf, gateway);
    pingora::services::listening::Service::new(
        "pd-gateway".to_owned(),
        front::Front::new(proxy, limits),
    )
}

/// Bytes pingora buffers when it reads a client connection. With its default, 64 KiB, a client
/// that once sent a large body kept 64 KiB resident for as long as its connection stayed open;
/// heads and bodies read as well through 16 KiB (a larger body takes more reads). An open
/// stream's other costs: docs/bench-log/scale.md, "Many slow streams".
pub const CLIENT_READ_BUFFER: usize = 16 * 1024;

/// Adds the client port at `addr` to `service`, with TLS when `tls` names a certificate and a
/// key (PEM paths; Mozilla's intermediate settings, as pingora's `add_tls`), and a read buffer of
/// [`CLIENT_READ_BUFFER`] per connection.
///
/// # Errors
/// The certificate or key cannot be read.
pub fn listen<A>(
    service: &mut pingora::services::listening::Service<A>,
    addr: &str,
    tls: Option<(&str, &str)>,
) -> pingora::Result<()> {
    use pingora::listeners::{L4BufferSettings, ListenerConfig};
    let buffers = L4BufferSettings::default().read(CLIENT_READ_BUFFER);
    let mut endpoint = ListenerConfig::tcp(addr).l4_buffer(buffers);
    if let Some((cert, key)) = tls {
        endpoint = endpoint.tls(pingora::listeners::tls::TlsSettings::intermediate(
            cert, key,
        )?);
    }
    service.add_listener(endpoint);
    Ok(())
}

/// Resolves when the client closed its connection (or sent more than it should have).
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

/// A response header: status, content type, the request's id, the length when known.
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

/// The client's `Authorization: Bearer KEY`.
fn bearer_key(session: &Session) -> Option<&str> {
    let header = session.req_header().headers.get("authorization");
    secret::bearer(header.and_then(|v| v.to_str().ok()))
}

/// A whole answer.
async fn respond(session: &mut Session, status: u16, content_type: &str, body: Bytes) {
    let h = header(status, content_type, Some(body.len()), request_id(session));
    send_whole(session, h, body).await;
}

async fn send_whole(session: &mut Session, h: Box<ResponseHeader>, body: Bytes) {
    if session.write_response_header(h, false).await.is_ok() {
        let _ = session.write_response_body(Some(body), true).await;
    }
}

/// An error as the whole answer: its status and OpenAI error object.
async fn respond_error(session: &mut Session, e: &GatewayError) {
    let body = e.body();
    let mut h = header(
        e.status(),
        "application/json",
        Some(body.len()),
        request_id(session),
    );
    if let Some(seconds) = e.retry_after() {
        // The OpenAI SDKs wait this long before they retry.
        let _ = h.insert_header("retry-after", seconds.to_string());
    }
    send_whole(session, h, body).await;
}

/// The route's body limit said by the client's `content-length`, before a byte of the body
/// is read; the connection is not kept alive, so the unread body is never read as a request.
fn declared_too_large(session: &mut Session, limit: usize) -> Result<(), GatewayError> {
    let declared = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        session.set_keepalive(None);
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    Ok(())
}

/// The request body, at most `limit` bytes, read within `deadline`. A body over the limit
/// (a chunked one, found while reading) or too slow ends the connection after the error.
async fn read_body(
    session: &mut Session,
    limit: usize,
    deadline: Option<Duration>,
) -> Result<Vec<u8>, GatewayError> {
    declared_too_large(session, limit)?;
    let read = read_body_within(session, limit);
    let read = match deadline {
        Some(t) => match tokio::time::timeout(t, read).await {
            Ok(r) => r,
            Err(_) => Err(GatewayError::ReadTimeout {
                what: "request body",
                limit: t,
            }),
        },
        None => read.await,
    };
    if read.is_err() {
        session.set_keepalive(None);
    }
    read
}

async fn read_body_within(session: &mut Session, limit: usize) -> Result<Vec<u8>, GatewayError> {
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

impl Gateway {
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

    /// Routes the request: a generation API, or one of the small endpoints.
    async fn serve(&self, session: &mut Session, x: &mut Exchange) {
        let method = session.req_header().method.as_str().to_owned();
        let path = session.req_header().uri.path().to_owned();
        let guarded = path.starts_with("/v1/") || pd_tokenize::endpoints::is_tokenizer_path(&path);
        if guarded && !self.authorized(session) {
            self.0.metrics.unauthorized.inc();
            respond_error(session, &GatewayError::Unauthorized).await;
            return;
        }
        if method == "POST"
            && let Some(api) = openai::api_of(&path)
        {
            let id = assign_request_id(session);
            let span = if pd_telemetry::enabled() {
                // Exported: a child of the client's `traceparent`, if it sent one.
                pd_telemetry::server_span!(id, &session.req_header().headers)
            } else {
                tracing::info_span!("request", id = %id)
            };
            return self.generate(session, x, api).instrument(span).await;
        }
        // Every other route takes a small body at most: one declared larger is refused before
        // it is read, and a chunked one is never drained for keep-alive.
        if let Err(e) = declared_too_large(session, self.0.config.max_small_body) {
            respond_error(session, &e).await;
            return;
        }
        if let Some(endpoint) = tokenizer_api::Endpoint::of(&method, &path) {
            return self.tokenizer_endpoint(session, endpoint).await;
        }
        if session
            .req_header()
            .headers
            .contains_key(http::header::TRANSFER_ENCODING)
        {
            session.set_keepalive(None);
        }
        self.endpoint(session, &method, &path).await;
    }

    /// A generation request, start to end, within `--request-timeout-secs`; the error answer
    /// when it failed before any byte reached the client, else an error event ending a stream.
    async fn generate(&self, session: &mut Session, x: &mut Exchange, api: Api) {
        x.api = Some(api);
        let outcome = match self.0.config.request_timeout {
            Some(limit) => tokio::time::timeout(limit, self.admit(session, x))
                .await
                .unwrap_or(Err(GatewayError::Timeout { limit })),
            None => self.admit(session, x).await,
        };
        x.outcome = Some(match outcome {
            // A node's own refusal, relayed as it answered it.
            Ok(Outcome::Ok) if x.progress.relayed >= 500 => "node_error",
            Ok(Outcome::Ok) if x.progress.relayed >= 400 => "client_error",
            Ok(Outcome::Ok) => "ok",
            Ok(Outcome::Aborted) => "aborted",
            Err(e) => {
                debug!(
                    api = openai::api_label(api),
                    status = e.status(),
                    "request failed: {e}"
                );
                if x.progress.timing.first_byte.is_none() && !x.progress.streaming {
                    respond_error(session, &e).await;
                } else if let GatewayError::Timeout { .. } = e {
                    // Cut mid-answer (the relay that was writing it is gone): a stream ends
                    // with an error event and no `[DONE]`, another body where it stands.
                    let last = x.progress.streaming.then(|| e.stream_event(api));
                    let _ = session.write_response_body(last, true).await;
                }
                e.outcome()
            }
        });
    }

    /// Admission, then the body read (bounded by `--max-body` and `--body-timeout-ms`): the
    /// request takes its place (a slot, or the bounded line for one) before its body is read,
    /// so bodies in memory are bounded by slots and line, not by connections; a request refused
    /// costs no read. While it waits its body is read; once read, the client is watched: one
    /// that leaves gives its place up at once. A completions request listing several prompts
    /// then takes the further slots it weighs. Waiting for a slot is waiting on the cluster, not
    /// the gateway's own time. The slots are held until the answer's last byte.
    async fn admit(
        &self,
        session: &mut Session,
        x: &mut Exchange,
    ) -> Result<Outcome, GatewayError> {
        let s = &self.0;
        let api = x.api.unwrap_or(Api::ChatCompletions);
        declared_too_large(session, s.config.max_body)?;
        let waited = std::time::Instant::now();
        let admission = pd_telemetry::phase!("admission", request_id(session).unwrap_or_default());
        let place = self.take_place(session, s.config.max_body);
        let (slot, raw) = match place.instrument(admission.clone()).await? {
            Placed::Admitted(slot, raw) => (slot, raw),
            Placed::Gone => return Ok(Outcome::Aborted),
        };
        x.progress.timing.waiting += waited.elapsed();
        // A completions request listing several prompts weighs as many (a body that does not
        // parse weighs 1 and fails later).
        let extra = match api {
            Api::Completions if s.admission.limited() => openai::prompts_listed(&raw) - 1,
            _ => 0,
        };
        let _more = if extra > 0 {
            let timing = &mut x.progress.timing;
            let more = tokio::select! {
                a = timing.wait(s.admission.admit_more(extra)).instrument(admission.clone()) => a,
                () = client_gone(session) => return Ok(Outcome::Aborted),
            };
            Some(more.map_err(|why| self.refused(why))?)
        } else {
            None
        };
        drop(admission);
        s.metrics
            .queue_wait
            .observe(x.progress.timing.waiting.as_secs_f64());
        let _slot = slot;
        self.answer(session, x, api, &raw).await
    }

    /// A place under `--max-concurrent-requests` and the body, at most `limit` bytes: the
    /// body is read while the request waits for its slot, and once it is in, the client is
    /// watched until the slot comes.
    async fn take_place(
        &self,
        session: &mut Session,
        limit: usize,
    ) -> Result<Placed, GatewayError> {
        let s = &self.0;
        let body_timeout = s.config.body_timeout;
        let admit = s.admission.admit();
        tokio::pin!(admit);
        let mut slot = None;
        let read = {
            let read = read_body(session, limit, body_timeout);
            tokio::pin!(read);
            loop {
                tokio::select! {
                    a = &mut admit, if slot.is_none() => match a {
                        Ok(a) => slot = Some(a),
                        Err(why) => break Err(self.refused(why)),
                    },
                    r = &mut read => break r,
                }
            }
        };
        let raw = match read {
            Ok(raw) => raw,
            Err(e) => {
                // Refused before its body was read: that body is never read as a request.
                session.set_keepalive(None);
                return Err(e);
            }
        };
        let slot = match slot {
            Some(slot) => slot,
            None => tokio::select! {
                a = &mut admit => a.map_err(|why| self.refused(why))?,
                () = client_gone(session) => return Ok(Placed::Gone),
            },
        };
        Ok(Placed::Admitted(slot, raw))
    }

    /// Counts a refusal and makes it the request's error (429).
    pub(crate) fn refused(&self, why: crate::admission::Refused) -> GatewayError {
        self.0
            .metrics
            .admission_refused
            .with_label_values(&[why.label()])
            .inc();
        GatewayError::Overloaded(why)
    }

    /// Phases 2–5 of an admitted request.
    async fn answer(
        &self,
        session: &mut Session,
        x: &mut Exchange,
        api: Api,
        raw: &[u8],
    ) -> Result<Outcome, GatewayError> {
        let (prepared, reserved) = self.prepare(session, api, raw).await?;
        x.progress.timing.prepared = Some(std::time::Instant::now());
        let prepared = x.request.insert(prepared);
        let outcome = self
            .execute(session, prepared, &mut x.progress, reserved)
            .await;
        self.remember(prepared, &mut x.progress, &outcome);
        outcome
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Exchange;

    fn new_ctx(&self) -> Self::CTX {
        Exchange::new()
    }

    /// Never reached: `request_filter` answers every request.
    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _x: &mut Self::CTX,
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
        x: &mut Self::CTX,
    ) -> pingora::Result<bool> {
        let _open = self.0.drain.enter();
        self.serve(session, x).await;
        Ok(true)
    }

    /// The request's metrics, once its answer is over.
    async fn logging(
        &self,
        _session: &mut Session,
        _e: Option<&pingora::Error>,
        x: &mut Self::CTX,
    ) {
        x.record(&self.0.metrics);
    }
}

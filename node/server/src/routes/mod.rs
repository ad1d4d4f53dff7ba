//! The axum router: one module per OpenAI endpoint, plus health, models, metrics and the
//! fallbacks that keep every error in the OpenAI shape.

mod chat;
mod completions;
mod gateway_id;
mod kv_plan;
mod kv_unreachable;
mod responses;
mod tokenize;

pub(crate) use gateway_id::GatewayId;
pub use gateway_id::{GATEWAY_ID_HEADER, MAX_GATEWAY_ID_BYTES};
pub(crate) use kv_plan::KvPlan;
pub use kv_unreachable::{KV_UNREACHABLE_HEADER, MAX_UNREACHABLE_NAMED};

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use std::sync::Arc;

use pd_engine::{EngineError, EngineHandle, GenerateRequest, RequestStream};
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::disagg::{Disagg, Events, PullSpans, consume};
use crate::error::ApiError;
use crate::kv_params::{KvDirective, KvReply};
use crate::openai::{ModelCard, ModelList};
use pd_tokenize::endpoints;
use pd_wire::Api;

/// Largest request body accepted; larger ones get a 413.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// What every handler shares.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub(crate) engine: EngineHandle,
    /// Unix seconds when this server started (the model card's `created`).
    pub(crate) started: u64,
    /// The node's P/D role and transfer machinery.
    pub(crate) disagg: Arc<Disagg>,
    /// Silence after which a stream sends a keep-alive comment.
    pub(crate) sse_keep_alive: std::time::Duration,
    /// How the model writes its own tool calls, if this node reads them.
    pub(crate) tool_parser: Option<crate::ToolCallParser>,
    /// Whether the node drains (`SIGTERM`): `/health` answers 503 meanwhile.
    pub(crate) drain: Arc<crate::drain::Drain>,
}

impl AppState {
    /// Queues `request` on the engine. A structured output is compiled first on the blocking
    /// pool (bounded by llguidance's limits, but tens of milliseconds for a large schema: not
    /// on the reactor), after the request's other checks.
    pub(crate) async fn submit(
        &self,
        request: GenerateRequest,
    ) -> Result<RequestStream, EngineError> {
        let Some(structured) = request.params.structured.clone() else {
            return self.engine.submit(request);
        };
        self.engine.validate(&request)?;
        let engine = self.engine.clone();
        let grammar = tokio::task::spawn_blocking(move || engine.compile(&structured))
            .await
            .map_err(|_| EngineError::Shutdown)??;
        self.engine.submit_compiled(request, Some(grammar))
    }

    /// Checks the request's `model` against the served one (absent means the served one) and
    /// returns the name to echo back.
    pub(crate) fn model_name(&self, requested: Option<&str>) -> Result<String, ApiError> {
        let served = &self.engine.info().model_name;
        match requested {
            None => Ok(served.clone()),
            Some(m) if m == served => Ok(served.clone()),
            Some(m) => Err(ApiError::ModelNotFound(m.to_owned())),
        }
    }

    /// The events of a submitted request (relayed through the pull task for a consumer), and
    /// the builder of its response's `kv_transfer_params`.
    pub(crate) fn events(
        &self,
        stream: RequestStream,
        mut plan: KvPlan,
        request_id: &str,
        prompt: &[u32],
    ) -> (Events, KvReply) {
        let reply = KvReply::new(
            self.disagg.advert.clone(),
            request_id,
            prompt,
            &self.engine.info().binding_key,
        );
        let phase = phase_span(&plan.directive);
        let events = match std::mem::replace(&mut plan.directive, KvDirective::None) {
            KvDirective::Consume(remotes) | KvDirective::Produce { held: remotes, .. }
                if !remotes.is_empty() =>
            {
                let pull = match phase.is_none() {
                    true => tracing::Span::none(),
                    false => phase.in_scope(|| match TRACED.try_with(Arc::clone) {
                        Ok(id) => pd_telemetry::phase!("pull", id),
                        Err(_) => tracing::Span::none(),
                    }),
                };
                consume(
                    self.disagg.clone(),
                    self.engine.clone(),
                    stream,
                    (remotes, prompt.to_vec()),
                    PullSpans { phase, pull },
                )
            }
            _ => Events::engine(stream, phase),
        };
        (events, reply)
    }
}

tokio::task_local! {
    /// The id of the request being served, while its spans are exported (set by [`request_id`]).
    static TRACED: Arc<str>;
}

/// The span of what `directive` has this node do, within the request's: `prefill` (a
/// producer's, a reverse pull first when it names a held turn), `decode` (after a pull), or
/// `generate` (the whole request); none while traces are off.
fn phase_span(directive: &KvDirective) -> tracing::Span {
    if !pd_telemetry::enabled() {
        return tracing::Span::none();
    }
    let Ok(id) = TRACED.try_with(Arc::clone) else {
        return tracing::Span::none();
    };
    match directive {
        KvDirective::Produce { .. } => pd_telemetry::phase!("prefill", id),
        KvDirective::Consume(_) => pd_telemetry::phase!("decode", id),
        KvDirective::None | KvDirective::Incomplete { .. } => {
            pd_telemetry::phase!("generate", id)
        }
    }
}

pub(crate) fn router(
    engine: EngineHandle,
    disagg: Arc<Disagg>,
    options: crate::HttpOptions,
) -> Router {
    let keys = Arc::new(Keys {
        api_key: options.api_key,
        cluster_token: options.cluster_token,
    });
    let unreachable = disagg.clone();
    let prefiller = options.prefiller.clone();
    let state = AppState {
        engine,
        started: unix_now(),
        disagg,
        sse_keep_alive: options.sse_keep_alive,
        tool_parser: options.tool_parser,
        drain: options.drain,
    };
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/metrics", get(metrics))
        .route(Api::Completions.path(), post(completions::create))
        .route(Api::ChatCompletions.path(), post(chat::create))
        .route(Api::Responses.path(), post(responses::create))
        .route(endpoints::TOKENIZE_PATH, post(tokenize::tokenize))
        .route(endpoints::DETOKENIZE_PATH, post(tokenize::detokenize))
        .route(
            endpoints::TOKENIZER_INFO_PATH,
            get(tokenize::tokenizer_info),
        )
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            prefiller,
            crate::prefiller::prefill_first,
        ))
        .layer(axum::middleware::from_fn_with_state(keys, require_key))
        .layer(axum::middleware::from_fn(request_id))
        .layer(axum::middleware::map_response_with_state(
            unreachable,
            kv_unreachable::name_unreachable,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// One token's logprobs as OpenAI's chat `logprobs.content` and the Responses API's
/// `output_text.logprobs` give them.
pub(super) fn logprob_entry(
    tokenizer: &pd_tokenize::Tokenizer,
    lp: &pd_engine::TokenLogprob,
) -> crate::openai::chat::ChatTokenLogprob {
    use crate::openai::chat::{ChatTokenLogprob, TopLogprob};
    use crate::prompt::token_text;
    let token = token_text(tokenizer, lp.token_id);
    ChatTokenLogprob {
        bytes: token.as_bytes().to_vec(),
        token,
        logprob: lp.logprob,
        top_logprobs: lp
            .top
            .iter()
            .map(|&(id, logprob)| {
                let token = token_text(tokenizer, id);
                TopLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob,
                }
            })
            .collect(),
    }
}

/// The header naming a request across the gateway's and the nodes' logs.
const REQUEST_ID: &str = "x-request-id";

/// `x-request-id`: the caller's id for this request (a gateway sends its own to P and D), or a
/// fresh one when it is missing, longer than 128 bytes or not printable ASCII. Every log line of
/// the handler carries it (a span), the answer echoes it, and each `/v1/` call ends with an
/// access line (method, path, status, time to the answer's head), so one request can be
/// followed across the gateway's, P's and D's logs.
async fn request_id(req: Request, next: axum::middleware::Next) -> Response {
    let start = std::time::Instant::now();
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let id = req
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| new_id("node-"), str::to_owned);
    // Exported (a POST, while traces are): a child of the caller's `traceparent`, its id
    // within reach of the phases' spans.
    let traced = pd_telemetry::enabled() && method == Method::POST;
    let span = match traced {
        true => pd_telemetry::server_span!(id, req.headers()),
        false => tracing::info_span!("request", id = %id),
    };
    let run = next.run(req);
    let mut resp = match traced {
        true => {
            let run = TRACED.scope(Arc::from(id.as_str()), run);
            run.instrument(span.clone()).await
        }
        false => run.instrument(span.clone()).await,
    };
    if path.starts_with("/v1/") {
        let ms = start.elapsed().as_secs_f64() * 1e3;
        span.in_scope(|| {
            tracing::info!("{method} {path} {} in {ms:.1} ms", resp.status().as_u16())
        });
    }
    if let Ok(v) = header::HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    resp
}

/// The keys `/v1/` takes, where the node has one (`--api-key`).
#[derive(Debug)]
struct Keys {
    api_key: Option<String>,
    cluster_token: Option<tokio::sync::watch::Receiver<Option<String>>>,
}

impl Keys {
    /// Whether `given` (a bearer key) opens `/v1/`: the node's key, or the cluster's token.
    fn admit(&self, given: Option<&str>) -> bool {
        let Some(key) = &self.api_key else {
            return true;
        };
        let Some(given) = given else {
            return false;
        };
        let cluster = self
            .cluster_token
            .as_ref()
            .and_then(|t| t.borrow().clone())
            .filter(|t| !t.is_empty());
        let same = |want: &str| pd_kv_transfer::constant_time_eq(given.as_bytes(), want.as_bytes());
        same(key) || cluster.is_some_and(|t| same(&t))
    }
}

/// `/v1/` and tokenizer requests without one of the node's keys get a 401 (OpenAI's
/// `invalid_api_key`).
async fn require_key(
    axum::extract::State(keys): axum::extract::State<Arc<Keys>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path();
    if path.starts_with("/v1/") || endpoints::is_tokenizer_path(path) {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !keys.admit(given) {
            return ApiError::InvalidApiKey.into_response();
        }
    }
    next.run(req).await
}

/// 200 while serving; 503 once the node drains, so a load balancer's readiness check takes it
/// out while it finishes what it has.
async fn health(State(state): State<AppState>) -> StatusCode {
    if state.drain.is_draining() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![card(&state)],
    })
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`): the served model's card, or 404
/// `model_not_found`. The id is the rest of the path as sent (slashes included, as the SDKs
/// send `org/name`), read as the gateway reads it.
async fn model(State(state): State<AppState>, uri: Uri) -> Result<Json<ModelCard>, ApiError> {
    let id = uri.path().strip_prefix("/v1/models/").unwrap_or_default();
    state.model_name(Some(id))?;
    Ok(Json(card(&state)))
}

fn card(state: &AppState) -> ModelCard {
    let info = state.engine.info();
    ModelCard {
        id: info.model_name.clone(),
        object: "model",
        created: state.started,
        owned_by: "pd-node",
        root: info.model_name.clone(),
        parent: None,
        max_model_len: info.max_model_len,
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let leases = state.engine.lease_stats();
    state
        .disagg
        .metrics
        .observe_leases(&pd_kv_transfer::PoolStats {
            total_blocks: state.engine.info().num_blocks,
            free_blocks: state.engine.free_blocks(),
            live_leases: leases.live,
            counts: leases.counts,
        });
    state.disagg.observe_puller();
    let info = state.engine.info();
    let mut families = state.engine.metrics().registry().gather();
    let vllm = crate::vllm_metrics::families(
        &families,
        crate::vllm_metrics::ServedModel {
            name: &info.model_name,
            block_size: info.block_size,
            num_blocks: info.num_blocks,
            cache_dtype: info.kv_layout.dtype.as_str(),
        },
    );
    families.extend(vllm);
    families.extend(state.disagg.metrics.registry().gather());
    families.extend(state.disagg.node_metrics.registry().gather());
    match prometheus::TextEncoder::new().encode_to_string(&families) {
        Ok(text) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "encoding metrics failed");
            (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
        }
    }
}

async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::UnknownRoute {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// A JSON body read as bytes and parsed here, whatever the `Content-Type`, so every failure is
/// a 400 (or 413) in the OpenAI error shape and a missing field is named in `param`.
#[derive(Debug)]
pub(crate) struct JsonBody<T>(pub(crate) T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // Refuse an announced oversized body before reading any of it; the limit on the body
        // stream below catches chunked bodies that grow past it.
        let announced = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if announced.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
            return Err(ApiError::PayloadTooLarge {
                limit: MAX_BODY_BYTES,
            });
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge {
                    limit: MAX_BODY_BYTES,
                }
            } else {
                ApiError::InvalidRequest {
                    message: rejection.body_text(),
                    param: None,
                }
            }
        })?;
        parse_json(&bytes).map(JsonBody)
    }
}

fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Straight into the request's type (no tree of the whole body first: for a prompt of a few
    // hundred token ids that tree cost as much as the rest of the request's parsing). A body
    // that is JSON but not an object is told so from its first byte.
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        return Err(ApiError::InvalidRequest {
            message: match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
                Ok(_) => "The request body must be a JSON object".into(),
                Err(e) => format!("Invalid JSON body: {e}"),
            },
            param: None,
        });
    }
    serde_json::from_slice(bytes).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            // Parsed again, off the success path, to name the field: "temperature: invalid
            // type: string \"hot\", expected f32", not a column of the body (which a gateway
            // that added fields to it has moved).
            let (path, message) = match serde_path_to_error::deserialize::<_, T>(
                &mut serde_json::Deserializer::from_slice(bytes),
            ) {
                Err(pe) => (pe.path().to_string(), without_position(pe.inner())),
                Ok(_) => (".".to_owned(), without_position(&e)),
            };
            // A field of a `#[serde(flatten)]` group has no path through serde.
            let path = match path.as_str() {
                "." if missing_field(&message).is_none() => {
                    flattened_culprit::<T>(bytes).unwrap_or(path)
                }
                _ => path,
            };
            let param = missing_field(&message)
                .map(str::to_owned)
                .or_else(|| top_field(&path));
            let message = if path == "." {
                message
            } else {
                format!("{path}: {message}")
            };
            ApiError::InvalidRequest {
                message: format!("Invalid request: {message}"),
                param,
            }
        }
        _ => ApiError::InvalidRequest {
            message: format!("Invalid JSON body: {e}"),
            param: None,
        },
    })
}

/// Bodies with more top-level fields than this are not searched for a culprit: the search
/// parses the body once per field, so its cost grows with the square of their number (a body
/// of a million one-letter keys must not cost a million parses of itself). Every request type
/// here has fewer than 64 fields.
const MAX_CULPRIT_FIELDS: usize = 64;

/// The one top-level field of a body that fails with no path: the field whose removal makes
/// the body parse. `None` when no single field does (two bad fields; a required one, whose
/// removal fails as "missing field" like any other required field's), or the body has more
/// than [`MAX_CULPRIT_FIELDS`]. Off the success path: one parse per field of the body.
fn flattened_culprit<T: DeserializeOwned>(bytes: &[u8]) -> Option<String> {
    let body: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(bytes).ok()?;
    if body.len() > MAX_CULPRIT_FIELDS {
        return None;
    }
    body.keys()
        .find(|&key| {
            let mut rest = body.clone();
            rest.remove(key);
            serde_json::from_value::<T>(serde_json::Value::Object(rest)).is_ok()
        })
        .cloned()
}

/// serde_json's message without its " at line L column C".
fn without_position(e: &serde_json::Error) -> String {
    let message = e.to_string();
    match message.rfind(" at line ") {
        Some(i) if e.line() > 0 => message[..i].to_owned(),
        _ => message,
    }
}

/// The top-level field of a serde path (`messages[0].content` → `messages`); `None` for the
/// root (`.`).
fn top_field(path: &str) -> Option<String> {
    let end = path.find(['.', '[']).unwrap_or(path.len());
    (end > 0).then(|| path[..end].to_owned())
}

/// The field named by serde's "missing field `x`" message.
fn missing_field(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("missing field `")?;
    rest.split('`').next()
}

/// Unix time in seconds.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh id like `cmpl-3f2a…`: a random (v4) UUID, 32 hex digits.
pub(crate) fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Needs {
        #[allow(dead_code)]
        prompt: String,
    }

    #[test]
    fn json_errors_name_missing_fields() {
        let e = parse_json::<Needs>(br#"{"model": "m"}"#).unwrap_err();
        assert_eq!(e.param(), Some("prompt"));
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let e = parse_json::<Needs>(b"{not json").unwrap_err();
        assert!(e.to_string().starts_with("Invalid JSON body"), "{e}");
        let e = parse_json::<Needs>(b"[1]").unwrap_err();
        assert_eq!(e.param(), None);
        assert!(e.to_string().contains("must be a JSON object"), "{e}");
        let e = parse_json::<Needs>(b"  \"text\"").unwrap_err();
        assert!(e.to_string().contains("must be a JSON object"), "{e}");
        let e = parse_json::<Needs>(b"[1").unwrap_err();
        assert!(e.to_string().starts_with("Invalid JSON body"), "{e}");
        let e = parse_json::<Needs>(b"").unwrap_err();
        assert!(e.to_string().starts_with("Invalid JSON body"), "{e}");
        let e = parse_json::<Needs>(br#"{"prompt": 3}"#).unwrap_err();
        assert!(e.to_string().starts_with("Invalid request"), "{e}");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        // A field of the wrong type is named, by its path, without a position in the body.
        assert_eq!(
            e.to_string(),
            "Invalid request: prompt: invalid type: integer `3`, expected a string"
        );
        assert_eq!(e.param(), Some("prompt"));
        assert!(parse_json::<Needs>(br#" {"prompt": "p", "extra": [1, {"a": null}]}"#).is_ok());
    }

    /// Wrong types inside real request bodies are named by their path, and the top-level field
    /// is the error's `param`; no position in the body either way (a gateway that added fields
    /// to the body moved it). Fields of a `#[serde(flatten)]` group (the sampling fields) have
    /// no path through serde: the one whose removal clears the error is named.
    #[test]
    fn json_errors_name_the_field_by_its_path() {
        let e = parse_json::<crate::openai::chat::ChatCompletionRequest>(
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}"#,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("Invalid request: max_tokens: invalid type: string \"5\""),
            "{e}"
        );
        assert_eq!(e.param(), Some("max_tokens"));
        let e = parse_json::<crate::openai::chat::ChatCompletionRequest>(
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}"#,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Invalid request: temperature: invalid type: string \"hot\", expected f32"
        );
        assert_eq!(e.param(), Some("temperature"));
        // The same in the other flattened groups, and beside a valid sampling field.
        let e = parse_json::<crate::openai::completions::CompletionRequest>(
            br#"{"model": "m", "prompt": "p", "top_p": 0.5, "seed": "x"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("Invalid request: seed: "), "{e}");
        assert_eq!(e.param(), Some("seed"));
        let e = parse_json::<crate::openai::chat::ChatCompletionRequest>(
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}"#,
        )
        .unwrap_err();
        assert_eq!(e.param(), Some("parallel_tool_calls"), "{e}");
        // A body of many unknown fields is not searched (one parse per field each time).
        let mut many = serde_json::json!({"model": "m", "prompt": "p", "seed": "x"});
        for i in 0..MAX_CULPRIT_FIELDS {
            many[format!("extra{i}")] = 0.into();
        }
        let e = parse_json::<crate::openai::completions::CompletionRequest>(
            many.to_string().as_bytes(),
        )
        .unwrap_err();
        assert_eq!(e.param(), None, "{e}");
        // Two bad fields: neither alone explains the error, so none is named.
        let e = parse_json::<crate::openai::chat::ChatCompletionRequest>(
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "a", "top_p": "b"}"#,
        )
        .unwrap_err();
        assert_eq!(e.param(), None, "{e}");
        assert_eq!(
            top_field("messages[0].content").as_deref(),
            Some("messages")
        );
        assert_eq!(top_field("."), None);
    }

    #[test]
    fn ids_are_unique() {
        assert_ne!(new_id("cmpl-"), new_id("cmpl-"));
        assert!(new_id("resp_").starts_with("resp_"));
    }

    /// `/v1/` takes the node's key or the cluster's token as it is now; no key set, anything.
    #[test]
    fn the_node_key_or_the_current_cluster_token_opens_v1() {
        let open = Keys {
            api_key: None,
            cluster_token: None,
        };
        assert!(open.admit(None));
        assert!(open.admit(Some("anything")));
        let (token, rx) = tokio::sync::watch::channel(None::<String>);
        let keyed = Keys {
            api_key: Some("node-key".into()),
            cluster_token: Some(rx),
        };
        assert!(keyed.admit(Some("node-key")));
        for refused in [None, Some(""), Some("node-kez"), Some("node-key-")] {
            assert!(!keyed.admit(refused), "{refused:?}");
        }
        // The token the gateway hands out at registration, and its replacement.
        token.send_replace(Some("cluster-1".into()));
        assert!(keyed.admit(Some("cluster-1")));
        token.send_replace(Some("cluster-2".into()));
        assert!(!keyed.admit(Some("cluster-1")));
        assert!(keyed.admit(Some("cluster-2")));
        // An empty token is no token.
        token.send_replace(Some(String::new()));
        assert!(!keyed.admit(Some("")));
    }
}

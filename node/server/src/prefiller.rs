//! Prefill first, behind an Endpoint Picker: a decode node that receives
//! `x-prefiller-host-port` (llm-d's routing-sidecar protocol, set by `pd-gateway`'s picker or
//! any picker that speaks it) runs the prompt on that prefill node first — the client's body
//! answering with one token, asking for the KV to be held (`kv_transfer_params`,
//! [`pd_wire::handoff`]) — then serves the request itself with the params P returned: the
//! usual consumer path pulls P's blocks and decodes, streaming as usual.
//!
//! Off unless the node is started with `--prefiller-header` (and it must be a `kv_consumer`):
//! a node without it answers a request carrying the header with 400, not with a silent
//! recompute. A body that already carries `kv_transfer_params` (a trusted client driving P/D
//! itself) passes untouched. The node only pulls from peers it allows (`--kv-allowed-peers`
//! or the gateway's registry), whatever the header names.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use pd_wire::Api;
use pd_wire::handoff::{self, KV_FIELD, PREFILLER_HEADER};
use serde_json::{Map, Value};
use tracing::{Instrument, debug};

use crate::error::ApiError;
use crate::routes::MAX_BODY_BYTES;

/// Longest `host:port` taken from the header.
const MAX_ADDR_BYTES: usize = 261;

/// Headers passed on to the prefill node.
const FORWARDED: &[&str] = &["authorization", "x-request-id", "traceparent", "tracestate"];

/// What runs the prefill: present when the node serves the header.
#[derive(Debug, Clone)]
pub struct Prefiller {
    client: reqwest::Client,
    /// `http` or, under the cluster's mutual TLS, `https`.
    scheme: &'static str,
}

impl Prefiller {
    /// A prefill client waiting up to `timeout` for P's whole answer; with `tls` (`--tls-*`),
    /// it speaks the cluster's mutual TLS to P, presenting this node's certificate and
    /// trusting only the cluster CA for P's, which must name the address it is dialled at.
    ///
    /// # Errors
    /// The HTTP client could not be built.
    pub fn new(
        timeout: Duration,
        tls: Option<&pd_tls::ClusterTls>,
    ) -> Result<Self, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        if let Some(tls) = tls {
            builder = builder.use_preconfigured_tls((*tls.client_config()).clone());
        }
        Ok(Self {
            client: builder.build()?,
            scheme: pd_tls::scheme(tls),
        })
    }
}

/// The middleware's state: the prefiller, when the node serves the header.
pub(crate) type PrefillerState = Option<Arc<Prefiller>>;

/// `host:port`, checked: printable, no path, no user info, a port.
fn checked_addr(v: &HeaderValue) -> Result<&str, ApiError> {
    let bad = |why: &str| ApiError::invalid(PREFILLER_HEADER, format!("{PREFILLER_HEADER}: {why}"));
    let s = v.to_str().map_err(|_| bad("not printable ASCII"))?.trim();
    if s.is_empty() || s.len() > MAX_ADDR_BYTES {
        return Err(bad("empty or longer than a host and port"));
    }
    if s.contains(['/', '@', '?', '#', ' ', ',']) {
        return Err(bad("must be host:port"));
    }
    let port = s.rsplit_once(':').map(|(_, p)| p);
    if port.is_none_or(|p| p.parse::<u16>().is_err()) {
        return Err(bad("must be host:port"));
    }
    Ok(s)
}

/// The middleware on the generation routes.
pub(crate) async fn prefill_first(
    State(prefiller): State<PrefillerState>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(value) = req.headers().get(PREFILLER_HEADER) else {
        return next.run(req).await;
    };
    let Some(api) = Api::of_path(req.uri().path()) else {
        return next.run(req).await;
    };
    let Some(prefiller) = prefiller else {
        return ApiError::invalid(
            PREFILLER_HEADER,
            format!(
                "{PREFILLER_HEADER} names a prefill node, but this node does not run prefills \
                 elsewhere first (start a kv_consumer with --prefiller-header)"
            ),
        )
        .into_response();
    };
    let addr = match checked_addr(value) {
        Ok(a) => a.to_owned(),
        Err(e) => return e.into_response(),
    };
    match with_prefill(&prefiller, api, &addr, req).await {
        Ok(req) => next.run(req).await,
        Err(answer) => answer,
    }
}

/// `req` with P's params in its body, P having prefilled; or the answer to send instead.
async fn with_prefill(
    prefiller: &Prefiller,
    api: Api,
    addr: &str,
    req: Request,
) -> Result<Request, Response> {
    let (mut parts, body) = req.into_parts();
    let raw = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| {
            ApiError::PayloadTooLarge {
                limit: MAX_BODY_BYTES,
            }
            .into_response()
        })?;
    let body: Map<String, Value> = match serde_json::from_slice(&raw) {
        Ok(Value::Object(m)) => m,
        // The route's own reading answers what is wrong with it.
        _ => return Ok(Request::from_parts(parts, Body::from(raw))),
    };
    if body.get(KV_FIELD).is_some_and(|v| !v.is_null()) {
        return Ok(Request::from_parts(parts, Body::from(raw)));
    }
    let failed = |why: String| {
        ApiError::PrefillFailed {
            addr: addr.to_owned(),
            why,
        }
        .into_response()
    };
    let p_body = handoff::prefill_bytes(api, &body, 1, None).map_err(|e| failed(e.to_string()))?;
    let mut call = prefiller
        .client
        .post(format!("{}://{addr}{}", prefiller.scheme, api.path()))
        .header(header::CONTENT_TYPE, "application/json")
        .body(p_body);
    for name in FORWARDED {
        if let Some(v) = parts.headers.get(*name) {
            call = call.header(*name, v.clone());
        }
    }
    // Traced: the call is a `prefill` client span of this request, P's spans its children.
    let id = parts
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let span = pd_telemetry::phase!("prefill", id, otel.kind = "client");
    if pd_telemetry::enabled() {
        let mut headers = axum::http::HeaderMap::new();
        span.in_scope(|| pd_telemetry::inject_current(&mut headers));
        call = call.headers(headers);
    }
    let answer = call
        .send()
        .instrument(span)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let status = answer.status();
    let bytes = answer.bytes().await.map_err(|e| failed(e.to_string()))?;
    if !status.is_success() {
        // P refused the request itself (a bad field, too long a prompt): its error is the
        // client's.
        debug!(%addr, status = status.as_u16(), "the prefill node refused the request");
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return Err(r);
    }
    let params = handoff::prefill_params(&bytes).map_err(|e| failed(e.to_string()))?;
    let first = params.first().ok_or_else(|| failed("no params".into()))?;
    let d_body = handoff::decode_bytes(&body, first).map_err(|e| failed(e.to_string()))?;
    debug!(%addr, "prefilled elsewhere; decoding with its KV");
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(PREFILLER_HEADER);
    Ok(Request::from_parts(parts, Body::from(d_body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_must_be_a_host_and_port() {
        for ok in ["10.0.0.1:8000", "p.example:80", "[::1]:8100"] {
            assert_eq!(checked_addr(&HeaderValue::from_static(ok)).unwrap(), ok);
        }
        for bad in [
            "",
            "10.0.0.1",
            "10.0.0.1:http",
            "a:1/evil",
            "user@h:1",
            "a:1,b:2",
            "h:99999",
        ] {
            assert!(
                checked_addr(&HeaderValue::from_static(bad)).is_err(),
                "{bad}"
            );
        }
    }
}

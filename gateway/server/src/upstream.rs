//! The HTTP/1 client the request path calls nodes with: hyper's pooled keep-alive client, no
//! more.
//!
//! `reqwest` (which wraps the same client) parsed every request's URL twice, ran a redirect layer
//! and a proxy matcher, and cloned default headers: about a third of the gateway's CPU per request
//! went to that (docs/bench-log/gateway.md, "A plain hyper client"). Nodes answer `POST`s with JSON
//! or SSE; nothing here follows redirects or uses a proxy. The control plane's scrapes and the CLI
//! keep `reqwest`.

use std::time::Duration;

use bytes::{Buf, Bytes};
use futures::Stream;
use http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyDataStream, BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::error::chain;

/// The header naming a request across the gateway's and the nodes' logs.
pub const REQUEST_ID: &str = "x-request-id";
/// The header naming the gateway a request came through (its registry's `gateway_id`): a
/// producer tags the lease it grants for the request with it and releases the lease when this
/// gateway's registry stream ends, so a dead gateway's leases do not wait for their expiry.
pub const GATEWAY_ID: &str = "x-pd-gateway-id";
/// The header a decode node names the producers it could not reach lately in (their KV side
/// channels, comma-separated): its release of their leases cannot get through, so the gateway
/// releases the one it had granted for the request.
pub const KV_UNREACHABLE: &str = "x-pd-kv-unreachable";
/// The longest [`KV_UNREACHABLE`] value read (the node names at most 16).
const MAX_KV_UNREACHABLE_BYTES: usize = 4096;

/// Pooled keep-alive HTTP/1 to the nodes; each request carries the bearer key its node takes
/// ([`crate::cluster::NodeRef::bearer`]: the cluster token for registered nodes, what the
/// operator configured for static ones). Under the cluster's mutual TLS every connection is
/// `https`, the node's certificate checked against the CA and the gateway's presented.
#[derive(Debug, Clone)]
pub struct NodeClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// `http://` or `https://`.
    scheme: &'static str,
    /// This gateway's id, sent as [`GATEWAY_ID`] on every request (none: not sent).
    gateway_id: Option<HeaderValue>,
}

/// `Bearer {key}` as a header value kept out of logs.
///
/// # Errors
/// The key is not a valid header value.
pub fn bearer(key: &str) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
    let mut auth = HeaderValue::from_str(&format!("Bearer {key}"))?;
    auth.set_sensitive(true);
    Ok(auth)
}

/// A failed call: the connection, the request or the answer's head broke.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The address and path make no URI.
    #[error("bad node address: {0}")]
    Uri(#[from] http::Error),
    /// Connecting, writing the request or reading the answer's head failed.
    #[error("{}", chain(.0))]
    Send(#[from] hyper_util::client::legacy::Error),
    /// Reading the answer's body failed.
    #[error("reading the answer: {}", chain(.0))]
    Body(#[from] hyper::Error),
    /// The node left the gateway's view mid-answer and did not come back
    /// ([`crate::cluster::NodeRef::gone`]): nothing more will come.
    #[error("the node left the view mid-answer and did not come back")]
    Gone,
}

impl NodeClient {
    /// A client over mutual TLS with `tls`'s CA when given (plain HTTP otherwise).
    pub fn new(tls: Option<&pd_tls::ClusterTls>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        // `https` URIs only need TLS; without the cluster's, no root is trusted at all.
        connector.enforce_http(false);
        let (config, scheme) = match tls {
            Some(tls) => ((*tls.client_config()).clone(), "https://"),
            None => (pd_tls::no_roots(), "http://"),
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build(connector);
        Self {
            client,
            scheme,
            gateway_id: None,
        }
    }

    /// Names this gateway on every request ([`GATEWAY_ID`]); an id that is no header value is
    /// not sent.
    #[must_use]
    pub fn with_gateway_id(mut self, id: &str) -> Self {
        self.gateway_id = HeaderValue::from_str(id).ok();
        self
    }

    /// `POST http://{addr}{path}` with a JSON `body`, `Authorization: {bearer}` when given;
    /// `request_id` goes in `x-request-id` (a `HeaderValue` is cheap to clone from the client's
    /// request: no copy of it); while traces are exported, the current span's trace context
    /// goes in `traceparent` (`tracestate`). Returns once the answer's head is in.
    ///
    /// # Errors
    /// [`UpstreamError`] when no answer's head came back.
    pub async fn post_json(
        &self,
        (addr, bearer): (&str, Option<&HeaderValue>),
        path: &str,
        body: Bytes,
        request_id: Option<HeaderValue>,
    ) -> Result<NodeResponse, UpstreamError> {
        // http(s)://{addr}{path}, built without a format: parsed once, as a URI.
        let mut uri = String::with_capacity(8 + addr.len() + path.len());
        uri.push_str(self.scheme);
        uri.push_str(addr);
        uri.push_str(path);
        let uri = Uri::try_from(uri).map_err(http::Error::from)?;
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(b) = bearer {
            req = req.header(AUTHORIZATION, b.clone());
        }
        if let Some(id) = request_id {
            req = req.header(REQUEST_ID, id);
        }
        if let Some(g) = &self.gateway_id {
            req = req.header(GATEWAY_ID, g.clone());
        }
        // The node's spans join the request's trace, under the phase that calls it.
        if pd_telemetry::enabled()
            && let Some(headers) = req.headers_mut()
        {
            pd_telemetry::inject_current(headers);
        }
        let resp = self.client.request(req.body(Full::new(body))?).await?;
        Ok(NodeResponse(resp))
    }
}

/// A node's answer, its head read, its body not yet.
#[derive(Debug)]
pub struct NodeResponse(http::Response<Incoming>);

impl NodeResponse {
    /// The answer's status.
    pub fn status(&self) -> StatusCode {
        self.0.status()
    }

    /// The answer's `content-type`, if it has a readable one.
    pub fn content_type(&self) -> Option<&str> {
        self.0.headers().get(CONTENT_TYPE)?.to_str().ok()
    }

    /// Whether the answering decode node names `side_channel` among the producers it could not
    /// reach ([`KV_UNREACHABLE`]).
    pub fn could_not_reach(&self, side_channel: &str) -> bool {
        self.0
            .headers()
            .get(KV_UNREACHABLE)
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.len() <= MAX_KV_UNREACHABLE_BYTES)
            .is_some_and(|v| v.split(',').any(|p| p.trim() == side_channel))
    }

    /// The answer's `content-length`, if it has one (a streamed answer is chunked: none).
    pub fn content_length(&self) -> Option<u64> {
        self.0
            .headers()
            .get(CONTENT_LENGTH)?
            .to_str()
            .ok()?
            .parse()
            .ok()
    }

    /// The next piece of the body; `None` at its end. Trailers are skipped.
    ///
    /// # Errors
    /// The connection broke.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        while let Some(frame) = self.0.body_mut().frame().await {
            if let Ok(data) = frame?.into_data() {
                return Ok(Some(data));
            }
        }
        Ok(None)
    }

    /// The whole body.
    ///
    /// # Errors
    /// The connection broke.
    pub async fn bytes(self) -> Result<Bytes, UpstreamError> {
        let mut collected = self.0.into_body().collect().await?.aggregate();
        Ok(collected.copy_to_bytes(collected.remaining()))
    }

    /// The whole body as text (lossy), or the empty string when it cannot be read: for
    /// error messages.
    pub async fn text(self) -> String {
        match self.bytes().await {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(_) => String::new(),
        }
    }

    /// The body as a stream of pieces.
    pub fn bytes_stream(self) -> impl Stream<Item = Result<Bytes, hyper::Error>> {
        BodyDataStream::new(self.0.into_body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One request against a raw TCP server: the method, path and headers the node gets, and
    /// a chunked answer read piece by piece.
    #[tokio::test]
    async fn posts_json_with_the_token_and_reads_a_chunked_answer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            // Read until the head and the 7-byte body are in.
            loop {
                let n = s.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&got);
                if let Some(head_end) = text.find("\r\n\r\n")
                    && got.len() >= head_end + 4 + 7
                {
                    break;
                }
            }
            s.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                  transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            )
            .await
            .unwrap();
            String::from_utf8(got).unwrap()
        });
        let client = NodeClient::new(None);
        let key = bearer("s3cret").unwrap();
        let mut resp = client
            .post_json(
                (&addr, Some(&key)),
                "/v1/completions",
                Bytes::from_static(b"{\"a\":1}"),
                Some(HeaderValue::from_static("req-7")),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.content_type(), Some("text/event-stream"));
        assert_eq!(resp.content_length(), None);
        let mut body = Vec::new();
        while let Some(piece) = resp.chunk().await.unwrap() {
            body.extend_from_slice(&piece);
        }
        assert_eq!(body, b"hello world");
        let request = server.await.unwrap().to_ascii_lowercase();
        assert!(
            request.starts_with("post /v1/completions http/1.1\r\n"),
            "{request}"
        );
        assert!(
            request.contains("authorization: bearer s3cret\r\n"),
            "{request}"
        );
        assert!(
            request.contains("content-type: application/json\r\n"),
            "{request}"
        );
        assert!(request.contains("x-request-id: req-7\r\n"), "{request}");
        assert!(request.ends_with("{\"a\":1}"), "{request}");
    }

    #[tokio::test]
    async fn a_closed_port_is_an_error_not_a_panic() {
        // Bind and drop: the port is (very likely) closed now.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let client = NodeClient::new(None);
        let e = client
            .post_json((&addr, None), "/v1/completions", Bytes::new(), None)
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::Send(_)), "{e}");
        assert!(e.to_string().contains("refused"), "the cause is named: {e}");
        let e = client
            .post_json(("not an address", None), "/x", Bytes::new(), None)
            .await
            .unwrap_err();
        assert!(matches!(e, UpstreamError::Uri(_)), "{e}");
    }
}

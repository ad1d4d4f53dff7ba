//! The Endpoint Picker: the gateway's routing (registry, view, policies and their hot-swap,
//! decision log and replay) offered to another data plane — Envoy, or any gateway of the
//! Gateway API Inference Extension — as Envoy's `ext_proc` v3 gRPC service
//! (`pd-gateway serve --ext-proc-port`).
//!
//! One `ext_proc` stream is one HTTP request, handled by one [`Exchange`], phase by phase:
//! 1. request headers: read (path, bearer key, session id, the subset hint); a request without
//!    a body is picked for at once, else the headers go on unchanged;
//! 2. request body (Envoy's `BUFFERED` mode: the whole body in one message): picked for
//!    ([`Gateway::pick`]); the answer sets `x-gateway-destination-endpoint` (and
//!    `x-prefiller-host-port` for a split) with the same endpoint in `envoy.lb` metadata, the
//!    fallbacks beside it; or an immediate OpenAI error (401, 400, 404, 429, 503);
//! 3. response headers: the endpoint the data plane reports as having served is compared with
//!    the pick (`pd_gateway_picker_served_total`), and the picked nodes stop counting as open.
//!
//! A generation request takes a place under the gateway's admission limit
//! (`--max-concurrent-requests`, shared with the front door) before it is tokenized, waits in
//! line for one or is refused with a 429, and holds it until the data plane ends the exchange
//! (Envoy 1.40 ends it with the request: a streamed answer holds its place to its end). A
//! data plane that resets the exchange while its pick waits gives the place up at once.
//!
//! Health: the standard gRPC health service on the same port; the empty service name is
//! liveness (serving while the process runs), [`READINESS`] is readiness (serving while a
//! node of some model is live).
//!
//! Must not: move requests or KV itself (the data plane and the nodes do), or keep
//! conversations (`/v1/responses` storage, reverse pulls: the gateway's front door does).

pub mod envoy;
mod pick;

pub use pick::{Asked, Picked};

use std::pin::Pin;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, processing_request,
};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;
use tracing::debug;

use crate::error::GatewayError;
use crate::proxy::Gateway;
use envoy::Headers;

/// The gRPC health service name that answers readiness.
pub const READINESS: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The `ext_proc` service over the gateway's shared state.
#[derive(Debug, Clone)]
pub struct Picker {
    gateway: Gateway,
    /// Largest request body read (the gateway's `--max-body`).
    max_body: usize,
}

/// One HTTP request's state, from its headers to its response's headers.
#[derive(Debug, Default)]
struct Exchange {
    path: String,
    headers: Headers,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    picked: Option<pick::Picked>,
    /// The place under the admission limit, once the pick's other holds are let go.
    slot: Option<crate::admission::Admitted>,
    /// Every answer after an immediate response is moot: the request is over.
    over: bool,
}

/// The `outcome` label of a pick that failed.
fn failed_outcome(e: &GatewayError) -> &'static str {
    if let GatewayError::Overloaded(_) = e {
        return "overloaded";
    }
    match e.status() {
        429 => "rejected",
        503 => "unavailable",
        s if s < 500 => "client_error",
        _ => "error",
    }
}

impl Exchange {
    /// Answers one message of the stream; `None` for a message that takes no answer.
    async fn on(&mut self, picker: &Picker, msg: ProcessingRequest) -> Option<ProcessingResponse> {
        use processing_request::Request as R;
        if self.over {
            return None;
        }
        match msg.request.as_ref()? {
            R::RequestHeaders(h) => {
                self.headers = Headers::of(h);
                let path = self.headers.get(":path").unwrap_or("/");
                self.path = path.split('?').next().unwrap_or("/").to_owned();
                self.subset = envoy::subset(&msg);
                if h.end_of_stream {
                    return Some(self.decide(picker, false).await);
                }
                Some(envoy::continue_headers())
            }
            R::RequestBody(b) => {
                if self.body.len().saturating_add(b.body.len()) > picker.max_body {
                    self.over = true;
                    let e = GatewayError::PayloadTooLarge {
                        limit: picker.max_body,
                    };
                    return Some(envoy::immediate(&e));
                }
                self.body.extend_from_slice(&b.body);
                if !b.end_of_stream {
                    // A streamed body's headers went upstream already: too late to route. The
                    // data plane must send bodies BUFFERED (docs/operations.md).
                    return Some(envoy::continue_body());
                }
                Some(self.decide(picker, true).await)
            }
            R::ResponseHeaders(_) => {
                self.served(picker, envoy::served(&msg));
                Some(envoy::continue_response_headers())
            }
            R::ResponseBody(_) => Some(envoy::continue_response_body()),
            R::RequestTrailers(_) => Some(envoy::continue_trailers(false)),
            R::ResponseTrailers(_) => Some(envoy::continue_trailers(true)),
        }
    }

    /// Picks, and answers the headers (`with_body` false) or the body.
    async fn decide(&mut self, picker: &Picker, with_body: bool) -> ProcessingResponse {
        let start = Instant::now();
        let asked = pick::Asked {
            path: &self.path,
            headers: &self.headers,
            body: with_body.then_some(self.body.as_slice()),
            subset: self.subset.as_deref(),
        };
        let result = picker.gateway.pick(asked).await;
        let metrics = &picker.gateway.0.metrics;
        metrics.pick_duration.observe(start.elapsed().as_secs_f64());
        match result {
            Ok(picked) => {
                metrics
                    .picks
                    .with_label_values(&[picked.route, "picked"])
                    .inc();
                debug!(path = %self.path, endpoint = %picked.pick.primary, route = picked.route, "picked");
                let answer = if with_body {
                    picked.pick.on_body()
                } else {
                    picked.pick.on_headers()
                };
                self.picked = Some(picked);
                self.body = Vec::new();
                answer
            }
            Err(e) => {
                metrics
                    .picks
                    .with_label_values(&["none", failed_outcome(&e)])
                    .inc();
                debug!(path = %self.path, status = e.status(), "no pick: {e}");
                self.over = true;
                envoy::immediate(&e)
            }
        }
    }

    /// The endpoint the data plane reports as serving, against the pick.
    fn served(&mut self, picker: &Picker, served: Option<String>) {
        let Some(mut picked) = self.picked.take() else {
            return;
        };
        // The nodes' own reports count the request from here on; its place under the admission
        // limit lasts as long as the exchange.
        self.slot = picked.slot.take();
        let how = match served {
            None => "unreported",
            Some(s) if s == picked.pick.primary => "picked",
            Some(s) if picked.pick.fallback.contains(&s) => "fallback",
            Some(_) => "other",
        };
        picker
            .gateway
            .0
            .metrics
            .picker_served
            .with_label_values(&[how])
            .inc();
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream =
        Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send + 'static>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let picker = self.clone();
        tokio::spawn(async move {
            let mut exchange = Exchange::default();
            while let Ok(Some(msg)) = inbound.message().await {
                // A data plane that resets the stream (its client left) drops the answers'
                // receiver: a pick waiting in line gives its place up at once.
                let answer = tokio::select! {
                    a = exchange.on(&picker, msg) => a,
                    () = tx.closed() => break,
                };
                if let Some(answer) = answer
                    && tx.send(Ok(answer)).await.is_err()
                {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl Picker {
    /// The picker over `gateway`'s shared state, reading bodies up to `max_body`.
    pub fn new(gateway: Gateway, max_body: usize) -> Self {
        Self { gateway, max_body }
    }

    /// Serves `ext_proc` and gRPC health on `listener` until the process ends; under `tls`
    /// (the cluster's mutual TLS), only to data planes presenting a certificate of the cluster
    /// CA.
    ///
    /// # Errors
    /// The gRPC server failed.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> Result<(), tonic::transport::Error> {
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", ServingStatus::Serving)
            .await;
        let cluster = self.gateway.0.cluster.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let ready = !cluster.live_models().is_empty();
                if last != Some(ready) {
                    let status = if ready {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    reporter.set_service_status(READINESS, status).await;
                    last = Some(ready);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        // The whole body comes in one message: room for the largest body and its framing.
        let max_message = self.max_body.saturating_add(1 << 16);
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            server = server.tls_config(tls)?;
        }
        server
            .add_service(health)
            .add_service(ExternalProcessorServer::new(self).max_decoding_message_size(max_message))
            // No Nagle: each answer is a few small frames the data plane waits on before it
            // sends the request upstream (tonic sets TCP_NODELAY only on listeners it binds
            // itself); with Nagle, Envoy's delayed ACK added ~44 ms to every pick.
            .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)))
            .await
    }
}

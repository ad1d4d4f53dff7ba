//! The HTTP front of one engine node: it serves the OpenAI API (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/responses`, `/v1/models`) plus `/health` and `/metrics`, and
//! translates each request into one [`pd_engine::GenerateRequest`] and the engine's events back
//! into OpenAI JSON or server-sent events.
//!
//! Brief overview:
//! - [`router`] builds the axum app over an [`EngineHandle`]; [`serve`] runs it on a listener
//!   until a shutdown future resolves (tests run it in-process on `127.0.0.1:0`).
//! - `openai` holds the wire types, `prompt` turns them into prompt tokens (chat template,
//!   tokenizer), `generation` collects a finished request, `sse` frames streaming bodies, and
//!   `routes` holds one handler module per endpoint.
//! - [`ApiError`] is every way a request can fail, mapped to a status and the OpenAI error
//!   object `{"error": {"message", "type", "param", "code"}}`.
//! - [`cli`] holds the `pd-node` command line, so the binary stays thin; [`advertise`] is who
//!   the node says it is and where others reach it (engine id, advertised hosts).
//! - `vllm_metrics` gives `/metrics` vLLM's names for the engine's metrics (copies made at
//!   scrape time), for tools that read vLLM servers.
//! - [`disagg`] is the node's P/D role and the glue between a consumer request and its
//!   engine: the pull itself (planning, peers, leases, reads, failure policy, metrics) is
//!   [`pd_kv_transfer::Consumer`]'s; `kv_params` maps `kv_transfer_params` to and from the
//!   wire; [`kv_side_channel`] serves the pool to peers; [`report`] feeds the gateway;
//!   [`prefiller`] runs the prefill an Endpoint Picker names (`x-prefiller-host-port`) first;
//!   [`drain`] is what `SIGTERM` does before the process exits (under `--tls-*` the API
//!   is served only over the cluster's mutual TLS, [`pd_tls::TlsListener`]).
//!
//! This crate does not run the model, schedule sequences or touch KV memory: all of that is the
//! engine's, reached only through [`EngineHandle::submit`]. A streaming body owns its
//! [`pd_engine::RequestStream`], so a client that goes away drops it and the engine aborts the
//! request and frees its blocks.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod advertise;
pub mod cli;
pub mod disagg;
pub mod drain;
mod error;
mod generation;
mod kv_params;
pub mod kv_side_channel;
mod metrics;
mod openai;
pub mod prefiller;
mod prompt;
pub mod report;
mod routes;
mod sse;
mod vllm_metrics;

use std::future::Future;

use std::sync::Arc;

use pd_engine::EngineHandle;

pub use disagg::{AllowedPeers, Disagg, KvRole, PullConfig};
pub use error::ApiError;
pub use openai::tool_parser::ToolCallParser;
pub use routes::{
    GATEWAY_ID_HEADER, KV_UNREACHABLE_HEADER, MAX_BODY_BYTES, MAX_GATEWAY_ID_BYTES,
    MAX_UNREACHABLE_NAMED,
};
pub use sse::KEEP_ALIVE as SSE_KEEP_ALIVE;

/// How the HTTP front answers, beyond what the engine serves.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Silence after which a stream sends a keep-alive comment.
    pub sse_keep_alive: std::time::Duration,
    /// How the model writes tool calls on its own (`tool_choice: "auto"`); `None` refuses
    /// `"auto"` with tools.
    pub tool_parser: Option<ToolCallParser>,
    /// A key clients must send as `Authorization: Bearer KEY` on `/v1/` (vLLM's `--api-key`);
    /// `None`: `/v1/` is open. `/health` and `/metrics` stay open.
    pub api_key: Option<String>,
    /// The cluster's token, as it is now: accepted on `/v1/` too where `api_key` is set, since
    /// the gateway sends it. Only a token the node was configured with (`--cluster-token`):
    /// one the gateway minted is handed to whoever registers.
    pub cluster_token: Option<tokio::sync::watch::Receiver<Option<String>>>,
    /// Whether the node drains: `/health` answers 503 once it does (see [`drain`]).
    pub drain: Arc<drain::Drain>,
    /// Mutual TLS with the cluster CA (`--tls-*`): only the gateway and nodes holding a
    /// certificate from it connect. `None`: plain HTTP.
    pub tls: Option<pd_tls::ClusterTls>,
    /// Runs the prefill `x-prefiller-host-port` names first (`--prefiller-header`); `None`:
    /// such a request is refused.
    pub prefiller: Option<Arc<prefiller::Prefiller>>,
}

impl HttpOptions {
    /// The defaults for `engine`'s model: [`SSE_KEEP_ALIVE`], and the tool-call parser its
    /// tokenizer calls for ([`ToolCallParser::detect`]).
    pub fn for_engine(engine: &EngineHandle) -> Self {
        Self {
            sse_keep_alive: SSE_KEEP_ALIVE,
            tool_parser: ToolCallParser::detect(engine.tokenizer()),
            api_key: None,
            cluster_token: None,
            drain: Arc::default(),
            tls: None,
            prefiller: None,
        }
    }
}

/// Builds the HTTP app serving `engine` as a standalone node.
pub fn router(engine: EngineHandle) -> axum::Router {
    let options = HttpOptions::for_engine(&engine);
    routes::router(engine, std::sync::Arc::new(Disagg::standalone()), options)
}

/// Serves [`router`]`(engine)` on `listener` until `shutdown` resolves, then stops accepting
/// and waits for in-flight requests to finish.
///
/// # Errors
/// Only when accepting on `listener` fails fatally.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let disagg = Arc::new(Disagg::standalone());
    let options = HttpOptions::for_engine(&engine);
    serve_with(listener, engine, disagg, options, shutdown).await
}

/// [`serve`] for a node with a P/D role and its own [`HttpOptions`].
///
/// # Errors
/// Only when accepting on `listener` fails fatally.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    disagg: Arc<Disagg>,
    options: HttpOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let tls = options.tls.clone();
    let app = routes::router(engine, disagg, options);
    match tls {
        Some(tls) => {
            let listener = pd_tls::TlsListener::new(listener, tls.acceptor(), "node HTTP API")?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

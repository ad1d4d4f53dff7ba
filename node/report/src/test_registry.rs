//! A `NodeRegistry` server for tests: it acknowledges registrations and records every message
//! of every connection, in order, so a test can check what a node reported. It is not a gateway:
//! it keeps no cluster view and makes no decisions.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use pd_report::test_registry::{TestRegistry, TestRegistryOptions};
//!
//! let registry = TestRegistry::start("127.0.0.1:0".parse()?).await?;
//! // ... spawn a reporter (or a pd-node) with `--gateway {registry.addr()}` ...
//! let log = registry
//!     .log()
//!     .wait_for(Duration::from_secs(10), |conns| conns.first().is_some_and(|c| c.register().is_some()))
//!     .await?;
//! // A gateway restart on the same port, same log:
//! let addr = registry.addr();
//! let log_handle = registry.stop().await?;
//! let registry = TestRegistry::start_with(addr, TestRegistryOptions { log: Some(log_handle), ..Default::default() }).await?;
//! # Ok(()) }
//! ```
//!
//! What it checks itself: the first message of a connection must be `Register` with this
//! crate's protocol version, otherwise the call ends with `FAILED_PRECONDITION`; with
//! [`TestRegistryOptions::cluster_token`] set, a `Register` carrying another token ends it with
//! `UNAUTHENTICATED` (either way the connection is recorded as [`ConnectionEnd::Refused`]).
//!
//! What it sends: a `RegisterAck` ([`TestRegistryOptions::gateway_id`], `state_interval_ms`,
//! `ack_cluster_token`), then the peer list ([`TestRegistryOptions::peers`], or the latest
//! [`TestRegistry::send_peers`]) if there is one, and every later list on every open connection.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pd_rpc::registry as pb;
use pd_rpc::registry::node_registry_server::{NodeRegistry, NodeRegistryServer};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::registration::REGISTRY_PROTOCOL_VERSION;

/// What went wrong with the test registry.
#[derive(Debug, thiserror::Error)]
pub enum TestRegistryError {
    /// The address could not be bound (for a restart: the port is taken).
    #[error("cannot bind the test registry to {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS's reason.
        #[source]
        source: std::io::Error,
    },
    /// The server stopped with an error.
    #[error("the test registry's server failed")]
    Serve(#[from] tonic::transport::Error),
    /// The server task panicked.
    #[error("the test registry's server task failed")]
    Join(#[from] tokio::task::JoinError),
    /// [`RegistryLog::wait_for`] ran out of time; `log` is what had been received (shown by
    /// `Debug`, so an `expect` prints it).
    #[error("condition not met within {timeout:?}")]
    Timeout {
        /// The time waited.
        timeout: Duration,
        /// Every connection as recorded when the time ran out.
        log: Vec<ConnectionRecord>,
    },
}

/// How the test registry answers.
#[derive(Debug, Clone)]
pub struct TestRegistryOptions {
    /// Sent in every `RegisterAck`. Default: `"test-registry"`.
    pub gateway_id: String,
    /// Sent in every `RegisterAck` (0: the node keeps its default). Default: 0.
    pub state_interval_ms: u32,
    /// Record into this log (to keep one log across a restart). Default: a new one.
    pub log: Option<RegistryLog>,
    /// The cluster token a `Register` must carry; `None` accepts any. Default: `None`.
    pub cluster_token: Option<String>,
    /// Sent in every `RegisterAck` as `cluster_token` (empty: none). Default: empty.
    pub ack_cluster_token: String,
    /// The peer list sent after every acknowledgement until [`TestRegistry::send_peers`]
    /// replaces it; `None`: no `PeerList` until then. Default: `None`.
    pub peers: Option<Vec<String>>,
    /// Refuse every registration with this status code (`AlreadyExists`, say) instead of
    /// acknowledging it. Default: `None`.
    pub refuse: Option<tonic::Code>,
    /// Serve over mutual TLS with these (the gateway's `--tls-*`). Default: `None`.
    pub tls: Option<pd_tls::ClusterTls>,
}

impl Default for TestRegistryOptions {
    fn default() -> Self {
        Self {
            gateway_id: "test-registry".to_string(),
            state_interval_ms: 0,
            log: None,
            cluster_token: None,
            ack_cluster_token: String::new(),
            peers: None,
            refuse: None,
            tls: None,
        }
    }
}

/// The largest message the test registry takes: a registration carries the node's tokenizer
/// files (several MiB for real models, above tonic's 4 MiB default).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// How a recorded connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEnd {
    /// The node ended its stream cleanly (it is shutting down).
    Finished,
    /// The stream failed (the node went away without ending it); the status as text.
    Failed(String),
    /// The registry refused the connection (first message not a valid `Register`, or a wrong
    /// cluster token); the reason.
    Refused(String),
    /// The registry was stopped while the connection was open.
    Stopped,
}

/// Everything one connection delivered, in order of arrival.
#[derive(Debug, Clone, Default)]
pub struct ConnectionRecord {
    /// The node's address as the server saw it.
    pub peer: Option<SocketAddr>,
    /// Every message received, in order.
    pub messages: Vec<pb::NodeMessage>,
    /// `None` while the connection is open.
    pub end: Option<ConnectionEnd>,
}

impl ConnectionRecord {
    /// The registration, if the first message was one.
    pub fn register(&self) -> Option<&pb::Register> {
        match self.messages.first()?.msg.as_ref()? {
            pb::node_message::Msg::Register(r) => Some(r),
            _ => None,
        }
    }

    /// The registration's tokenizer files by name (empty when it sent none).
    pub fn tokenizer_files(&self) -> BTreeMap<String, String> {
        self.register()
            .and_then(|r| r.tokenizer.as_ref())
            .map(|t| {
                t.files
                    .iter()
                    .map(|f| (f.name.clone(), f.content.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every `NodeState`, in order.
    pub fn states(&self) -> impl Iterator<Item = &pb::NodeState> {
        self.messages.iter().filter_map(|m| match m.msg.as_ref()? {
            pb::node_message::Msg::State(s) => Some(s),
            _ => None,
        })
    }

    /// Every `BlockEvents`, in order.
    pub fn block_events(&self) -> impl Iterator<Item = &pb::BlockEvents> {
        self.messages.iter().filter_map(|m| match m.msg.as_ref()? {
            pb::node_message::Msg::Blocks(b) => Some(b),
            _ => None,
        })
    }

    /// `BlockEvents` messages with `resync = true`.
    pub fn resyncs(&self) -> usize {
        self.block_events().filter(|b| b.resync).count()
    }

    /// The node's stored hashes as a gateway following the contract sees them after this
    /// connection's messages: a resync clears, `stored` adds, `removed` takes away.
    pub fn stored_hashes(&self) -> HashSet<u64> {
        let mut set = HashSet::new();
        for b in self.block_events() {
            if b.resync {
                set.clear();
            }
            set.extend(b.stored.iter().copied());
            for h in &b.removed {
                set.remove(h);
            }
        }
        set
    }
}

/// The shared record of every connection a test registry accepted (in order of acceptance),
/// kept across restarts when passed in [`TestRegistryOptions::log`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RegistryLog {
    inner: Arc<watch::Sender<Vec<ConnectionRecord>>>,
}

impl Default for RegistryLog {
    fn default() -> Self {
        Self {
            inner: Arc::new(watch::Sender::new(Vec::new())),
        }
    }
}

impl RegistryLog {
    /// A copy of every connection so far.
    pub fn connections(&self) -> Vec<ConnectionRecord> {
        self.inner.borrow().clone()
    }

    /// Waits until `condition` holds for the connections, re-checking after every recorded
    /// message or connection change, and returns a copy of them at that moment.
    ///
    /// # Errors
    /// [`TestRegistryError::Timeout`] (carrying the log) when `timeout` passes first.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        mut condition: impl FnMut(&[ConnectionRecord]) -> bool,
    ) -> Result<Vec<ConnectionRecord>, TestRegistryError> {
        let mut rx = self.inner.subscribe();
        match tokio::time::timeout(timeout, rx.wait_for(|conns| condition(conns))).await {
            Ok(Ok(conns)) => Ok(conns.clone()),
            // The sender lives in `self`, so `wait_for` cannot see it closed.
            Ok(Err(_)) | Err(_) => Err(TestRegistryError::Timeout {
                timeout,
                log: self.connections(),
            }),
        }
    }

    fn open(&self, peer: Option<SocketAddr>) -> usize {
        let mut index = 0;
        self.inner.send_modify(|conns| {
            index = conns.len();
            conns.push(ConnectionRecord {
                peer,
                ..ConnectionRecord::default()
            });
        });
        index
    }

    fn push(&self, index: usize, msg: pb::NodeMessage) {
        self.inner
            .send_modify(|conns| conns[index].messages.push(msg));
    }

    fn close(&self, index: usize, end: ConnectionEnd) {
        self.inner.send_modify(|conns| conns[index].end = Some(end));
    }
}

/// A running test registry; see the [module docs](self). Dropping it stops the server without
/// waiting.
#[derive(Debug)]
pub struct TestRegistry {
    addr: SocketAddr,
    log: RegistryLog,
    stop: watch::Sender<bool>,
    peers: watch::Sender<Option<Vec<String>>>,
    server: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl TestRegistry {
    /// Serves on `addr` (port 0 picks a free port; see [`addr`](Self::addr)) with default
    /// options. The listener is bound before this returns, so a client may connect at once.
    ///
    /// # Errors
    /// [`TestRegistryError::Bind`].
    pub async fn start(addr: SocketAddr) -> Result<Self, TestRegistryError> {
        Self::start_with(addr, TestRegistryOptions::default()).await
    }

    /// Serves on `addr` with `options`.
    ///
    /// # Errors
    /// [`TestRegistryError::Bind`].
    pub async fn start_with(
        addr: SocketAddr,
        options: TestRegistryOptions,
    ) -> Result<Self, TestRegistryError> {
        let bind_err = |source| TestRegistryError::Bind { addr, source };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        let log = options.log.clone().unwrap_or_default();
        let (stop, stop_rx) = watch::channel(false);
        let (peers, peers_rx) = watch::channel(options.peers);
        let service = RegistryService {
            log: log.clone(),
            stop: stop_rx.clone(),
            peers: peers_rx,
            cluster_token: options.cluster_token,
            refuse: options.refuse,
            ack: pb::RegisterAck {
                gateway_id: options.gateway_id,
                state_interval_ms: options.state_interval_ms,
                cluster_token: options.ack_cluster_token,
                observed_host: String::new(),
            },
        };
        let mut shutdown = stop_rx;
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &options.tls {
            builder = builder.tls_config(tls.grpc_server())?;
        }
        let server = tokio::spawn(
            builder
                .add_service(
                    NodeRegistryServer::new(service).max_decoding_message_size(MAX_MESSAGE_BYTES),
                )
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    async move {
                        let _ = shutdown.wait_for(|s| *s).await;
                    },
                ),
        );
        Ok(Self {
            addr,
            log,
            stop,
            peers,
            server: Some(server),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The record of every connection.
    pub fn log(&self) -> &RegistryLog {
        &self.log
    }

    /// Sends `peers` as a `PeerList` on every open connection (after its acknowledgement), and
    /// after the acknowledgement of every later one.
    pub fn send_peers(&self, peers: Vec<String>) {
        self.peers.send_replace(Some(peers));
    }

    /// Ends every open stream with `UNAVAILABLE` (recorded as [`ConnectionEnd::Stopped`]),
    /// closes the listener and waits for the server to finish; the port is free again when this
    /// returns. Returns the log, to hand to the next registry.
    ///
    /// # Errors
    /// The server failed or panicked.
    pub async fn stop(mut self) -> Result<RegistryLog, TestRegistryError> {
        self.stop.send_replace(true);
        if let Some(server) = self.server.take() {
            server.await??;
        }
        Ok(self.log.clone())
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

#[derive(Debug)]
struct RegistryService {
    log: RegistryLog,
    stop: watch::Receiver<bool>,
    peers: watch::Receiver<Option<Vec<String>>>,
    cluster_token: Option<String>,
    refuse: Option<tonic::Code>,
    ack: pb::RegisterAck,
}

#[tonic::async_trait]
impl NodeRegistry for RegistryService {
    type ReportStream = ReceiverStream<Result<pb::GatewayMessage, Status>>;

    async fn report(
        &self,
        request: Request<Streaming<pb::NodeMessage>>,
    ) -> Result<Response<Self::ReportStream>, Status> {
        let index = self.log.open(request.remote_addr());
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(serve_connection(
            Connection {
                log: self.log.clone(),
                index,
                tx,
                stop: self.stop.clone(),
                peers: self.peers.clone(),
                cluster_token: self.cluster_token.clone(),
                refuse: self.refuse,
                ack: self.ack.clone(),
            },
            inbound,
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// One connection's side of the registry.
struct Connection {
    log: RegistryLog,
    index: usize,
    tx: mpsc::Sender<Result<pb::GatewayMessage, Status>>,
    stop: watch::Receiver<bool>,
    peers: watch::Receiver<Option<Vec<String>>>,
    cluster_token: Option<String>,
    refuse: Option<tonic::Code>,
    ack: pb::RegisterAck,
}

impl Connection {
    async fn send(&self, msg: pb::gateway_message::Msg) -> bool {
        self.tx
            .send(Ok(pb::GatewayMessage { msg: Some(msg) }))
            .await
            .is_ok()
    }

    /// Sends the current peer list, if there is one.
    async fn send_peers(&mut self) -> bool {
        let peers = self.peers.borrow_and_update().clone();
        match peers {
            Some(addrs) => {
                self.send(pb::gateway_message::Msg::Peers(pb::PeerList {
                    kv_side_channel_addrs: addrs,
                }))
                .await
            }
            None => true,
        }
    }
}

/// Records one connection's messages until it ends or the registry stops.
async fn serve_connection(mut conn: Connection, mut inbound: Streaming<pb::NodeMessage>) {
    let mut registered = false;
    let end = loop {
        tokio::select! {
            () = stopped(&mut conn.stop) => {
                let _ = conn.tx.send(Err(Status::unavailable("test registry stopped"))).await;
                break ConnectionEnd::Stopped;
            }
            changed = conn.peers.changed(), if registered => {
                if changed.is_err() || !conn.send_peers().await {
                    break ConnectionEnd::Failed("response stream dropped".to_string());
                }
            }
            msg = inbound.message() => match msg {
                Ok(Some(msg)) => {
                    let refusal = if registered {
                        None
                    } else {
                        check_register(&msg, conn.cluster_token.as_deref()).or_else(|| {
                            conn.refuse.map(|code| Status::new(code, "refused by the test registry"))
                        })
                    };
                    conn.log.push(conn.index, msg);
                    if let Some(status) = refusal {
                        let reason = status.message().to_string();
                        let _ = conn.tx.send(Err(status)).await;
                        break ConnectionEnd::Refused(reason);
                    }
                    if !registered {
                        registered = true;
                        let ack = pb::gateway_message::Msg::Ack(conn.ack.clone());
                        if !conn.send(ack).await || !conn.send_peers().await {
                            break ConnectionEnd::Failed("response stream dropped".to_string());
                        }
                    }
                }
                Ok(None) => break ConnectionEnd::Finished,
                Err(status) => break ConnectionEnd::Failed(status.to_string()),
            },
        }
    };
    conn.log.close(conn.index, end);
}

/// Resolves once the registry is stopping.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Why the first message of a connection is not acceptable, if it is not.
fn check_register(msg: &pb::NodeMessage, cluster_token: Option<&str>) -> Option<Status> {
    match msg.msg.as_ref() {
        Some(pb::node_message::Msg::Register(r))
            if r.protocol_version != REGISTRY_PROTOCOL_VERSION =>
        {
            Some(Status::failed_precondition(format!(
                "unsupported registry protocol version {} (this registry speaks {REGISTRY_PROTOCOL_VERSION})",
                r.protocol_version
            )))
        }
        Some(pb::node_message::Msg::Register(r))
            if cluster_token.is_some_and(|t| t != r.cluster_token) =>
        {
            Some(Status::unauthenticated(if r.cluster_token.is_empty() {
                "this registry requires a cluster token"
            } else {
                "wrong cluster token"
            }))
        }
        Some(pb::node_message::Msg::Register(_)) => None,
        _ => Some(Status::failed_precondition(
            "the first message of a connection must be Register",
        )),
    }
}

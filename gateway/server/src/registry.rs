//! The gateway's side of `pd.registry.v1.NodeRegistry` (`node/rpc/proto/registry.proto`): nodes
//! dial in, register (cluster token checked, tokenizer taken), then stream their state and block
//! hashes into the [`Cluster`]. A stream that ends, fails or falls silent past the node timeout
//! takes its node out of the view at once; the node comes back when it reconnects.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::Stream;
use pd_rpc::registry as pb;
use pd_rpc::registry::node_registry_server::{NodeRegistry, NodeRegistryServer};
use pd_tokenize::Tokenizer;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::cluster::{Cluster, ConnId, NodeEntry, role_of};

/// The registry contract version this gateway speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// Messages queued to one node.
const OUTBOX: usize = 8;
/// Largest message a node may send (a registration with its tokenizer files).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// How long a new node with a KV side channel stays out of the view: a new producer until the
/// peer list naming it reaches the decode nodes, a new decode node until it has received the
/// list (both are sent at once; decode nodes refuse producers they do not know).
pub const PEER_SETTLE: Duration = Duration::from_millis(300);
/// The state period the gateway asks nodes for.
pub const STATE_INTERVAL: Duration = Duration::from_millis(250);

/// Settings of the registry service.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// Identifies this gateway process in nodes' logs.
    pub gateway_id: String,
    /// The cluster secret nodes must present. Minted when the operator set none; nodes that
    /// registered without one receive it in the ack.
    pub cluster_token: String,
    /// Whether the operator set the token (then a node must present it).
    pub token_required: bool,
    /// A node silent this long leaves the view.
    pub node_timeout: Duration,
}

/// The `NodeRegistry` service.
#[derive(Debug, Clone)]
pub struct Registry {
    cluster: Arc<Cluster>,
    config: Arc<RegistryConfig>,
}

type OutStream = Pin<Box<dyn Stream<Item = Result<pb::GatewayMessage, Status>> + Send>>;

impl Registry {
    /// A registry feeding `cluster`.
    pub fn new(cluster: Arc<Cluster>, config: RegistryConfig) -> Self {
        Self {
            cluster,
            config: Arc::new(config),
        }
    }

    /// Serves on `listener` until `shutdown` resolves, and sweeps silent nodes meanwhile.
    ///
    /// # Errors
    /// The transport failed.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let sweeper = tokio::spawn(sweep(self.cluster.clone(), self.config.node_timeout));
        let result = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(5)))
            .serve_with_incoming_shutdown(
                // Registrations carry the tokenizer: real tokenizer.json files are 7-9 MiB,
                // above tonic's 4 MiB default.
                NodeRegistryServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES),
                TcpListenerStream::new(listener),
                shutdown,
            )
            .await;
        sweeper.abort();
        result
    }

    fn check(&self, r: &pb::Register) -> Result<(), Status> {
        if r.protocol_version != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "registry protocol version {} is not supported (gateway speaks {PROTOCOL_VERSION})",
                r.protocol_version
            )));
        }
        let matches = crate::secret::same_secret(&r.cluster_token, &self.config.cluster_token);
        let token_ok = if self.config.token_required {
            matches
        } else {
            r.cluster_token.is_empty() || matches
        };
        if !token_ok {
            return Err(Status::unauthenticated(
                "wrong or missing cluster token (--cluster-token / PD_CLUSTER_TOKEN)",
            ));
        }
        if r.engine_id.is_empty() || r.model.is_empty() || r.http_addr.is_empty() {
            return Err(Status::invalid_argument(
                "registration needs engine_id, model and http_addr",
            ));
        }
        if r.block_size == 0 {
            return Err(Status::invalid_argument("block_size must be positive"));
        }
        Ok(())
    }
}

fn tokenizer_of(bundle: Option<&pb::TokenizerBundle>) -> Result<(Arc<Tokenizer>, u64), String> {
    let bundle = bundle.ok_or("registration carries no tokenizer")?;
    let files = bundle
        .files
        .iter()
        .map(|f| (f.name.clone(), f.content.clone()))
        .collect();
    let tokenizer =
        Tokenizer::from_files(&files).map_err(|e| format!("the node's tokenizer: {e}"))?;
    Ok((Arc::new(tokenizer), bundle.fingerprint))
}

#[tonic::async_trait]
impl NodeRegistry for Registry {
    type ReportStream = OutStream;

    async fn report(
        &self,
        request: Request<Streaming<pb::NodeMessage>>,
    ) -> Result<Response<Self::ReportStream>, Status> {
        let peer = request.remote_addr();
        let mut inbound = request.into_inner();
        let first = match tokio::time::timeout(Duration::from_secs(10), inbound.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(s))) => return Err(s),
            Ok(None) | Err(_) => {
                return Err(Status::invalid_argument(
                    "expected a Register message first",
                ));
            }
        };
        let Some(pb::node_message::Msg::Register(reg)) = first.msg else {
            return Err(Status::invalid_argument(
                "the first message must be Register",
            ));
        };
        if let Err(status) = self.check(&reg) {
            warn!(engine_id = %reg.engine_id, ?peer, "registration refused: {}", status.message());
            return Err(status);
        }
        let Some(role) = role_of(reg.role()) else {
            return Err(Status::invalid_argument("role must be set"));
        };
        let conn: ConnId = self.cluster.new_conn();
        let (tx, rx) = mpsc::channel(OUTBOX);
        let fingerprint = reg.tokenizer.as_ref().map_or(0, |t| t.fingerprint);
        let entry = NodeEntry {
            conn,
            engine_id: reg.engine_id.as_str().into(),
            epoch: reg.epoch,
            role,
            model: reg.model.as_str().into(),
            block_size: reg.block_size,
            http_addr: reg.http_addr.as_str().into(),
            kv_addr: reg.kv_side_channel_addr.as_str().into(),
            max_model_len: reg.max_model_len,
            hash_key: reg.kv_hash_key,
            kv_bytes_per_token: reg.kv_bytes_per_token,
            takes_prompt_token_ids: reg.takes_prompt_token_ids,
            state: pb::NodeState {
                total_blocks: reg.num_blocks,
                free_blocks: reg.num_blocks,
                ..pb::NodeState::default()
            },
            hashes: Default::default(),
            draining: false,
            last_seen: Instant::now(),
            registered_at: SystemTime::now(),
            visible_from: if reg.kv_side_channel_addr.is_empty() {
                Instant::now()
            } else {
                Instant::now() + PEER_SETTLE
            },
            outbox: tx.clone(),
            source: "registered",
            open: Default::default(),
            gone: Default::default(),
        };
        let bundle = reg.tokenizer.clone();
        if let Err(why) = self
            .cluster
            .join(entry, || tokenizer_of(bundle.as_ref()), fingerprint)
        {
            warn!(engine_id = %reg.engine_id, "registration refused: {why}");
            return Err(Status::failed_precondition(why));
        }
        let ack = pb::GatewayMessage {
            msg: Some(pb::gateway_message::Msg::Ack(pb::RegisterAck {
                gateway_id: self.config.gateway_id.clone(),
                state_interval_ms: STATE_INTERVAL.as_millis() as u32,
                cluster_token: if reg.cluster_token.is_empty() {
                    self.config.cluster_token.clone()
                } else {
                    String::new()
                },
            })),
        };
        // The outbox has room: nothing else was sent on it yet.
        let _ = tx.try_send(Ok(ack));
        tokio::spawn(follow(self.cluster.clone(), conn, inbound, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Applies one node's messages until its stream ends, keeping it informed of the peer list.
async fn follow(
    cluster: Arc<Cluster>,
    conn: ConnId,
    mut inbound: Streaming<pb::NodeMessage>,
    outbox: mpsc::Sender<Result<pb::GatewayMessage, Status>>,
) {
    let mut peers = cluster.peers();
    peers.mark_changed();
    let mut check = tokio::time::interval(STATE_INTERVAL);
    let why = loop {
        tokio::select! {
            msg = inbound.next() => match msg {
                Some(Ok(m)) => {
                    let live = match m.msg {
                        Some(pb::node_message::Msg::State(s)) => cluster.state(conn, s),
                        Some(pb::node_message::Msg::Blocks(b)) => cluster.blocks(conn, b),
                        Some(pb::node_message::Msg::Register(_)) => break "registered twice on one stream",
                        None => true,
                    };
                    if !live { break "left the view"; }
                }
                Some(Err(status)) => {
                    info!(conn, "node stream failed: {}", status.message());
                    break "stream failed";
                }
                None => break "stream ended",
            },
            changed = peers.changed() => {
                if changed.is_err() { break "gateway stopping"; }
                let list = peers.borrow_and_update().clone();
                let msg = pb::GatewayMessage {
                    msg: Some(pb::gateway_message::Msg::Peers(pb::PeerList { kv_side_channel_addrs: list })),
                };
                if outbox.send(Ok(msg)).await.is_err() { break "node stopped reading"; }
            }
            _ = outbox.closed() => break "node stopped reading",
            _ = check.tick() => if !cluster.is_live(conn) { break "left the view"; },
        }
    };
    cluster.leave(conn, why);
}

/// Takes silent nodes out of the view. Their streams are ended by dropping the entry's outbox
/// (the node reconnects and registers anew). Gives up on nodes gone for good.
async fn sweep(cluster: Arc<Cluster>, timeout: Duration) {
    let mut tick = tokio::time::interval(timeout / 4);
    loop {
        tick.tick().await;
        let Some(deadline) = Instant::now().checked_sub(timeout) else {
            continue;
        };
        for conn in cluster.silent_since(deadline) {
            cluster.leave(conn, "silent past the node timeout");
        }
        // Out of the view for another node timeout without coming back: its open requests
        // end (a node silent that long is stopped or cut off; one that only stalled is back).
        cluster.cut_departed(timeout);
    }
}

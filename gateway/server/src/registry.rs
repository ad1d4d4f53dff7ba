//! The gateway's side of `pd.registry.v1.NodeRegistry` (`node/rpc/proto/registry.proto`): nodes
//! dial in, register (cluster token checked, tokenizer taken), then stream their state and block
//! hashes into the [`Cluster`]. A stream that ends, fails or falls silent past the node timeout
//! takes its node out of the view at once; the node comes back when it reconnects. The retained
//! conversation turns a node reports go to the proxy's [`Holdings`] ([`Registry::with_holdings`];
//! `conversation/reported.rs`) and leave it with the node.
//!
//! Addresses: a node bound to a wildcard address registers it as such, and is listed under the
//! address its registration came from ([`reachable`]); a loopback address registered from
//! another machine is refused. One engine id belongs to one live node ([`JoinError`]).

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::Stream;
use pd_rpc::registry as pb;
use pd_rpc::registry::node_registry_server::{NodeRegistry, NodeRegistryServer};
use pd_tokenize::Tokenizer;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::cluster::{Cluster, ConnId, JoinError, NodeEntry, TokenizerRefused, role_of};
use crate::conversation::{Applied, Holdings, ReportedTurns};
use crate::metrics::Metrics;

/// The registry contract version this gateway speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// Messages queued to one node.
const OUTBOX: usize = 8;
/// Largest message a node may send (a registration with its tokenizer files).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Longest engine id or model name a registration may carry.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest address (`host:port`: a DNS name is at most 253 bytes).
const MAX_ADDR_BYTES: usize = 270;
/// Most files in a tokenizer bundle (`tokenizer.json`, its config, a chat template...).
const MAX_TOKENIZER_FILES: usize = 16;
/// Most bytes of a tokenizer bundle (the largest real `tokenizer.json` files are ~35 MB).
const MAX_TOKENIZER_BYTES: usize = 48 << 20;
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
    /// Mutual TLS with the cluster CA: only nodes holding a certificate from it connect.
    pub tls: Option<pd_tls::ClusterTls>,
}

/// The `NodeRegistry` service.
#[derive(Debug, Clone)]
pub struct Registry {
    cluster: Arc<Cluster>,
    metrics: Metrics,
    config: Arc<RegistryConfig>,
    /// What requests to registered nodes carry: the cluster token (they proved they hold it).
    bearer: Option<http::HeaderValue>,
    /// The conversation index the nodes' reported retained turns go to (the proxy's).
    holdings: Option<Arc<Holdings>>,
}

type OutStream = Pin<Box<dyn Stream<Item = Result<pb::GatewayMessage, Status>> + Send>>;

impl Registry {
    /// A registry feeding `cluster`, counting refusals in `metrics`.
    pub fn new(cluster: Arc<Cluster>, metrics: Metrics, config: RegistryConfig) -> Self {
        Self {
            cluster,
            metrics,
            bearer: crate::upstream::bearer(&config.cluster_token).ok(),
            config: Arc::new(config),
            holdings: None,
        }
    }

    /// Indexes the retained turns nodes report (`RetainedTurns`) in `holdings`, the index the
    /// proxy routes conversations by; without it they are ignored.
    pub fn with_holdings(mut self, holdings: Arc<Holdings>) -> Self {
        self.holdings = Some(holdings);
        self
    }

    /// Counts a refused registration and logs it; returns `status`.
    fn refuse(&self, reason: &str, engine_id: &str, status: Status) -> Status {
        self.metrics
            .registrations_refused
            .with_label_values(&[reason])
            .inc();
        warn!(
            engine_id,
            reason,
            "registration refused: {}",
            status.message()
        );
        status
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
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = &self.config.tls {
            server = server.tls_config(tls.grpc_server())?;
        }
        let sweeper = tokio::spawn(sweep(self.cluster.clone(), self.config.node_timeout));
        let result = server
            .http2_keepalive_interval(Some(Duration::from_secs(5)))
            .serve_with_incoming_shutdown(
                // Registrations carry the tokenizer: real tokenizer.json files are 7-9 MiB,
                // above tonic's 4 MiB default.
                NodeRegistryServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES),
                // No Nagle: reports and answers are small and read as they come.
                TcpIncoming::from(listener).with_nodelay(Some(true)),
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
        let names = [
            ("engine_id", &r.engine_id, MAX_NAME_BYTES),
            ("model", &r.model, MAX_NAME_BYTES),
            ("http_addr", &r.http_addr, MAX_ADDR_BYTES),
            (
                "kv_side_channel_addr",
                &r.kv_side_channel_addr,
                MAX_ADDR_BYTES,
            ),
        ];
        if let Some((field, _, max)) = names.iter().find(|(_, v, max)| v.len() > *max) {
            return Err(Status::invalid_argument(format!(
                "{field} is longer than {max} bytes"
            )));
        }
        if let Some(t) = &r.tokenizer {
            let bytes: usize = t.files.iter().map(|f| f.name.len() + f.content.len()).sum();
            if t.files.len() > MAX_TOKENIZER_FILES || bytes > MAX_TOKENIZER_BYTES {
                return Err(Status::invalid_argument(format!(
                    "the tokenizer bundle ({} files, {bytes} bytes) is over {MAX_TOKENIZER_FILES} \
                     files or {MAX_TOKENIZER_BYTES} bytes",
                    t.files.len()
                )));
            }
        }
        if r.block_size == 0 {
            return Err(Status::invalid_argument("block_size must be positive"));
        }
        Ok(())
    }
}

/// Why a registered address cannot be dialled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreachable {
    /// Not `host:port`.
    #[error("`{0}` is not host:port")]
    NotHostPort(String),
    /// A wildcard host from a registration whose source address is unknown.
    #[error(
        "`{0}` is a wildcard address and the registration's source address is unknown; start \
         the node with --advertise-host"
    )]
    Wildcard(String),
    /// A loopback host registered from another machine.
    #[error(
        "`{addr}` is a loopback address registered from {seen}, another machine: no one there \
         can reach it; start the node with --advertise-host ADDRESS (or bind --host to an \
         address of its own)"
    )]
    LoopbackFromElsewhere {
        /// The address registered.
        addr: String,
        /// Where the registration came from.
        seen: IpAddr,
    },
}

/// `addr` (`host:port`, as a node registered it) as the gateway will dial it: a wildcard host
/// becomes `observed` (the address the registration came from); a loopback host is refused when
/// the registration came from another machine. Host names pass as they are.
///
/// # Errors
/// Why no one could reach it.
pub fn reachable(addr: &str, observed: Option<IpAddr>) -> Result<String, Unreachable> {
    let not_host_port = || Unreachable::NotHostPort(addr.to_owned());
    let (host, port) = addr.rsplit_once(':').ok_or_else(not_host_port)?;
    let port: u16 = port.parse().map_err(|_| not_host_port())?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let ip = match bare.parse::<IpAddr>() {
        Ok(ip) => ip.to_canonical(),
        Err(_) if bare.eq_ignore_ascii_case("localhost") => IpAddr::from([127, 0, 0, 1]),
        Err(_) => return Ok(addr.to_owned()),
    };
    let from_elsewhere = observed.filter(|o| !o.is_loopback());
    if ip.is_unspecified() {
        let seen = observed.ok_or_else(|| Unreachable::Wildcard(addr.to_owned()))?;
        return Ok(SocketAddr::new(seen, port).to_string());
    }
    if let Some(seen) = from_elsewhere.filter(|_| ip.is_loopback()) {
        return Err(Unreachable::LoopbackFromElsewhere {
            addr: addr.to_owned(),
            seen,
        });
    }
    Ok(addr.to_owned())
}

fn tokenizer_of(
    bundle: Option<&pb::TokenizerBundle>,
) -> Result<(Arc<Tokenizer>, u64), TokenizerRefused> {
    let bundle = bundle.ok_or(TokenizerRefused::Missing)?;
    let files = bundle
        .files
        .iter()
        .map(|f| (f.name.clone(), f.content.clone()))
        .collect();
    let tokenizer = Tokenizer::from_files(&files).map_err(TokenizerRefused::Invalid)?;
    // The node's word on its files is checked, not taken: the model's tokenizer is fixed by
    // its first node, and later nodes are compared by fingerprint.
    if tokenizer.fingerprint() != bundle.fingerprint {
        return Err(TokenizerRefused::Fingerprint {
            claimed: bundle.fingerprint,
            computed: tokenizer.fingerprint(),
        });
    }
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
            let reason = match status.code() {
                tonic::Code::Unauthenticated => "token",
                _ => "invalid",
            };
            return Err(self.refuse(reason, &reg.engine_id, status));
        }
        let Some(role) = role_of(reg.role()) else {
            let status = Status::invalid_argument("role must be set");
            return Err(self.refuse("invalid", &reg.engine_id, status));
        };
        let observed = peer.map(|p| p.ip().to_canonical());
        let addrs = reachable(&reg.http_addr, observed).and_then(|http| {
            match reg.kv_side_channel_addr.as_str() {
                "" => Ok((http, String::new())),
                kv => Ok((http, reachable(kv, observed)?)),
            }
        });
        let (http_addr, kv_addr) = match addrs {
            Ok(a) => a,
            Err(why) => {
                let status = Status::invalid_argument(format!("node `{}`: {why}", reg.engine_id));
                return Err(self.refuse("unreachable_address", &reg.engine_id, status));
            }
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
            http_addr: http_addr.into(),
            kv_addr: kv_addr.as_str().into(),
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
            visible_from: if kv_addr.is_empty() {
                Instant::now()
            } else {
                Instant::now() + PEER_SETTLE
            },
            outbox: tx.clone(),
            source: "registered",
            bearer: self.bearer.clone(),
            open: Default::default(),
            gone: Default::default(),
        };
        // Off the registry's task: a model's first node has its tokenizer parsed here.
        let bundle = reg.tokenizer.clone();
        let cluster = self.cluster.clone();
        let joined = tokio::task::spawn_blocking(move || {
            cluster.join(entry, || tokenizer_of(bundle.as_ref()), fingerprint)
        })
        .await
        .map_err(|e| Status::internal(format!("registering: {e}")))?;
        match joined {
            Ok(()) => {}
            Err(why @ JoinError::EngineIdTaken { .. }) => {
                let status = Status::already_exists(why.to_string());
                return Err(self.refuse("engine_id_taken", &reg.engine_id, status));
            }
            Err(why) => {
                let status = Status::failed_precondition(why.to_string());
                return Err(self.refuse("incompatible", &reg.engine_id, status));
            }
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
                observed_host: observed.map(|ip| ip.to_string()).unwrap_or_default(),
            })),
        };
        // The outbox has room: nothing else was sent on it yet.
        let _ = tx.try_send(Ok(ack));
        let turns = self.holdings.clone().map(|h| Turns {
            holdings: h,
            reported: ReportedTurns::new(&reg.engine_id, reg.epoch),
            metrics: self.metrics.clone(),
        });
        tokio::spawn(follow(self.cluster.clone(), conn, inbound, tx, turns));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Applies one node's messages until its stream ends, keeping it informed of the peer list.
async fn follow(
    cluster: Arc<Cluster>,
    conn: ConnId,
    mut inbound: Streaming<pb::NodeMessage>,
    outbox: mpsc::Sender<Result<pb::GatewayMessage, Status>>,
    mut turns: Option<Turns>,
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
                        Some(pb::node_message::Msg::Turns(t)) => {
                            if let Some(turns) = turns.as_mut() { turns.apply(t); }
                            cluster.is_live(conn)
                        }
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
    // Before leaving: the node may register again once it left, and report the same turns.
    if let Some(mut turns) = turns {
        turns.clear();
    }
    cluster.leave(conn, why);
}

/// One node's reported retained turns and where they go.
struct Turns {
    holdings: Arc<Holdings>,
    reported: ReportedTurns,
    metrics: Metrics,
}

impl Turns {
    fn apply(&mut self, msg: pb::RetainedTurns) {
        let a = self.reported.apply(&self.holdings, msg);
        self.count(a);
    }

    /// The node left the view: its turns leave the index.
    fn clear(&mut self) {
        let removed = self.reported.clear(&self.holdings);
        self.count(Applied {
            removed,
            ..Applied::default()
        });
    }

    fn count(&self, a: Applied) {
        let m = &self.metrics;
        for (event, n) in [
            ("added", a.added),
            ("removed", a.removed),
            ("refused", a.refused),
        ] {
            if n > 0 {
                m.reported_turns
                    .with_label_values(&[event])
                    .inc_by(n as u64);
            }
        }
        if a.expired > 0 {
            m.conversation_dropped
                .with_label_values(&["expired"])
                .inc_by(a.expired as u64);
        }
        if a.refused > 0 {
            warn!(
                refused = a.refused,
                "a node reported retained turns that are not its own or not readable"
            );
        }
        m.conversation_holdings.set(self.holdings.len() as i64);
    }
}

/// Takes silent nodes out of the view. Their streams are ended by dropping the entry's outbox
/// (the node reconnects and registers anew). Gives up on nodes gone for good.
async fn sweep(cluster: Arc<Cluster>, timeout: Duration) {
    let every = timeout / 4;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tick.tick().await;
        let now = Instant::now();
        let gap = now.saturating_duration_since(last);
        last = now;
        if stalled(gap, every) {
            // This process did not run (frozen, paused, starved): the nodes' reports wait
            // unread in its sockets, and their silence is its own.
            warn!(
                stalled_ms = gap.as_millis() as u64,
                "the gateway stalled: nodes' silence during it is not held against them"
            );
            cluster.forgive_stall(now);
            continue;
        }
        let Some(deadline) = now.checked_sub(timeout) else {
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

/// Whether a sweep `gap` after the previous one, ticking `every`, means the gateway itself
/// stalled: twice the tick (half the node timeout) without running.
fn stalled(gap: Duration, every: Duration) -> bool {
    gap > every * 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_late_by_half_the_node_timeout_is_the_gateways_own_stall() {
        let every = Duration::from_millis(750);
        assert!(!stalled(every, every));
        assert!(!stalled(every * 2, every));
        assert!(stalled(every * 2 + Duration::from_millis(1), every));
        assert!(stalled(Duration::from_secs(7), every));
    }

    /// A registration's tokenizer files are fingerprinted by the gateway; a bundle claiming
    /// another fingerprint than its files have is refused (it would fix the model's tokenizer
    /// under a fingerprint later nodes are compared against).
    #[test]
    fn a_tokenizer_bundle_must_have_the_fingerprint_it_claims() {
        let dir = std::env::temp_dir().join(format!("pd-registry-fp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        pd_tokenize::write_byte_level_tokenizer(&dir, 300).unwrap();
        let real = Tokenizer::from_dir(&dir).unwrap().fingerprint();
        let files = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                pb::TokenizerFile {
                    name: e.file_name().to_string_lossy().into_owned(),
                    content: std::fs::read_to_string(e.path()).unwrap(),
                }
            })
            .collect::<Vec<_>>();
        let _ = std::fs::remove_dir_all(&dir);
        let bundle = |fingerprint| pb::TokenizerBundle {
            files: files.clone(),
            fingerprint,
        };
        let (_, fp) = tokenizer_of(Some(&bundle(real))).expect("honest bundle");
        assert_eq!(fp, real);
        match tokenizer_of(Some(&bundle(real ^ 1))) {
            Err(TokenizerRefused::Fingerprint { claimed, computed }) => {
                assert_eq!((claimed, computed), (real ^ 1, real));
            }
            other => panic!("a lying bundle: {:?}", other.map(|(_, f)| f)),
        }
    }

    #[test]
    fn wildcard_hosts_become_the_registrations_source_and_loopback_from_afar_is_refused() {
        let far = Some("10.1.2.3".parse().unwrap());
        let near = Some("127.0.0.1".parse().unwrap());
        assert_eq!(reachable("0.0.0.0:8000", far).unwrap(), "10.1.2.3:8000");
        assert_eq!(reachable("[::]:8000", far).unwrap(), "10.1.2.3:8000");
        let v6 = Some("fd00::7".parse().unwrap());
        assert_eq!(reachable("0.0.0.0:9", v6).unwrap(), "[fd00::7]:9");
        // IPv4 seen through an IPv6 listener.
        let mapped = Some("::ffff:10.1.2.3".parse::<IpAddr>().unwrap().to_canonical());
        assert_eq!(reachable("0.0.0.0:1", mapped).unwrap(), "10.1.2.3:1");
        assert!(reachable("0.0.0.0:8000", None).is_err());
        for lo in ["127.0.0.1:8000", "[::1]:8000", "localhost:8000"] {
            let err = reachable(lo, far).unwrap_err().to_string();
            assert!(
                err.contains("--advertise-host") && err.contains("10.1.2.3"),
                "{err}"
            );
            assert_eq!(reachable(lo, near).unwrap(), lo);
        }
        assert_eq!(reachable("10.9.9.9:8000", far).unwrap(), "10.9.9.9:8000");
        assert_eq!(reachable("pd-p-0.pd:8000", far).unwrap(), "pd-p-0.pd:8000");
        assert!(reachable("nonsense", far).is_err());
        assert!(reachable("host:port", far).is_err());
    }
}

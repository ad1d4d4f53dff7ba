//! A fleet: many simulated nodes in one process, each with its own HTTP listener (and side
//! channel, for nodes that hand KV off), each registered with every gateway over the real
//! registry by its own [`pd_report::Reporter`].

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::serve::ListenerExt;
use pd_report::{Registration, Reporter, ReporterHandle, ReporterOptions, Role};
use pd_rpc::kv::kv_peer_server::KvPeerServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::kv_peer::SimKvPeer;
use crate::node::{Identity, SimNode};
use crate::state::{Leases, NodeLoad};
use crate::timing::Timing;

/// Why a fleet did not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A listener could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS's answer.
        source: std::io::Error,
    },
    /// The tokenizer files cannot be read.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] pd_tokenize::TokenizeError),
    /// A scratch directory cannot be written.
    #[error("scratch directory: {0}")]
    Scratch(std::io::Error),
    /// A gateway address is not a URI.
    #[error("gateway `{addr}`: {source}")]
    Gateway {
        /// The address given.
        addr: String,
        /// Why it is refused.
        source: pd_report::ReportError,
    },
}

/// How to start a fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// The nodes, by role: `(role, count)`, started in this order.
    pub roles: Vec<(Role, usize)>,
    /// Engine ids are `{prefix}-{role}-{i}`.
    pub id_prefix: String,
    /// The served model.
    pub model: String,
    /// The address every node binds (port 0 each) and registers.
    pub host: IpAddr,
    /// Gateways' registry addresses (`host:port`); every node reports to each.
    pub gateways: Vec<String>,
    /// Timings.
    pub timing: Timing,
    /// The tokenizer files every node registers, and their fingerprint.
    pub tokenizer: (BTreeMap<String, String>, u64),
    /// Tokens per block.
    pub block_size: u32,
    /// KV blocks per node.
    pub total_blocks: u64,
    /// Longest prompt plus output.
    pub max_model_len: u32,
    /// How long a prefill node holds a lease nobody pulls or releases.
    pub lease_duration: Duration,
    /// Every state read differs (a state message every `change_poll`): the registry's
    /// highest load.
    pub churn: bool,
    /// The reporter's state interval and change poll.
    pub state_interval: Duration,
    /// How often the reporter reads the counters.
    pub change_poll: Duration,
    /// The cluster token (empty: take the gateway's).
    pub cluster_token: String,
    /// The prefix-cache hash key (0: none).
    pub hash_key: u64,
}

/// A running fleet.
#[derive(Debug)]
pub struct Fleet {
    /// Every node, in start order.
    pub nodes: Vec<Arc<SimNode>>,
    /// Every node's reporters (one per gateway), in the same order.
    reporters: Vec<Vec<ReporterHandle>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Fleet {
    /// Binds and starts every node, and starts reporting them; returns once every listener is
    /// bound (registration goes on in the background).
    ///
    /// # Errors
    /// A listener cannot be bound, a gateway address is not a URI.
    pub async fn start(config: FleetConfig) -> Result<Fleet, SimError> {
        let leases = Arc::new(Leases::default());
        let mut fleet = Fleet {
            nodes: Vec::new(),
            reporters: Vec::new(),
            tasks: Vec::new(),
        };
        let expiring = Arc::clone(&leases);
        fleet.tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                expiring.expire(Instant::now());
            }
        }));
        for &(role, count) in &config.roles {
            for i in 0..count {
                fleet.start_node(&config, role, i, &leases).await?;
            }
        }
        Ok(fleet)
    }

    async fn start_node(
        &mut self,
        config: &FleetConfig,
        role: Role,
        i: usize,
        leases: &Arc<Leases>,
    ) -> Result<(), SimError> {
        let http = bind(SocketAddr::new(config.host, 0)).await?;
        let http_addr = http.local_addr().map_err(|source| SimError::Bind {
            addr: SocketAddr::new(config.host, 0),
            source,
        })?;
        let kv = if matches!(role, Role::Producer | Role::Both) {
            let listener = bind(SocketAddr::new(config.host, 0)).await?;
            let addr = listener.local_addr().ok();
            let service = KvPeerServer::new(SimKvPeer(Arc::clone(leases)));
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            self.tasks.push(tokio::spawn(async move {
                let served = tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming(incoming)
                    .await;
                if let Err(e) = served {
                    tracing::warn!("side channel ended: {e}");
                }
            }));
            addr
        } else {
            None
        };
        let id = Identity {
            engine_id: format!("{}-{}-{i}", config.id_prefix, role_name(role)),
            epoch: rand::random(),
            role,
            model: config.model.clone(),
            block_size: config.block_size,
            http: http_addr,
            kv,
        };
        let load = Arc::new(NodeLoad::new(config.total_blocks, config.churn));
        let node = Arc::new(SimNode::new(
            id,
            Arc::clone(&load),
            config.timing,
            Arc::clone(leases),
            config.lease_duration,
            config.hash_key,
        ));
        let app = crate::serve::router(Arc::clone(&node));
        // No Nagle: stream chunks are small, and a delayed ACK would hold each one back.
        let http = http.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        self.tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(http, app).await {
                tracing::warn!("HTTP server ended: {e}");
            }
        }));
        let registration = registration(config, &node);
        let mut reporters = Vec::new();
        for gateway in &config.gateways {
            let options = ReporterOptions {
                state_interval: config.state_interval,
                change_poll: config.change_poll,
                ..ReporterOptions::default()
            };
            let source: Arc<dyn pd_report::StateSource> = load.clone();
            let handle = Reporter::spawn(gateway.clone(), registration.clone(), source, options)
                .map_err(|source| SimError::Gateway {
                    addr: gateway.clone(),
                    source,
                })?;
            reporters.push(handle);
        }
        self.reporters.push(reporters);
        self.nodes.push(node);
        Ok(())
    }

    /// Nodes every gateway acknowledged (registered and streaming).
    pub fn registered(&self) -> usize {
        self.reporters
            .iter()
            .filter(|r| r.iter().all(|h| h.status().connected))
            .count()
    }

    /// Ends every node's reports cleanly (the gateways drop them at once) and stops serving.
    pub async fn shutdown(self) {
        let closing = self
            .reporters
            .into_iter()
            .flatten()
            .map(ReporterHandle::shutdown);
        futures::future::join_all(closing).await;
        for t in self.tasks {
            t.abort();
        }
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, SimError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| SimError::Bind { addr, source })
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Producer => "p",
        Role::Consumer => "d",
        Role::Both => "pd",
        Role::Standalone => "s",
    }
}

fn registration(config: &FleetConfig, node: &SimNode) -> Registration {
    let (files, fingerprint) = config.tokenizer.clone();
    Registration {
        engine_id: node.id.engine_id.clone(),
        epoch: node.id.epoch,
        role: node.id.role,
        model: config.model.clone(),
        block_size: config.block_size,
        // Simulated nodes are compatible with each other only.
        compat_hash: 0x7064_2d73_696d_0001,
        http_addr: node.id.http.to_string(),
        kv_side_channel_addr: node.id.kv.map(|a| a.to_string()),
        grpc_addr: None,
        num_blocks: config.total_blocks,
        max_model_len: config.max_model_len,
        cluster_token: config.cluster_token.clone(),
        tokenizer_files: files,
        tokenizer_fingerprint: fingerprint,
        kv_hash_key: config.hash_key,
        kv_bytes_per_token: config.timing.kv_bytes_per_token,
        takes_prompt_token_ids: true,
    }
}

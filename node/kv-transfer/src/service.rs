//! The owner's side of the `KvPeer` side channel (tonic server).

use std::sync::Arc;

use pd_kv_pool::{KvLayout, LeaseContents, LeaseError, LeaseId};
use pd_rpc::kv::kv_peer_server::KvPeer;
use pd_rpc::kv::{
    Compat, HandshakeReply, HandshakeRequest, Layout, LeaseRef, LeaseReply, PoolStatsReply,
    PoolStatsRequest,
};
use tonic::{Request, Response, Status};

use crate::compat::CompatInfo;
use crate::lease_authority::{LeaseAuthority, unix_ms};

/// How peers reach and read this node's pool.
#[derive(Debug, Clone)]
pub struct OwnerIdentity {
    /// This node's engine id.
    pub engine_id: String,
    /// Changes at every start.
    pub epoch: u64,
    /// What peers must match.
    pub compat: CompatInfo,
    /// The pool's layout.
    pub layout: KvLayout,
    /// UCX worker address.
    pub worker_address: Vec<u8>,
    /// Pool base address and length (as registered).
    pub region_base: u64,
    /// Bytes registered.
    pub region_len: u64,
    /// Packed remote key of the pool.
    pub rkey: Vec<u8>,
    /// Transports offered, for the report.
    pub transports: Vec<String>,
    /// The lease board's offset from `region_base` (in the same registered region, beyond
    /// `region_len`) and its records (0: no board). See `pd_kv_pool::LeaseBoard`.
    pub board_offset: u64,
    /// Records on the lease board.
    pub board_slots: u32,
    /// The clock the lease board's beat reads, `None` when it does not beat. An owner sets
    /// [`crate::OwnerClock::local`] (its board's `pd_kv_pool::BeatClock` anchored on
    /// [`crate::monotonic_ns`]) and its handshake states that clock; a consumer gets the
    /// owner's clock as measured at the handshake.
    pub owner_clock: Option<crate::OwnerClock>,
    /// How blocks reach the registered region (`in-place`, `host-staged`, `cuda-host-staged`;
    /// the handshake's `kv_path`).
    pub kv_path: String,
    /// The owner's TCP data port ([`crate::tcp_data`]; 0: none).
    pub data_port: u16,
    /// The host a consumer reached the owner's side channel at (set by the consumer; empty on
    /// the owner): its data port is on that host.
    pub data_host: String,
}

/// The `KvPeer` service over a [`LeaseAuthority`].
#[derive(Debug)]
pub struct KvPeerService<A> {
    identity: OwnerIdentity,
    authority: Arc<A>,
}

impl<A: LeaseAuthority> KvPeerService<A> {
    /// Serves `identity`, deciding about leases with `authority`.
    pub fn new(identity: OwnerIdentity, authority: Arc<A>) -> Self {
        Self {
            identity,
            authority,
        }
    }

    /// The tonic server wrapper, ready for `Server::builder().add_service(...)`, admitting every
    /// caller (tests and tools; a node serves [`KvPeerService::into_guarded_server`]).
    pub fn into_server(self) -> pd_rpc::kv::kv_peer_server::KvPeerServer<Self> {
        pd_rpc::kv::kv_peer_server::KvPeerServer::new(self)
    }

    /// The server wrapper admitting only calls that carry the cluster token
    /// ([`pd_rpc::CLUSTER_TOKEN_METADATA`]) `token` holds now; while it holds none, every call.
    /// Refusals are `UNAUTHENTICATED` and counted in `refused`.
    pub fn into_guarded_server(
        self,
        token: tokio::sync::watch::Receiver<Option<String>>,
        refused: prometheus::IntCounter,
    ) -> tonic::service::interceptor::InterceptedService<
        pd_rpc::kv::kv_peer_server::KvPeerServer<Self>,
        impl tonic::service::Interceptor + Clone,
    > {
        let check = move |req: Request<()>| -> Result<Request<()>, Status> {
            let want = token.borrow();
            let Some(want) = want.as_deref().filter(|t| !t.is_empty()) else {
                return Ok(req);
            };
            let given = req
                .metadata()
                .get(pd_rpc::CLUSTER_TOKEN_METADATA)
                .and_then(|v| v.to_str().ok());
            if given.is_some_and(|g| constant_time_eq(g.as_bytes(), want.as_bytes())) {
                Ok(req)
            } else {
                refused.inc();
                tracing::warn!(
                    token_given = given.is_some(),
                    "KV side channel call without the cluster token: refused"
                );
                Err(Status::unauthenticated(
                    "the KV side channel needs the cluster token (x-pd-cluster-token)",
                ))
            }
        };
        pd_rpc::kv::kv_peer_server::KvPeerServer::with_interceptor(self, check)
    }
}

/// `CompatInfo` → wire.
pub fn compat_to_proto(c: &CompatInfo) -> Compat {
    Compat {
        project_version: c.project_version.clone(),
        protocol_version: c.protocol_version,
        model: c.model.clone(),
        dtype: c.dtype.clone(),
        num_kv_heads: c.num_kv_heads,
        num_layers: c.num_layers,
        head_dim: c.head_dim,
        hash: c.hash(),
        fingerprint: c.fingerprint.clone(),
    }
}

/// Wire → `CompatInfo`.
pub fn compat_from_proto(c: &Compat) -> CompatInfo {
    CompatInfo {
        project_version: c.project_version.clone(),
        protocol_version: c.protocol_version,
        model: c.model.clone(),
        fingerprint: c.fingerprint.clone(),
        dtype: c.dtype.clone(),
        num_kv_heads: c.num_kv_heads,
        num_layers: c.num_layers,
        head_dim: c.head_dim,
    }
}

fn layout_to_proto(l: &KvLayout) -> Layout {
    Layout {
        num_blocks: l.num_blocks as u64,
        block_size: l.block_size as u32,
        num_layers: l.num_layers as u32,
        num_kv_heads: l.num_kv_heads as u32,
        head_dim: l.head_dim as u32,
        dtype: l.dtype.as_str().to_string(),
        dim_order: l.order.dim_order().to_string(),
        block_bytes: l.block_bytes() as u64,
    }
}

fn parse_lease(r: &LeaseRef) -> Result<LeaseId, Status> {
    r.lease_id
        .parse::<LeaseId>()
        .map_err(|_| Status::invalid_argument(format!("malformed lease id {:?}", r.lease_id)))
}

/// The reason string of a refused lease.
pub fn lease_reason(e: &LeaseError) -> &'static str {
    match e {
        LeaseError::Unknown(_) => "unknown",
        LeaseError::Stale { .. } => "stale",
        LeaseError::Expired(_) => "expired",
        LeaseError::WrongPeer { .. } => "wrong_peer",
    }
}

fn reply(r: Result<std::time::SystemTime, LeaseError>) -> Response<LeaseReply> {
    reply_with(r.map(|t| (t, LeaseContents::default())))
}

fn reply_with(
    r: Result<(std::time::SystemTime, LeaseContents), LeaseError>,
) -> Response<LeaseReply> {
    Response::new(match r {
        Ok((t, c)) => LeaseReply {
            live: true,
            deadline_unix_ms: unix_ms(t),
            reason: String::new(),
            num_tokens: c.num_tokens,
            tokens_digest: match c.tokens_digest {
                0 => Vec::new(),
                d => d.to_le_bytes().to_vec(),
            },
            next_token: c.next_token,
            blocks_hash: c.blocks_hash,
            next_token_key: c.next_token_key,
        },
        Err(e) => LeaseReply {
            live: false,
            deadline_unix_ms: 0,
            reason: lease_reason(&e).to_string(),
            ..LeaseReply::default()
        },
    })
}

/// Equality that takes the same time wherever the first difference is (secrets: the cluster
/// token here, a node's API key on its HTTP side).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A lease call naming an epoch other than ours: refused before the authority is asked.
fn stale_epoch(r: &LeaseRef, ours: u64) -> Option<Response<LeaseReply>> {
    (r.owner_epoch != 0 && r.owner_epoch != ours).then(|| {
        tracing::warn!(
            peer = %r.peer_engine_id,
            named = r.owner_epoch,
            ours,
            "lease call names another epoch of this engine: refused"
        );
        Response::new(LeaseReply {
            live: false,
            reason: "stale_epoch".to_string(),
            ..LeaseReply::default()
        })
    })
}

#[tonic::async_trait]
impl<A: LeaseAuthority> KvPeer for KvPeerService<A> {
    async fn handshake(
        &self,
        request: Request<HandshakeRequest>,
    ) -> Result<Response<HandshakeReply>, Status> {
        let req = request.into_inner();
        let theirs = req.compat.as_ref().map(compat_from_proto);
        match theirs {
            Some(theirs) if !req.skip_compat_check => {
                if let Err(e) = self.identity.compat.check(&theirs) {
                    tracing::warn!(peer = %req.engine_id, error = %e, "handshake refused");
                    return Err(Status::failed_precondition(e.to_string()));
                }
            }
            None if !req.skip_compat_check => {
                return Err(Status::invalid_argument(
                    "handshake without compatibility info",
                ));
            }
            _ => {}
        }
        tracing::debug!(peer = %req.engine_id, epoch = req.epoch, "handshake accepted");
        let id = &self.identity;
        Ok(Response::new(HandshakeReply {
            engine_id: id.engine_id.clone(),
            epoch: id.epoch,
            compat: Some(compat_to_proto(&id.compat)),
            worker_address: id.worker_address.clone(),
            region_base: id.region_base,
            region_len: id.region_len,
            rkey: id.rkey.clone(),
            layout: Some(layout_to_proto(&id.layout)),
            transports: id.transports.clone(),
            board_offset: id.board_offset,
            board_slots: id.board_slots,
            owner_clock_ns: if id.owner_clock.is_some() && id.board_slots > 0 {
                crate::monotonic_ns()
            } else {
                0
            },
            kv_path: id.kv_path.clone(),
            data_port: u32::from(id.data_port),
        }))
    }

    async fn renew_lease(
        &self,
        request: Request<LeaseRef>,
    ) -> Result<Response<LeaseReply>, Status> {
        let r = request.into_inner();
        if let Some(refused) = stale_epoch(&r, self.identity.epoch) {
            return Ok(refused);
        }
        Ok(reply(self.authority.renew(
            parse_lease(&r)?,
            r.generation,
            &r.peer_engine_id,
        )))
    }

    async fn confirm_lease(
        &self,
        request: Request<LeaseRef>,
    ) -> Result<Response<LeaseReply>, Status> {
        let r = request.into_inner();
        if let Some(refused) = stale_epoch(&r, self.identity.epoch) {
            return Ok(refused);
        }
        Ok(reply_with(self.authority.confirm(
            parse_lease(&r)?,
            r.generation,
            &r.peer_engine_id,
        )))
    }

    async fn release_lease(
        &self,
        request: Request<LeaseRef>,
    ) -> Result<Response<LeaseReply>, Status> {
        let r = request.into_inner();
        if let Some(refused) = stale_epoch(&r, self.identity.epoch) {
            return Ok(refused);
        }
        let res = self
            .authority
            .release(parse_lease(&r)?, r.generation, &r.peer_engine_id);
        Ok(reply(res.map(|()| std::time::SystemTime::now())))
    }

    async fn pool_stats(
        &self,
        _: Request<PoolStatsRequest>,
    ) -> Result<Response<PoolStatsReply>, Status> {
        let s = self.authority.stats();
        Ok(Response::new(PoolStatsReply {
            total_blocks: s.total_blocks as u64,
            free_blocks: s.free_blocks as u64,
            live_leases: s.live_leases as u64,
            leases_granted: s.counts.granted,
            leases_renewed: s.counts.renewed,
            leases_released: s.counts.released,
            leases_expired: s.counts.expired,
        }))
    }
}

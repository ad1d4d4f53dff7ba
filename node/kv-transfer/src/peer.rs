//! The puller's side of the side channel: handshake (cached per peer, redone after a restart),
//! lease renewal / confirmation / release, and the failure policy.

use std::collections::HashMap;

use pd_kv_pool::{KvDtype, KvLayout, LeaseContents, LeaseId};
use pd_rpc::kv::kv_peer_client::KvPeerClient;
use pd_rpc::kv::{HandshakeRequest, LeaseRef, PoolStatsReply, PoolStatsRequest};
use tonic::transport::Channel;

use crate::compat::{CompatError, CompatInfo};
use crate::pull::PullError;
use crate::service::{compat_from_proto, compat_to_proto};

/// What a handshake told us about a peer: its [`crate::service::OwnerIdentity`].
pub type PeerInfo = crate::service::OwnerIdentity;

/// Why KV expected from a peer did not arrive. Every case is counted by [`TransferError::reason`].
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The side channel could not be reached.
    #[error("peer {addr} unreachable: {message}")]
    PeerUnreachable {
        /// Its address.
        addr: String,
        /// The transport error.
        message: String,
    },
    /// The peer (or we) refused the handshake.
    #[error("handshake refused: {0}")]
    HandshakeRefused(String),
    /// Compatibility mismatch found locally.
    #[error(transparent)]
    Incompatible(#[from] CompatError),
    /// The reads failed.
    #[error(transparent)]
    Transfer(#[from] PullError),
    /// The lease ended before the data was confirmed; the data was discarded.
    #[error("lease {lease} lost ({reason}); pulled data discarded")]
    LeaseLost {
        /// The lease.
        lease: String,
        /// `expired`, `unknown`, `stale`, `wrong_peer`, `stale_epoch`.
        reason: String,
    },
    /// The side channel answered with an error.
    #[error("side channel error: {0}")]
    Rpc(String),
    /// The pull (reads, or a side-channel call it needs) did not finish by its deadline; any
    /// reads were cancelled before this was returned.
    #[error("KV pull past its deadline ({0})")]
    Deadline(String),
    /// The request waited this long for free local blocks to pull into and gave up (the
    /// producer's lease is released).
    #[error("no free KV blocks to pull into within {0:?}")]
    BlocksUnavailable(std::time::Duration),
    /// The local puller thread is gone.
    #[error("puller stopped")]
    PullerStopped,
    /// The transfer parameters do not describe this request's prompt (wrong block count, token
    /// count or prompt hash, or another engine than the one named).
    #[error("kv_transfer_params do not match this request: {0}")]
    Mismatch(String),
    /// The owner says the leased blocks hold another prompt than the reader's: the pulled data
    /// was discarded (forged or mismatched params).
    #[error(
        "prompt_mismatch: lease {lease} holds {theirs:?}, this request's prompt is {ours:?}; pulled data discarded"
    )]
    PromptMismatch {
        /// The lease.
        lease: String,
        /// What the owner says its blocks hold.
        theirs: LeaseContents,
        /// What the reader's prompt is.
        ours: LeaseContents,
    },
}

impl TransferError {
    /// Every label [`TransferError::reason`] gives: the failure and recompute counters start
    /// at 0 for each.
    pub const REASONS: [&'static str; 12] = [
        "peer_unreachable",
        "handshake_refused",
        "deadline",
        "staging",
        "transfer_error",
        "stale_epoch",
        "lease_expired",
        "rpc_error",
        "puller_stopped",
        "wait_timeout",
        "params_mismatch",
        "prompt_mismatch",
    ];

    /// Metric label of this failure (one of [`TransferError::REASONS`]).
    pub fn reason(&self) -> &'static str {
        match self {
            TransferError::PeerUnreachable { .. } => "peer_unreachable",
            TransferError::HandshakeRefused(_) | TransferError::Incompatible(_) => {
                "handshake_refused"
            }
            TransferError::Deadline(_) | TransferError::Transfer(PullError::Deadline(_)) => {
                "deadline"
            }
            TransferError::Transfer(PullError::Landing(_)) => "staging",
            TransferError::Transfer(_) => "transfer_error",
            TransferError::LeaseLost { reason, .. } if reason == "stale_epoch" => "stale_epoch",
            TransferError::LeaseLost { .. } => "lease_expired",
            TransferError::Rpc(_) => "rpc_error",
            TransferError::PullerStopped => "puller_stopped",
            TransferError::BlocksUnavailable(_) => "wait_timeout",
            TransferError::Mismatch(_) => "params_mismatch",
            TransferError::PromptMismatch { .. } => "prompt_mismatch",
        }
    }
}

/// What to do when expected KV does not arrive (vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Fail the request with the error.
    #[default]
    Fail,
    /// Compute the prompt locally instead.
    Recompute,
}

/// The decision after a failed pull.
#[derive(Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Compute the prompt locally.
    Recompute,
}

impl FailurePolicy {
    /// Applies the policy to `err`, logging it either way (never silent).
    ///
    /// # Errors
    /// `err` itself under [`FailurePolicy::Fail`].
    pub fn apply(self, err: TransferError) -> Result<Fallback, TransferError> {
        match self {
            FailurePolicy::Fail => {
                tracing::warn!(reason = err.reason(), error = %err, "KV pull failed; failing the request");
                Err(err)
            }
            FailurePolicy::Recompute => {
                tracing::warn!(reason = err.reason(), error = %err, "KV pull failed; recomputing locally");
                Ok(Fallback::Recompute)
            }
        }
    }
}

/// The largest block size (tokens) a peer's handshake may state.
pub const MAX_PEER_BLOCK_SIZE: usize = 4096;

/// Most lease-board records a peer's handshake may claim (owners make 4096).
pub const MAX_PEER_BOARD_SLOTS: u32 = 1 << 16;

/// Deadline of every side-channel call.
pub const RPC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A side-channel client to one peer.
#[derive(Debug, Clone)]
pub struct PeerClient {
    addr: String,
    me: String,
    client: KvPeerClient<Channel>,
    /// Named in lease calls ([`PeerClient::name_owner_epoch`]); 0: none.
    owner_epoch: u64,
    /// The cluster token sent with every call, as it is at the call.
    token: Option<tokio::sync::watch::Receiver<Option<String>>>,
}

impl PeerClient {
    /// Connects to the peer's side channel at `addr` (`http://host:port`; under `tls`, the same
    /// address over mutual TLS) as engine `me`. Every
    /// call has a deadline ([`RPC_TIMEOUT`]): a stalled peer fails a call as unreachable instead
    /// of holding a pull (or a lease release) forever.
    ///
    /// # Errors
    /// [`TransferError::PeerUnreachable`].
    pub async fn connect(
        addr: &str,
        me: &str,
        tls: Option<&pd_tls::ClusterTls>,
    ) -> Result<Self, TransferError> {
        let unreachable = |e: &dyn std::fmt::Display| TransferError::PeerUnreachable {
            addr: addr.to_string(),
            message: e.to_string(),
        };
        let endpoint = pd_tls::grpc_endpoint(addr, tls).map_err(|e| unreachable(&e))?;
        let channel = endpoint
            .connect_timeout(std::time::Duration::from_secs(5))
            .timeout(RPC_TIMEOUT)
            .connect()
            .await
            .map_err(|e| unreachable(&e))?;
        Ok(Self {
            addr: addr.to_string(),
            me: me.to_string(),
            client: KvPeerClient::new(channel),
            owner_epoch: 0,
            token: None,
        })
    }

    /// Sends the cluster token `token` holds (at each call) with every call from now on.
    #[must_use]
    pub fn with_cluster_token(
        mut self,
        token: tokio::sync::watch::Receiver<Option<String>>,
    ) -> Self {
        self.token = Some(token);
        self
    }

    /// `message` as a request carrying the cluster token, when there is one.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(message);
        let token = self.token.as_ref().and_then(|t| t.borrow().clone());
        if let Some(v) = token
            .filter(|t| !t.is_empty())
            .and_then(|t| tonic::metadata::MetadataValue::try_from(t.as_str()).ok())
        {
            r.metadata_mut().insert(pd_rpc::CLUSTER_TOKEN_METADATA, v);
        }
        r
    }

    fn status(&self, s: tonic::Status) -> TransferError {
        match s.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
                TransferError::PeerUnreachable {
                    addr: self.addr.clone(),
                    message: s.message().to_string(),
                }
            }
            tonic::Code::FailedPrecondition
            | tonic::Code::InvalidArgument
            | tonic::Code::Unauthenticated => {
                TransferError::HandshakeRefused(s.message().to_string())
            }
            _ => TransferError::Rpc(s.to_string()),
        }
    }

    /// Handshakes with the peer; checks compatibility on our side too unless `skip_check`.
    ///
    /// # Errors
    /// [`TransferError::HandshakeRefused`] / [`TransferError::Incompatible`] naming the field,
    /// or [`TransferError::PeerUnreachable`].
    pub async fn handshake(
        &mut self,
        local: &CompatInfo,
        epoch: u64,
        skip_check: bool,
    ) -> Result<PeerInfo, TransferError> {
        let req = HandshakeRequest {
            engine_id: self.me.clone(),
            epoch,
            compat: Some(compat_to_proto(local)),
            skip_compat_check: skip_check,
        };
        let sent_ns = crate::monotonic_ns();
        let r = self
            .client
            .handshake(self.request(req))
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        let info = check_handshake_reply(local, skip_check, r, self.host(), sent_ns)?;
        self.owner_epoch = info.epoch;
        Ok(info)
    }

    /// The host of the side channel this client talks to (without brackets or port).
    pub fn host(&self) -> &str {
        let rest = self
            .addr
            .split_once("://")
            .map_or(self.addr.as_str(), |(_, r)| r);
        let host = rest.rsplit_once(':').map_or(rest, |(h, _)| h);
        host.trim_start_matches('[').trim_end_matches(']')
    }

    /// This client's engine id (the grantee of the leases it reads).
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The cluster token the calls carry now (empty: none).
    pub fn token(&self) -> String {
        self.token
            .as_ref()
            .and_then(|t| t.borrow().clone())
            .unwrap_or_default()
    }

    fn lease_ref(&self, id: LeaseId, generation: u64) -> LeaseRef {
        LeaseRef {
            lease_id: id.to_string(),
            generation,
            peer_engine_id: self.me.clone(),
            owner_epoch: self.owner_epoch,
        }
    }

    /// Names the owner's epoch in this client's lease calls from now on (the epoch of the
    /// handshake whose keys the reads used); the owner refuses them if it is another
    /// incarnation. 0 names none.
    pub fn name_owner_epoch(&mut self, epoch: u64) {
        self.owner_epoch = epoch;
    }

    /// Renews a lease; `Ok(false)` when the owner says it is no longer live.
    ///
    /// # Errors
    /// Side-channel failures.
    pub async fn renew(&mut self, id: LeaseId, generation: u64) -> Result<bool, TransferError> {
        let r = self
            .client
            .renew_lease(self.request(self.lease_ref(id, generation)))
            .await
            .map_err(|s| self.status(s))?;
        Ok(r.into_inner().live)
    }

    /// Confirms a lease is still live; returns what its blocks hold, as the owner says.
    ///
    /// # Errors
    /// [`TransferError::LeaseLost`] when it is not; side-channel failures.
    pub async fn confirm(
        &mut self,
        id: LeaseId,
        generation: u64,
    ) -> Result<LeaseContents, TransferError> {
        let r = self
            .client
            .confirm_lease(self.request(self.lease_ref(id, generation)))
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        let contents = LeaseContents {
            num_tokens: r.num_tokens,
            // 16 bytes, little-endian; anything else reads as "not said" (0), which differs
            // from every prompt the reader checks it against.
            tokens_digest: <[u8; 16]>::try_from(r.tokens_digest.as_slice())
                .map_or(0, u128::from_le_bytes),
            blocks_hash: r.blocks_hash,
            next_token: r.next_token,
            next_token_key: r.next_token_key,
        };
        live_or_lost(id, r)?;
        Ok(contents)
    }

    /// Tells the owner the pull is done.
    ///
    /// # Errors
    /// [`TransferError::LeaseLost`] when the lease was no longer live; side-channel failures.
    pub async fn release(&mut self, id: LeaseId, generation: u64) -> Result<(), TransferError> {
        let r = self
            .client
            .release_lease(self.request(self.lease_ref(id, generation)))
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        live_or_lost(id, r)
    }

    /// The owner's pool and lease counters.
    ///
    /// # Errors
    /// Side-channel failures.
    pub async fn stats(&mut self) -> Result<PoolStatsReply, TransferError> {
        Ok(self
            .client
            .pool_stats(self.request(PoolStatsRequest {}))
            .await
            .map_err(|s| self.status(s))?
            .into_inner())
    }
}

/// Checks a peer's handshake reply `r` against `local` (compatibility, unless `skip_check`; the
/// pool layout against the peer's own compatibility info and registered region) and reads it as
/// the peer's identity; `data_host` is the host of the side channel it came from, `sent_ns` when
/// the handshake was sent ([`crate::monotonic_ns`]). No IO: the reply is the peer's word.
///
/// # Errors
/// [`TransferError::HandshakeRefused`] / [`TransferError::Incompatible`] naming the field.
pub fn check_handshake_reply(
    local: &CompatInfo,
    skip_check: bool,
    r: pd_rpc::kv::HandshakeReply,
    data_host: &str,
    sent_ns: u64,
) -> Result<PeerInfo, TransferError> {
    let compat =
        r.compat.as_ref().map(compat_from_proto).ok_or_else(|| {
            TransferError::HandshakeRefused("reply lacks compatibility info".into())
        })?;
    if !skip_check {
        local.check(&compat)?;
    }
    let l = r
        .layout
        .ok_or_else(|| TransferError::HandshakeRefused("reply lacks the pool layout".into()))?;
    let dtype = match l.dtype.as_str() {
        "f32" => KvDtype::F32,
        "f16" => KvDtype::F16,
        "bf16" => KvDtype::BF16,
        other => {
            return Err(TransferError::HandshakeRefused(format!(
                "unknown pool dtype {other:?}"
            )));
        }
    };
    let Some(order) = pd_kv_pool::KvOrder::from_dim_order(&l.dim_order) else {
        return Err(TransferError::HandshakeRefused(format!(
            "unsupported pool dimension order {:?}",
            l.dim_order
        )));
    };
    let layout = KvLayout {
        num_blocks: l.num_blocks as usize,
        block_size: l.block_size as usize,
        num_layers: l.num_layers as usize,
        num_kv_heads: l.num_kv_heads as usize,
        head_dim: l.head_dim as usize,
        dtype,
        order,
    };
    // The layout is the peer's word: its shape must be the one its compatibility info
    // states (which was checked against ours, unless told not to), its block size one a
    // request may name, and its sizes must not overflow before they are compared.
    let shape_said = (l.num_layers, l.num_kv_heads, l.head_dim, l.dtype.as_str())
        == (
            compat.num_layers,
            compat.num_kv_heads,
            compat.head_dim,
            compat.dtype.as_str(),
        );
    if !shape_said || layout.block_size == 0 || layout.block_size > MAX_PEER_BLOCK_SIZE {
        return Err(TransferError::HandshakeRefused(format!(
            "pool layout {layout:?} does not fit the peer's compatibility info"
        )));
    }
    let block_bytes = [
        layout.num_layers,
        2,
        layout.num_kv_heads,
        layout.block_size,
        layout.head_dim,
        layout.dtype.size(),
    ]
    .into_iter()
    .try_fold(1usize, usize::checked_mul);
    let pool_bytes = block_bytes.and_then(|b| b.checked_mul(layout.num_blocks));
    if block_bytes.is_none_or(|b| b as u64 != l.block_bytes)
        || pool_bytes.is_none_or(|p| p as u64 > r.region_len)
    {
        return Err(TransferError::HandshakeRefused(
            "pool layout and registered region disagree".into(),
        ));
    }
    // The lease board is mapped and read through the same key as the pool
    // (`puller/worker.rs`), registered with it right after it (`region_len` counts the pool
    // only; every owner puts the board at its end): anywhere else, or larger than an owner
    // makes it, and a mapped read could leave the registration. Neither may wrap the address
    // space (found by the `handshake` fuzz target). A peer that lies about what it registered
    // is beyond this check: the cluster token and the allowed peers keep such peers out.
    let board_end = r
        .board_offset
        .checked_add(pd_kv_pool::board_bytes(r.board_slots as usize) as u64)
        .and_then(|end| r.region_base.checked_add(end));
    let board_ok = r.board_slots == 0
        || (r.board_offset == r.region_len
            && r.board_slots <= MAX_PEER_BOARD_SLOTS
            && board_end.is_some());
    if !board_ok || r.region_base.checked_add(r.region_len).is_none() {
        return Err(TransferError::HandshakeRefused(format!(
            "lease board ({} slots at offset {}) or region ({} bytes at {:#x}) out of bounds",
            r.board_slots, r.board_offset, r.region_len, r.region_base
        )));
    }
    Ok(PeerInfo {
        engine_id: r.engine_id,
        epoch: r.epoch,
        compat,
        layout,
        worker_address: r.worker_address,
        region_base: r.region_base,
        region_len: r.region_len,
        rkey: r.rkey,
        transports: r.transports,
        board_offset: r.board_offset,
        board_slots: r.board_slots,
        owner_clock: crate::OwnerClock::from_handshake(r.owner_clock_ns, sent_ns),
        kv_path: r.kv_path,
        data_port: u16::try_from(r.data_port).unwrap_or(0),
        data_host: data_host.to_owned(),
    })
}

/// `Ok` when the owner says the lease is live, else [`TransferError::LeaseLost`] with its reason.
fn live_or_lost(id: LeaseId, r: pd_rpc::kv::LeaseReply) -> Result<(), TransferError> {
    if r.live {
        Ok(())
    } else {
        Err(TransferError::LeaseLost {
            lease: id.to_string(),
            reason: r.reason,
        })
    }
}

/// Handshakes cached per peer address. A peer that restarted shows a new epoch at the next
/// handshake and replaces its entry; [`HandshakeCache::invalidate`] forces one after a failure.
#[derive(Debug, Default)]
pub struct HandshakeCache {
    peers: HashMap<String, PeerInfo>,
}

impl HandshakeCache {
    /// The cached handshake of `addr`, or a fresh one through `client`.
    ///
    /// # Errors
    /// As [`PeerClient::handshake`].
    pub async fn get(
        &mut self,
        client: &mut PeerClient,
        local: &CompatInfo,
        epoch: u64,
        skip: bool,
    ) -> Result<PeerInfo, TransferError> {
        if let Some(p) = self.peers.get(&client.addr) {
            return Ok(p.clone());
        }
        let p = client.handshake(local, epoch, skip).await?;
        self.peers.insert(client.addr.clone(), p.clone());
        Ok(p)
    }

    /// The cached handshake of `addr`, if any (to handshake without holding a lock across it).
    pub fn lookup(&self, addr: &str) -> Option<PeerInfo> {
        self.peers.get(addr).cloned()
    }

    /// [`HandshakeCache::lookup`] without the copy.
    pub fn cached(&self, addr: &str) -> Option<&PeerInfo> {
        self.peers.get(addr)
    }

    /// Forgets `addr` (after a transfer failure or a changed engine id / epoch).
    pub fn invalidate(&mut self, addr: &str) {
        self.peers.remove(addr);
    }

    /// Records a handshake seen elsewhere; returns true when it replaced one with another
    /// engine id or epoch (the peer restarted).
    pub fn observe(&mut self, addr: &str, info: PeerInfo) -> bool {
        let restarted = self
            .peers
            .get(addr)
            .is_some_and(|old| old.engine_id != info.engine_id || old.epoch != info.epoch);
        self.peers.insert(addr.to_string(), info);
        restarted
    }
}

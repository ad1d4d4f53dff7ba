//! Who the node is ([`Registration`]) and its conversion to the wire (`pd.registry.v1.Register`).

use pd_rpc::registry as pb;

/// Version of `pd.registry.v1` this crate speaks, sent in every registration.
pub const REGISTRY_PROTOCOL_VERSION: u32 = 1;

/// What a node serves, as a P/D participant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Serves whole requests itself (no KV transfer).
    Standalone,
    /// Prefills and hands KV off (vLLM `kv_producer`).
    Producer,
    /// Pulls KV and decodes (vLLM `kv_consumer`).
    Consumer,
    /// Both (vLLM `kv_both`).
    Both,
}

/// Who the node is and where to reach it; sent as the first message of every connection.
/// Fixed for the process's life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The node's engine id (the one `KvPeer.Handshake` reports).
    pub engine_id: String,
    /// New at every process start (the `KvPeer` epoch).
    pub epoch: u64,
    /// What the node serves.
    pub role: Role,
    /// The served model name.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The KV compatibility hash (`pd_kv_transfer::CompatInfo::hash`).
    pub compat_hash: u64,
    /// `host:port` of the OpenAI HTTP API.
    pub http_addr: String,
    /// `host:port` of the `KvPeer` side channel, when the node transfers KV.
    pub kv_side_channel_addr: Option<String>,
    /// `host:port` of other node gRPC services, when there are any.
    pub grpc_addr: Option<String>,
    /// Blocks in the KV pool.
    pub num_blocks: u64,
    /// Longest sequence (prompt + output) in tokens the node accepts.
    pub max_model_len: u32,
}

impl From<Role> for pb::Role {
    fn from(role: Role) -> Self {
        match role {
            Role::Standalone => Self::Standalone,
            Role::Producer => Self::Producer,
            Role::Consumer => Self::Consumer,
            Role::Both => Self::Both,
        }
    }
}

impl From<&Registration> for pb::Register {
    fn from(r: &Registration) -> Self {
        Self {
            protocol_version: REGISTRY_PROTOCOL_VERSION,
            engine_id: r.engine_id.clone(),
            epoch: r.epoch,
            role: pb::Role::from(r.role).into(),
            model: r.model.clone(),
            block_size: r.block_size,
            compat_hash: r.compat_hash,
            http_addr: r.http_addr.clone(),
            kv_side_channel_addr: r.kv_side_channel_addr.clone().unwrap_or_default(),
            grpc_addr: r.grpc_addr.clone().unwrap_or_default(),
            num_blocks: r.num_blocks,
            max_model_len: r.max_model_len,
        }
    }
}

//! Who the node is ([`Registration`]) and its conversion to the wire (`pd.registry.v1.Register`).

use std::collections::BTreeMap;

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
/// Fixed for the process's life. `Debug` hides the cluster token and the tokenizer's contents.
#[derive(Clone, PartialEq, Eq)]
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
    /// The cluster secret (`--cluster-token`); empty when the node has none. A gateway with a
    /// secret refuses (UNAUTHENTICATED) a registration without it.
    pub cluster_token: String,
    /// The files the node's tokenizer was built from, by name
    /// (`pd_tokenize::Tokenizer::files`); empty: no tokenizer is sent.
    pub tokenizer_files: BTreeMap<String, String>,
    /// `pd_tokenize::Tokenizer::fingerprint` of those files.
    pub tokenizer_fingerprint: u64,
    /// The prefix-cache hash key (`pd_kv_pool::hash_key` of `--kv-hash-key`); 0: none.
    pub kv_hash_key: u64,
    /// Bytes of KV per token as the node stores it (`KvLayout::block_bytes / block_size`).
    pub kv_bytes_per_token: u32,
    /// The node takes `prompt_token_ids` (`pd_tokenize::prompt::GIVEN_IDS_FIELD`) as the prompt.
    pub takes_prompt_token_ids: bool,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files: BTreeMap<&str, usize> = self
            .tokenizer_files
            .iter()
            .map(|(name, content)| (name.as_str(), content.len()))
            .collect();
        f.debug_struct("Registration")
            .field("engine_id", &self.engine_id)
            .field("epoch", &self.epoch)
            .field("role", &self.role)
            .field("model", &self.model)
            .field("block_size", &self.block_size)
            .field("compat_hash", &self.compat_hash)
            .field("http_addr", &self.http_addr)
            .field("kv_side_channel_addr", &self.kv_side_channel_addr)
            .field("grpc_addr", &self.grpc_addr)
            .field("num_blocks", &self.num_blocks)
            .field("max_model_len", &self.max_model_len)
            .field(
                "cluster_token",
                &if self.cluster_token.is_empty() {
                    "(none)"
                } else {
                    "(set)"
                },
            )
            .field(
                "kv_hash_key",
                &if self.kv_hash_key == 0 {
                    "(none)"
                } else {
                    "(set)"
                },
            )
            .field("kv_bytes_per_token", &self.kv_bytes_per_token)
            .field("takes_prompt_token_ids", &self.takes_prompt_token_ids)
            .field("tokenizer_files", &files)
            .field(
                "tokenizer_fingerprint",
                &format_args!("{:016x}", self.tokenizer_fingerprint),
            )
            .finish()
    }
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
            cluster_token: r.cluster_token.clone(),
            kv_hash_key: r.kv_hash_key,
            kv_bytes_per_token: r.kv_bytes_per_token,
            takes_prompt_token_ids: r.takes_prompt_token_ids,
            tokenizer: (!r.tokenizer_files.is_empty()).then(|| pb::TokenizerBundle {
                files: r
                    .tokenizer_files
                    .iter()
                    .map(|(name, content)| pb::TokenizerFile {
                        name: name.clone(),
                        content: content.clone(),
                    })
                    .collect(),
                fingerprint: r.tokenizer_fingerprint,
            }),
        }
    }
}

//! The gateway's own routing types: what a policy decides on and what it answers, as the
//! gateway handles them (its request path, admin API, decision records and native policies).
//!
//! They are not the WIT's generated types: those stay private to the host (`wit.rs`), which
//! converts these into `pd:policy@1.0.0`'s shape once per call (the view as columns) and the
//! guest's answer back (a split's two lists into [`DecodeTarget`]s). Field meanings are the
//! WIT's (`wit/policy.wit`); the view here is a list of [`Node`] records, the shape the
//! gateway's records and native policies read.

/// The OpenAI API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/responses`.
    Responses,
}

/// What a node does in prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefills and hands its KV off (vLLM `kv_producer`).
    Prefill,
    /// Pulls KV from a prefill node and decodes (vLLM `kv_consumer`).
    Decode,
    /// Serves whole requests alone (no role, or vLLM's deprecated `kv_both`).
    Standalone,
}

/// One live node as the gateway reports it to a policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    /// What the node does.
    pub role: Role,
    /// Blocks an allocation can take now (cached but unreferenced blocks included).
    pub free_blocks: u32,
    /// Blocks in the node's KV pool.
    pub total_blocks: u32,
    /// Blocks pinned by leases: KV held for another node to pull.
    pub leased_blocks: u32,
    /// Requests queued, not yet scheduled.
    pub waiting: u32,
    /// Requests being prefilled or decoded.
    pub running: u32,
    /// Requests parked until their KV arrives from another node.
    pub waiting_remote_kv: u32,
    /// The operator is draining this node.
    pub draining: bool,
    /// Tokens of earlier-turn KV of this request's conversation the node holds under a lease
    /// (0: none; at most one node of a view has some).
    pub conversation_tokens: u32,
    /// Milliseconds until that conversation KV's lease ends (0: none).
    pub conversation_expiry_ms: u32,
}

/// The live nodes serving the request's model, in registration order: a node's identity in a
/// decision is its index here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// The nodes.
    pub nodes: Vec<Node>,
}

/// What a node measures of itself and reports in its state stream (0: not measured yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Rates {
    /// Prompt tokens per second its prefill steps compute (moving average).
    pub prefill_tokens_per_s: u32,
    /// Bandwidth of its KV pulls, MB/s (10^6 bytes; moving average).
    pub pull_mb_per_s: u32,
}

/// What the nodes report about themselves beside the [`View`]: each node's [`Rates`], the
/// model's KV bytes per token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measured {
    /// `rates[i]` is what `view.nodes[i]` measured; missing entries read as not measured.
    pub rates: Vec<Rates>,
    /// Bytes of KV per token of the model's nodes (all layers, K and V, as stored): what a
    /// pull moves per token (0: unknown).
    pub kv_bytes_per_token: u32,
}

impl Measured {
    /// Node `i`'s rates (not measured when missing).
    pub fn rates_of(&self, i: usize) -> Rates {
        self.rates.get(i).copied().unwrap_or_default()
    }
}

/// The request being routed. Token counts are in the model's tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Sequence number of this call, increasing by one per request the gateway routes.
    pub seq: u64,
    /// The API it came in on.
    pub api: Api,
    /// Prompt length in tokens (after the chat template).
    pub prompt_tokens: u32,
    /// Tokens per KV block of the model's nodes.
    pub block_size: u32,
    /// Chained xxh3-64 hashes of the prompt's full blocks, first block first.
    pub block_hashes: Vec<u64>,
    /// For each node of the view (same index), how many leading blocks of this prompt it holds
    /// in its prefix cache.
    pub prefix_blocks: Vec<u32>,
    /// Completions requested (`n`, at least 1).
    pub n: u32,
    /// Most tokens to generate per completion, as the client asked.
    pub max_tokens: Option<u32>,
    /// The client asked for a stream (SSE).
    pub stream: bool,
    /// Identifies a conversation when the client gave one.
    pub conversation_key: Option<String>,
}

/// One decode assignment: `children` of the request's `n` completions on `node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeTarget {
    /// The node (index into the view).
    pub node: u32,
    /// Completions it decodes.
    pub children: u32,
}

/// Prefill on one node, decode on others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Prefill candidates, best first.
    pub prefill: Vec<u32>,
    /// Decode assignments, best first; entries past the `n` placed are failover candidates.
    pub decode: Vec<DecodeTarget>,
}

/// Refuse the request with this HTTP status (400..=599) and message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rejection {
    /// The HTTP status.
    pub status: u16,
    /// The message the client reads.
    pub message: String,
}

/// Where the request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Prefill/decode disaggregation.
    Split(Split),
    /// One node serves the request alone; candidates, best first.
    Whole(Vec<u32>),
    /// Refuse the request.
    Reject(Rejection),
}

/// Use the earlier turn node `from` holds (multi-turn).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReversePull {
    /// The node holding the conversation's KV.
    pub from: u32,
    /// Pull only when at least this many tokens would move; recompute below.
    pub min_tokens: u32,
}

/// A policy's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Where the request goes.
    pub route: Route,
    /// Pull the conversation's earlier-turn KV back from its holder first.
    pub reverse_pull: Option<ReversePull>,
}

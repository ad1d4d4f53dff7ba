//! One simulated node: what it is (role, model, addresses), its load, and how it serves one
//! generation request — as a prefill node handing its KV off, a decode node pulling it, or a
//! node computing the whole request — with the timing model's delays and deterministic text.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pd_report::Role;
use pd_wire::kv::{Hex64, KvTransferParams};
use pd_wire::request::Api;
use serde_json::{Map, Value};

use crate::state::{Leases, NodeLoad};
use crate::text::Prompt;
use crate::timing::Timing;

/// Most completions per request (`n`), as the real node.
pub const MAX_N: u32 = 16;
/// Most output tokens a simulated request may ask for.
pub const MAX_OUTPUT_TOKENS: usize = 1 << 16;
/// Output tokens when the request sets no limit.
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// What a node is, fixed at start.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Registered engine id.
    pub engine_id: String,
    /// Incarnation (random per start).
    pub epoch: u64,
    /// Registered role.
    pub role: Role,
    /// Served model.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The HTTP (OpenAI) address.
    pub http: SocketAddr,
    /// The KV side channel (`pd.kv.v1.KvPeer`), for nodes that hand KV off.
    pub kv: Option<SocketAddr>,
}

/// Requests served, by how.
#[derive(Debug, Default)]
pub struct Served {
    /// Prefills that handed their KV off (`do_remote_decode`).
    pub handoffs: AtomicU64,
    /// Decodes after a pull (`do_remote_prefill`).
    pub pulls: AtomicU64,
    /// Requests computed whole on this node.
    pub wholes: AtomicU64,
    /// Requests refused (400).
    pub refused: AtomicU64,
    /// Output tokens generated.
    pub tokens: AtomicU64,
}

/// A simulated node.
#[derive(Debug)]
pub struct SimNode {
    /// What it is.
    pub id: Identity,
    /// Its load, as reported.
    pub load: Arc<NodeLoad>,
    /// What it served.
    pub served: Served,
    pub(crate) timing: Timing,
    pub(crate) leases: Arc<Leases>,
    pub(crate) lease_duration: Duration,
    pub(crate) hash_root: Option<pd_kv_pool::BlockHash>,
    seq: AtomicU64,
}

/// How a request is served.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    /// Prefill, grant `consumers` leases, answer one token with the params.
    Handoff {
        /// Decode nodes that will pull.
        consumers: u32,
    },
    /// Pull the prompt's KV named by these params, then decode.
    Pull(Vec<KvTransferParams>),
    /// Prefill and decode here.
    Whole,
}

/// A request the simulator refuses, as the real node would (400).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// The field at fault.
    pub param: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl Refusal {
    fn new(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            param: param.map(str::to_owned),
            message: message.into(),
        }
    }
}

/// One generation request as the simulator reads it.
#[derive(Debug, Clone)]
pub struct Job {
    /// The API.
    pub api: Api,
    /// The prompt.
    pub prompt: Prompt,
    /// Output tokens per completion.
    pub max_tokens: usize,
    /// Completions.
    pub n: u32,
    /// Streamed (SSE).
    pub stream: bool,
    /// Usage chunk at the end of a stream.
    pub include_usage: bool,
    /// The model named.
    pub model: String,
    /// How it is served.
    pub work: Work,
}

impl SimNode {
    pub(crate) fn new(
        id: Identity,
        load: Arc<NodeLoad>,
        timing: Timing,
        leases: Arc<Leases>,
        lease_duration: Duration,
        hash_key: u64,
    ) -> Self {
        Self {
            id,
            load,
            served: Served::default(),
            timing,
            leases,
            lease_duration,
            hash_root: pd_kv_pool::root_hash(hash_key, None),
            seq: AtomicU64::new(0),
        }
    }

    /// Reads a request body into a [`Job`], refusing what the real node refuses.
    ///
    /// # Errors
    /// A field of the wrong type or out of range, params this node's role cannot serve.
    pub fn job(&self, api: Api, body: &Map<String, Value>) -> Result<Job, Refusal> {
        if api == Api::Responses {
            return Err(Refusal::new(
                None,
                "the node simulator serves /v1/chat/completions and /v1/completions",
            ));
        }
        let max_tokens = api
            .pick_max_tokens(|f| body.get(f).filter(|v| !v.is_null()))
            .0
            .map(|v| {
                v.as_u64()
                    .filter(|&t| t >= 1 && t as usize <= MAX_OUTPUT_TOKENS)
                    .ok_or_else(|| Refusal::new(Some("max_tokens"), "max_tokens must be 1..=65536"))
            })
            .transpose()?
            .map_or(DEFAULT_MAX_TOKENS, |t| t as usize);
        let n = match body.get("n").filter(|v| !v.is_null()) {
            None => 1,
            Some(v) => v
                .as_u64()
                .filter(|&n| (1..=u64::from(MAX_N)).contains(&n))
                .ok_or_else(|| Refusal::new(Some("n"), "n must be 1..=16"))?
                as u32,
        };
        let params = pd_wire::kv::read(body.get("kv_transfer_params"))
            .map_err(|e| Refusal::new(Some(&e.param), e.message))?;
        let work = match params.first() {
            None => Work::Whole,
            Some(p) if p.do_remote_decode && !p.do_remote_prefill => {
                if !matches!(self.id.role, Role::Producer | Role::Both) {
                    return Err(Refusal::new(
                        Some("kv_transfer_params"),
                        "this node hands no KV off (it is not a kv_producer)",
                    ));
                }
                Work::Handoff {
                    consumers: p.num_consumers.unwrap_or(1).clamp(1, MAX_N),
                }
            }
            Some(p) if p.do_remote_prefill => {
                if self.id.role == Role::Standalone {
                    return Err(Refusal::new(
                        Some("kv_transfer_params"),
                        "this node pulls no KV (it has no KV role)",
                    ));
                }
                Work::Pull(params)
            }
            Some(_) => Work::Whole,
        };
        Ok(Job {
            api,
            prompt: Prompt::of(body),
            max_tokens,
            n,
            stream: body.get("stream").and_then(Value::as_bool) == Some(true),
            include_usage: body
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                == Some(true),
            model: body
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or(&self.id.model)
                .to_owned(),
            work,
        })
    }

    /// A new answer id for `api`.
    pub fn answer_id(&self, api: Api) -> String {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let prefix = if api == Api::ChatCompletions {
            "chatcmpl"
        } else {
            "cmpl"
        };
        format!("{prefix}-{}-{seq}", self.id.engine_id)
    }

    /// Puts the prompt's blocks in the prefix cache (reported to the gateways).
    pub fn cache_prompt(&self, prompt: &Prompt) {
        if let Some(ids) = &prompt.ids {
            let hashes =
                pd_kv_pool::hash_full_blocks_from(self.hash_root, ids, self.id.block_size as usize);
            let hashes: Vec<u64> = hashes.iter().map(|h| h.0).collect();
            self.load.store_blocks(&hashes);
        }
    }

    /// Grants the handoff's leases and writes the params P answers with (one object per
    /// consumer).
    pub fn hand_off(&self, job: &Job, request_id: &str, consumers: u32) -> Vec<KvTransferParams> {
        let tokens = job.prompt.tokens;
        let blocks = tokens.div_ceil(self.id.block_size as usize).min(1 << 16) as u32;
        let side_channel = self.id.kv.unwrap_or(self.id.http);
        let (host, port) = (side_channel.ip().to_string(), side_channel.port());
        let expiry = SystemTime::now()
            .checked_add(self.lease_duration)
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        (0..consumers)
            .map(|_| {
                let lease = self
                    .leases
                    .grant(&self.load, u64::from(blocks), self.lease_duration);
                KvTransferParams {
                    do_remote_prefill: true,
                    remote_engine_id: Some(self.id.engine_id.clone()),
                    remote_block_ids: Some((0..blocks).collect()),
                    remote_host: Some(host.clone()),
                    remote_port: Some(port),
                    remote_request_id: Some(request_id.to_owned()),
                    tp_size: Some(1),
                    remote_num_tokens: Some(tokens as u32),
                    remote_lease_id: Some(format!("{lease:032x}")),
                    remote_lease_generation: Some(1),
                    remote_blocks_expiry_time: Some(expiry),
                    remote_engine_epoch: Some(Hex64(self.id.epoch)),
                    remote_block_size: Some(self.id.block_size),
                    ..KvTransferParams::default()
                }
            })
            .collect()
    }

    /// After a pull: releases every distinct lease the params name that this process holds
    /// (a producer in another process lets its lease expire).
    pub fn release_pulled(&self, params: &[KvTransferParams]) {
        for p in params {
            if let Some(id) = p
                .remote_lease_id
                .as_deref()
                .and_then(|h| u128::from_str_radix(h, 16).ok())
            {
                self.leases.release(id);
            }
        }
    }

    /// The delay before the first output token: prefill, or the pull of the prompt's KV.
    pub fn before_first_token(&self, job: &Job) -> Duration {
        match job.work {
            Work::Pull(_) => self.timing.pull(job.prompt.tokens),
            Work::Handoff { .. } | Work::Whole => self.timing.prefill(job.prompt.tokens),
        }
    }

    /// The gap before output token `k`.
    pub fn before_token(&self, k: usize) -> Duration {
        self.timing.before_token(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(role: Role) -> SimNode {
        let id = Identity {
            engine_id: "sim-1".into(),
            epoch: 7,
            role,
            model: "m".into(),
            block_size: 4,
            http: "127.0.0.1:1".parse().unwrap(),
            kv: Some("127.0.0.1:2".parse().unwrap()),
        };
        let load = Arc::new(NodeLoad::new(64, false));
        SimNode::new(
            id,
            load,
            Timing::INSTANT,
            Arc::default(),
            Duration::from_secs(5),
            0,
        )
    }

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn roles_decide_what_is_served() {
        let p = node(Role::Producer);
        let ask = body(json!({"prompt_token_ids": [1, 2, 3, 4, 5],
            "kv_transfer_params": {"do_remote_decode": true, "num_consumers": 2}}));
        let job = p.job(Api::Completions, &ask).unwrap();
        assert_eq!(job.work, Work::Handoff { consumers: 2 });
        let params = p.hand_off(&job, "r1", 2);
        assert_eq!(params.len(), 2);
        assert_eq!(p.load.live_leases(), 2);
        assert_eq!(params[0].remote_block_ids.as_deref(), Some(&[0, 1][..]));
        assert_eq!(params[0].remote_port, Some(2));
        let s = node(Role::Standalone);
        assert!(s.job(Api::Completions, &ask).is_err(), "no KV role");
        let d = node(Role::Consumer);
        let pull = body(json!({"prompt": "x", "kv_transfer_params": params[0].to_value()}));
        let job = d.job(Api::ChatCompletions, &pull).unwrap();
        assert!(matches!(job.work, Work::Pull(_)));
        // A decode node of another process cannot release P's lease; P's own table can.
        p.release_pulled(&params);
        assert_eq!(p.load.live_leases(), 0);
    }

    #[test]
    fn sizes_from_outside_are_bounded() {
        let s = node(Role::Standalone);
        for bad in [
            json!({"max_tokens": 0}),
            json!({"max_tokens": 1_000_000}),
            json!({"n": 17}),
            json!({"n": "2"}),
            json!({"kv_transfer_params": 3}),
        ] {
            assert!(
                s.job(Api::Completions, &body(bad.clone())).is_err(),
                "{bad}"
            );
        }
        let ok = s
            .job(
                Api::ChatCompletions,
                &body(json!({"max_completion_tokens": 3, "n": 2, "stream": true,
            "stream_options": {"include_usage": true}})),
            )
            .unwrap();
        assert_eq!(
            (ok.max_tokens, ok.n, ok.stream, ok.include_usage),
            (3, 2, true, true)
        );
        assert!(s.job(Api::Responses, &Map::new()).is_err());
    }
}

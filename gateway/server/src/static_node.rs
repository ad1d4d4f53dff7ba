//! Nodes the operator names (`--static-node`) instead of nodes that register over gRPC: any
//! server that speaks vLLM's HTTP API and its metrics — a vLLM server started as a P/D producer
//! or consumer, or a `pd-node` started without `--gateway`. This is the other half of "interop
//! both ways": our nodes speak vLLM's protocol to vLLM's proxies, and our gateway drives nodes
//! that speak only vLLM's protocol.
//!
//! Such a node tells the gateway nothing by itself, so a task per node ([`follow`]) asks:
//! `GET /v1/models` for the served model and its context length, and `GET /metrics` for its
//! load under vLLM's names (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
//! `vllm:kv_cache_usage_perc`, and `vllm:cache_config_info`'s `num_gpu_blocks` and
//! `block_size`), every scrape interval. The first answer joins it to the [`Cluster`] exactly as
//! a registration does (the model's tokenizer, read from the directory the operator named, is
//! checked against the model's like a registered node's); each later one is its state update;
//! a node that stops answering is taken out by the registry's sweep after the node timeout, and
//! joins again when it answers.
//!
//! What such a node does not give, the gateway does without: no block events (its prefix cache
//! is invisible to prefix-aware routing), no KV side channel of ours (a decode node behind the
//! gateway must be told its producers with its own allow-list, e.g. `--kv-allowed-peers`; the
//! gateway pushes peer lists only to registered nodes), no `prompt_token_ids` (the prompt goes
//! as text), no epoch.
//!
//! This module does not route, proxy or touch KV: it only keeps static nodes in the view.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use pd_policy::Role;
use pd_rpc::registry as pb;
use pd_tokenize::Tokenizer;
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::cluster::{Cluster, ConnId, JoinError, NodeEntry};

/// One `--static-node` flag: `role=prefill|decode|standalone,url=http://HOST:PORT,
/// tokenizer=DIR[,engine-id=NAME][,bearer-env=VAR|bearer=cluster-token]`.
#[derive(Debug, Clone, PartialEq)]
pub struct StaticNode {
    /// The node's part, as the policy sees it.
    pub role: Role,
    /// `host:port` of its OpenAI API (as registered nodes' `http_addr`).
    pub http_addr: String,
    /// A Hugging Face model directory holding the served model's `tokenizer.json` and
    /// `tokenizer_config.json`.
    pub tokenizer: PathBuf,
    /// Its name in logs, the admin API and the policy's `host.node-name`.
    pub engine_id: String,
    /// What requests and scrapes send it as the bearer key.
    pub bearer: StaticBearer,
}

/// A static node's bearer key. The cluster token is never sent to a static node unless the
/// operator says so: such a node is outside the cluster (a vLLM server, anyone's), and the token
/// opens every node's KV side channel and the registry.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StaticBearer {
    /// No `Authorization` header (the default).
    #[default]
    None,
    /// `bearer-env=VAR`: the key in the gateway's environment variable `VAR` (the node's
    /// `--api-key`), read at start.
    Env(String),
    /// `bearer=cluster-token`: the cluster token (a `pd-node` of this cluster run without
    /// `--gateway`).
    ClusterToken,
}

impl StaticBearer {
    /// The `Authorization` value to send, given the cluster token.
    ///
    /// # Errors
    /// [`SpecError::Bearer`] when the variable is unset or not a header value.
    pub fn header(&self, cluster_token: &str) -> Result<Option<http::HeaderValue>, SpecError> {
        let key = match self {
            Self::None => return Ok(None),
            Self::ClusterToken => cluster_token.to_owned(),
            Self::Env(var) => std::env::var(var)
                .ok()
                .filter(|k| !k.is_empty())
                .ok_or_else(|| SpecError::Bearer(format!("${var} is not set")))?,
        };
        crate::upstream::bearer(&key)
            .map(Some)
            .map_err(|_| SpecError::Bearer("the key is not a valid header value".into()))
    }
}

/// Why a `--static-node` spec does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A part without `=`.
    #[error("`{0}` is not KEY=VALUE")]
    NotKeyValue(String),
    /// A key given twice.
    #[error("`{0}` given twice")]
    Twice(String),
    /// A role that is none of the three.
    #[error("role `{0}`: expected prefill, decode or standalone")]
    Role(String),
    /// A required key is missing (its form in the message).
    #[error("{0} is missing")]
    Missing(&'static str),
    /// A URL that is not `http://`.
    #[error("url `{0}`: only http://HOST:PORT is served")]
    NotHttp(String),
    /// An `http://` URL with a path or no host.
    #[error("url `{0}`: expected http://HOST:PORT")]
    Url(String),
    /// A key the spec does not have.
    #[error("unknown key `{0}` (keys: role, url, tokenizer, engine-id, bearer-env, bearer)")]
    UnknownKey(String),
    /// The bearer key cannot be had.
    #[error("bearer: {0}")]
    Bearer(String),
}

impl FromStr for StaticNode {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let mut fields = BTreeMap::new();
        for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| SpecError::NotKeyValue(part.to_owned()))?;
            if fields.insert(key.trim(), value.trim()).is_some() {
                return Err(SpecError::Twice(key.to_owned()));
            }
        }
        let mut take = |key: &str| fields.remove(key);
        let role = match take("role") {
            Some("prefill") => Role::Prefill,
            Some("decode") => Role::Decode,
            Some("standalone") => Role::Standalone,
            Some(other) => return Err(SpecError::Role(other.to_owned())),
            None => return Err(SpecError::Missing("role=prefill|decode|standalone")),
        };
        let url = take("url").ok_or(SpecError::Missing("url=http://HOST:PORT"))?;
        let http_addr = url
            .strip_prefix("http://")
            .ok_or_else(|| SpecError::NotHttp(url.to_owned()))?
            .trim_end_matches('/')
            .to_owned();
        if http_addr.is_empty() || http_addr.contains('/') {
            return Err(SpecError::Url(url.to_owned()));
        }
        let tokenizer = PathBuf::from(take("tokenizer").ok_or(SpecError::Missing(
            "tokenizer=DIR (the model's tokenizer files)",
        ))?);
        let engine_id =
            take("engine-id").map_or_else(|| format!("static-{http_addr}"), str::to_owned);
        let bearer = match (take("bearer-env"), take("bearer")) {
            (None, None) => StaticBearer::None,
            (Some(var), None) if !var.is_empty() => StaticBearer::Env(var.to_owned()),
            (None, Some("cluster-token")) => StaticBearer::ClusterToken,
            _ => {
                return Err(SpecError::Bearer(
                    "one of bearer-env=VAR or bearer=cluster-token".into(),
                ));
            }
        };
        if let Some(key) = fields.keys().next() {
            return Err(SpecError::UnknownKey((*key).to_owned()));
        }
        Ok(Self {
            role,
            http_addr,
            tokenizer,
            engine_id,
            bearer,
        })
    }
}

/// What one scrape of a node found.
#[derive(Debug, Clone, PartialEq)]
pub struct Scraped {
    /// The served model (the first of `/v1/models`).
    pub model: String,
    /// Its context length, when the node says (vLLM and `pd-node` do).
    pub max_model_len: u32,
    /// Tokens per block (`vllm:cache_config_info`'s `block_size`; 0: not said).
    pub block_size: u32,
    /// Its load, as a registered node would report it.
    pub state: pb::NodeState,
}

/// Why a scrape of a static node does not put it in the view.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// A request failed or its body did not read.
    #[error("GET {path}: {source}")]
    Http {
        /// `/v1/models` or `/metrics`.
        path: &'static str,
        /// Why.
        source: reqwest::Error,
    },
    /// The answers lack what routing needs (see [`read_scrape`]).
    #[error("{0}")]
    Missing(&'static str),
    /// It answers, but the cluster refused it.
    #[error(transparent)]
    Refused(#[from] JoinError),
    /// It serves another model than the one its tokenizer is for.
    #[error(
        "it serves `{served}` now, not `{model}` (the model of its tokenizer); restart the gateway \
         with the new model's tokenizer"
    )]
    OtherModel {
        /// What it serves now.
        served: String,
        /// What it served first.
        model: String,
    },
}

/// Why a static node's tokenizer could not be read (at start).
#[derive(Debug, thiserror::Error)]
#[error("static node `{engine_id}`: its tokenizer ({}): {source}", dir.display())]
pub struct TokenizerError {
    /// The node.
    pub engine_id: String,
    /// The directory named.
    pub dir: PathBuf,
    /// Why.
    pub source: pd_tokenize::TokenizeError,
}

/// Reads `/v1/models` and `/metrics` bodies.
///
/// # Errors
/// [`ScrapeError::Missing`]: a model, the queue gauges (a server that does not export vLLM's
/// metrics cannot be routed on load), or `vllm:cache_config_info` with a block size (prompts
/// are hashed in the node's blocks).
pub fn read_scrape(models: &Value, metrics: &str) -> Result<Scraped, ScrapeError> {
    let missing = ScrapeError::Missing;
    let first = models["data"]
        .get(0)
        .ok_or(missing("/v1/models lists no model"))?;
    let model = first["id"]
        .as_str()
        .ok_or(missing("/v1/models: the first model has no id"))?
        .to_owned();
    let max_model_len = first["max_model_len"]
        .as_u64()
        .map_or(0, |v| u32::try_from(v).unwrap_or(u32::MAX));
    let sum = |name: &str| -> Option<f64> {
        let values: Vec<f64> = samples(metrics, name).map(|(_, v)| v).collect();
        (!values.is_empty()).then(|| values.iter().sum())
    };
    let waiting = sum("vllm:num_requests_waiting")
        .ok_or(missing("/metrics has no vllm:num_requests_waiting"))?;
    let running = sum("vllm:num_requests_running")
        .ok_or(missing("/metrics has no vllm:num_requests_running"))?;
    // Several engines (data parallel) report one sample each: their blocks add up, and so do
    // the blocks each one's usage says are taken.
    let mut total_blocks = 0.0;
    let mut block_size: u32 = 0;
    let mut engines = BTreeMap::new();
    for (labels, _) in samples(metrics, "vllm:cache_config_info") {
        let label = |k: &str| labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let blocks: f64 = label("num_gpu_blocks")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        total_blocks += blocks;
        block_size = label("block_size")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        engines.insert(label("engine").unwrap_or("").to_owned(), blocks);
    }
    // V1's name, else V0's (a server may write both for one engine: counted once).
    let mut usage: Vec<_> = samples(metrics, "vllm:kv_cache_usage_perc").collect();
    if usage.is_empty() {
        usage = samples(metrics, "vllm:gpu_cache_usage_perc").collect();
    }
    let used_blocks: f64 = usage
        .iter()
        .map(|(labels, fraction)| {
            let engine = labels
                .iter()
                .find(|(n, _)| n == "engine")
                .map_or("", |(_, v)| v.as_str());
            // One engine: its usage whatever the labels say (versions label them differently).
            let blocks = match engines.len() {
                1 => engines.values().next().copied(),
                _ => engines.get(engine).copied(),
            };
            fraction.clamp(0.0, 1.0) * blocks.unwrap_or(0.0)
        })
        .sum();
    if block_size == 0 {
        return Err(missing(
            "/metrics has no vllm:cache_config_info with a block_size (the gateway hashes \
             prompts in the node's blocks)",
        ));
    }
    let total = total_blocks.round() as u64;
    let free = (total_blocks - used_blocks).round().max(0.0) as u64;
    Ok(Scraped {
        model,
        max_model_len,
        block_size,
        state: pb::NodeState {
            total_blocks: total,
            free_blocks: free.min(total),
            waiting: waiting.max(0.0) as u64,
            running: running.max(0.0) as u64,
            unix_ms: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64),
            ..pb::NodeState::default()
        },
    })
}

/// Every sample of `name` in Prometheus text: its labels and value.
fn samples<'a>(
    text: &'a str,
    name: &'a str,
) -> impl Iterator<Item = (Vec<(String, String)>, f64)> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        let (labels, rest) = match rest.strip_prefix('{') {
            Some(inner) => parse_labels(inner)?,
            None if rest.starts_with([' ', '\t']) => (Vec::new(), rest),
            None => return None,
        };
        let value = rest.split_whitespace().next()?.parse().ok()?;
        Some((labels, value))
    })
}

/// `a="x",b="y\"z"} rest` → the labels and ` rest` (escapes `\\`, `\"`, `\n` undone).
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (name, rest) = s.split_once('=')?;
        let mut chars = rest.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((name.trim().to_owned(), value));
        s = &rest[1 + end + 1..];
    }
}

impl StaticNode {
    /// Reads the model's tokenizer from the directory named (once, at start: a wrong path is
    /// the operator's error to see at once, not on every scrape).
    ///
    /// # Errors
    /// The directory lacks the tokenizer's files or they do not parse.
    pub fn load_tokenizer(&self) -> Result<Arc<Tokenizer>, TokenizerError> {
        Tokenizer::from_dir(&self.tokenizer)
            .map(Arc::new)
            .map_err(|source| TokenizerError {
                engine_id: self.engine_id.clone(),
                dir: self.tokenizer.clone(),
                source,
            })
    }
}

/// How often a static node is scraped, and how long each of a scrape's two requests may take
/// before the node counts as not answering.
#[derive(Debug, Clone, Copy)]
pub struct ScrapeTiming {
    /// Between scrapes.
    pub interval: Duration,
    /// Per request.
    pub timeout: Duration,
}

/// Keeps `node` in the view while it answers: scrapes it on `timing` with `http`, sending
/// `bearer` (requests routed to it send the same). The first
/// model it serves is the one `tokenizer` belongs to; if it later serves another, it stays out
/// of the view (that model's tokenizer is not known here). Runs until the gateway stops.
pub async fn follow(
    cluster: Arc<Cluster>,
    (node, bearer): (StaticNode, Option<http::HeaderValue>),
    tokenizer: Arc<Tokenizer>,
    http: reqwest::Client,
    timing: ScrapeTiming,
) {
    let base = format!("http://{}", node.http_addr);
    // The model its tokenizer is for: the first one it served.
    let mut model: Option<String> = None;
    // Its connection while in the view.
    let mut conn: Option<ConnId> = None;
    // The last reason it was out of the view, logged once per change.
    let mut last_problem = String::new();
    let mut tick = tokio::time::interval(timing.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let problem = match scrape(&http, &base, bearer.as_ref(), timing.timeout).await {
            Ok(s) if model.as_ref().is_some_and(|m| *m != s.model) => {
                if let Some(c) = conn.take() {
                    cluster.leave(c, "it serves another model");
                }
                ScrapeError::OtherModel {
                    served: s.model,
                    model: model.clone().unwrap_or_default(),
                }
            }
            Ok(s) => {
                // Still in the view: this is its state update. (Swept since: it joins again.)
                if let Some(c) = conn
                    && cluster.state(c, s.state)
                {
                    continue;
                }
                let served = s.model.clone();
                match join(&cluster, (&node, bearer.clone()), &tokenizer, s) {
                    Ok(c) => {
                        info!(engine_id = %node.engine_id, http = %node.http_addr, model = %served, "static node in the view");
                        conn = Some(c);
                        model = Some(served);
                        last_problem.clear();
                        continue;
                    }
                    Err(why) => why.into(),
                }
            }
            Err(why) => why,
        }
        .to_string();
        if problem != last_problem {
            warn!(engine_id = %node.engine_id, http = %node.http_addr, "static node not in the view: {problem}");
            last_problem = problem;
        }
    }
}

async fn scrape(
    http: &reqwest::Client,
    base: &str,
    bearer: Option<&http::HeaderValue>,
    timeout: Duration,
) -> Result<Scraped, ScrapeError> {
    let get = |path: &str| {
        let mut req = http.get(format!("{base}{path}")).timeout(timeout);
        if let Some(b) = bearer {
            req = req.header(http::header::AUTHORIZATION, b.clone());
        }
        req.send()
    };
    let failed = |path| move |source| ScrapeError::Http { path, source };
    let models = get("/v1/models")
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(failed("/v1/models"))?
        .json::<Value>()
        .await
        .map_err(failed("/v1/models"))?;
    let metrics = get("/metrics")
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(failed("/metrics"))?
        .text()
        .await
        .map_err(failed("/metrics"))?;
    read_scrape(&models, &metrics)
}

/// Joins a scraped node to the cluster as a registration would; its id, or the refusal.
fn join(
    cluster: &Cluster,
    (node, bearer): (&StaticNode, Option<http::HeaderValue>),
    tokenizer: &Arc<Tokenizer>,
    s: Scraped,
) -> Result<ConnId, JoinError> {
    let fingerprint = tokenizer.fingerprint();
    let conn = cluster.new_conn();
    // A static node has no registry stream to send on: the receiver is dropped here, so
    // this sender is closed from the start, and nothing sends to a static node.
    let (outbox, _) = mpsc::channel(1);
    let entry = NodeEntry {
        conn,
        engine_id: node.engine_id.as_str().into(),
        epoch: 0,
        role: node.role,
        model: s.model.as_str().into(),
        block_size: s.block_size,
        http_addr: node.http_addr.as_str().into(),
        kv_addr: "".into(),
        max_model_len: s.max_model_len,
        hash_key: 0,
        kv_bytes_per_token: 0,
        takes_prompt_token_ids: false,
        state: s.state,
        hashes: Default::default(),
        draining: false,
        last_seen: Instant::now(),
        registered_at: SystemTime::now(),
        visible_from: Instant::now(),
        outbox,
        source: "static",
        bearer,
        open: Default::default(),
        gone: Default::default(),
    };
    cluster.join(entry, || Ok((tokenizer.clone(), fingerprint)), fingerprint)?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let n: StaticNode = "role=prefill, url=http://127.0.0.1:8100/, tokenizer=/m"
            .parse()
            .unwrap();
        assert_eq!(n.role, Role::Prefill);
        assert_eq!(n.http_addr, "127.0.0.1:8100");
        assert_eq!(n.engine_id, "static-127.0.0.1:8100");
        let n: StaticNode = "role=decode,url=http://h:1,tokenizer=/m,engine-id=d0"
            .parse()
            .unwrap();
        assert_eq!((n.role, n.engine_id.as_str()), (Role::Decode, "d0"));
        for (spec, says) in [
            ("url=http://h:1,tokenizer=/m", "role"),
            ("role=both,url=http://h:1,tokenizer=/m", "role `both`"),
            ("role=decode,tokenizer=/m", "url"),
            ("role=decode,url=https://h:1,tokenizer=/m", "only http"),
            ("role=decode,url=http://h:1/v1,tokenizer=/m", "HOST:PORT"),
            ("role=decode,url=http://h:1", "tokenizer"),
            (
                "role=decode,url=http://h:1,tokenizer=/m,weight=2",
                "unknown key `weight`",
            ),
            ("role=decode,role=prefill", "twice"),
            ("role", "KEY=VALUE"),
        ] {
            let err = spec.parse::<StaticNode>().unwrap_err().to_string();
            assert!(err.contains(says), "{spec}: {err}");
        }
    }

    /// A vLLM server's `/metrics` as it writes it (V1, one engine; other families around).
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 5.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 9.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",engine="0",num_gpu_blocks="4000",prefix_caching_hash_algo="sha256"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1234.0
"#;

    #[test]
    fn a_static_nodes_bearer_is_none_unless_named() {
        let spec = "role=decode,url=http://h:1,tokenizer=/m";
        let n: StaticNode = spec.parse().unwrap();
        assert_eq!(n.bearer, StaticBearer::None);
        assert_eq!(n.bearer.header("tok").unwrap(), None);
        let n: StaticNode = format!("{spec},bearer=cluster-token").parse().unwrap();
        let h = n.bearer.header("tok").unwrap().unwrap();
        assert_eq!(h.to_str().unwrap(), "Bearer tok");
        assert!(h.is_sensitive());
        let n: StaticNode = format!("{spec},bearer-env=PD_TEST_UNSET_KEY_9")
            .parse()
            .unwrap();
        assert!(
            n.bearer
                .header("tok")
                .unwrap_err()
                .to_string()
                .contains("not set")
        );
        for bad in [
            "bearer=yes",
            "bearer-env=",
            "bearer-env=A,bearer=cluster-token",
        ] {
            let err = format!("{spec},{bad}").parse::<StaticNode>().unwrap_err();
            assert!(matches!(err, SpecError::Bearer(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn a_vllm_servers_metrics_become_its_state() {
        let models = json!({"object": "list", "data": [
            {"id": "Qwen/Qwen3-0.6B", "object": "model", "max_model_len": 40960}]});
        let s = read_scrape(&models, VLLM).unwrap();
        assert_eq!(s.model, "Qwen/Qwen3-0.6B");
        assert_eq!((s.max_model_len, s.block_size), (40960, 16));
        assert_eq!((s.state.waiting, s.state.running), (5, 3));
        assert_eq!((s.state.total_blocks, s.state.free_blocks), (4000, 3000));

        // Two engines (data parallel): blocks and queues add up.
        let two = VLLM.replace(
            "vllm:prompt_tokens_total",
            "vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2.0\n\
             vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 1.0\n\
             vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"1000\"} 1.0\n\
             vllm:prompt_tokens_total",
        );
        let s = read_scrape(&models, &two).unwrap();
        assert_eq!(s.state.waiting, 7);
        assert_eq!((s.state.total_blocks, s.state.free_blocks), (5000, 3000));

        // One engine's info without an engine label still sizes its usage.
        let unlabelled = VLLM.replace(",engine=\"0\",num_gpu_blocks", ",num_gpu_blocks");
        assert_ne!(unlabelled, VLLM);
        assert_eq!(
            read_scrape(&models, &unlabelled).unwrap().state.free_blocks,
            3000
        );

        // V0's name alone is read too; both names for one engine count once.
        let v0 = VLLM.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc");
        assert_eq!(read_scrape(&models, &v0).unwrap().state.free_blocks, 3000);
        let both = format!("{VLLM}vllm:gpu_cache_usage_perc{{engine=\"0\"}} 0.25\n");
        assert_eq!(read_scrape(&models, &both).unwrap().state.free_blocks, 3000);
    }

    #[test]
    fn what_cannot_be_routed_on_is_refused_by_name() {
        let models = json!({"data": [{"id": "m"}]});
        let err = read_scrape(&models, "process_cpu_seconds_total 1\n").unwrap_err();
        assert!(
            err.to_string().contains("vllm:num_requests_waiting"),
            "{err}"
        );
        let err = read_scrape(&json!({"data": []}), VLLM).unwrap_err();
        assert!(err.to_string().contains("no model"), "{err}");
        // Without cache_config_info the blocks (and their hashes) are unknown: refused.
        let err = read_scrape(
            &models,
            "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("vllm:cache_config_info"), "{err}");
        // A name that only starts like a wanted one is not it.
        let s = read_scrape(
            &models,
            "vllm:num_requests_waiting_by_reason 7\nvllm:num_requests_waiting 1\nvllm:num_requests_running 0\n\
             vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"8\"} 1\n",
        )
        .unwrap();
        assert_eq!(s.state.waiting, 1);
    }

    #[test]
    fn label_values_with_escapes() {
        let text = r#"m{a="x\"y,}z",b="\\"} 4"#;
        let got: Vec<_> = samples(text, "m").collect();
        assert_eq!(
            got,
            vec![(
                vec![("a".into(), "x\"y,}z".into()), ("b".into(), "\\".into())],
                4.0
            )]
        );
    }
}

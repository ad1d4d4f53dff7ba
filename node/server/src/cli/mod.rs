//! The `pd-node` command line: `serve` and `gen-tiny-model`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use pd_engine::{EngineConfig, KvCompute};

/// Engine node of the P/D-disaggregated serving system.
#[derive(Debug, Parser)]
#[command(name = "pd-node", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// `pd-node` subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve a model over the OpenAI HTTP API.
    Serve(Box<ServeArgs>),
    /// Write a small random model (config, weights, tokenizer) for tests and demos.
    GenTinyModel(GenTinyModelArgs),
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// An NVIDIA GPU (needs a build with CUDA support).
    Cuda,
}

/// `pd-node serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The model: a Hugging Face directory (config.json, *.safetensors, tokenizer.json), a GGUF
    /// file (llama / qwen2 architecture, byte-level BPE tokenizer), or a directory holding one.
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (printed on stdout once ready).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Name clients use in `model`; defaults to the model directory's name (a GGUF file's name
    /// without `.gguf`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Compute threads (candle's matmuls and attention). Default: `RAYON_NUM_THREADS` if set,
    /// else every core the process may run on. Set it below the core count when other
    /// processes share the cores (nodes side by side on one machine): compute threads wait for
    /// each other at every op, and one descheduled thread stalls the rest.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Seconds a node may take to drain on SIGTERM or ctrl-c: it tells the gateway it takes no
    /// new work, finishes its requests and waits for decode nodes to pull the KV it leased
    /// them, then exits (a second signal exits at once). Past this, it closes what is open.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Blocks in the KV pool; overrides --kv-cache-memory.
    #[arg(long = "num-gpu-blocks")]
    pub num_blocks: Option<usize>,
    /// KV pool size: bytes, or with a unit (256MiB, 1GiB, 500MB).
    #[arg(long, value_parser = parse_size)]
    pub kv_cache_memory: Option<usize>,
    /// What the model's weights and activations are held in: `auto` (default: f32 on the CPU;
    /// on CUDA the checkpoint's f16/bf16, else bf16), `f32`, `f16` or `bf16` (Hugging Face
    /// directories only; a GGUF model computes in f32). Greedy output is exact between nodes
    /// of one dtype, not across dtypes.
    #[arg(long, value_parser = parse_model_dtype, default_value = "auto")]
    pub dtype: pd_engine::ModelDtype,
    /// Element type of the KV pool (and of every KV transfer): f32, f16 or bf16. Default: f16
    /// for a GGUF model; for a Hugging Face directory the model's --dtype. Peers must use the
    /// same.
    #[arg(long, value_parser = parse_kv_dtype)]
    pub kv_cache_dtype: Option<pd_kv_pool::KvDtype>,
    /// Order inside a KV block: `hnd` (default: heads outer, the CPU kernels' order) or `nhd`
    /// (positions outer: the GPU layout, as a FlashAttention/vLLM CUDA cache block). Peers may
    /// differ in this and in --block-size: a decode node converts what it pulls.
    #[arg(long, value_parser = parse_kv_layout, default_value = "hnd")]
    pub kv_layout: pd_kv_pool::KvOrder,
    /// How a GGUF model's quantized weights are held: `fast` (default: Q4_1 through our own
    /// SIMD kernel, other types as measured in BENCHMARKS.md), `candle-kernels` (candle's
    /// kernels only: Q4_1 requantized to Q8_0, the default before), `as-stored` (the file's
    /// exact arithmetic, slow), `dense` (all f32).
    #[arg(long, value_parser = parse_gguf_weights, default_value = "fast")]
    pub gguf_weights: pd_model::gguf::QuantPolicy,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Most sequences in one engine step.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Context length limit; defaults to the model's.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Do not reuse cached prompt blocks across requests.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Where the model runs.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// CUDA device ordinal for `--device cuda`.
    #[arg(long, default_value_t = 0)]
    pub cuda_device: usize,
    /// On CPU, compute on a second KV pool and copy blocks to and from the transfer pool as a
    /// GPU node does (before a lease is granted, after a pull). Slower; it exists to test the
    /// GPU path's staging without a GPU.
    #[arg(long)]
    pub kv_staged: bool,
    /// Where the model computes on a staged pool (a GPU, or `--kv-staged`): a decode node's
    /// pull uploads each block into it as the block lands, from the pull's thread, so the
    /// uploads overlap the rest of the pull and the engine keeps stepping (`true`); `false`:
    /// the engine uploads every pulled block after the pull, between its steps (for
    /// comparison).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub kv_upload_while_pulling: bool,
    /// Serve the KV pool to peers: allocate it through UCX and answer the `KvPeer` side channel
    /// (handshake, leases, pool stats) on this port of `--host` (0 picks one; printed on stdout).
    #[arg(long)]
    pub kv_port: Option<u16>,
    /// Port of the KV data port on `--host` (0: any free one; named in handshakes): a TCP port
    /// that sends leased blocks to decode nodes that reach this node only over TCP, where UCX
    /// emulates one-sided reads on a socket at a fraction of the link's rate. Needs `--kv-port`.
    #[arg(long, default_value_t = 0)]
    pub kv_data_port: u16,
    /// This node's engine id: its name at the gateway and in KV handshakes (one live node per
    /// id; the gateway refuses a second). Default: `<hostname>-<12 random hex digits>`, new at
    /// every start. Under Kubernetes give it the pod's name (the downward API).
    #[arg(long, env = "PD_ENGINE_ID")]
    pub engine_id: Option<String>,
    /// Host (address or DNS name) others reach this node at, for everything it publishes: the
    /// HTTP API it registers, its KV side channel (`kv_transfer_params.remote_host`) and the
    /// interface UCX offers (`UCX_NET_DEVICES`, unless set). Default: the `--host` it binds;
    /// for a wildcard `--host`, the address the gateway sees it register from. Under
    /// Kubernetes give it the pod's IP (the downward API).
    #[arg(long, env = "PD_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Part in P/D disaggregation: `kv_producer` (prefill node), `kv_consumer` (decode node);
    /// `kv_both` is deprecated. Absent: standalone. A role needs `--kv-port`.
    #[arg(long, value_enum)]
    pub kv_role: Option<KvRoleArg>,
    /// Host decode nodes reach this node's side channel at (in `kv_transfer_params`), when it
    /// differs from `--advertise-host`.
    #[arg(long)]
    pub kv_host: Option<String>,
    /// Seconds a prefill node keeps a prompt's blocks for the decode node unless renewed.
    #[arg(long, default_value_t = 30.0)]
    pub kv_lease_duration: f64,
    /// Share of the KV pool a prefill node lets leases for decode nodes hold (0 < f ≤ 1);
    /// prefills beyond it are answered 503 `kv_lease_capacity`, so unpulled leases cannot
    /// starve the node's own prefills.
    #[arg(long, default_value_t = 0.9)]
    pub kv_max_leased_fraction: f64,
    /// Seconds to keep a finished completion's KV (prompt and generated tokens, whole blocks)
    /// under a lease for the conversation's next turn, which may then pull it (reverse pull) or
    /// be sent here; 0: free at once. The final response's `kv_transfer_params` describe it.
    /// Revoked first when this node needs the blocks, before anything is preempted. Behind
    /// `pd-gateway` the params go to its conversation index and are removed from what an
    /// untrusted client sees; a client that reaches this node directly sees them.
    #[arg(long, default_value_t = 0.0)]
    pub kv_retain_after_decode: f64,
    /// Report the turns kept by `--kv-retain-after-decode` to every `--gateway` (their
    /// `kv_transfer_params`, and when their leases end), so that any gateway, not only the one
    /// that relayed the answer, routes the next turn to this node; `false` leaves them to the
    /// answers alone.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub report_retained_turns: bool,
    /// What a decode node does when the KV does not arrive: fail the request, or compute the
    /// prompt itself (counted by reason either way).
    #[arg(long, value_enum, default_value_t = FailurePolicyArg::Fail)]
    pub kv_load_failure_policy: FailurePolicyArg,
    /// Seconds a decode node gives one pull (handshake, reads and the owner's confirmation)
    /// before cancelling it and following `--kv-load-failure-policy`; larger pulls get more, at
    /// 100 MiB/s. A producer that stops answering (a frozen process, a hung host) costs a
    /// request at most this long; under `recompute`, the requests after it for as long again
    /// (at least 1 s) compute their prompts at once instead of waiting for it
    /// (`pd_kv_recompute_total{reason="peer_suspect"}`), and one of them then tries it again.
    #[arg(long, default_value_t = 5.0)]
    pub kv_pull_timeout: f64,
    /// Milliseconds within which a producer's lease board must have beaten (the producer's
    /// latest grant) for a decode node to confirm a lease on the board alone, without asking
    /// the producer or waiting for its answer (shared memory only: the board must be mapped
    /// here). A producer silent for longer is asked. 0: always wait for the producer's answer.
    #[arg(long, default_value_t = 50)]
    pub kv_board_freshness_ms: u64,
    /// Seconds a streamed response may stay silent (queued, or waiting for a peer's KV) before
    /// the node sends an SSE comment, so proxies and clients with idle timeouts keep it open.
    #[arg(long, default_value_t = 15.0)]
    pub sse_keep_alive: f64,
    /// How the model writes tool calls on its own, read out of its text for
    /// `tool_choice: "auto"` (the default when a chat request sends tools): `hermes`
    /// (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Hermes, Qwen2.5, Qwen3),
    /// `llama3_json` (an answer of `{"name": ..., "parameters": ...}` objects: Llama 3.1-3.3),
    /// `none` (`"auto"` with tools is refused), or `auto`: `hermes` where the model's chat
    /// template or vocabulary knows `<tool_call>`, `llama3_json` where its template asks for
    /// Llama 3's JSON calls, else `none`. Forced calls (`"required"`, a named function) need no
    /// parser.
    #[arg(long, value_enum, default_value_t = ToolCallParserArg::Auto)]
    pub tool_call_parser: ToolCallParserArg,
    /// A key clients must send as `Authorization: Bearer KEY` on `/v1/` (vLLM's flag; also
    /// read from `PD_NODE_API_KEY`). The cluster token opens `/v1/` too: the gateway sends it,
    /// so a node behind a gateway can require a key its clients do not have. `/health` and
    /// `/metrics` stay open.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// How this node reads a peer's pool: `auto` copies straight from it where UCX maps it into
    /// this process (shared memory on one host), the copy shared with a helper thread, and posts
    /// UCX gets elsewhere; `auto-one-thread` copies without the helper; `get` always posts UCX
    /// gets (for comparison).
    #[arg(long, value_enum, default_value_t = PullViaArg::Auto)]
    pub kv_pull_via: PullViaArg,
    /// Seconds a decode node's request may wait for free blocks to pull into before it fails
    /// and releases the producer's lease.
    #[arg(long, default_value_t = 60.0)]
    pub kv_wait_timeout: f64,
    /// A decode node computes prompts itself instead of pulling fewer than this many tokens.
    #[arg(long, default_value_t = 64)]
    pub kv_recompute_threshold: usize,
    /// Skip the compatibility check of KV handshakes (model, dtype, layout...). Dangerous.
    #[arg(long)]
    pub kv_skip_compat_check: bool,
    /// Producers a decode node may contact, as `host` or `host:port` (IPv6 in brackets),
    /// comma-separated; requests
    /// naming another `remote_host` get a 400. Default: any (set it when clients are untrusted).
    #[arg(long, value_delimiter = ',')]
    pub kv_allowed_peers: Vec<String>,
    /// Behind an Endpoint Picker: a decode node (kv_consumer) that receives
    /// `x-prefiller-host-port` runs the prompt on that prefill node first and decodes with the
    /// KV it pulls from there (llm-d's routing-sidecar protocol). Without it such a request gets
    /// a 400. Under --tls-* the prefill node is asked over the cluster's mutual TLS.
    #[arg(long)]
    pub prefiller_header: bool,
    /// How long the prefill that x-prefiller-host-port names may take, seconds.
    #[arg(long, default_value_t = 300, requires = "prefiller_header")]
    pub prefiller_timeout_secs: u64,
    /// Gateways to register with and stream state to, each `host:port` (or
    /// `http://host:port`): comma-separated, or the flag repeated (also `PD_GATEWAY`, one or a
    /// comma-separated list). The node reports to all of them at once (active-active). A host
    /// that is a DNS name standing for several addresses (a Kubernetes headless Service) is one
    /// gateway per address, looked up again every --gateway-resolve-ms: a gateway that appears
    /// is registered with, one that disappears is left. Under --tls-* the node dials the
    /// address and checks the gateway's certificate against the host as given.
    /// A decode node then also pulls from the producers the gateways registered (the union of
    /// the connected gateways' lists), and with no --kv-allowed-peers only from those. Without
    /// its own --cluster-token the node takes the first token a gateway hands out and leaves a
    /// gateway that hands out another. A gateway refusing the node for good stops reporting
    /// to that gateway; the node exits only once every gateway refused it. The leases a
    /// prefill node grants for a gateway's requests (`x-pd-gateway-id`) are released when
    /// that gateway's stream ends.
    #[arg(
        long,
        value_delimiter = ',',
        env = "PD_GATEWAY",
        value_name = "HOST:PORT"
    )]
    pub gateway: Vec<String>,
    /// Milliseconds between lookups of the --gateway names (addresses are never looked up).
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    pub gateway_resolve_ms: u64,
    /// Cluster secret sent when registering with the gateway (a gateway with a secret refuses
    /// nodes without it). Default: the `PD_CLUSTER_TOKEN` environment variable.
    #[arg(long, value_name = "TOKEN")]
    pub cluster_token: Option<String>,
    /// Secret key of the prefix-cache hash, shared by every node of a deployment and sent to
    /// the gateway at registration (so its hashes match). Without one, block hashes are the
    /// public chain anyone can compute, and crafted prompts could collide with cached blocks.
    /// Default: the `PD_KV_HASH_KEY` environment variable.
    #[arg(long, value_name = "SECRET")]
    pub kv_hash_key: Option<String>,
    /// Mutual TLS with the cluster CA on every hop.
    #[command(flatten)]
    pub tls: pd_tls::TlsArgs,
    /// Traces over OTLP (off without an endpoint).
    #[command(flatten)]
    pub otlp: pd_telemetry::OtlpArgs,
}

/// The environment variable read when `--cluster-token` is absent.
pub const CLUSTER_TOKEN_ENV: &str = "PD_CLUSTER_TOKEN";

/// Environment variable holding the prefix-cache hash key (`--kv-hash-key` wins).
pub const HASH_KEY_ENV: &str = "PD_KV_HASH_KEY";

/// `--kv-role` values (vLLM's spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum KvRoleArg {
    /// Prefill node.
    KvProducer,
    /// Decode node.
    KvConsumer,
    /// Both (deprecated: run one node per role).
    KvBoth,
}

/// `--tool-call-parser` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ToolCallParserArg {
    /// `hermes` where the tokenizer's files know `<tool_call>`, `mistral` where they know
    /// `[TOOL_CALLS]`, `llama3_json` where the template asks for Llama 3's JSON calls, else
    /// `none`.
    Auto,
    /// `<tool_call>` JSON blocks (vLLM's `hermes`).
    Hermes,
    /// Llama 3.x's `{"name": ..., "parameters": ...}` answers (vLLM's `llama3_json`).
    #[value(name = "llama3_json")]
    Llama3Json,
    /// Mistral's `[TOOL_CALLS]` calls (vLLM's `mistral`).
    Mistral,
    /// No parser: `tool_choice: "auto"` with tools is refused.
    None,
}

impl ToolCallParserArg {
    /// The parser this node serves with, for `tokenizer`'s model.
    pub fn resolve(self, tokenizer: &pd_tokenize::Tokenizer) -> Option<crate::ToolCallParser> {
        match self {
            ToolCallParserArg::Auto => crate::ToolCallParser::detect(tokenizer),
            ToolCallParserArg::Hermes => Some(crate::ToolCallParser::Hermes),
            ToolCallParserArg::Llama3Json => Some(crate::ToolCallParser::Llama3Json),
            ToolCallParserArg::Mistral => Some(crate::ToolCallParser::Mistral),
            ToolCallParserArg::None => None,
        }
    }
}

/// `--kv-pull-via` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PullViaArg {
    /// Copy from the mapped pool where UCX maps it (two threads), UCX gets elsewhere.
    Auto,
    /// As `auto`, copying on one thread.
    AutoOneThread,
    /// UCX gets only.
    Get,
}

impl From<PullViaArg> for pd_kv_transfer::PullVia {
    fn from(v: PullViaArg) -> Self {
        match v {
            PullViaArg::Auto => pd_kv_transfer::PullVia::Auto,
            PullViaArg::AutoOneThread => pd_kv_transfer::PullVia::AutoOneThread,
            PullViaArg::Get => pd_kv_transfer::PullVia::Get,
        }
    }
}

/// `--kv-load-failure-policy` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailurePolicyArg {
    /// Fail the request with the transfer error.
    Fail,
    /// Compute the prompt locally.
    Recompute,
}

/// A `serve` argument this build cannot honour.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// `--device cuda` on a build without CUDA.
    #[error("--device cuda: pd-node was built without CUDA support")]
    NoCuda,
    /// `--host`/`--port` do not form an address.
    #[error("invalid listen address {0:?}")]
    BadAddress(String),
    /// A KV flag is inconsistent.
    #[error("{0}")]
    Kv(String),
    /// An HTTP flag is out of range.
    #[error("{0}")]
    Http(String),
}

impl ServeArgs {
    /// The engine configuration these arguments ask for.
    ///
    /// # Errors
    /// [`CliError::NoCuda`] for `--device cuda`.
    pub fn engine_config(&self) -> Result<EngineConfig, CliError> {
        let kv_compute = match self.device {
            Device::Cpu if self.kv_staged => KvCompute::HostStaged,
            Device::Cpu => KvCompute::InPlace,
            #[cfg(feature = "cuda")]
            Device::Cuda => KvCompute::Cuda(self.cuda_device),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => return Err(CliError::NoCuda),
        };
        let defaults = EngineConfig::default();
        Ok(EngineConfig {
            model_dir: self.model.clone(),
            served_model_name: self.served_model_name.clone(),
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            kv_cache_memory: self.kv_cache_memory.unwrap_or(defaults.kv_cache_memory),
            kv_cache_dtype: self.kv_cache_dtype,
            kv_layout: self.kv_layout,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            pool_memory: None,
            kv_lease_duration: self.lease_duration()?,
            kv_max_leased_fraction: self.max_leased_fraction()?,
            kv_retain_after_decode: self.retain_after_decode()?,
            kv_hash_key: self.hash_key(),
            binding_key: crate::kv_params::binding_key(&self.cluster_token()),
            gguf_weights: self.gguf_weights,
            kv_compute,
            dtype: self.dtype,
        })
    }

    /// `--kv-retain-after-decode` as a duration (`None`: off).
    ///
    /// # Errors
    /// [`CliError::Kv`] when it is not a number of seconds ≥ 0.
    pub fn retain_after_decode(&self) -> Result<Option<std::time::Duration>, CliError> {
        std::time::Duration::try_from_secs_f64(self.kv_retain_after_decode)
            .map(|d| Some(d).filter(|d| !d.is_zero()))
            .map_err(|_| {
                CliError::Kv(format!(
                    "--kv-retain-after-decode must be a number of seconds >= 0, got {}",
                    self.kv_retain_after_decode
                ))
            })
    }

    /// `--sse-keep-alive` as a duration.
    ///
    /// # Errors
    /// [`CliError::Http`] when it is not a positive number of seconds.
    pub fn sse_keep_alive(&self) -> Result<std::time::Duration, CliError> {
        match std::time::Duration::try_from_secs_f64(self.sse_keep_alive) {
            Ok(d) if !d.is_zero() => Ok(d),
            _ => Err(CliError::Http(format!(
                "--sse-keep-alive must be a positive number of seconds, got {}",
                self.sse_keep_alive
            ))),
        }
    }

    /// `--kv-lease-duration` as a duration.
    ///
    /// # Errors
    /// [`CliError::Kv`] when it is not a positive number of seconds.
    pub fn lease_duration(&self) -> Result<std::time::Duration, CliError> {
        std::time::Duration::try_from_secs_f64(self.kv_lease_duration)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                CliError::Kv(format!(
                    "--kv-lease-duration must be a positive number of seconds, got {}",
                    self.kv_lease_duration
                ))
            })
    }

    /// `--drain-timeout` as a duration.
    ///
    /// # Errors
    /// [`CliError::Http`] when it is not a number of seconds ≥ 0.
    pub fn drain_timeout(&self) -> Result<std::time::Duration, CliError> {
        std::time::Duration::try_from_secs_f64(self.drain_timeout).map_err(|_| {
            CliError::Http(format!(
                "--drain-timeout must be a number of seconds ≥ 0, got {}",
                self.drain_timeout
            ))
        })
    }

    /// `--kv-max-leased-fraction`, checked.
    ///
    /// # Errors
    /// [`CliError::Kv`] unless 0 < f ≤ 1.
    pub fn max_leased_fraction(&self) -> Result<f64, CliError> {
        let f = self.kv_max_leased_fraction;
        if f > 0.0 && f <= 1.0 {
            Ok(f)
        } else {
            Err(CliError::Kv(format!(
                "--kv-max-leased-fraction must be in (0, 1], got {f}"
            )))
        }
    }

    /// `--kv-board-freshness-ms` as a duration; `None` for 0 (always hear the producer).
    pub fn board_freshness(&self) -> Option<std::time::Duration> {
        (self.kv_board_freshness_ms > 0)
            .then(|| std::time::Duration::from_millis(self.kv_board_freshness_ms))
    }

    /// `--kv-pull-timeout` and `--kv-wait-timeout` as durations.
    ///
    /// # Errors
    /// [`CliError::Kv`] when one is not a positive number of seconds.
    pub fn pull_timeouts(&self) -> Result<(std::time::Duration, std::time::Duration), CliError> {
        let secs = |flag: &str, v: f64| {
            std::time::Duration::try_from_secs_f64(v)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    CliError::Kv(format!(
                        "{flag} must be a positive number of seconds, got {v}"
                    ))
                })
        };
        Ok((
            secs("--kv-pull-timeout", self.kv_pull_timeout)?,
            secs("--kv-wait-timeout", self.kv_wait_timeout)?,
        ))
    }

    /// The P/D role. `kv_both` logs a deprecation warning; a role without `--kv-port` is an
    /// error.
    ///
    /// # Errors
    /// [`CliError::Kv`] for a role without a side channel.
    pub fn role(&self) -> Result<crate::KvRole, CliError> {
        let role = match self.kv_role {
            None => return Ok(crate::KvRole::Standalone),
            Some(KvRoleArg::KvProducer) => crate::KvRole::Producer,
            Some(KvRoleArg::KvConsumer) => crate::KvRole::Consumer,
            Some(KvRoleArg::KvBoth) => {
                tracing::warn!(
                    "--kv-role kv_both is deprecated: run prefill nodes with --kv-role kv_producer \
                     and decode nodes with --kv-role kv_consumer"
                );
                crate::KvRole::Both
            }
        };
        if self.kv_port.is_none() {
            return Err(CliError::Kv(format!(
                "--kv-role {} needs --kv-port (the KV side channel)",
                role.as_str()
            )));
        }
        if self.prefiller_header && role != crate::KvRole::Consumer {
            return Err(CliError::Kv(format!(
                "--prefiller-header is for decode nodes (--kv-role kv_consumer), not {}",
                role.as_str()
            )));
        }
        Ok(role)
    }

    /// The failure policy.
    pub fn failure_policy(&self) -> pd_kv_transfer::FailurePolicy {
        match self.kv_load_failure_policy {
            FailurePolicyArg::Fail => pd_kv_transfer::FailurePolicy::Fail,
            FailurePolicyArg::Recompute => pd_kv_transfer::FailurePolicy::Recompute,
        }
    }

    /// The API key `/v1/` requires (`--api-key`, else `$PD_NODE_API_KEY`, else none), and
    /// whether the cluster token opens `/v1/` too.
    ///
    /// # Errors
    /// [`CliError::Http`] for an empty key, or a key on a node that reports to a gateway
    /// without its own `--cluster-token`: the gateway reaches nodes with the cluster token, and
    /// a token the gateway mints is handed to anyone who can reach its registry, so it cannot
    /// stand in for a key.
    pub fn api_key(&self) -> Result<(Option<String>, bool), CliError> {
        if self.api_key.as_deref() == Some("") {
            return Err(CliError::Http("--api-key must not be empty".into()));
        }
        let key = Some(flag_or_env(
            self.api_key.as_deref(),
            std::env::var("PD_NODE_API_KEY").ok(),
        ))
        .filter(|k| !k.is_empty());
        let own_token = !self.cluster_token().is_empty();
        if key.is_some() && !self.gateway.is_empty() && !own_token {
            return Err(CliError::Http(
                "--api-key behind --gateway needs --cluster-token (or PD_CLUSTER_TOKEN), the same as the gateway's: \
                 the gateway reaches this node with it, and a token the gateway mints itself is handed to anyone who can reach its registry"
                    .into(),
            ));
        }
        Ok((key, own_token))
    }

    /// The cluster token: `--cluster-token`, else `$PD_CLUSTER_TOKEN`, else none (empty).
    pub fn cluster_token(&self) -> String {
        flag_or_env(
            self.cluster_token.as_deref(),
            std::env::var(CLUSTER_TOKEN_ENV).ok(),
        )
    }

    /// The prefix-cache hash key: `--kv-hash-key`, else `$PD_KV_HASH_KEY`, else none (0).
    pub fn hash_key(&self) -> u64 {
        pd_kv_pool::hash_key(&flag_or_env(
            self.kv_hash_key.as_deref(),
            std::env::var(HASH_KEY_ENV).ok(),
        ))
    }

    /// The engine id: `--engine-id` (or `$PD_ENGINE_ID`), else a fresh default.
    pub fn engine_id(&self) -> String {
        self.engine_id
            .clone()
            .filter(|id| !id.is_empty())
            .unwrap_or_else(crate::advertise::default_engine_id)
    }

    /// The hosts this node advertises, bound at `bound`.
    pub fn addresses(&self, bound: std::net::IpAddr) -> crate::advertise::Addresses {
        crate::advertise::Addresses::new(
            self.advertise_host.as_deref(),
            self.kv_host.as_deref(),
            bound,
        )
    }

    /// The address to bind (`--host`, `--port`); host may be an IPv6 literal.
    ///
    /// # Errors
    /// [`CliError::BadAddress`] when the host is not an IP address.
    pub fn listen_addr(&self) -> Result<SocketAddr, CliError> {
        let host = self.host.trim_start_matches('[').trim_end_matches(']');
        let ip = if host == "localhost" {
            "127.0.0.1"
        } else {
            host
        };
        ip.parse::<std::net::IpAddr>()
            .map(|ip| SocketAddr::new(ip, self.port))
            .map_err(|_| CliError::BadAddress(self.host.clone()))
    }
}

/// The flag wins over the environment; neither (or empty) is no token.
fn flag_or_env(flag: Option<&str>, env: Option<String>) -> String {
    match flag {
        Some(t) => t.to_owned(),
        None => env.unwrap_or_default(),
    }
}

mod parse;
#[cfg(test)]
mod tests;
mod tiny;

use parse::parse_gguf_weights;
pub use parse::{parse_kv_dtype, parse_kv_layout, parse_model_dtype, parse_size};
pub use tiny::{Arch, GenTinyModelArgs};

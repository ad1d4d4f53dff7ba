//! `pd-gateway`: serve the gateway, or talk to a running one's admin API.
//!
//! ```sh
//! pd-gateway serve --port 8080 --registry-port 50051 --admin-port 8081 [--policy FILE.wasm]
//! pd-gateway policy push FILE.wasm --admin http://127.0.0.1:8081 --token-file FILE
//! pd-gateway policy new --lang python my-policy
//! pd-gateway policy test FILE.wasm --cases DIR
//! pd-gateway policy replay decisions.jsonl --policy NEW.wasm
//! ```

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use pd_gateway::admin::{self, Admin};
use pd_gateway::admission::Admission;
use pd_gateway::cluster::Cluster;
use pd_gateway::conversation::{Holdings, ResponseStore};
use pd_gateway::decision_log::{DecisionLog, DecisionLogConfig};
use pd_gateway::drain::Drain;
use pd_gateway::lease::LeaseReleaser;
use pd_gateway::metrics::Metrics;
use pd_gateway::proxy::{Gateway, ProxyConfig, Shared};
use pd_gateway::registry::{Registry, RegistryConfig};
use pd_gateway::route::{OnPolicyFailure, Router};
use pd_gateway::static_node::{self, ScrapeTiming, StaticNode};
use pd_policy::{Installed, PolicyEngine, PolicySlot, PolicySpec};
use pingora::server::Server;
use pingora::server::configuration::ServerConf;
use tracing::info;

mod picker;
mod policy_cmd;
mod startup;
mod state;

use startup::{is_loopback, millis, parse_config, random_token, write_secret};

use policy_cmd::{PolicyCommand, policy_local};

#[derive(Parser, Debug)]
#[command(
    name = "pd-gateway",
    version,
    about = "Gateway of a prefill/decode-disaggregated LLM cluster"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the OpenAI API, the node registry and the admin API.
    Serve(Box<ServeArgs>),
    /// Manage the policy of a running gateway.
    #[command(subcommand)]
    Policy(Box<PolicyCommand>),
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Address the OpenAI API listens on (0.0.0.0 or :: for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// OpenAI API port (0: any free port).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Address the node registry listens on; default: `--host`.
    #[arg(long)]
    registry_host: Option<String>,
    /// Node registry (gRPC) port; nodes join with `pd-node serve --gateway HOST:PORT`.
    #[arg(long, default_value_t = 50051)]
    registry_port: u16,
    /// Address the admin API listens on: loopback unless said otherwise, whatever `--host` is
    /// (operators reach it on the gateway's machine, or through a port-forward).
    #[arg(long, default_value = "127.0.0.1")]
    admin_host: String,
    /// Admin API port.
    #[arg(long, default_value_t = 8081)]
    admin_port: u16,
    /// A policy component to serve, watched for changes. Without it the built-in policy serves.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// The built-in policy serving without --policy (also PD_NATIVE_POLICY).
    #[arg(long, env = "PD_NATIVE_POLICY", default_value = "least-loaded", value_parser = ["least-loaded", "round-robin", "prefix-aware"])]
    native_policy: String,
    /// Configuration for the policy, KEY=VALUE (repeatable, or comma-separated; also
    /// PD_POLICY_CONFIG).
    #[arg(
        long = "policy-config",
        env = "PD_POLICY_CONFIG",
        value_delimiter = ','
    )]
    policy_config: Vec<String>,
    /// Deadline of one policy decision, milliseconds.
    #[arg(long, default_value_t = 1.0)]
    policy_deadline_ms: f64,
    /// Memory a policy instance may use, MiB.
    #[arg(long, default_value_t = 16)]
    policy_memory_mib: usize,
    /// Fuel (about one unit per wasm instruction) one policy decision may use.
    #[arg(long, default_value_t = pd_policy::DEFAULT_FUEL)]
    policy_fuel: u64,
    /// Policy instances made ahead of requests, off the request path (0 to 8; 0: each
    /// decision instantiates its policy on the request path). Each holds its memory.
    #[arg(long, default_value_t = pd_policy::DEFAULT_SPARES)]
    policy_spares: usize,
    /// Where compiled policies are cached (a private directory, created 0700). Default:
    /// $PD_CACHE_DIR/policy-cache, else $XDG_CACHE_HOME/pd-serve/policy-cache, else
    /// ~/.cache/pd-serve/policy-cache.
    #[arg(long)]
    policy_cache_dir: Option<PathBuf>,
    /// Compile policies at every load instead of caching them on disk.
    #[arg(long)]
    no_policy_cache: bool,
    /// Sample one decision in this many into the decision log (1: all; 0: none).
    #[arg(long, default_value_t = 100)]
    decision_log_every: u64,
    /// Sampled decisions kept in memory for GET /admin/decisions.
    #[arg(long, default_value_t = 1000)]
    decision_log_keep: usize,
    /// Also append sampled decisions to this JSONL file (rotated to FILE.1).
    #[arg(long)]
    decision_log: Option<PathBuf>,
    /// Size at which the decision log file is rotated, MiB.
    #[arg(long, default_value_t = 64)]
    decision_log_max_mib: u64,
    /// What a failing policy does to a request: the built-in policy decides, or 503.
    #[arg(long, value_enum, default_value_t = OnPolicyFailure::Fallback)]
    on_policy_failure: OnPolicyFailure,
    /// Admin bearer token (also PD_ADMIN_TOKEN). Without one a token is generated and written to
    /// --admin-token-file.
    #[arg(long)]
    admin_token: Option<String>,
    /// Where a generated admin token is written (mode 0600). Default: a file in the temp dir.
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Cluster secret nodes must present (also PD_CLUSTER_TOKEN). Without one the gateway mints
    /// one and hands it to nodes at registration, which it allows only on a loopback registry
    /// (see --insecure-open-registry).
    #[arg(long)]
    cluster_token: Option<String>,
    /// Start a registry that listens beyond loopback without a cluster token: whoever reaches
    /// it can register a node, receive users' prompts and the minted token. For a trusted
    /// network only.
    #[arg(long)]
    insecure_open_registry: bool,
    /// Mutual TLS with the cluster CA on the registry, the requests to nodes and lease
    /// releases: only nodes holding a certificate from the CA register.
    #[command(flatten)]
    tls: pd_tls::TlsArgs,
    /// Serve the OpenAI API and the admin API over TLS with this certificate chain (PEM), for
    /// clients outside the cluster (no client certificate asked for). Needs --client-tls-key.
    #[arg(
        long,
        env = "PD_CLIENT_TLS_CERT",
        value_name = "PEM",
        requires = "client_tls_key"
    )]
    client_tls_cert: Option<PathBuf>,
    /// The private key of --client-tls-cert (PEM).
    #[arg(
        long,
        env = "PD_CLIENT_TLS_KEY",
        value_name = "PEM",
        requires = "client_tls_cert"
    )]
    client_tls_key: Option<PathBuf>,
    /// Clients whose bearer key equals this may send kv_transfer_params; everyone else's are
    /// stripped.
    #[arg(long)]
    trusted_client_token: Option<String>,
    /// An API key clients must send (`Authorization: Bearer KEY`, as the OpenAI SDKs do with
    /// their `api_key`) to use /v1/; repeatable, also PD_API_KEYS (comma-separated). None: /v1/
    /// is open. /health and /metrics stay open; the trusted client token is also a key.
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// A node silent this long leaves the view, milliseconds; out of the view for as long
    /// again without coming back, the requests still waiting on it fail over or end.
    #[arg(long, default_value_t = 3000)]
    node_timeout_ms: u64,
    /// A node that does not register: any server speaking vLLM's OpenAI API and metrics (a
    /// vLLM server, or a pd-node without --gateway), kept in the view by scraping its
    /// /v1/models and /metrics.
    /// `role=prefill|decode|standalone,url=http://HOST:PORT,tokenizer=MODEL_DIR[,engine-id=NAME]
    /// [,bearer-env=VAR|bearer=cluster-token]`; repeatable. Requests to it carry the key in the
    /// gateway's environment variable VAR (the node's --api-key), or the cluster token only when
    /// told `bearer=cluster-token`; by default no key. The gateway pushes it no peer list (a
    /// decode node allows its producers itself, e.g. --kv-allowed-peers).
    #[arg(long = "static-node")]
    static_nodes: Vec<StaticNode>,
    /// How often static nodes are scraped, milliseconds.
    #[arg(long, default_value_t = 250)]
    static_scrape_ms: u64,
    /// Largest body of a generation request (/v1/chat/completions, /v1/completions,
    /// /v1/responses), bytes. A larger `content-length` is refused with 413 before the body is
    /// read; a chunked body is cut with 413 as soon as it passes the limit.
    #[arg(long, default_value_t = 32 << 20)]
    max_body: usize,
    /// Largest body of every other route (the tokenizer endpoints and the rest), bytes; 413
    /// beyond it, as --max-body.
    #[arg(long, default_value_t = 4 << 20)]
    max_small_body: usize,
    /// A request's head (request line and headers) must arrive within this, milliseconds,
    /// counted from the connection's start (from the first byte for the next requests of a
    /// keep-alive connection); else 408 and the connection is closed (slowloris). 0: only the
    /// per-read timeout (60 s).
    #[arg(long, default_value_t = 20_000)]
    header_timeout_ms: u64,
    /// A request's whole body must arrive within this, milliseconds; else 408 and the
    /// connection is closed. 0: only the per-read timeout (60 s).
    #[arg(long, default_value_t = 60_000)]
    body_timeout_ms: u64,
    /// A generation request must end within this, seconds (queueing included): else 504 with
    /// an OpenAI error object, or, once a stream is under way, an error event and the end of
    /// the stream. 0: no limit.
    #[arg(long, default_value_t = 600)]
    request_timeout_secs: u64,
    /// A node must send its answer's head within this, milliseconds, else the request fails
    /// over to the next candidate (or ends with 503 when none is left): a prefill node always,
    /// a decode or whole node when the answer is streamed (a whole answer's head comes with its
    /// end; --request-timeout-secs bounds it). Covers queueing and prefill on the node. 0: no
    /// limit.
    #[arg(long, default_value_t = 120_000)]
    node_first_byte_timeout_ms: u64,
    /// A node must send the next piece of its answer within this, milliseconds, else the
    /// answer ends (504, or a stream's error event). 0: no limit.
    #[arg(long, default_value_t = 120_000)]
    node_idle_timeout_ms: u64,
    /// Client connections open at once on the OpenAI port; one more is closed at once, before
    /// it is read. 0: no limit.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Worker threads of the HTTP server.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Seconds the gateway may take to drain on SIGTERM: it stops accepting connections at
    /// once, lets open requests (streams included) finish, and exits when none is left; past
    /// this it cuts what is still open. A second SIGTERM, or ctrl-c, exits at once.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Retained conversation turns (nodes' `--kv-retain-after-decode`) the gateway indexes at
    /// most; the oldest go first (their leases then just expire on the node).
    #[arg(long, default_value_t = 65_536)]
    conversation_holdings: usize,
    /// Bytes of `/v1/responses` turns kept for `previous_response_id` (least recently used go
    /// first), MiB.
    #[arg(long, default_value_t = 256)]
    responses_store_mib: usize,
    /// How long a `/v1/responses` turn is kept for `previous_response_id`, seconds. Keep it at
    /// least as long as the nodes' `--kv-retain-after-decode`.
    #[arg(long, default_value_t = 3600)]
    responses_ttl_secs: u64,
    /// A directory for the state that outlives the process (also PD_STATE_DIR): stored
    /// responses (within --responses-ttl-secs and --responses-store-mib), the policy slot as
    /// pushed or rolled back, the operator's drains, a minted cluster token. One file,
    /// `state.redb`, private to the gateway (0600); one gateway process at a time. Without it
    /// all of these are lost at exit.
    #[arg(
        long,
        env = "PD_STATE_DIR",
        value_name = "DIR",
        conflicts_with = "state_url"
    )]
    state_dir: Option<PathBuf>,
    /// A PostgreSQL database several gateways share for that state instead (also PD_STATE_URL;
    /// `postgres://USER:PASSWORD@HOST:PORT/DB` or libpq's `key=value` form): each change one
    /// gateway makes (a push, a rollback, a drain, a deleted response) is announced to the
    /// others, which apply it at once. Tables are created if missing (`pd_*`). While the
    /// database does not answer, requests that need no stored state are served; a
    /// `previous_response_id` this gateway does not hold is answered 503.
    #[arg(long, env = "PD_STATE_URL", value_name = "URL", hide_env_values = true)]
    state_url: Option<String>,
    /// Speak TLS to --state-url's database, trusting this CA (PEM) for its certificate, which
    /// must name the URL's host; add `sslmode=require` to the URL to refuse a database without
    /// TLS (the default, `prefer`, falls back to plain when the server offers no TLS). The
    /// database holds the cluster token and every stored response: off loopback, use it.
    #[arg(
        long,
        env = "PD_STATE_TLS_CA",
        value_name = "PEM",
        requires = "state_url"
    )]
    state_tls_ca: Option<PathBuf>,
    /// Generation and tokenizer requests served at once, the front door's and the Endpoint
    /// Picker's together; beyond it they wait for a slot (0: no limit). A completions request
    /// listing several prompts takes as many slots.
    #[arg(long, default_value_t = pd_gateway::admission::DEFAULT_MAX_CONCURRENT)]
    max_concurrent_requests: usize,
    /// Requests that may wait for a slot; beyond it a request is refused at once (429).
    #[arg(long, default_value_t = 1024)]
    max_queued_requests: usize,
    /// How long a request waits for a slot before it is refused (429), milliseconds.
    #[arg(long, default_value_t = 30_000)]
    queue_timeout_ms: u64,
    #[command(flatten)]
    picker: picker::PickerArgs,
    #[command(flatten)]
    otlp: pd_telemetry::OtlpArgs,
}

/// A policy engine with the on-disk cache when one can be had (a warning, not an error,
/// when not: it only saves compile time).
fn engine_with_cache(dir: Option<PathBuf>) -> anyhow::Result<PolicyEngine> {
    if let Some(dir) = dir {
        match PolicyEngine::with_disk_cache(&dir) {
            Ok(e) => return Ok(e),
            Err(e) => tracing::warn!(error = %e, "compiled policies will not be cached on disk"),
        }
    }
    PolicyEngine::new().context("starting the policy engine")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs (RUST_LOG); `serve` also exports traces with --otlp-endpoint.
    let traces = match &cli.command {
        Command::Serve(args) => Some((&args.otlp, pd_telemetry::Service::named("pd-gateway"))),
        Command::Policy(_) => None,
    };
    let filter = "info,pingora_core=warn,pingora_proxy=warn";
    if let Err(e) = pd_telemetry::install(filter, traces) {
        eprintln!("pd-gateway: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Serve(args) => serve(*args).map(|()| ExitCode::SUCCESS),
        Command::Policy(cmd) => policy_local(*cmd),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pd-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Whether `host` (an address or a name) means this machine only: every address it resolves
/// to is loopback. A name that does not resolve is not.
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let cache_dir = if args.no_policy_cache {
        None
    } else {
        args.policy_cache_dir
            .clone()
            .or_else(pd_policy::default_cache_dir)
    };
    let engine = Arc::new(engine_with_cache(cache_dir)?);
    let mut spec = PolicySpec {
        config: parse_config(&args.policy_config)?,
        deadline: Duration::from_secs_f64(args.policy_deadline_ms / 1000.0),
        memory_limit: args.policy_memory_mib << 20,
        fuel: args.policy_fuel,
        spares: args.policy_spares,
        ..PolicySpec::default()
    };
    let log = DecisionLog::new(DecisionLogConfig {
        every: args.decision_log_every,
        keep: args.decision_log_keep,
        file: args.decision_log.clone(),
        max_bytes: args.decision_log_max_mib << 20,
    })
    .context("opening the decision log")?;
    let initial = match &args.policy {
        Some(path) => {
            let bytes =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            spec.name = path
                .file_stem()
                .map_or("policy".into(), |s| s.to_string_lossy().into_owned());
            Installed::Wasm(
                engine
                    .load(&bytes, spec.clone())
                    .with_context(|| format!("loading the policy {}", path.display()))?,
            )
        }
        None => Installed::Native {
            name: args.native_policy.clone(),
        },
    };
    let log = Arc::new(log);
    let state = state::open(
        args.state_dir.as_deref(),
        args.state_url.as_deref(),
        args.state_tls_ca.as_deref(),
    )?;
    let keeper = state
        .clone()
        .map(|st| pd_gateway::state::policy::PolicyKeeper::new(st, args.policy.clone()));
    let slot = match &keeper {
        Some(k) => state::slot(k, &engine, initial, args.policy.as_deref())?,
        None => PolicySlot::new(initial),
    };
    let router = Arc::new(Router::new(
        slot,
        args.on_policy_failure,
        metrics.clone(),
        log.clone(),
    ));
    let cluster = Arc::new(Cluster::default());

    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let admin_token = args.admin_token.clone().or_else(|| env("PD_ADMIN_TOKEN"));
    let (admin_token, token_file) = match admin_token {
        Some(t) => (t, None),
        None => {
            let t = random_token();
            let path = args.admin_token_file.clone().unwrap_or_else(|| {
                std::env::temp_dir().join(format!("pd-gateway-admin-{}.token", std::process::id()))
            });
            write_secret(&path, &t)?;
            (t, Some(path))
        }
    };
    let configured_cluster_token = args
        .cluster_token
        .clone()
        .or_else(|| env("PD_CLUSTER_TOKEN"));
    let token_required = configured_cluster_token.is_some();
    let mut api_keys = args.api_keys.clone();
    api_keys.extend(
        env("PD_API_KEYS")
            .iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned),
    );
    if api_keys.iter().any(|k| k.is_empty()) {
        anyhow::bail!("--api-key must not be empty");
    }
    if args.trusted_client_token.as_deref() == Some("") {
        anyhow::bail!("--trusted-client-token must not be empty");
    }
    if api_keys.is_empty() {
        info!("/v1/ is open: no --api-key given");
    } else {
        info!(keys = api_keys.len(), "/v1/ requires an API key");
    }
    let cluster_token = match (configured_cluster_token, &state) {
        (Some(t), _) => t,
        // Minted once: nodes keep the token across the gateway's restarts.
        (None, Some(st)) => state::cluster_token(st, random_token())?,
        (None, None) => random_token(),
    };
    if let Some(st) = &state {
        state::drains(st, &cluster)?;
    }

    let bind = |host: &str, port: u16| -> anyhow::Result<TcpListener> {
        let l = TcpListener::bind((host.trim_start_matches('[').trim_end_matches(']'), port))
            .with_context(|| format!("binding {host}:{port}"))?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    let tls = args.tls.load().context("--tls-cert/--tls-key/--tls-ca")?;
    // The client port's TLS: pingora reads the files itself; the admin API's acceptor is ours.
    let client_tls = match (&args.client_tls_cert, &args.client_tls_key) {
        (Some(cert), Some(key)) => {
            let admin =
                pd_tls::server_only(cert, key).context("--client-tls-cert/--client-tls-key")?;
            let (cert, key) = (cert.display().to_string(), key.display().to_string());
            Some((cert, key, admin))
        }
        _ => None,
    };
    let client_scheme = if client_tls.is_some() {
        "https"
    } else {
        "http"
    };
    let registry_host = args.registry_host.as_deref().unwrap_or(&args.host);
    if !token_required
        && tls.is_none()
        && !args.insecure_open_registry
        && !is_loopback(registry_host)
    {
        anyhow::bail!(
            "the node registry would listen on {registry_host} without a cluster token: anyone \
             who reaches it could register a node, receive users' prompts and the minted token. \
             Give --cluster-token (or PD_CLUSTER_TOKEN) or mutual TLS (--tls-cert, --tls-key, \
             --tls-ca), listen on loopback (--registry-host 127.0.0.1), or pass \
             --insecure-open-registry on a trusted network"
        );
    }
    let registry_listener = bind(registry_host, args.registry_port)?;
    let admin_listener = bind(&args.admin_host, args.admin_port)?;
    let picker_listener = args.picker.bind()?;
    // pingora binds its own listener: find a free port first when asked for any.
    let http_addr: SocketAddr = {
        let l = bind(&args.host, args.port)?;
        l.local_addr()?
    };
    let registry_addr = registry_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    // Every request to a registered node carries the cluster token as its bearer key: a node
    // started with `--api-key` takes it, so its clients need not share the gateway's way in.
    // A static node gets only the key its spec names (`bearer-env=`), never the token unless
    // told (`bearer=cluster-token`).
    pd_gateway::upstream::bearer(&cluster_token)
        .context("the cluster token is not a valid header value")?;
    // Static nodes are scraped from the control runtime: a client (and pool) of its own.
    let scrape_http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()
        .context("building the HTTP client")?;
    if !args.static_nodes.is_empty()
        && args.static_scrape_ms.saturating_mul(2) >= args.node_timeout_ms
    {
        bail!(
            "--static-scrape-ms {} must be under half of --node-timeout-ms {}, or static nodes fall out of the view between scrapes",
            args.static_scrape_ms,
            args.node_timeout_ms
        );
    }
    for (i, a) in args.static_nodes.iter().enumerate() {
        if let Some(b) = args.static_nodes[..i]
            .iter()
            .find(|b| b.engine_id == a.engine_id || b.http_addr == a.http_addr)
        {
            bail!(
                "--static-node `{}` at {} and `{}` at {}: each static node needs its own engine id and address",
                b.engine_id,
                b.http_addr,
                a.engine_id,
                a.http_addr
            );
        }
    }
    let static_nodes = args
        .static_nodes
        .iter()
        .map(|n| {
            let bearer = n
                .bearer
                .header(&cluster_token)
                .with_context(|| format!("--static-node `{}`", n.engine_id))?;
            Ok(((n.clone(), bearer), n.load_tokenizer()?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // A scrape's two requests together stay under half the node timeout, so a node that
    // answers slowly is not swept between two scrapes that reached it.
    let scrape_timing = ScrapeTiming {
        interval: Duration::from_millis(args.static_scrape_ms.max(10)),
        timeout: Duration::from_millis((args.node_timeout_ms / 4).clamp(50, 2000)),
    };
    let static_cluster = cluster.clone();
    let gateway_id = format!("pd-gateway-{}", random_token());
    let http = pd_gateway::upstream::NodeClient::new(tls.as_ref()).with_gateway_id(&gateway_id);
    let drain = Arc::new(Drain::default());
    let shared = Arc::new(Shared {
        cluster: cluster.clone(),
        router: router.clone(),
        metrics: metrics.clone(),
        http,
        leases: LeaseReleaser::new(metrics.clone(), &cluster_token, tls.clone()),
        holdings: Arc::new(Holdings::new(args.conversation_holdings)),
        responses: Arc::new(ResponseStore::new(
            args.responses_store_mib << 20,
            Duration::from_secs(args.responses_ttl_secs),
        )),
        state: state.clone(),
        unsaved: Default::default(),
        admission: Admission::new(
            args.max_concurrent_requests,
            args.max_queued_requests,
            Duration::from_millis(args.queue_timeout_ms),
        ),
        drain: drain.clone(),
        config: ProxyConfig {
            max_body: args.max_body,
            max_small_body: args.max_small_body,
            body_timeout: millis(args.body_timeout_ms),
            request_timeout: millis(args.request_timeout_secs.saturating_mul(1000)),
            node_first_byte_timeout: millis(args.node_first_byte_timeout_ms),
            node_idle_timeout: millis(args.node_idle_timeout_ms),
            settled_at: Instant::now() + Duration::from_millis(args.node_timeout_ms * 2),
            trusted_client_token: args.trusted_client_token.clone(),
            api_keys,
        },
    });
    let picker_addr = match picker_listener {
        Some(l) => Some(picker::spawn(
            l,
            Gateway(shared.clone()),
            picker::Serving {
                max_body: args.max_body,
                threads: args.threads,
                tls: tls.clone(),
            },
        )?),
        None => None,
    };
    let admin = Admin {
        token: admin_token.into(),
        engine: engine.clone(),
        router: router.clone(),
        cluster: cluster.clone(),
        defaults: spec.clone(),
        keeper: keeper.clone(),
        state: state.clone(),
    };
    // A shared store: apply what the other gateways change.
    let follow = keeper.clone().zip(state.clone()).and_then(|(keeper, st)| {
        let changes = st.changes()?;
        let follower = pd_gateway::state::follow::Follower {
            keeper,
            engine: engine.clone(),
            router: router.clone(),
            cluster: cluster.clone(),
            responses: shared.responses.clone(),
        };
        Some((st.clone().listener(), follower.follow(changes)))
    });
    let sweep = state.clone().map(|st| {
        let ttl = Duration::from_secs(args.responses_ttl_secs);
        let sweep = state::sweep(st, ttl, (args.responses_store_mib as u64) << 20);
        let unsaved = pd_gateway::proxy::write_unsaved_turns(shared.clone());
        async { tokio::join!(sweep, unsaved) }
    });

    // The control plane (registry, admin API, policy file watcher) runs on its own runtime, so
    // request load never delays a node's registration or an operator's push.
    let registry = Registry::new(
        cluster,
        metrics.clone(),
        RegistryConfig {
            gateway_id,
            cluster_token,
            token_required,
            node_timeout: Duration::from_millis(args.node_timeout_ms.max(100)),
            tls,
        },
    )
    .with_holdings(shared.holdings.clone());
    let watch = args.policy.clone().map(|p| (p, spec));
    let admin_tls = client_tls.as_ref().map(|(_, _, acceptor)| acceptor.clone());
    let drain_timeout = args.drain_timeout;
    std::thread::Builder::new()
        .name("pd-gateway-control".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("pd-gateway: control runtime: {e}");
                    std::process::exit(1);
                }
            };
            rt.block_on(async move {
                let registry_listener = tokio::net::TcpListener::from_std(registry_listener)
                    .expect("a bound std listener converts");
                let admin_listener = tokio::net::TcpListener::from_std(admin_listener)
                    .expect("a bound std listener converts");
                tokio::spawn(async move {
                    if let Err(e) = registry
                        .serve(registry_listener, std::future::pending())
                        .await
                    {
                        eprintln!("pd-gateway: registry stopped: {e}");
                        std::process::exit(1);
                    }
                });
                for (node, tokenizer) in static_nodes {
                    tokio::spawn(static_node::follow(
                        static_cluster.clone(),
                        node,
                        tokenizer,
                        scrape_http.clone(),
                        scrape_timing,
                    ));
                }
                let drain_timeout = Duration::from_secs(drain_timeout);
                tokio::spawn(async move {
                    pd_gateway::drain::exit_when_drained(&drain, drain_timeout, || {
                        if !log.flush(Duration::from_secs(2)) {
                            tracing::warn!("the decision log's last lines may not be in its file");
                        }
                        pd_telemetry::shutdown();
                    })
                    .await;
                });
                if let Some(sweep) = sweep {
                    tokio::spawn(sweep);
                }
                if let Some((listener, follow)) = follow {
                    if let Some(l) = listener {
                        tokio::spawn(l);
                    }
                    tokio::spawn(follow);
                }
                if let Some((path, spec)) = watch {
                    tokio::spawn(admin::watch_policy_file(admin.clone(), path, spec));
                }
                tokio::spawn(async move {
                    let served = match admin_tls {
                        Some(acceptor) => {
                            match pd_tls::TlsListener::new(admin_listener, acceptor, "admin API") {
                                Ok(l) => axum::serve(l, admin::routes(admin)).await,
                                Err(e) => Err(e),
                            }
                        }
                        None => axum::serve(admin_listener, admin::routes(admin)).await,
                    };
                    if let Err(e) = served {
                        eprintln!("pd-gateway: admin API stopped: {e}");
                        std::process::exit(1);
                    }
                });
                // Tell the caller where everything is once the OpenAI port accepts connections.
                for _ in 0..500 {
                    if tokio::net::TcpStream::connect(http_addr).await.is_ok() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "pd-gateway registry on {registry_addr}");
                let _ = writeln!(out, "pd-gateway admin on {client_scheme}://{admin_addr}");
                if let Some(a) = picker_addr {
                    let _ = writeln!(out, "pd-gateway ext_proc on {a}");
                }
                if let Some(f) = &token_file {
                    let _ = writeln!(out, "pd-gateway admin token in {}", f.display());
                }
                let _ = writeln!(out, "pd-gateway listening on {client_scheme}://{http_addr}");
                let _ = out.flush();
                std::future::pending::<()>().await;
            });
        })
        .context("starting the control thread")?;

    let conf = ServerConf {
        threads: args.threads.max(1),
        // SIGTERM: pingora stops accepting at once and waits this long before it drops what is
        // still open; `drain::exit_when_drained` exits sooner, once nothing is.
        grace_period_seconds: Some(args.drain_timeout),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut service = pd_gateway::proxy::service(
        &server.configuration,
        Gateway(shared),
        pd_gateway::proxy::front::FrontLimits {
            max_connections: args.max_connections,
            header_timeout: millis(args.header_timeout_ms),
        },
    );
    let tls = client_tls
        .as_ref()
        .map(|(c, k, _)| (c.as_str(), k.as_str()));
    pd_gateway::proxy::listen(&mut service, &http_addr.to_string(), tls)
        .map_err(|e| anyhow::anyhow!("--client-tls-cert/--client-tls-key: {e}"))?;
    server.add_service(service);
    info!(%http_addr, %registry_addr, %admin_addr, "pd-gateway starting");
    server.run_forever();
}

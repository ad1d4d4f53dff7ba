//! `pd-node-sim`: start a fleet of simulated nodes reporting to one or more gateways, and
//! serve until SIGINT or SIGTERM. A benchmark instrument (see the library's docs).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use pd_node_sim::{Fleet, FleetConfig, Role, Timing};

/// Simulated P/D nodes for benchmarks: real registration, real protocol, modelled timings.
#[derive(Debug, Parser)]
#[command(name = "pd-node-sim", version)]
struct Args {
    /// A gateway's registry address (`host:port`); repeat or comma-separate for several.
    #[arg(long, required = true, value_delimiter = ',')]
    gateway: Vec<String>,
    /// Prefill nodes (`kv_producer`).
    #[arg(long, default_value_t = 0)]
    prefill: usize,
    /// Decode nodes (`kv_consumer`).
    #[arg(long, default_value_t = 0)]
    decode: usize,
    /// Standalone nodes (no KV role).
    #[arg(long, default_value_t = 0)]
    standalone: usize,
    /// The served model's name.
    #[arg(long, default_value = "sim")]
    model: String,
    /// Address every node binds and registers.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// A model directory whose tokenizer the nodes register (default: a byte-level one).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Prompt tokens per second (0: instant).
    #[arg(long, default_value_t = 20_000.0)]
    prefill_tokens_per_s: f64,
    /// Milliseconds per output token after the first.
    #[arg(long, default_value_t = 5.0)]
    tpot_ms: f64,
    /// KV pull bandwidth, MB/s (0: instant).
    #[arg(long, default_value_t = 1_000.0)]
    pull_mb_per_s: f64,
    /// KV bytes per prompt token.
    #[arg(long, default_value_t = 4096)]
    kv_bytes_per_token: u32,
    /// Every phase instant (overrides the three rates): measures only the router.
    #[arg(long)]
    instant: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV blocks per node.
    #[arg(long, default_value_t = 4096)]
    blocks: u64,
    /// Longest prompt plus output.
    #[arg(long, default_value_t = 8192)]
    max_model_len: u32,
    /// Seconds a lease nobody pulls is held.
    #[arg(long, default_value_t = 30)]
    lease_secs: u64,
    /// Send a state message on every change poll (the registry's highest load).
    #[arg(long)]
    churn: bool,
    /// Milliseconds between state messages when nothing changed.
    #[arg(long, default_value_t = 1000)]
    state_interval_ms: u64,
    /// Milliseconds between reads of the counters.
    #[arg(long, default_value_t = 100)]
    change_poll_ms: u64,
    /// Cluster token (default: the gateway's).
    #[arg(long, env = "PD_CLUSTER_TOKEN", default_value = "")]
    cluster_token: String,
    /// Engine ids are `{prefix}-{p|d|s}-{i}`.
    #[arg(long, default_value = "sim")]
    id_prefix: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let tokenizer = match &args.tokenizer {
        Some(dir) => pd_node_sim::tokenizer_files(dir),
        None => pd_node_sim::byte_level_tokenizer(),
    }
    .context("the tokenizer")?;
    let timing = if args.instant {
        Timing {
            kv_bytes_per_token: args.kv_bytes_per_token,
            ..Timing::INSTANT
        }
    } else {
        Timing {
            prefill_tokens_per_s: args.prefill_tokens_per_s,
            tpot: Duration::from_secs_f64(args.tpot_ms.max(0.0) / 1e3),
            pull_mb_per_s: args.pull_mb_per_s,
            kv_bytes_per_token: args.kv_bytes_per_token,
        }
    };
    let total = args.prefill + args.decode + args.standalone;
    anyhow::ensure!(
        total > 0,
        "no nodes: give --prefill, --decode or --standalone"
    );
    let config = FleetConfig {
        roles: vec![
            (Role::Producer, args.prefill),
            (Role::Consumer, args.decode),
            (Role::Standalone, args.standalone),
        ],
        id_prefix: args.id_prefix,
        model: args.model,
        host: args.host,
        gateways: args.gateway,
        timing,
        tokenizer,
        block_size: args.block_size,
        total_blocks: args.blocks,
        max_model_len: args.max_model_len,
        lease_duration: Duration::from_secs(args.lease_secs),
        churn: args.churn,
        state_interval: Duration::from_millis(args.state_interval_ms),
        change_poll: Duration::from_millis(args.change_poll_ms),
        cluster_token: args.cluster_token,
        hash_key: 0,
    };
    let started = Instant::now();
    let fleet = Fleet::start(config).await.context("starting the fleet")?;
    println!("pd-node-sim: {total} nodes listening");
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let registered = loop {
        tokio::select! {
            _ = tick.tick() => {
                if fleet.registered() == total {
                    break true;
                }
            }
            _ = shutdown_signal() => break false,
        }
    };
    if registered {
        println!(
            "pd-node-sim: {total} nodes registered in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        shutdown_signal().await;
    }
    fleet.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

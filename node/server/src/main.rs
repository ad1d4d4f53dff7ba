//! `pd-node`: an engine node serving the OpenAI API. See `pd-node --help`.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use std::sync::Arc;

use pd_node::cli::{Cli, Command, GenTinyModelArgs, ServeArgs};
use pd_node::{AllowedPeers, Disagg, KvRole, PullConfig};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let threads = match &cli.command {
        Command::Serve(args) => args.threads,
        Command::GenTinyModel(_) => None,
    };
    pin_compute_threads(threads);
    keep_freed_memory();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pd-node: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// candle sizes its thread pool from `RAYON_NUM_THREADS` and asks for it on every CPU matmul;
/// without the variable that reads `/proc/cpuinfo` each time (~40 µs a call, ~16% of a decode
/// step here). Sets it once: to `--threads` when given, else (when unset) to the machine's
/// parallelism.
fn pin_compute_threads(threads: Option<u16>) {
    // SAFETY (both blocks): called first thing in `main` (after parsing the arguments, which
    // starts no thread), before any other thread exists, so nothing reads the environment
    // concurrently.
    match threads {
        Some(n) => unsafe {
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
            // candle's barrier pool reads this one first: the flag wins over it too.
            std::env::remove_var("CANDLE_NUM_THREADS");
        },
        None if std::env::var_os("RAYON_NUM_THREADS").is_some() => {}
        None => {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
        }
    }
}

/// UCX offers peers every interface it finds; a node that advertises an address (or binds a
/// specific one, loopback included) has UCX offer that address's interface only, so KV moves
/// where the operator said, and interfaces that come and go on the machine (containers' veths)
/// are never listed (one that vanishes between UCX's start and its worker fails the worker).
/// `None` when the operator set `UCX_NET_DEVICES` (theirs wins) or no interface holds it.
fn ucx_net_devices(args: &ServeArgs) -> Option<String> {
    if std::env::var_os("UCX_NET_DEVICES").is_some() {
        return None;
    }
    let host = args.advertise_host.as_deref().unwrap_or(&args.host);
    pd_node::advertise::ucx_net_device(host)
}

/// Every step allocates and frees the same activation buffers (a 512-token prefill's are
/// 1–6 MB each, ~15 per layer). With glibc's defaults, buffers above its mmap threshold are
/// fresh mappings and freed heap tops are trimmed, so the kernel faults in and zeroes those
/// pages again on every step. Raising the mmap threshold to its maximum (32 MiB: the pool and
/// the weights are allocated once, above it) and never trimming keeps freed buffers in the
/// process for the next step. Resident memory stays at the peak of a step, which is what a
/// serving process holds anyway. `PD_KEEP_FREED_MEMORY=0` leaves glibc's defaults.
fn keep_freed_memory() {
    if std::env::var_os("PD_KEEP_FREED_MEMORY").is_some_and(|v| v == "0") {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets allocator parameters; called first thing in `main`, before
    // any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(mut args) => {
            // Logs (RUST_LOG), and traces with --otlp-endpoint, under the node's role and id
            // (a default id is drawn once, here).
            let engine_id = args.engine_id();
            args.engine_id = Some(engine_id.clone());
            let service = pd_telemetry::Service {
                name: service_name(args.role().unwrap_or_default()),
                instance: Some(&engine_id),
            };
            pd_telemetry::install("info", Some((&args.otlp, service)))?;
            let served = serve(&args);
            // The spans still queued leave before the process does.
            pd_telemetry::shutdown();
            served
        }
        Command::GenTinyModel(args) => {
            pd_telemetry::install("info", None)?;
            gen_tiny_model(&args)
        }
    }
}

/// The `service.name` a node's spans are exported under, unless `--otlp-service-name` says.
fn service_name(role: KvRole) -> &'static str {
    match role {
        KvRole::Producer => "pd-node-prefill",
        KvRole::Consumer => "pd-node-decode",
        KvRole::Standalone | KvRole::Both => "pd-node",
    }
}

fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    let mut config = args.engine_config()?;
    let addr = args.listen_addr()?;
    let role = args.role()?;
    let ucx = match args.kv_port {
        Some(_) => {
            let devices = ucx_net_devices(args);
            if let Some(dev) = devices
                .clone()
                .or_else(|| std::env::var("UCX_NET_DEVICES").ok())
            {
                tracing::info!(ucx_net_devices = %dev, "UCX offers peers these network devices");
            }
            let ucx = pd_node::kv_side_channel::UcxPool::new(devices.as_deref())
                .context("starting UCX")?;
            config.pool_memory = Some(ucx.pool_memory());
            Some(ucx)
        }
        None => None,
    };
    let engine = pd_engine::Engine::load(&config)
        .with_context(|| format!("loading model from {}", config.model_dir.display()))?;
    let engine = pd_engine::EngineHandle::spawn(engine).context("starting the engine thread")?;
    let info = engine.info().clone();
    tracing::info!(
        model = %info.model_name,
        max_model_len = info.max_model_len,
        num_blocks = info.num_blocks,
        block_size = info.block_size,
        compute_threads = %std::env::var("CANDLE_NUM_THREADS")
            .or_else(|_| std::env::var("RAYON_NUM_THREADS"))
            .unwrap_or_default(),
        "engine ready"
    );

    if let Some(ucx) = &ucx
        && info.kv_path != "in-place"
    {
        // Peers read the host transfer pool; the model computes on the staged pool.
        tracing::info!(
            kv_path = info.kv_path,
            ucx_registers_gpu_memory = ucx.registers_cuda_memory(),
            upload_while_pulling = args.kv_upload_while_pulling,
            "KV moves through the host transfer pool (device-to-device transfer is not built, \
             whether or not this UCX could register GPU memory)"
        );
    }
    let engine_id = args.engine_id();
    let addresses = args.addresses(addr.ip());
    // New at every start, random (never 0, which names no epoch): peers and the gateway tell
    // a restarted node from the old one, even one restarted within the same clock tick.
    let epoch = rand::random::<u64>() | 1;
    // The TCP data port beside the side channel (`pd_kv_transfer::tcp_data`): consumers that
    // reach this node only over TCP read leased blocks through it.
    let data_listener = match &ucx {
        Some(_) => {
            let l = std::net::TcpListener::bind((addr.ip(), args.kv_data_port))
                .with_context(|| format!("binding a KV data port on {}", addr.ip()))?;
            l.set_nonblocking(true)?;
            Some(l)
        }
        None => None,
    };
    let data_port = match &data_listener {
        Some(l) => l.local_addr()?.port(),
        None => 0,
    };
    let kv_service = match &ucx {
        Some(ucx) => Some(
            ucx.service(engine.clone(), engine_id.clone(), epoch, data_port)
                .context("starting the KV side channel")?,
        ),
        None => None,
    };
    // Every node with a side channel can pull: a decode node the prompt's KV from a prefill
    // node, any node an earlier turn's KV from the node that retained it (reverse pull).
    // Mutual TLS with the cluster CA on every hop (`--tls-*`): this node's HTTP API, its side
    // channel and data port, its pulls from peers and its registration with the gateway.
    let tls = args.tls.load().context("--tls-cert/--tls-key/--tls-ca")?;
    let prefiller = if args.prefiller_header {
        let timeout = std::time::Duration::from_secs(args.prefiller_timeout_secs.max(1));
        Some(Arc::new(
            pd_node::prefiller::Prefiller::new(timeout, tls.as_ref())
                .context("the prefill client")?,
        ))
    } else {
        None
    };
    let puller = match &ucx {
        Some(ucx) => Some(
            ucx.puller(info.kv_layout.block_bytes(), args.kv_pull_via.into())
                .context("starting the KV puller")?
                .with_tls(tls.clone()),
        ),
        None => None,
    };
    let lease_duration = args.lease_duration()?;
    let sse_keep_alive = args.sse_keep_alive()?;
    let tool_parser = args.tool_call_parser.resolve(engine.tokenizer());
    tracing::info!(
        tool_call_parser = tool_parser.map_or("none", pd_node::ToolCallParser::name),
        "tool calls the model writes itself (tool_choice \"auto\") are read by this parser"
    );
    // The cluster token the side channel requires and sends: the configured one, replaced by
    // the one the gateway hands out at registration (see below).
    let (cluster_token, token_rx) =
        tokio::sync::watch::channel(Some(args.cluster_token()).filter(|t| !t.is_empty()));
    let http_token = token_rx.clone();
    let (api_key, token_opens_v1) = args.api_key()?;
    let transfer_metrics = Arc::new(pd_kv_transfer::TransferMetrics::new());
    let (pull_timeout, wait_timeout) = args.pull_timeouts()?;
    let mut pull = PullConfig {
        engine_id: engine_id.clone(),
        policy: args.failure_policy(),
        recompute_threshold: args.kv_recompute_threshold,
        skip_compat_check: args.kv_skip_compat_check,
        renew_interval: lease_duration / 6,
        pull_timeout,
        wait_timeout,
        board_freshness: args.board_freshness(),
        upload_while_pulling: args.kv_upload_while_pulling,
        allowed_peers: AllowedPeers::fixed(args.kv_allowed_peers.clone()),
        cluster_token: token_rx.clone(),
        tls: tls.clone(),
    };
    if role != KvRole::Standalone {
        tracing::info!(role = role.as_str(), engine_id = %engine_id, "P/D role");
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")?;
    let drain_timeout = args.drain_timeout()?;
    runtime.block_on(async move {
        // SIGTERM drains the node (`pd_node::drain`): `drain_at` says until when, once it began.
        let drain = Arc::new(pd_node::drain::Drain::default());
        let (drain_tx, drain_at) = tokio::sync::watch::channel(None::<tokio::time::Instant>);
        let (kv_stop_tx, kv_stop_rx) = tokio::sync::watch::channel(false);
        let kv_stop = async move {
            let mut rx = kv_stop_rx;
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        let mut side_channel = None;
        if let (Some(ucx), Some(l)) = (&ucx, data_listener) {
            let server = ucx
                .data_server(
                    engine.clone(),
                    pull.cluster_token.clone(),
                    transfer_metrics.side_channel_refused.clone(),
                )
                .context("starting the KV data port")?;
            let server = match &tls {
                Some(tls) => server.with_tls(tls),
                None => server,
            };
            let listener = tokio::net::TcpListener::from_std(l).context("the KV data port")?;
            let mut stop = kv_stop_tx.subscribe();
            tokio::spawn(Arc::new(server).serve(listener, async move {
                let _ = stop.wait_for(|s| *s).await;
            }));
        }
        if let (Some(service), Some(port)) = (kv_service, args.kv_port) {
            let (token_rx, refused) = (
                pull.cluster_token.clone(),
                transfer_metrics.side_channel_refused.clone(),
            );
            let kv_addr = std::net::SocketAddr::new(addr.ip(), port);
            let kv_listener = tokio::net::TcpListener::bind(kv_addr)
                .await
                .with_context(|| format!("binding {kv_addr}"))?;
            let kv_local = kv_listener.local_addr().context("reading the KV address")?;
            side_channel = Some(kv_local);
            let scheme = pd_tls::scheme(tls.as_ref());
            println!("pd-node kv side channel on {scheme}://{kv_local}");
            let grpc_tls = tls.as_ref().map(pd_tls::ClusterTls::grpc_server);
            tokio::spawn(async move {
                // No Nagle: a lease reply is small and on a decode node's path to its first
                // token (tonic sets TCP_NODELAY only on listeners it binds itself).
                let incoming = tonic::transport::server::TcpIncoming::from(kv_listener)
                    .with_nodelay(Some(true));
                let service = service.into_guarded_server(token_rx, refused);
                let mut server = tonic::transport::Server::builder();
                if let Some(tls) = grpc_tls {
                    server = match server.tls_config(tls) {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::error!(error = %e, "KV side channel: TLS");
                            return;
                        }
                    };
                }
                if let Err(e) = server
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, kv_stop)
                    .await
                {
                    tracing::error!(error = %e, "KV side channel stopped");
                }
            });
        }
        let mut stdout = std::io::stdout().lock();
        writeln!(
            stdout,
            "pd-node listening on {}://{local}",
            pd_tls::scheme(tls.as_ref())
        )
        .context("writing to stdout")?;
        stdout.flush().context("flushing stdout")?;
        drop(stdout);
        // The turns this node retains, reported to every gateway (not only the one that
        // relayed the answer).
        let retained_turns = (!args.gateway.is_empty()
            && args.report_retained_turns
            && args.retain_after_decode()?.is_some())
        .then(|| Arc::new(pd_report::RetainedTurns::new()));
        let reporter = match args.gateway.is_empty() {
            true => None,
            false => {
                let registration = pd_report::Registration {
                    engine_id: engine_id.clone(),
                    epoch,
                    role: pd_node::report::role(role),
                    model: info.model_name.clone(),
                    block_size: info.block_size as u32,
                    compat_hash: pd_kv_transfer::CompatInfo::new(
                        info.model_name.clone(),
                        &info.kv_layout,
                    )
                    .with_fingerprint(info.fingerprint.clone())
                    .hash(),
                    http_addr: addresses.http(local),
                    kv_side_channel_addr: side_channel.map(|kv| addresses.kv(kv)),
                    grpc_addr: None,
                    num_blocks: info.num_blocks as u64,
                    max_model_len: info.max_model_len as u32,
                    cluster_token: args.cluster_token(),
                    kv_hash_key: args.hash_key(),
                    kv_bytes_per_token: u32::try_from(
                        info.kv_layout.block_bytes() / info.block_size.max(1),
                    )
                    .unwrap_or(u32::MAX),
                    takes_prompt_token_ids: true,
                    tokenizer_files: engine.tokenizer().files().clone(),
                    tokenizer_fingerprint: engine.tokenizer().fingerprint(),
                };
                let source = Arc::new(
                    pd_node::report::EngineSource::new(
                        engine.clone(),
                        transfer_metrics.pull_bytes_per_second.clone(),
                        drain.clone(),
                    )
                    .with_turns(retained_turns.clone()),
                );
                let gateway_left = transfer_metrics
                    .leases
                    .with_label_values(&[pd_node::report::GATEWAY_LEFT_EVENT]);
                let gateways = pd_node::report::report_to_gateways(
                    pd_node::report::GatewaysConfig {
                        entries: args.gateway.clone(),
                        resolve_every: std::time::Duration::from_millis(
                            args.gateway_resolve_ms.max(1),
                        ),
                        tls: tls.clone(),
                    },
                    registration,
                    source,
                    engine.clone(),
                    cluster_token,
                    gateway_left,
                )
                .with_context(|| format!("--gateway {}", args.gateway.join(",")))?;
                // From now on a decode node pulls from the gateways' registered peers (and
                // only from those when --kv-allowed-peers is empty).
                pull.allowed_peers.gateway = Some(gateways.peers());
                Some(gateways)
            }
        };
        // What KV handoffs name as `remote_host`: the advertised host, else where the gateway
        // saw this node register from.
        let observed = reporter.as_ref().map(pd_report::Gateways::observed_host);
        let side_channel = side_channel.map(|kv| (addresses.remote_host(observed), kv.port()));
        let disagg = Arc::new(
            Disagg::new(
                role,
                &engine,
                &engine_id,
                epoch,
                side_channel,
                puller,
                pull,
                transfer_metrics,
            )
            .with_retained_turns(retained_turns),
        );
        let options = pd_node::HttpOptions {
            sse_keep_alive,
            tool_parser,
            api_key,
            cluster_token: token_opens_v1.then_some(http_token),
            drain: drain.clone(),
            tls: tls.clone(),
            prefiller: prefiller.clone(),
        };
        tokio::spawn(drain_on_signal(
            engine.clone(),
            drain.clone(),
            drain_timeout,
            drain_tx,
        ));
        let http_stop = {
            let mut at = drain_at.clone();
            async move {
                let _ = at.wait_for(Option::is_some).await;
            }
        };
        let cut = {
            let mut at = drain_at.clone();
            async move {
                let deadline = at.wait_for(Option::is_some).await.ok().and_then(|d| *d);
                tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await;
            }
        };
        let refused = async {
            match &reporter {
                Some(r) => r.refused().await,
                None => std::future::pending().await,
            }
        };
        let served = tokio::select! {
            served = pd_node::serve_with(listener, engine.clone(), disagg, options, http_stop) => {
                served.context("serving HTTP")
            }
            () = cut => {
                tracing::warn!("drain timeout: closing the requests still open");
                Ok(())
            }
            why = refused => {
                let _ = kv_stop_tx.send(true);
                return Err(anyhow::anyhow!("{why}"));
            }
        };
        let deadline = (*drain_at.borrow()).unwrap_or_else(tokio::time::Instant::now);
        pd_node::drain::leases_pulled(&engine, deadline).await;
        let _ = kv_stop_tx.send(true);
        if let Some(r) = reporter {
            r.shutdown().await;
        }
        served
    })?;
    tracing::info!("shut down");
    Ok(())
}

/// Waits for ctrl-c or SIGTERM, then drains (see `pd_node::drain`): the flag the gateway sees,
/// a quiet engine (at most until `timeout` from the signal), then `drain_at` set to that
/// deadline, which stops the HTTP server and bounds what follows. A second signal exits at once.
async fn drain_on_signal(
    engine: pd_engine::EngineHandle,
    drain: Arc<pd_node::drain::Drain>,
    timeout: std::time::Duration,
    drain_at: tokio::sync::watch::Sender<Option<tokio::time::Instant>>,
) {
    shutdown_signal().await;
    let deadline = tokio::time::Instant::now() + timeout;
    drain.begin();
    tracing::info!(
        timeout_s = timeout.as_secs_f64(),
        "draining: no new work from the gateway; finishing requests and unpulled leases (a second signal exits at once)"
    );
    tokio::spawn(async {
        shutdown_signal().await;
        tracing::warn!("second signal: exiting without draining");
        std::process::exit(1);
    });
    pd_node::drain::engine_quiet(&engine, pd_node::drain::SETTLE, deadline).await;
    let _ = drain_at.send(Some(deadline));
}

/// Resolves on ctrl-c or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sig) => {
                sig.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutdown signal received");
}

fn gen_tiny_model(args: &GenTinyModelArgs) -> anyhow::Result<()> {
    let spec = args.spec();
    match args.gguf {
        None => pd_model::tiny::generate(&spec, &args.out),
        Some(t) => pd_model::tiny::generate_gguf(&spec, &args.out, t),
    }
    .with_context(|| format!("writing a tiny model to {}", args.out.display()))?;
    println!("wrote tiny {:?} model to {}", args.arch, args.out.display());
    Ok(())
}

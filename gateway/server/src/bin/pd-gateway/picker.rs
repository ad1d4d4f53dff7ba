//! `--ext-proc-port`: the Endpoint Picker (`pd_gateway::picker`) beside the OpenAI front door,
//! over the same registry, view, policy slot and decision log, on a runtime of its own (picks
//! tokenize and run the policy: request load, kept off the control plane's runtime). Under
//! `--tls-*` it speaks the cluster's mutual TLS, as the registry does.

use std::net::{SocketAddr, TcpListener};

use anyhow::Context;
use clap::Args;
use pd_gateway::picker::Picker;
use pd_gateway::proxy::Gateway;

/// The Endpoint Picker's flags.
#[derive(Args, Debug)]
pub(crate) struct PickerArgs {
    /// Serve the Endpoint Picker (Envoy's ext_proc v3, the Gateway API Inference Extension's
    /// protocol) and gRPC health on this port; off when not given. The data plane must send
    /// request bodies BUFFERED (docs/operations.md has an Envoy configuration). Under --tls-*
    /// it speaks the cluster's mutual TLS: the data plane presents a certificate of the CA.
    #[arg(long)]
    ext_proc_port: Option<u16>,
    /// Address the Endpoint Picker listens on.
    #[arg(long, default_value = "127.0.0.1")]
    ext_proc_host: String,
}

impl PickerArgs {
    /// Binds the picker's port, when one is asked for.
    pub(crate) fn bind(&self) -> anyhow::Result<Option<TcpListener>> {
        let Some(port) = self.ext_proc_port else {
            return Ok(None);
        };
        let host = self
            .ext_proc_host
            .trim_start_matches('[')
            .trim_end_matches(']');
        let l = TcpListener::bind((host, port))
            .with_context(|| format!("binding the Endpoint Picker to {host}:{port}"))?;
        l.set_nonblocking(true)?;
        Ok(Some(l))
    }
}

/// How the picker serves.
pub(crate) struct Serving {
    /// Largest request body (`--max-body`).
    pub(crate) max_body: usize,
    /// Its runtime's threads.
    pub(crate) threads: usize,
    /// The cluster's mutual TLS (`--tls-*`): data planes must present a certificate of the CA.
    pub(crate) tls: Option<pd_tls::ClusterTls>,
}

/// Serves the picker on `listener` from a thread of its own; returns its address.
pub(crate) fn spawn(
    listener: TcpListener,
    gateway: Gateway,
    serving: Serving,
) -> anyhow::Result<SocketAddr> {
    let Serving {
        max_body,
        threads,
        tls,
    } = serving;
    let tls = tls.as_ref().map(pd_tls::ClusterTls::grpc_server);
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name("pd-picker")
        .enable_all()
        .build()
        .context("the Endpoint Picker's runtime")?;
    std::thread::Builder::new()
        .name("pd-gateway-picker".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        eprintln!("pd-gateway: Endpoint Picker: {e}");
                        std::process::exit(1);
                    }
                };
                if let Err(e) = Picker::new(gateway, max_body).serve(listener, tls).await {
                    eprintln!("pd-gateway: Endpoint Picker stopped: {e}");
                    std::process::exit(1);
                }
            });
        })
        .context("starting the Endpoint Picker's thread")?;
    Ok(addr)
}

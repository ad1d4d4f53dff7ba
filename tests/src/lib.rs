//! The harness of the cluster tests: real `pd-gateway` and `pd-node` processes, started from the
//! workspace's own build, talking over real sockets (HTTP, the gRPC registry, the KV side
//! channel, UCX), driven the way an operator and a client drive them.
//!
//! - [`bins`]: where the binaries and the guest policies are (next to the test executable).
//! - [`process`]: a child process whose address is read from its stdout and which is killed
//!   by a `Drop` guard; its stderr goes to a log file printed when a test fails.
//! - [`hosts`]: several machines on one (network, mount, UTS and IPC namespaces on a bridge),
//!   for tests that cross hosts; a process on a host may run as PID 1, as in a container.
//! - [`cluster`]: [`cluster::TestCluster::start`] brings up a gateway and its nodes (every port
//!   `:0`) and waits until the gateway lists every node; admin calls and metrics scrapes.
//! - [`chaos`]: the chaos suite: a cluster on hosts behind Envoy, a mixed load checked against
//!   a reference node, one fault at a time, and a row per scenario of what survived.
//! - [`envoy`]: a real Envoy balancing over several gateways, or asking an Endpoint Picker.
//! - [`vllm_router`]: vLLM's router (PyPI's `vllm-router`) driving our prefill and decode nodes.
//! - [`k8s`]: the Kubernetes manifests (`examples/k8s`) rendered and read as a kubelet starts
//!   their containers, for the harness to start on its hosts.
//! - [`metrics`]: Prometheus text parsing and label-filtered sums.
//! - [`openai`]: requests over plain HTTP, JSON and SSE answers read into one [`openai::Answer`].
//! - [`otlp`]: a real OTLP/gRPC trace receiver, keeping the spans the processes export.
//! - [`load`]: streaming clients looping requests in the background, for changes under load.
//! - [`postgres`]: a real PostgreSQL server for the gateways' shared state.
//! - [`prometheus`]: a real Prometheus scraping a cluster, and `promtool`, for the dashboard
//!   and alert rules of `examples/observability`.
//! - [`python`]: the unmodified `openai` Python package as a client (`tests/clients/`).
//!
//! This crate does not start anything in-process: every server under test is a separate process
//! built by `cargo build -p pd-node -p pd-gateway`. Tests never bind fixed ports and never sleep
//! without a condition: every wait polls a condition under a deadline ([`eventually`]).
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod bins;
pub mod chaos;
pub mod cluster;
pub mod envoy;
pub mod hosts;
pub mod k8s;
pub mod load;
pub mod metrics;
pub mod openai;
pub mod otlp;
pub mod postgres;
pub mod process;
pub mod prometheus;
pub mod python;
pub mod vllm_router;

use std::time::{Duration, Instant};

/// The value after `name` on the command line (`--requests 400`), parsed; `default` when the
/// flag is absent or does not parse. For the examples (benchmarks) built on this crate.
pub fn flag<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Polls `check` every 20 ms until it holds; panics naming `what` after `timeout`. Returns how
/// long it took.
pub async fn eventually(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

//! The registry at scale: many simulated nodes reporting their state every 100 ms to one
//! gateway — what it costs the gateway (CPU, memory) and how fresh its view stays.
//!
//! ```sh
//! cargo build --release -p pd-gateway
//! BENCH_NODES=1000 cargo bench -p pd-gateway --bench registry
//! ```
//!
//! A `pd-node-sim` fleet in this process (half prefill nodes with a side channel, half decode
//! nodes), each node on its own ports and registry stream. Rows: registering the fleet (until
//! the gateway lists every node routable); the fleet idle (a state message per node per second);
//! every node's state changing on every 100 ms poll (ten messages per node per second); then
//! freshness: a node's `waiting` set to a new value, timed until `/admin/nodes` shows it
//! (polled every 10 ms; the reporter's 100 ms poll is part of what is measured).
//! Gateway CPU is read from `/proc` (user + system, all threads), over `BENCH_SECONDS`
//! (default 10) per row.

#[path = "common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{cpu_seconds, pct, rss_mib};
use pd_node_sim::{Role, Timing};

fn raise_fd_limit() {
    let want = libc::rlimit {
        rlim_cur: 65_536,
        rlim_max: 65_536,
    };
    // SAFETY: setrlimit reads the struct; failure (not root) leaves the limit as it was.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) };
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    raise_fd_limit();
    let n: usize = std::env::var("BENCH_NODES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let window = Duration::from_secs(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10),
    );
    let gw = common::gateway(&["--node-timeout-ms", "5000"]);
    let pid = gw.proc.pid();
    let c = reqwest::Client::new();
    let rss0 = rss_mib(pid);
    let t = Instant::now();
    let cpu0 = cpu_seconds(pid);
    let fleet = common::fleet(
        &gw.registry,
        vec![(Role::Producer, n / 2), (Role::Consumer, n - n / 2)],
        "sim",
        Timing::INSTANT,
        |_| {},
    )
    .await;
    gw.wait_nodes(&c, n, Duration::from_secs(300)).await;
    let joined = t.elapsed();
    let join_cpu = cpu_seconds(pid) - cpu0;
    println!(
        "| nodes | row | gateway CPU (% of one core) | gateway RSS | state messages/s | note |"
    );
    println!("|---:|---|---:|---:|---:|---|");
    println!(
        "| {n} | registering (all listed and routable) | {:.0} CPU-ms in {:.2} s | {:.0} MiB | – | {:.0} KiB per node |",
        join_cpu * 1e3,
        joined.as_secs_f64(),
        rss_mib(pid),
        (rss_mib(pid) - rss0) * 1024.0 / n as f64,
    );
    // Let registration traffic settle (peer lists, first resyncs).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let measure = |label: &'static str, rate: f64| {
        let fleet_churn = label;
        async move {
            let cpu0 = cpu_seconds(pid);
            tokio::time::sleep(window).await;
            let cpu = cpu_seconds(pid) - cpu0;
            println!(
                "| {n} | {fleet_churn} | {:.1}% | {:.0} MiB | {:.0} | {:.1} µs per message |",
                cpu / window.as_secs_f64() * 100.0,
                rss_mib(pid),
                rate,
                cpu / (rate * window.as_secs_f64()) * 1e6,
            );
        }
    };
    measure("idle: a state message per node per second", n as f64).await;
    for node in &fleet.nodes {
        node.load.set_churn(true);
    }
    measure("every state poll a change: every 100 ms", n as f64 * 10.0).await;

    // Freshness, under the churning load.
    let mut ms = Vec::new();
    for k in 0..30u64 {
        let node = &fleet.nodes[(k as usize * 37) % n];
        let marker = 1000 + k;
        let t = Instant::now();
        node.load.set_waiting(marker);
        loop {
            let seen =
                gw.nodes(&c).await.into_iter().any(|v| {
                    v["engine_id"] == node.id.engine_id.as_str() && v["waiting"] == marker
                });
            if seen {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the change never showed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    println!(
        "| {n} | freshness: a change until `/admin/nodes` shows it | p50 {:.0} ms, p99 {:.0} ms | – | – | 30 changes; includes the node's 100 ms poll |",
        pct(&ms, 0.5),
        pct(&ms, 0.99)
    );
    fleet.shutdown().await;
}

//! Many slow streams through one gateway: its memory per open stream and CPU per token relayed.
//!
//! ```sh
//! cargo build --release -p pd-gateway
//! BENCH_STREAMS=10000 cargo bench -p pd-gateway --bench streams
//! ```
//!
//! A `pd-node-sim` fleet in this process (one prefill and two decode nodes; prefill and pull
//! instant, one output token a second), the gateway on the P/D route. `BENCH_STREAMS` clients
//! each open a streamed chat request (`max_tokens` 150) over their own connection, in a ramp of
//! 1 000 a second; once all are open and relaying, the gateway's resident memory against its
//! idle figure gives the memory per stream, and its CPU over `BENCH_SECONDS` (default 10)
//! against the tokens the clients received gives the CPU per token relayed. Every stream must
//! end complete (`[DONE]`).

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{cpu_seconds, rss_mib};
use futures::StreamExt;
use pd_node_sim::{Role, Timing};
use serde_json::json;

const MAX_TOKENS: usize = 150;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let want = libc::rlimit {
        rlim_cur: 200_000,
        rlim_max: 200_000,
    };
    // SAFETY: setrlimit reads the struct; failure leaves the limit as it was.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) };
    let streams: usize = std::env::var("BENCH_STREAMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let window = Duration::from_secs(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10),
    );
    let gw = common::gateway(&[
        "--max-connections",
        "0",
        "--max-concurrent-requests",
        "0",
        "--threads",
        "2",
        "--node-idle-timeout-ms",
        "120000",
    ]);
    let pid = gw.proc.pid();
    let timing = Timing {
        prefill_tokens_per_s: 0.0,
        tpot: Duration::from_secs(1),
        pull_mb_per_s: 0.0,
        kv_bytes_per_token: 4096,
    };
    let fleet = common::fleet(
        &gw.registry,
        vec![(Role::Producer, 1), (Role::Consumer, 2)],
        "sim",
        timing,
        |c| c.lease_duration = Duration::from_secs(120),
    )
    .await;
    let probe = reqwest::Client::new();
    gw.wait_nodes(&probe, 3, Duration::from_secs(20)).await;
    // Warm the gateway's paths with a few short requests, then take the idle figure.
    for i in 0..20 {
        let r = probe
            .post(format!("{}/v1/chat/completions", gw.http))
            .json(&json!({"model": "sim", "max_tokens": 1,
                "messages": [{"role": "user", "content": format!("warm {i}")}]}))
            .send()
            .await
            .expect("warm-up");
        assert!(r.status().is_success());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_idle = rss_mib(pid);

    let tokens = Arc::new(AtomicU64::new(0));
    let open = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(streams);
    // HTTP/1.1: every open stream holds a connection of its own, as separate clients' would.
    let streaming = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    for i in 0..streams {
        // A ramp of 1 000 new streams a second.
        let due = Duration::from_millis(i as u64);
        if let Some(wait) = due.checked_sub(t0.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let client = streaming.clone();
        let url = format!("{}/v1/chat/completions", gw.http);
        let (tokens, open, done, failed) =
            (tokens.clone(), open.clone(), done.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": "sim", "max_tokens": MAX_TOKENS, "stream": true,
                "messages": [{"role": "user", "content": format!("stream {i}")}]});
            let r = match client.post(url).json(&body).send().await {
                Ok(r) => r,
                Err(e) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    eprintln!("stream {i}: not sent: {:?}", std::error::Error::source(&e));
                    return;
                }
            };
            if !r.status().is_success() {
                failed.fetch_add(1, Ordering::Relaxed);
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                eprintln!("stream {i}: answered {status}: {text}");
                return;
            }
            open.fetch_add(1, Ordering::Relaxed);
            let mut body = r.bytes_stream();
            let mut tail = Vec::new();
            while let Some(Ok(chunk)) = body.next().await {
                let n = chunk.windows(10).filter(|w| w == b"\"content\":").count();
                tokens.fetch_add(n as u64, Ordering::Relaxed);
                tail.extend_from_slice(&chunk);
                if tail.len() > 64 {
                    tail.drain(..tail.len() - 64);
                }
            }
            if tail.windows(6).any(|w| w == b"[DONE]") {
                done.fetch_add(1, Ordering::Relaxed);
            } else {
                failed.fetch_add(1, Ordering::Relaxed);
                eprintln!("stream {i}: cut before [DONE]");
            }
        }));
    }
    // All open and relaying.
    while open.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed) < streams as u64 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ramp = t0.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_open = rss_mib(pid);
    let (cpu0, tok0) = (cpu_seconds(pid), tokens.load(Ordering::Relaxed));
    tokio::time::sleep(window).await;
    let (cpu, relayed) = (
        cpu_seconds(pid) - cpu0,
        tokens.load(Ordering::Relaxed) - tok0,
    );
    let rss_peak = rss_mib(pid).max(rss_open);
    for t in tasks {
        let _ = t.await;
    }
    println!(
        "| streams | ramp | gateway RSS idle → open | per stream | tokens relayed/s | gateway CPU | CPU per token | complete | failed |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {streams} | {:.1} s | {:.0} → {:.0} MiB | {:.1} KiB | {:.0} | {:.0}% of a core | {:.1} µs | {} | {} |",
        ramp.as_secs_f64(),
        rss_idle,
        rss_peak,
        (rss_peak - rss_idle) * 1024.0 / streams as f64,
        relayed as f64 / window.as_secs_f64(),
        cpu / window.as_secs_f64() * 100.0,
        cpu / relayed.max(1) as f64 * 1e6,
        done.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
    );
    fleet.shutdown().await;
}

//! Routers at saturation on the same simulated nodes: CPU per request, requests/s per router
//! core, latency — pd-gateway against vLLM's `vllm-router` (P/D mode) and SGLang's `smg`
//! (one-node route), in one run.
//!
//! ```sh
//! bash scripts/build-policies.sh && cargo build --release -p pd-gateway
//! PD_BENCH_ROUTERS=$(bash scripts/routers.sh) PD_POLICIES_DIR=$PWD/target/policies \
//!   cargo bench -p pd-gateway --bench saturation
//! ```
//!
//! Nodes: `pd-node-sim` fleets in this process with every phase instant (the routers' own
//! work is all there is to measure): one prefill and one decode node of model `sim`, one
//! standalone node of model `sim-one`, all registered with the gateway. The gateway runs the
//! WASM least-loaded policy (`PD_POLICIES_DIR`; the native one without it). Each row: `clients`
//! closed-loop clients for `BENCH_SECONDS` (default 8) after a 1 s warm-up; the router's CPU is
//! read from `/proc` (user + system, all threads), so the load generator's and the nodes' CPU
//! are not counted. A P/D row checks that the nodes really split (P handed off, D pulled).
//! Without `PD_BENCH_ROUTERS` the anchors are skipped.

#[path = "common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{GatewayProc, Proc, closed_loop, cpu_seconds, pct, start_quiet, wait_http};
use pd_node_sim::{Fleet, Role, Timing};
use serde_json::{Value, json};

#[derive(Clone, Copy, PartialEq)]
enum Route {
    Split,
    One,
}

struct Router {
    name: &'static str,
    proc: Option<Proc>,
    pid: u32,
    base: String,
}

fn prompt(i: usize) -> String {
    // ~64 tokens of the byte-level tokenizer, different per request (no prefix hits).
    let mut s = format!("{i:08} ");
    while s.len() < 64 {
        s.push_str("abcdefghij klmnopqrst ");
    }
    s.truncate(64);
    s
}

fn body(route: Route, stream: bool) -> Arc<dyn Fn(usize) -> Value + Send + Sync> {
    Arc::new(move |i| match route {
        Route::Split => json!({"model": "sim", "prompt": prompt(i), "max_tokens": 4,
            "stream": stream}),
        Route::One => json!({"model": "sim-one", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": prompt(i)}]}),
    })
}

fn path(route: Route) -> &'static str {
    match route {
        Route::Split => "/v1/completions",
        Route::One => "/v1/chat/completions",
    }
}

fn sum(fleet: &Fleet, role: Role, f: impl Fn(&pd_node_sim::Served) -> u64) -> u64 {
    fleet
        .nodes
        .iter()
        .filter(|n| n.id.role == role)
        .map(|n| f(&n.served))
        .sum()
}

#[allow(clippy::too_many_arguments)]
async fn row(
    c: &reqwest::Client,
    r: &Router,
    route: Route,
    stream: bool,
    clients: usize,
    window: Duration,
    pd: &Fleet,
) {
    let url = format!("{}{}", r.base, path(route));
    let b = body(route, stream);
    closed_loop(c, &url, clients, Duration::from_secs(1), Arc::clone(&b)).await;
    let handoffs = sum(pd, Role::Producer, |s| s.handoffs.load(Ordering::Relaxed));
    let pulls = sum(pd, Role::Consumer, |s| s.pulls.load(Ordering::Relaxed));
    let cpu0 = cpu_seconds(r.pid);
    let load = closed_loop(c, &url, clients, window, b).await;
    let cpu = cpu_seconds(r.pid) - cpu0;
    let split = if route == Route::Split {
        let h = sum(pd, Role::Producer, |s| s.handoffs.load(Ordering::Relaxed)) - handoffs;
        let p = sum(pd, Role::Consumer, |s| s.pulls.load(Ordering::Relaxed)) - pulls;
        format!("{h} / {p}")
    } else {
        "–".into()
    };
    let rps = load.ok as f64 / load.elapsed.as_secs_f64();
    println!(
        "| {} | {} | {} | {clients} | {:.0} | {:.2} | {:.2} | {:.0} | {:.0} | {split} | {} |",
        if route == Route::Split {
            "P/D"
        } else {
            "one node"
        },
        if stream { "yes" } else { "no" },
        r.name,
        rps,
        pct(&load.ms, 0.5),
        pct(&load.ms, 0.99),
        cpu / load.ok.max(1) as f64 * 1e6,
        load.ok as f64 / cpu.max(1e-9),
        match &load.first_error {
            Some(e) => format!(
                "{} ({})",
                load.errors,
                e.chars().take(80).collect::<String>()
            ),
            None => "0".into(),
        },
    );
}

fn policy_args() -> Vec<String> {
    match std::env::var_os("PD_POLICIES_DIR") {
        Some(dir) => {
            let wasm = PathBuf::from(dir).join("least-loaded.wasm");
            vec!["--policy".into(), wasm.display().to_string()]
        }
        None => vec![],
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let window = Duration::from_secs(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(8),
    );
    let clients: Vec<usize> = std::env::var("BENCH_CLIENTS")
        .unwrap_or_else(|_| "16,64".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let policy = policy_args();
    let mut extra: Vec<&str> = policy.iter().map(String::as_str).collect();
    extra.extend([
        "--max-concurrent-requests",
        "0",
        "--decision-log-every",
        "0",
    ]);
    let gw: GatewayProc = common::gateway(&extra);
    let pd = common::fleet(
        &gw.registry,
        vec![(Role::Producer, 1), (Role::Consumer, 1)],
        "sim",
        Timing::INSTANT,
        |_| {},
    )
    .await;
    let one = common::fleet(
        &gw.registry,
        vec![(Role::Standalone, 1)],
        "sim-one",
        Timing::INSTANT,
        |_| {},
    )
    .await;
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .expect("a client");
    gw.wait_nodes(&c, 3, Duration::from_secs(20)).await;
    let url = |n: &pd_node_sim::SimNode| format!("http://{}", n.id.http);
    let (p, d, s) = (url(&pd.nodes[0]), url(&pd.nodes[1]), url(&one.nodes[0]));
    let gateway = Router {
        name: "pd-gateway",
        pid: gw.proc.pid(),
        proc: None,
        base: gw.http.clone(),
    };
    let mut split_routers = vec![gateway];
    let mut one_routers = vec![Router {
        name: "pd-gateway",
        pid: gw.proc.pid(),
        proc: None,
        base: gw.http.clone(),
    }];
    if let Some(dir) = std::env::var_os("PD_BENCH_ROUTERS").map(PathBuf::from) {
        let (vp, mp) = (common::free_port(), common::free_port());
        let vr = start_quiet(
            &dir.join("vllm-router"),
            &[
                "--host",
                "127.0.0.1",
                "--port",
                &vp.to_string(),
                "--vllm-pd-disaggregation",
                "--prefill",
                &p,
                "--decode",
                &d,
                "--kv-connector",
                "nixl",
                "--policy",
                "round_robin",
                "--prometheus-port",
                &mp.to_string(),
                "--log-level",
                "error",
                "--max-concurrent-requests",
                "4096",
            ],
        );
        let (sp, smp) = (common::free_port(), common::free_port());
        let smg = start_quiet(
            &dir.join("smg"),
            &[
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                &sp.to_string(),
                "--worker-urls",
                &s,
                "--backend",
                "openai",
                "--policy",
                "round_robin",
                "--prometheus-port",
                &smp.to_string(),
                "--log-level",
                "error",
                "--history-backend",
                "none",
            ],
        );
        let vbase = format!("http://127.0.0.1:{vp}");
        let sbase = format!("http://127.0.0.1:{sp}");
        wait_http(&c, &format!("{vbase}/health"), Duration::from_secs(60)).await;
        wait_http(&c, &format!("{sbase}/health"), Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        split_routers.push(Router {
            name: "vllm-router",
            pid: vr.pid(),
            proc: Some(vr),
            base: vbase,
        });
        one_routers.push(Router {
            name: "smg",
            pid: smg.pid(),
            proc: Some(smg),
            base: sbase,
        });
    }
    println!(
        "| route | stream | router | clients | req/s | p50 ms | p99 ms | router CPU µs/req | req/s per router core | handoffs / pulls | errors |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---|---|");
    for &n in &clients {
        for stream in [false, true] {
            for r in &split_routers {
                row(&c, r, Route::Split, stream, n, window, &pd).await;
            }
            for r in &one_routers {
                row(&c, r, Route::One, stream, n, window, &pd).await;
            }
        }
    }
    drop(
        split_routers
            .into_iter()
            .map(|r| r.proc)
            .collect::<Vec<_>>(),
    );
    drop(one_routers);
    pd.shutdown().await;
    one.shutdown().await;
}

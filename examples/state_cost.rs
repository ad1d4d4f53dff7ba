//! What the gateway's durable state costs per request: `/v1/responses` conversations through
//! three gateways in front of the same standalone node, one keeping responses in memory only,
//! one with the embedded store (`--state-dir`), one with the shared PostgreSQL store
//! (`--state-url`, a real server from Debian's package started here), requests interleaved
//! gateway by gateway in one run.
//!
//! ```sh
//! cargo build --release -p pd-node -p pd-gateway --bins
//! cargo run --release -p pd-cluster-tests --example state_cost [-- --conversations 100 --turns 4]
//! ```
//!
//! Each conversation is `--turns` requests chained by `previous_response_id` (4 output tokens,
//! greedy, not streamed), so every turn after the first reads the stored history and every turn
//! stores itself: through the durable stores, written before the answer's end goes out. Per
//! gateway: client latency p50/p99 and the gateway process's CPU time (utime + stime from
//! `/proc`) over its requests. Results go to BENCHMARKS.md ("Durable state") by hand.

use std::time::{Duration, Instant};

use pd_cluster_tests::cluster::{ClusterSpec, Gateway, Role, TestCluster, args};
use pd_cluster_tests::flag;
use pd_cluster_tests::postgres::PgServer;
use pd_cluster_tests::process::WorkDir;
use serde_json::{Value, json};

/// The process's CPU time so far, in clock ticks (10 ms).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime), counted from 1 over the whole line; `after` starts at 3.
    f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0u64)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0u64)
}

struct Row {
    name: &'static str,
    http: String,
    pid: u32,
    latencies: Vec<Duration>,
    ticks: u64,
    parent: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let conversations = flag("--conversations", 100);
    let turns = flag("--turns", 4);
    let work = WorkDir::new("state-cost");
    let pg = PgServer::start(work.path());
    let c = TestCluster::start(
        "state-cost-cluster",
        ClusterSpec {
            standalone: 1,
            ..ClusterSpec::default()
        },
    )
    .await;
    let node = c.role(Role::Standalone).next().expect("a node");
    let node_flag = format!(
        "role=standalone,url={},tokenizer={},engine-id=s0",
        node.http,
        c.model.display()
    );
    let state_dir = work.path().join("state");
    let embedded = Gateway::start(
        c.dir(),
        &args(&[
            "--static-node",
            &node_flag,
            "--state-dir",
            state_dir.to_str().expect("UTF-8"),
        ]),
    );
    let shared = Gateway::start(
        c.dir(),
        &args(&["--static-node", &node_flag, "--state-url", &pg.url]),
    );
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .expect("a client");
    let mut rows = vec![
        ("memory", &c.gateway),
        ("embedded (redb)", &embedded),
        ("shared (PostgreSQL)", &shared),
    ]
    .into_iter()
    .map(|(name, g)| Row {
        name,
        http: g.http.clone(),
        pid: g.proc.pid(),
        latencies: Vec::new(),
        ticks: 0,
        parent: None,
    })
    .collect::<Vec<_>>();
    // Every gateway lists the node before the clock starts.
    for r in &rows {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let body = json!({"model": "tiny", "input": "warm up", "max_output_tokens": 1});
            let ok = client
                .post(format!("{}/v1/responses", r.http))
                .json(&body)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            assert!(Instant::now() < deadline, "{} did not come up", r.name);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for conv in 0..conversations {
        for turn in 0..turns {
            for r in &mut rows {
                let mut body = json!({"model": "tiny", "max_output_tokens": 4, "temperature": 0,
                    "input": format!("Conversation {conv}, turn {turn}: say something.")});
                if turn > 0 {
                    body["previous_response_id"] = json!(r.parent.clone());
                }
                let before = cpu_ticks(r.pid);
                let t = Instant::now();
                let resp = client
                    .post(format!("{}/v1/responses", r.http))
                    .json(&body)
                    .send()
                    .await
                    .expect("a request");
                assert_eq!(resp.status().as_u16(), 200, "{}", r.name);
                let v: Value = resp.json().await.expect("JSON");
                r.latencies.push(t.elapsed());
                r.ticks += cpu_ticks(r.pid) - before;
                r.parent = v["id"].as_str().map(str::to_owned);
            }
        }
    }
    println!(
        "{conversations} conversations x {turns} turns per gateway, interleaved; 4 output tokens"
    );
    println!("| state | requests | p50 ms | p99 ms | gateway CPU per request µs |");
    println!("|---|---:|---:|---:|---:|");
    for r in &mut rows {
        r.latencies.sort();
        let n = r.latencies.len();
        let q = |p: f64| r.latencies[((n as f64 * p) as usize).min(n - 1)].as_secs_f64() * 1e3;
        println!(
            "| {} | {n} | {:.2} | {:.2} | {:.0} |",
            r.name,
            q(0.5),
            q(0.99),
            r.ticks as f64 * 1e4 / n as f64
        );
    }
}

//! KV pulls between two hosts against the link's own figures, in one run.
//!
//! ```sh
//! apt-get install -y iperf3   # once
//! PD_MODEL_GGUF=$(bash scripts/fetch-model.sh) cargo run -p pd-cluster-tests --example hosts_pull \
//!     [-- --tokens 512,4096 --repeat 3]
//! ```
//!
//! Two harness hosts (`pd_cluster_tests::hosts`: own address, hostname, boot id and `/dev/shm`, so
//! UCX sees two machines) joined by veth links through a bridge. On that link, one after the
//! other: `iperf3` (one TCP stream, 5 s), `ucx_perftest -t ucp_get` (2.25 MiB and 16 MiB gets, UCX's
//! default transports, which between these hosts is TCP), and our pull: a prefill node on host A
//! and a decode node on host B (SmolLM2, `$PD_MODEL_GGUF`), driven as a vLLM proxy drives them
//! (P with `do_remote_decode`, D with P's `kv_transfer_params`), prompts of each length given as
//! token ids (`prompt_token_ids`, random, so nothing is cached). The pull's rate is D's own
//! account: bytes moved over time in transfer (`pd_kv_transfer_bytes_total`,
//! `pd_kv_transfer_seconds`), per pull. Results go to BENCHMARKS.md ("KV pull between hosts")
//! by hand, with the command.

use std::process::Stdio;
use std::time::{Duration, Instant};

use pd_cluster_tests::bins;
use pd_cluster_tests::flag;
use pd_cluster_tests::hosts::{Host, Net};
use pd_cluster_tests::metrics::scrape;
use pd_cluster_tests::process::{Proc, WorkDir};
use serde_json::{Value, json};

#[path = "../node/kv-transfer/benches/support/perftest.rs"]
mod perftest;

const TOKEN: &str = "hosts-pull-token";

/// `iperf3` from B to A, one stream, 5 s: GB/s received.
fn iperf3(a: &Host, b: &Host) -> f64 {
    let mut server = a
        .command("iperf3")
        .args(["-s", "-1", "-p", "5201"])
        .stdout(Stdio::null())
        .spawn()
        .expect("iperf3 (apt-get install iperf3)");
    let until = Instant::now() + Duration::from_secs(10);
    let out = loop {
        let out = b
            .command("iperf3")
            .args(["-c", &a.addr.to_string(), "-p", "5201", "-t", "5", "-J"])
            .output()
            .expect("iperf3 client");
        if out.status.success() || Instant::now() > until {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = server.wait();
    let v: Value = serde_json::from_slice(&out.stdout).expect("iperf3 JSON");
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .expect("iperf3's received rate")
        / 8e9
}

/// `ucx_perftest -t ucp_get` of `size` bytes, client on B reading A: GB/s and the transports.
fn perftest(a: &Host, b: &Host, size: usize) -> f64 {
    let mut server = a
        .command("ucx_perftest")
        .args(["-p", "13337"])
        .stdout(Stdio::null())
        .spawn()
        .expect("ucx_perftest (apt-get install ucx-utils)");
    std::thread::sleep(Duration::from_millis(500));
    let iterations = ((2usize << 30) / size).clamp(20, 2000);
    let out = b
        .command("ucx_perftest")
        .arg(a.addr.to_string())
        .args(["-p", "13337", "-t", "ucp_get", "-s", &size.to_string()])
        .args(["-n", &iterations.to_string(), "-f", "-v"])
        .output()
        .expect("ucx_perftest client");
    let _ = server.kill();
    let _ = server.wait();
    perftest::parse_perftest(&String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
        .gbps
}

/// A node of `role` on `host`, listening on its address.
fn node(host: &Host, dir: &WorkDir, role: &str, extra: &[&str]) -> (Proc, String) {
    let model =
        std::env::var("PD_MODEL_GGUF").expect("PD_MODEL_GGUF (bash scripts/fetch-model.sh)");
    let mut cmd = host.command(bins::pd_node());
    cmd.args([
        "serve",
        "--model",
        &model,
        "--port",
        "8000",
        "--threads",
        "1",
    ])
    .args(["--host", &host.addr.to_string(), "--kv-port", "9000"])
    .args(["--kv-role", role, "--engine-id", &host.name])
    .args(["--cluster-token", TOKEN, "--kv-cache-memory", "1GiB"])
    .args(extra);
    let mut p = Proc::spawn(&host.name, cmd, dir.path());
    let http = host.url(&p.wait_line("pd-node listening on ", Duration::from_secs(120)));
    (p, http)
}

async fn post(client: &reqwest::Client, url: &str, body: &Value) -> Value {
    let resp = client
        .post(url)
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = resp.status();
    let v: Value = resp.json().await.expect("JSON");
    assert!(status.is_success(), "{url}: {status}: {v}");
    v
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let tokens: Vec<usize> = flag("--tokens", "512,4096".to_owned())
        .split(',')
        .map(|t| t.parse().expect("--tokens N,M"))
        .collect();
    let repeat: usize = flag("--repeat", 3);
    let dir = WorkDir::new("hosts-pull");
    let net = Net::new(dir.path());
    let a = net.host("p");
    let b = net.host("d");

    let link = iperf3(&a, &b);
    println!("iperf3, one TCP stream B←A: {link:.2} GB/s");
    for size in [2_359_296, 16 << 20] {
        let g = perftest(&a, &b, size);
        println!(
            "ucx_perftest -t ucp_get -s {size}: {g:.2} GB/s ({:.2}× iperf3)",
            g / link
        );
    }

    let (_p, p_http) = node(&a, &dir, "kv_producer", &[]);
    let allowed = format!("{}:9000", a.addr);
    let (d_proc, d_http) = node(&b, &dir, "kv_consumer", &["--kv-allowed-peers", &allowed]);
    let client = reqwest::Client::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for &n in &tokens {
        let mut rates = Vec::new();
        for _ in 0..repeat {
            let ids: Vec<u32> = (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    100 + (seed % 48_000) as u32
                })
                .collect();
            let body = json!({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "ids",
                "prompt_token_ids": ids, "max_tokens": 1, "temperature": 0});
            let mut to_p = body.clone();
            to_p["kv_transfer_params"] = json!({"do_remote_decode": true,
                "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null});
            let p_answer = post(&client, &format!("{p_http}/v1/completions"), &to_p).await;
            let before = scrape(&client, &d_http).await;
            let mut to_d = body;
            to_d["kv_transfer_params"] = p_answer["kv_transfer_params"].clone();
            let d_answer = post(&client, &format!("{d_http}/v1/completions"), &to_d).await;
            let after = scrape(&client, &d_http).await;
            let bytes = after.sum("pd_kv_transfer_bytes_total", &[])
                - before.sum("pd_kv_transfer_bytes_total", &[]);
            let secs = after.sum("pd_kv_transfer_seconds_sum", &[])
                - before.sum("pd_kv_transfer_seconds_sum", &[]);
            let pulled = d_answer["usage"]["prompt_tokens_details"]["kv_pulled_tokens"].clone();
            assert!(bytes > 0.0, "no pull: {d_answer}");
            rates.push(bytes / secs / 1e9);
            println!(
                "pull of {n} tokens ({pulled} pulled, {:.1} MB): {:.1} ms in transfer, {:.2} GB/s ({:.2}× iperf3)",
                bytes / 1e6,
                secs * 1e3,
                bytes / secs / 1e9,
                bytes / secs / 1e9 / link
            );
        }
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        println!(
            "{n} tokens: median {median:.2} GB/s = {:.2}× iperf3",
            median / link
        );
    }
    let endpoint = d_proc
        .log()
        .lines()
        .find(|l| l.contains("transports="))
        .unwrap_or_default()
        .to_owned();
    println!("D's endpoint to P: {endpoint}");
}

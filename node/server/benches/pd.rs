//! Prefill/decode disaggregation between real `pd-node` processes (release build) against one
//! standalone node, on the same generated model, in one run.
//!
//! Run: `cargo bench -p pd-node --bench pd [-- --repeat 5 --lens 64,512,1536 --kv-cache-dtype
//! f32|f16|bf16 --pull-via auto|auto-one-thread|get --d-args "FLAGS"]` (the dtype is given to all three nodes;
//! default f32; D's `--kv-pull-via`, default auto; `--d-args` adds flags to D only, e.g.
//! `"--block-size 32 --kv-layout nhd"` for a pull converted to another block size and order;
//! `--p-args` the same for P, e.g. `"--kv-staged"` on both for the GPU path's copies on CPU).
//! `PD_BENCH_NODE_BIN=PATH` runs another pd-node build (all three nodes) for an A/B.
//! Results are recorded in `BENCHMARKS.md` ("P/D vs one node").
//!
//! Per prompt length (token-id prompts through `/v1/completions`, greedy, distinct prompts so no
//! prefix cache helps):
//! - `solo`: one request with `max_tokens = 1` to the standalone node (prefill + first token).
//! - `P`: the proxy's prefill request to the producer; `D`: the request with P's params to the
//!   consumer, `max_tokens = 1` (wait, handshake (cached), pull, confirm, first token). Greedy,
//!   so D emits P's attested first token and computes nothing before it. `P+D` is their sum:
//!   the time to first token a proxy adds up to, without the proxy.
//! - `D (sampled)`: the same handoff for a seeded sampled request (temperature 0.8), whose first
//!   token D also takes from P (sampled there with the same parameters and seed); and D's time
//!   per stage (`pd_kv_consume_stage_seconds`).
//! - `pull`: D's own `pd_kv_transfer_seconds` (posting the reads to their completion) and the
//!   bytes it moved; `copied by the helper`: the share of those bytes D's copy helper thread
//!   moved (`pd_kv_copy_helper_bytes_total`; 0 with `--pull-via auto-one-thread` or `get`).
//! - `perftest`: `ucx_perftest -t ucp_get` of the same number of bytes in one get, between two
//!   processes, right after the row's pulls (the transfer layer's reference, in the same run);
//!   `pull / perftest` is the pull's bandwidth as a share of perftest's (goal ≥ 0.8).
//!
//! Then the KV bytes D pulls for n = 1 and n = 8 of one prompt (they must be equal: one pull).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use pd_model::tiny::{TinyArch, TinySpec, generate};
use serde_json::{Value, json};

#[path = "../../kv-transfer/benches/support/perftest.rs"]
mod perftest;

use perftest::{BenchResult, run_perftest};

struct Node {
    child: Child,
    http: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(model: &Path, extra: &[&str]) -> BenchResult<Node> {
    let mut node = Node {
        // `PD_BENCH_NODE_BIN`: another build of pd-node (an A/B in one run of this bench).
        child: Command::new(
            std::env::var_os("PD_BENCH_NODE_BIN")
                .unwrap_or_else(|| env!("CARGO_BIN_EXE_pd-node").into()),
        )
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args([
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--num-gpu-blocks",
            "2048",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?,
        http: String::new(),
    };
    let mut out = BufReader::new(node.child.stdout.take().ok_or("no stdout")?);
    loop {
        let mut line = String::new();
        if out.read_line(&mut line)? == 0 {
            return Err("pd-node exited before listening".into());
        }
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            node.http = a.to_string();
            return Ok(node);
        }
    }
}

async fn post(client: &reqwest::Client, node: &Node, body: &Value) -> BenchResult<Value> {
    let r = client
        .post(format!("{}/v1/completions", node.http))
        .json(body)
        .send()
        .await?;
    if !r.status().is_success() {
        return Err(format!("{}: {}", r.status(), r.text().await?).into());
    }
    Ok(r.json().await?)
}

async fn metric(client: &reqwest::Client, node: &Node, sample: &str) -> BenchResult<f64> {
    let text = client
        .get(format!("{}/metrics", node.http))
        .send()
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == sample).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0))
}

/// The stages of D's handoff, in order (`pd_kv_consume_stage_seconds{stage}`).
const STAGES: [&str; 5] = ["wait_blocks", "prepare", "reads", "confirm", "first_token"];

/// D's summed seconds per stage so far.
async fn stage_sums(client: &reqwest::Client, node: &Node) -> BenchResult<Vec<f64>> {
    let mut v = Vec::with_capacity(STAGES.len());
    for stage in STAGES {
        let sample = format!("pd_kv_consume_stage_seconds_sum{{stage=\"{stage}\"}}");
        v.push(metric(client, node, &sample).await?);
    }
    Ok(v)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> BenchResult<()> {
    let mut repeat = 5usize;
    let mut lens = vec![64usize, 512, 1536];
    let mut dtype = "f32".to_string();
    let mut via = "auto".to_string();
    let mut d_args = String::new();
    let mut p_args = String::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--repeat" => repeat = args.next().ok_or("--repeat N")?.parse()?,
            "--lens" => {
                lens = args
                    .next()
                    .ok_or("--lens A,B")?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--kv-cache-dtype" => dtype = args.next().ok_or("--kv-cache-dtype f32|f16|bf16")?,
            "--pull-via" => via = args.next().ok_or("--pull-via auto|get")?,
            // More flags for D only, e.g. "--block-size 32 --kv-layout nhd" (a converting pull).
            "--d-args" => d_args = args.next().ok_or("--d-args \"FLAGS\"")?,
            // More flags for P only, e.g. "--kv-staged" (its prompt copied down before a lease).
            "--p-args" => p_args = args.next().ok_or("--p-args \"FLAGS\"")?,
            "--bench" => {}
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let dir = std::env::temp_dir().join(format!("pd-bench-pd-{}", std::process::id()));
    let spec = TinySpec {
        arch: TinyArch::Llama,
        seed: 1,
        layers: 4,
        hidden: 256,
        heads: 8,
        kv_heads: 4,
        vocab: 2048,
        intermediate: 768,
        max_position_embeddings: 4096,
        shards: 1,
    };
    generate(&spec, &dir)?;
    let kv_dtype = ["--kv-cache-dtype", dtype.as_str()];
    let solo = start(&dir, &kv_dtype)?;
    let p = start(
        &dir,
        &[
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            "p",
            kv_dtype[0],
            kv_dtype[1],
        ]
        .into_iter()
        .chain(p_args.split_whitespace())
        .collect::<Vec<_>>(),
    )?;
    let d = start(
        &dir,
        &[
            "--kv-role",
            "kv_consumer",
            "--kv-port",
            "0",
            "--engine-id",
            "d",
            "--kv-recompute-threshold",
            "0",
            "--kv-pull-via",
            via.as_str(),
            kv_dtype[0],
            kv_dtype[1],
        ]
        .into_iter()
        .chain(d_args.split_whitespace())
        .collect::<Vec<_>>(),
    )?;
    let client = reqwest::Client::new();
    let mut salt = 0u32;
    let mut prompt = |len: usize| -> Vec<u32> {
        salt += 1;
        (0..len as u32)
            .map(|i| (i * 7 + salt * 131) % 2000 + 1)
            .collect()
    };
    let body = |tokens: &[u32], n: usize| {
        json!({"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0,
               "ignore_eos": true, "n": n})
    };
    let p_body = |tokens: &[u32], n: usize| {
        let mut b = body(tokens, n);
        b["kv_transfer_params"] = json!({"do_remote_decode": true});
        b
    };
    // Warm-up: handshake, endpoint, caches.
    let w = prompt(16);
    let params = post(&client, &p, &p_body(&w, 1)).await?["kv_transfer_params"].clone();
    let mut wb = body(&w, 1);
    wb["kv_transfer_params"] = params;
    post(&client, &d, &wb).await?;
    post(&client, &solo, &body(&w, 1)).await?;

    println!(
        "model: {} layers, hidden {}, {} KV heads × {} dim, {dtype} KV, block 16; D pulls via {via}; median of {repeat} (ms)",
        spec.layers,
        spec.hidden,
        spec.kv_heads,
        spec.hidden / spec.heads
    );
    println!(
        "| prompt | solo | P | D | P+D | P+D / solo | pull (reads) | KV bytes | copied by the helper | perftest | pull / perftest |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut stage_rows = Vec::new();
    for &len in &lens {
        let (mut solo_ms, mut p_ms, mut d_ms, mut pull_ms) = (vec![], vec![], vec![], vec![]);
        let mut stage_ms: Vec<Vec<f64>> = vec![Vec::new(); STAGES.len()];
        let mut d_sampled_ms = Vec::new();
        let mut bytes = 0.0;
        let (mut all_bytes, mut helper_bytes) = (0.0, 0.0);
        for _ in 0..repeat {
            let t = prompt(len);
            let s = Instant::now();
            post(&client, &solo, &body(&t, 1)).await?;
            solo_ms.push(s.elapsed().as_secs_f64() * 1e3);

            let t = prompt(len);
            let s = Instant::now();
            let params = post(&client, &p, &p_body(&t, 1)).await?["kv_transfer_params"].clone();
            p_ms.push(s.elapsed().as_secs_f64() * 1e3);
            let (sum0, n0, b0) = (
                metric(&client, &d, "pd_kv_transfer_seconds_sum").await?,
                metric(&client, &d, "pd_kv_transfer_seconds_count").await?,
                metric(&client, &d, "pd_kv_transfer_bytes_total").await?,
            );
            let h0 = metric(&client, &d, "pd_kv_copy_helper_bytes_total").await?;
            let stages0 = stage_sums(&client, &d).await?;
            let mut db = body(&t, 1);
            db["kv_transfer_params"] = params;
            let s = Instant::now();
            let r = post(&client, &d, &db).await?;
            d_ms.push(s.elapsed().as_secs_f64() * 1e3);
            let stages1 = stage_sums(&client, &d).await?;
            for (i, (a, b)) in stages0.iter().zip(&stages1).enumerate() {
                stage_ms[i].push((b - a) * 1e3);
            }
            let pulled = r["usage"]["prompt_tokens_details"]["kv_pulled_tokens"]
                .as_u64()
                .unwrap_or(0);
            // Greedy: D takes P's first token and computes nothing before it.
            if pulled as usize != len {
                return Err(format!("expected {len} pulled tokens, got {pulled}").into());
            }
            let (sum1, n1, b1) = (
                metric(&client, &d, "pd_kv_transfer_seconds_sum").await?,
                metric(&client, &d, "pd_kv_transfer_seconds_count").await?,
                metric(&client, &d, "pd_kv_transfer_bytes_total").await?,
            );
            helper_bytes += metric(&client, &d, "pd_kv_copy_helper_bytes_total").await? - h0;
            all_bytes += b1 - b0;
            if n1 - n0 != 1.0 {
                return Err("expected exactly one pull".into());
            }
            pull_ms.push((sum1 - sum0) * 1e3);
            bytes = b1 - b0;

            // The same handoff for a seeded sampled request: P's first token was sampled with
            // the same parameters and seed (the lease says so), so D takes it too.
            let t = prompt(len);
            let mut sb = body(&t, 1);
            sb["temperature"] = json!(0.8);
            sb["seed"] = json!(1);
            let mut pb = sb.clone();
            pb["kv_transfer_params"] = json!({"do_remote_decode": true});
            let params = post(&client, &p, &pb).await?["kv_transfer_params"].clone();
            sb["kv_transfer_params"] = params;
            let s = Instant::now();
            let r = post(&client, &d, &sb).await?;
            d_sampled_ms.push(s.elapsed().as_secs_f64() * 1e3);
            let pulled = r["usage"]["prompt_tokens_details"]["kv_pulled_tokens"]
                .as_u64()
                .unwrap_or(0);
            if pulled as usize != len {
                return Err(format!("sampled: expected {len} pulled, got {pulled}").into());
            }
        }
        let (s, pm, dm) = (median(solo_ms), median(p_ms), median(d_ms));
        let stages: Vec<f64> = stage_ms.into_iter().map(median).collect();
        stage_rows.push((len, dm, median(d_sampled_ms), stages));
        let pull = median(pull_ms);
        let (reference, _) = run_perftest("ucx_perftest", bytes as usize, 200)?;
        let perftest_ms = reference.overall_lat_us / 1e3;
        println!(
            "| {len} | {s:.2} | {pm:.2} | {dm:.2} | {:.2} | {:.2}× | {pull:.3} | {:.2} MiB | {:.0}% | {perftest_ms:.3} | {:.2}× |",
            pm + dm,
            (pm + dm) / s,
            bytes / (1 << 20) as f64,
            100.0 * helper_bytes / all_bytes.max(1.0),
            perftest_ms / pull
        );
    }

    println!();
    println!("Where D's time goes (median ms per stage, D's `pd_kv_consume_stage_seconds`):");
    println!();
    println!(
        "| prompt | D (sampled) | D (greedy) | {} | rest (HTTP, queueing) |",
        STAGES.join(" | ")
    );
    println!("|---:|---:|---:|{}---:|", "---:|".repeat(STAGES.len()));
    for (len, dm, sampled, stages) in &stage_rows {
        let cells: Vec<String> = stages.iter().map(|v| format!("{v:.3}")).collect();
        println!(
            "| {len} | {sampled:.2} | {dm:.2} | {} | {:.3} |",
            cells.join(" | "),
            dm - stages.iter().sum::<f64>()
        );
    }

    println!();
    println!("| n | KV bytes pulled by D |");
    println!("|---:|---:|");
    for n in [1usize, 8] {
        // A fresh prompt of the same length each time, so D's prefix cache holds none of it.
        let t = prompt(512);
        let b0 = metric(&client, &d, "pd_kv_transfer_bytes_total").await?;
        let params = post(&client, &p, &p_body(&t, n)).await?["kv_transfer_params"].clone();
        let mut db = body(&t, n);
        db["max_tokens"] = json!(4);
        db["temperature"] = json!(0.8);
        db["kv_transfer_params"] = params;
        let r = post(&client, &d, &db).await?;
        if r["choices"].as_array().map(Vec::len) != Some(n) {
            return Err("wrong number of choices".into());
        }
        let moved = metric(&client, &d, "pd_kv_transfer_bytes_total").await? - b0;
        println!("| {n} | {moved} |");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

//! Gateway-added latency: the same P→D requests through `pd-gateway` (WASM least-loaded policy
//! in the path) and from a Rust client that drives P and D itself, interleaved in one run.
//!
//! ```sh
//! bash scripts/build-policies.sh && cargo build --release -p pd-node
//! cargo bench -p pd-gateway --bench gateway            # BENCH_REQUESTS=400 by default
//! ```
//!
//! Real processes on loopback: a tiny generated model, one prefill node (P), one decode node
//! (D), the gateway. Each request has a fresh prompt (no prefix-cache hits) and asks for 4
//! tokens, greedy, not streamed. Two direct clients, over the same kind of pooled keep-alive
//! client, interleaved with the gateway's requests:
//! - **text** (the reference of the "added" columns): the client has the prompt as text and
//!   drives P and D with it (`prefill_body`/`decode_body` of its request, as vLLM's example
//!   proxy does), so P and D each tokenize it;
//! - **ids**: the same bodies carrying the prompt's ids in `prompt_token_ids`, tokenized
//!   outside the timed region, i.e. byte for byte what the gateway sends P and D (the
//!   gateway tokenizes once, on its path). Against it, the gateway's cost alone.
//!
//! `BENCH_GATEWAY_BIN=PATH` runs another `pd-gateway` build against the same nodes (A/B).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pd_gateway::openai::{decode_body, prefill_body, prefill_params};
use pd_policy::Api;
use pd_tokenize::{Tokenizer, prompt};
use serde_json::{Map, Value, json};

mod common;
use common::{pct, start};

struct Stats {
    p50: f64,
    p99: f64,
    mean: f64,
}

fn stats(mut v: Vec<f64>) -> Stats {
    v.sort_by(f64::total_cmp);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    Stats {
        p50: pct(&v, 0.5),
        p99: pct(&v, 0.99),
        mean,
    }
}

fn prompt(i: usize, len: usize) -> String {
    // The tiny model's tokenizer is byte-level: one ASCII byte is one token.
    let head = format!("{i:08} ");
    let mut s = head.clone();
    while s.len() < len {
        s.push_str("abcdefghij klmnopqrst ");
    }
    s.truncate(len);
    s
}

fn body(i: usize, len: usize) -> Map<String, Value> {
    match json!({"model": "tiny", "prompt": prompt(i, len), "max_tokens": 4, "temperature": 0}) {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

/// `b` with the prompt's ids as the gateway sends them (`prompt_token_ids`), computed with the
/// model's tokenizer through the code the gateway and the nodes run.
fn with_ids(tokenizer: &Tokenizer, mut b: Map<String, Value>) -> Map<String, Value> {
    let text = b["prompt"].as_str().expect("a text prompt").to_owned();
    let ids = prompt::prompt_tokens(
        tokenizer,
        prompt::PromptKind::Completion(prompt::PromptInput::Text(text)),
    )
    .expect("tokenized");
    b.insert(prompt::GIVEN_IDS_FIELD.into(), json!(ids));
    b
}

async fn direct(c: &reqwest::Client, p: &str, d: &str, b: &Map<String, Value>) {
    let pr = c
        .post(format!("{p}/v1/completions"))
        .json(&prefill_body(Api::Completions, b, 1))
        .send()
        .await
        .expect("P answers");
    assert!(pr.status().is_success(), "P: {}", pr.status());
    let params = prefill_params(&pr.bytes().await.expect("P body")).expect("P's params")[0].clone();
    let dr = c
        .post(format!("{d}/v1/completions"))
        .json(&decode_body(b, &params))
        .send()
        .await
        .expect("D answers");
    assert!(dr.status().is_success(), "D: {}", dr.status());
    let v: Value = dr.json().await.expect("D's JSON");
    assert!(v["usage"]["prompt_tokens_details"]["kv_pulled_tokens"].as_u64() > Some(0));
}

async fn via_gateway(c: &reqwest::Client, gw: &str, b: &Map<String, Value>) {
    let r = c
        .post(format!("{gw}/v1/completions"))
        .json(b)
        .send()
        .await
        .expect("gateway answers");
    assert!(r.status().is_success(), "gateway: {}", r.status());
    let v: Value = r.json().await.expect("gateway JSON");
    assert!(v["usage"]["prompt_tokens_details"]["kv_pulled_tokens"].as_u64() > Some(0));
}

/// One row: `n` requests per path, the three paths interleaved request by request. Returns
/// the row's line for the ids table.
async fn run(
    prompt_len: usize,
    n: usize,
    c: &reqwest::Client,
    tokenizer: &Tokenizer,
    (gw, p, d): (&str, &str, &str),
) -> String {
    let mut ids = 0..;
    let mut next = || ids.next().expect("unbounded");
    for _ in 0..20 {
        direct(c, p, d, &body(next(), prompt_len)).await;
        direct(c, p, d, &with_ids(tokenizer, body(next(), prompt_len))).await;
        via_gateway(c, gw, &body(next(), prompt_len)).await;
    }
    let (mut dt, mut it, mut gt) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for _ in 0..n {
        let b = body(next(), prompt_len);
        let t = Instant::now();
        direct(c, p, d, &b).await;
        dt.push(t.elapsed().as_secs_f64() * 1e3);
        let b = with_ids(tokenizer, body(next(), prompt_len));
        let t = Instant::now();
        direct(c, p, d, &b).await;
        it.push(t.elapsed().as_secs_f64() * 1e3);
        let b = body(next(), prompt_len);
        let t = Instant::now();
        via_gateway(c, gw, &b).await;
        gt.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (ds, is, gs) = (stats(dt), stats(it), stats(gt));
    println!(
        "| {prompt_len:>5} | {n:>5} | {:>8.3} | {:>8.3} | {:>8.3} | {:>8.3} | {:>8.0} | {:>8.0} | {:>8.0} | {:>8.0} |",
        ds.p50,
        ds.p99,
        gs.p50,
        gs.p99,
        (gs.p50 - ds.p50) * 1e3,
        (gs.p99 - ds.p99) * 1e3,
        1e3 / ds.mean,
        1e3 / gs.mean,
    );
    format!(
        "| {prompt_len:>5} | {:>8.3} | {:>8.3} | {:>8.0} | {:>8.0} |",
        is.p50,
        is.p99,
        (gs.p50 - is.p50) * 1e3,
        (gs.p99 - is.p99) * 1e3,
    )
}

/// CPU time (user + system, in clock ticks) of each thread of process `pid`, summed by thread
/// name (Linux `/proc`; empty elsewhere).
fn thread_cpu(pid: u32) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(t.path().join("comm")),
            std::fs::read_to_string(t.path().join("stat")),
        ) else {
            continue;
        };
        // Fields after the `(comm)`: state is field 3, utime 14 and stime 15.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
            + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        *out.entry(comm.trim().to_owned()).or_default() += ticks;
    }
    out
}

/// The gateway's histogram sums and counts, keyed `name_sum{labels}` / `name_count{labels}`
/// with the labels as exposed (summed over label sets for the unlabelled name).
async fn scrape(c: &reqwest::Client, gw: &str) -> std::collections::HashMap<String, f64> {
    let text = c
        .get(format!("{gw}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let mut out = std::collections::HashMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, v)) = l.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = v.parse::<f64>() else { continue };
        if key.contains("_bucket{") {
            out.insert(key.to_owned(), v);
            continue;
        }
        if !(key.contains("_sum") || key.contains("_count")) {
            continue;
        }
        *out.entry(key.to_owned()).or_default() += v;
        if let Some((name, _)) = key.split_once('{') {
            *out.entry(name.to_owned()).or_default() += v;
        }
    }
    out
}

fn main() {
    let n: usize = std::env::var("BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let built = PathBuf::from(env!("CARGO_BIN_EXE_pd-gateway"));
    // PD_BENCH_NODE_BIN: the pd-node to run (default: the one built beside this bench's
    // pd-gateway), e.g. where the bench runs on another machine than it was built on.
    let node = std::env::var_os("PD_BENCH_NODE_BIN")
        .map_or_else(|| built.with_file_name("pd-node"), PathBuf::from);
    // BENCH_GATEWAY_BIN: another pd-gateway binary (an A/B comparison of two builds).
    let gateway = std::env::var_os("BENCH_GATEWAY_BIN").map_or(built, PathBuf::from);
    assert!(
        node.exists(),
        "{} is missing: cargo build --release -p pd-node",
        node.display()
    );
    let policies = std::env::var("PD_POLICIES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            node.parent()
                .and_then(Path::parent)
                .expect("target dir")
                .join("policies")
        });
    let policy = policies.join("least-loaded.wasm");
    assert!(
        policy.exists(),
        "{} is missing: bash scripts/build-policies.sh",
        policy.display()
    );
    let dir = std::env::temp_dir().join(format!("pd-gateway-bench-{}", std::process::id()));
    let model = dir.join("model");
    let status = Command::new(&node)
        .args(["gen-tiny-model", "--out"])
        .arg(&model)
        .args(["--seed", "1"])
        .stdout(Stdio::null())
        .status()
        .expect("gen-tiny-model");
    assert!(status.success());
    let tokenizer = Tokenizer::from_dir(&model).expect("the model's tokenizer");
    let model = model.to_str().expect("utf-8 path").to_owned();

    // Extra gateway flags to compare settings, e.g. BENCH_GATEWAY_ARGS="--threads 1", and
    // BENCH_POLICY=native for the built-in least-loaded instead of the WASM one.
    let extra = std::env::var("BENCH_GATEWAY_ARGS").unwrap_or_default();
    let mut gw_args: Vec<String> = [
        "serve",
        "--port",
        "0",
        "--registry-port",
        "0",
        "--admin-port",
        "0",
        "--admin-token",
        "bench",
        "--policy",
        policy.to_str().expect("utf-8 path"),
    ]
    .map(str::to_owned)
    .to_vec();
    if std::env::var("BENCH_POLICY").is_ok_and(|p| p == "native") {
        // The built-in native least-loaded instead of the WASM one.
        gw_args.truncate(gw_args.len() - 2);
    }
    gw_args.extend(extra.split_whitespace().map(str::to_owned));
    // BENCH_GATEWAY_CPUS=1: the gateway alone on CPU 1 (run the bench itself under `taskset -c
    // 0` so the client and the nodes stay off it), as a deployment gives it cores of its own.
    let (gw_bin, gw_args) = match std::env::var("BENCH_GATEWAY_CPUS") {
        Ok(cpus) => {
            let mut a = vec!["-c".to_owned(), cpus, gateway.display().to_string()];
            a.extend(gw_args);
            (PathBuf::from("taskset"), a)
        }
        Err(_) => (gateway.clone(), gw_args),
    };
    let (gw_proc, found) = start(
        &gw_bin,
        &gw_args,
        &["pd-gateway registry on ", "pd-gateway listening on "],
    );
    let (registry, gw) = (found[0].clone(), found[1].clone());
    let node_args = |id: &'static str, role: &'static str| {
        vec![
            "serve".to_owned(),
            "--model".into(),
            model.clone(),
            "--served-model-name".into(),
            "tiny".into(),
            "--port".into(),
            "0".into(),
            "--engine-id".into(),
            id.into(),
            "--kv-role".into(),
            role.into(),
            "--kv-port".into(),
            "0".into(),
            "--kv-recompute-threshold".into(),
            "0".into(),
            "--gateway".into(),
            registry.clone(),
        ]
    };
    let (_p, pf) = start(
        &node,
        &node_args("bench-p", "kv_producer"),
        &["pd-node listening on "],
    );
    let (_d, df) = start(
        &node,
        &node_args("bench-d", "kv_consumer"),
        &["pd-node listening on "],
    );
    let (p, d) = (pf[0].clone(), df[0].clone());

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let c = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .tcp_nodelay(true)
            .build()
            .expect("client");
        // Wait until both nodes are in the gateway's view (a request routes to P and D).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = c
                .post(format!("{gw}/v1/completions"))
                .json(&body(usize::MAX / 2, 64))
                .send()
                .await;
            if r.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            assert!(Instant::now() < deadline, "the cluster did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("pd-gateway added latency (ms for latencies, µs for added, req/s sequential), {n} requests per row per path");
        println!("Against a client that drives P and D with the prompt's text (P and D each tokenize it):");
        println!("| prompt tokens | requests | direct p50 | direct p99 | gateway p50 | gateway p99 | added p50 µs | added p99 µs | direct req/s | gateway req/s |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        let before = scrape(&c, &gw).await;
        let cpu_before = thread_cpu(gw_proc.0.id());
        let nodes = (gw.as_str(), p.as_str(), d.as_str());
        let ids_64 = run(64, n, &c, &tokenizer, nodes).await;
        let cpu_after = thread_cpu(gw_proc.0.id());
        let mid = scrape(&c, &gw).await;
        let ids_2000 = run(2000, (n / 4).max(20), &c, &tokenizer, nodes).await;
        let after = scrape(&c, &gw).await;
        println!("Against a client that sends what the gateway sends P and D (the prompt's ids, tokenized before the clock starts), same requests interleaved:");
        println!("| prompt tokens | direct p50 | direct p99 | added p50 µs | added p99 µs |");
        println!("|---|---|---|---|---|");
        println!("{ids_64}\n{ids_2000}");
        // The gateway's CPU time over the 64-token row (its requests, and everything that ran
        // meanwhile: the nodes' registry streams, the epoch ticker), per gateway request; clock
        // ticks are 10 ms, so this needs a long row (BENCH_REQUESTS >= 1000).
        let per_request = |ticks: u64| ticks as f64 * 1e4 / n as f64;
        let by_thread: Vec<String> = cpu_after
            .iter()
            .map(|(name, t)| {
                let d = t - cpu_before.get(name).copied().unwrap_or(0);
                format!("{name} {:.0}", per_request(d))
            })
            .collect();
        let total: u64 = cpu_after.values().sum::<u64>() - cpu_before.values().sum::<u64>();
        println!(
            "64-token row, gateway CPU per gateway request (µs, by thread name): total {:.0} = {}",
            per_request(total),
            by_thread.join(", ")
        );
        // The gateway's own account, per row: its time on requests (not waiting on nodes) by
        // phase, and the policy decision, as means over the row's requests.
        for (row, (a, b)) in [("64", (&before, &mid)), ("2000", (&mid, &after))] {
            let mean = |metric: &str| {
                let d = |suffix: &str| {
                    let k = match metric.split_once('{') {
                        Some((name, labels)) => format!("{name}_{suffix}{{{labels}"),
                        None => format!("{metric}_{suffix}"),
                    };
                    b.get(&k).unwrap_or(&0.0) - a.get(&k).unwrap_or(&0.0)
                };
                d("sum") / d("count").max(1.0) * 1e6
            };
            // The bucket holding the median: "≤ X µs" (the histograms' buckets are coarse,
            // 1-2-5 steps; a mean is moved by a few descheduled requests, a median is not).
            let median = |metric: &str| {
                let (name, labels) = metric.split_once('{').unwrap_or((metric, "}"));
                let labels = labels.trim_end_matches('}');
                let d = |k: &str| b.get(k).unwrap_or(&0.0) - a.get(k).unwrap_or(&0.0);
                let count = d(&format!("{name}_count{{{labels}}}"));
                let sep = if labels.is_empty() { "" } else { "," };
                let bucket = [1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3]
                    .into_iter()
                    .find(|le| d(&format!("{name}_bucket{{{labels}{sep}le=\"{le}\"}}")) >= count / 2.0);
                bucket.map_or_else(|| "> 5000".to_owned(), |le| format!("≤ {:.0}", le * 1e6))
            };
            println!(
                "{row}-token row, phase medians (µs, the bucket holding it): tokenize {} / view {} / policy {} / respond {}",
                median("pd_gateway_phase_seconds{phase=\"tokenize\"}"),
                median("pd_gateway_phase_seconds{phase=\"view\"}"),
                median("pd_gateway_phase_seconds{phase=\"policy\"}"),
                median("pd_gateway_phase_seconds{phase=\"respond\"}"),
            );

            println!(
                "{row}-token row, gateway's own time (from /metrics, µs mean): total {:.1} = read {:.1} + tokenize {:.1} + view {:.1} + policy {:.1} + respond {:.1}; policy decision alone {:.1}",
                mean("pd_gateway_added_latency_seconds"),
                mean("pd_gateway_phase_seconds{phase=\"read\"}"),
                mean("pd_gateway_phase_seconds{phase=\"tokenize\"}"),
                mean("pd_gateway_phase_seconds{phase=\"view\"}"),
                mean("pd_gateway_phase_seconds{phase=\"policy\"}"),
                mean("pd_gateway_phase_seconds{phase=\"respond\"}"),
                mean("pd_gateway_policy_decision_seconds"),
            );
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

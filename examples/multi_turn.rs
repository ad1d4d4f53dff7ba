//! Multi-turn benchmark, modelled on vLLM's `benchmarks/multi_turn`: conversations that share a
//! system prompt and grow turn by turn, several clients at once, each turn a streamed chat
//! request that resends the whole history (as OpenAI clients do). One cluster — `pd-gateway` +
//! one prefill node + two decode nodes that keep each finished turn (`--kv-retain-after-decode`)
//! — on the real model, run in three modes one after the other, each on conversations of its
//! own:
//!
//! - **a**: round-robin placement, prefix caching on everywhere, no reverse pull (what a peer's
//!   proxy does);
//! - **b**: as a, with prefix caching off (a unique `cache_salt` per request: no node finds any
//!   block of it cached; the setting of the reverse-pull PR's first figure);
//! - **c**: the shipped `prefix-aware` policy: the next turn goes to the node holding the
//!   conversation (it prefills only the new tokens), or P pulls the history back (and decodes
//!   the turn itself when both decode nodes are busy and P is idle: the keep rule).
//!
//! ```sh
//! bash scripts/build-policies.sh
//! cargo build --release -p pd-node -p pd-gateway
//! PD_MODEL_GGUF=$(bash scripts/fetch-model.sh) \
//!   cargo run --release -p pd-cluster-tests --example multi_turn -- [--conversations 6]
//!   [--clients 3] [--turns 10] [--system-words 300] [--user-words 90] [--answer-tokens 24]
//!   [--request-rate 0]
//! ```
//!
//! `--request-rate R` is vLLM's: after each turn a client waits an exponential time of mean
//! `1 / R` seconds (seeded by conversation and turn, so every mode waits the same); 0 (the
//! default, as in vLLM) sends the next turn at once. Without waits the clients form a closed
//! loop: a mode that answers faster also carries more turns at once, which on a machine with
//! few cores shows in its TPOT; each mode's rate of turns (`turns/s`, over its wall time,
//! waits included) is printed beside it.
//!
//! `PD_BENCH_NODE_CPU=0.6` caps each node at that many cores (a cgroup per node, CFS bandwidth
//! control; root and a cgroup `cpu` controller needed): on a machine with fewer cores than
//! nodes, each node then computes at the same pace whether the others are busy or not, as on a
//! machine where each node has cores of its own, so a mode that puts more work on otherwise
//! idle nodes is not charged for the cores they share. Use with `RAYON_NUM_THREADS=1`.
//!
//! `PD_BENCH_MODES=ac` runs only those modes (default `abc`; ratios need the modes they
//! compare); `PD_BENCH_C_CONFIG=holder-load-slack=0,pull-overhead-us=500` pushes mode c's
//! policy with that config (default: none, the policy's defaults). `PD_BENCH_TRACE=DIR` logs
//! every decision (`DIR/decisions.jsonl`, the gateway's decision log) and every turn's wall-clock
//! times (`DIR/turns.jsonl`), to see what the policy saw against what was running
//! (`scripts/multi-turn-trace.py DIR`).
//!
//! Prints per mode: TTFT (mean, p50, p99), TPOT (mean), latency (mean), the prompt length of
//! the last turns, and how the gateway placed turns; then the ratios c/a and c/b. Not part of CI.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ADMIN_TOKEN, CLUSTER_TOKEN, Gateway};
use pd_cluster_tests::metrics::scrape;
use pd_cluster_tests::process::{Proc, WorkDir};
use serde_json::{Value, json};
use tokio::sync::Mutex;

const MODEL: &str = "smollm2";

/// Run settings (flags `--name value`).
#[derive(Debug, Clone)]
struct Settings {
    conversations: usize,
    clients: usize,
    turns: usize,
    system_words: usize,
    user_words: usize,
    answer_tokens: u32,
    retain_secs: u32,
    blocks: u32,
    /// Each client's mean request rate (requests/s) in vLLM's sense: after each turn the client
    /// waits an exponential time of mean `1 / rate` before its next (0: no wait).
    request_rate: f64,
}

impl Settings {
    fn from_args() -> Self {
        let mut s = Settings {
            conversations: 6,
            clients: 3,
            turns: 10,
            system_words: 300,
            user_words: 90,
            answer_tokens: 24,
            retain_secs: 600,
            blocks: 4096,
            request_rate: 0.0,
        };
        let args: Vec<String> = std::env::args().skip(1).collect();
        for pair in args.chunks(2) {
            let [flag, value] = pair else {
                panic!("flags come in pairs: --name value");
            };
            if flag == "--request-rate" {
                s.request_rate = value
                    .parse()
                    .ok()
                    .filter(|r: &f64| r.is_finite() && *r >= 0.0)
                    .unwrap_or_else(|| panic!("{flag} {value}: a rate ≥ 0"));
                continue;
            }
            let v: usize = value
                .parse()
                .unwrap_or_else(|e| panic!("{flag} {value}: {e}"));
            match flag.as_str() {
                "--conversations" => s.conversations = v,
                "--clients" => s.clients = v,
                "--turns" => s.turns = v,
                "--system-words" => s.system_words = v,
                "--user-words" => s.user_words = v,
                "--answer-tokens" => s.answer_tokens = v as u32,
                "--retain-secs" => s.retain_secs = v as u32,
                "--blocks" => s.blocks = v as u32,
                other => panic!("unknown flag {other}"),
            }
        }
        s
    }
}

/// splitmix64's output for state `x`.
fn mix(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A client's wait after a turn at `rate` requests/s (vLLM's `poisson_sleep`): exponential with
/// mean `1 / rate`, drawn from `seed` (the same conversation and turn wait the same in every
/// mode, so the modes see the same think times).
fn think_time(seed: u64, rate: f64) -> Duration {
    if rate <= 0.0 {
        return Duration::ZERO;
    }
    // u in (0, 1]: 53 random bits.
    let u =
        ((mix(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 11) + 1) as f64 / (1u64 << 53) as f64;
    Duration::from_secs_f64(-u.ln() / rate)
}

/// A deterministic text of `n` words (splitmix64 over a small vocabulary of English words).
fn words(seed: u64, n: usize) -> String {
    const VOCAB: &[&str] = &[
        "river", "mountain", "city", "history", "music", "science", "garden", "ocean", "train",
        "bridge", "winter", "summer", "language", "market", "forest", "castle", "engine",
        "library", "island", "valley", "festival", "harbor", "desert", "planet", "recipe",
        "painting", "theory", "journey", "village", "museum", "storm", "lantern", "orchard",
        "canyon", "glacier", "meadow", "compass", "voyage", "summit", "archive",
    ];
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            VOCAB[(mix(x) % VOCAB.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One turn's figures.
#[derive(Debug, Clone, Copy)]
struct TurnStats {
    ttft: f64,
    tpot: f64,
    latency: f64,
    prompt_tokens: u64,
    /// Sent, first token and end, in milliseconds since the Unix epoch (the decision log's clock).
    wall_ms: [f64; 3],
}

/// Milliseconds since the Unix epoch.
fn epoch_ms() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// Streams one chat turn; returns its figures and the answer's text.
async fn chat_turn(
    client: &reqwest::Client,
    gateway: &str,
    messages: &[Value],
    s: &Settings,
    salt: Option<String>,
) -> (TurnStats, String) {
    let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": s.answer_tokens,
        "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true}});
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    let start = Instant::now();
    let start_ms = epoch_ms();
    let resp = client
        .post(format!("{gateway}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("the request is sent");
    assert_eq!(resp.status(), 200, "a turn failed");
    let mut stream = resp.bytes_stream();
    let (mut first, mut last) = (None, start);
    let (mut text, mut chunks, mut prompt_tokens) = (String::new(), 0u32, 0);
    let mut pending = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("the stream");
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).expect("an SSE event is JSON");
            if let Some(delta) = v["choices"][0]["delta"]["content"].as_str()
                && !delta.is_empty()
            {
                let now = Instant::now();
                first.get_or_insert(now);
                last = now;
                chunks += 1;
                text.push_str(delta);
            }
            if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
                prompt_tokens = p;
            }
        }
    }
    let first = first.expect("at least one token");
    let ttft = (first - start).as_secs_f64();
    let tpot = if chunks > 1 {
        (last - first).as_secs_f64() / f64::from(chunks - 1)
    } else {
        0.0
    };
    let latency = start.elapsed().as_secs_f64();
    let stats = TurnStats {
        ttft,
        tpot,
        latency,
        prompt_tokens,
        wall_ms: [start_ms, start_ms + ttft * 1e3, start_ms + latency * 1e3],
    };
    (stats, text)
}

/// Runs every conversation of mode `mode` with `s.clients` clients at once.
async fn run_mode(
    client: &reqwest::Client,
    gateway: &str,
    mode: char,
    system: &str,
    s: &Settings,
    trace: Option<&std::path::Path>,
) -> Vec<TurnStats> {
    let queue = Arc::new(Mutex::new((0..s.conversations).collect::<Vec<_>>()));
    let results = Arc::new(Mutex::new(Vec::new()));
    let mut clients = Vec::new();
    for _ in 0..s.clients {
        let trace = trace.map(|d| d.join("turns.jsonl"));
        let (queue, results, client, gateway, system, s) = (
            queue.clone(),
            results.clone(),
            client.clone(),
            gateway.to_owned(),
            system.to_owned(),
            s.clone(),
        );
        clients.push(tokio::spawn(async move {
            loop {
                let Some(conv) = queue.lock().await.pop() else {
                    return;
                };
                let seed = (mode as u64) << 32 | conv as u64;
                let mut messages = vec![json!({"role": "system", "content": system})];
                for turn in 0..s.turns {
                    let user = format!(
                        "Conversation {mode}{conv}, question {turn}: {}?",
                        words(seed * 1000 + turn as u64, s.user_words)
                    );
                    messages.push(json!({"role": "user", "content": user}));
                    let salt = (mode == 'b').then(|| format!("b-{conv}-{turn}"));
                    let (stats, answer) = chat_turn(&client, &gateway, &messages, &s, salt).await;
                    messages.push(json!({"role": "assistant", "content": answer}));
                    let mut results = results.lock().await;
                    if let Some(file) = &trace {
                        let line = json!({"mode": mode.to_string(), "conversation": conv,
                            "turn": turn, "prompt_tokens": stats.prompt_tokens,
                            "sent_ms": stats.wall_ms[0], "first_ms": stats.wall_ms[1],
                            "end_ms": stats.wall_ms[2], "tpot_ms": stats.tpot * 1e3});
                        use std::io::Write;
                        let mut f = std::fs::OpenOptions::new()
                            .create(true)
                            .append(true)
                            .open(file)
                            .expect("the turns log");
                        writeln!(f, "{line}").expect("writing the turns log");
                    }
                    results.push(stats);
                    drop(results);
                    // Keyed by conversation and turn, not mode: every mode waits the same.
                    let wait = think_time((conv as u64) << 32 | turn as u64, s.request_rate);
                    tokio::time::sleep(wait).await;
                }
            }
        }));
    }
    for c in clients {
        c.await.expect("a client task");
    }
    results.lock().await.clone()
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Mean TTFT, p50 TTFT, p99 TTFT, mean TPOT, mean latency.
fn summary(turns: &[TurnStats]) -> [f64; 5] {
    let mut ttft: Vec<f64> = turns.iter().map(|t| t.ttft).collect();
    ttft.sort_by(f64::total_cmp);
    let tpot: Vec<f64> = turns.iter().map(|t| t.tpot).collect();
    let lat: Vec<f64> = turns.iter().map(|t| t.latency).collect();
    [
        mean(&ttft),
        pct(&ttft, 0.5),
        pct(&ttft, 0.99),
        mean(&tpot),
        mean(&lat),
    ]
}

/// A node of the cluster, with the CPU cap it runs under (`PD_BENCH_NODE_CPU`). Fields drop in
/// order: the process is killed and reaped before its cgroup is removed.
struct BenchNode {
    _proc: Proc,
    _cap: Option<CpuCap>,
}

/// A cgroup (v1 `cpu` controller, or v2 with `cpu` enabled) capping one process at a fraction
/// of a core: CFS bandwidth control, `quota` µs of CPU per 10 ms period, whatever the other
/// processes do. With three nodes capped at 0.6 core on a 2-core machine, each node computes at
/// the same pace whether the others are busy or idle: as on a machine where each node has cores
/// of its own, only slower.
struct CpuCap {
    dir: PathBuf,
}

impl CpuCap {
    const PERIOD_US: u64 = 10_000;

    /// Moves process `pid` (all its threads) into a new cgroup named `name` capped at `cores`.
    fn new(name: &str, pid: u32, cores: f64) -> Result<CpuCap, String> {
        let quota = (cores * Self::PERIOD_US as f64).round() as u64;
        let v1 = PathBuf::from("/sys/fs/cgroup/cpu");
        let v2 = PathBuf::from("/sys/fs/cgroup");
        let is_v2 = std::fs::read_to_string(v2.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"));
        let root = if is_v2 { v2 } else { v1 };
        let dir = root.join(format!("pd-bench-{}-{name}", std::process::id()));
        let write = |file: &str, value: String| {
            std::fs::write(dir.join(file), &value)
                .map_err(|e| format!("{}/{file} <- {value}: {e}", dir.display()))
        };
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let cap = CpuCap { dir: dir.clone() };
        if is_v2 {
            write("cpu.max", format!("{quota} {}", Self::PERIOD_US))?;
        } else {
            write("cpu.cfs_period_us", Self::PERIOD_US.to_string())?;
            write("cpu.cfs_quota_us", quota.to_string())?;
        }
        write("cgroup.procs", pid.to_string())?;
        Ok(cap)
    }
}

impl Drop for CpuCap {
    fn drop(&mut self) {
        // Empty once the process is reaped.
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `PD_BENCH_NODE_CPU`: cores each node may use (none: uncapped).
fn node_cpu() -> Option<f64> {
    let v = std::env::var("PD_BENCH_NODE_CPU").ok()?;
    match v.trim().parse::<f64>() {
        Ok(c) if c > 0.0 => Some(c),
        _ => panic!("PD_BENCH_NODE_CPU takes a number of cores > 0, got {v:?}"),
    }
}

fn spawn_node(
    dir: &WorkDir,
    id: &str,
    role: &str,
    registry: &str,
    model: &str,
    s: &Settings,
) -> BenchNode {
    let mut cmd = Command::new(bins::pd_node());
    cmd.args([
        "serve",
        "--model",
        model,
        "--served-model-name",
        MODEL,
        "--port",
        "0",
    ])
    .args(["--engine-id", id, "--num-gpu-blocks", &s.blocks.to_string()])
    .args([
        "--kv-role",
        role,
        "--kv-port",
        "0",
        "--kv-recompute-threshold",
        "0",
    ])
    .args(["--gateway", registry, "--cluster-token", CLUSTER_TOKEN]);
    if role == "kv_consumer" {
        cmd.args(["--kv-retain-after-decode", &s.retain_secs.to_string()]);
    }
    let mut p = Proc::spawn(id, cmd, dir.path());
    // Capped before it loads the model: every thread it starts is in the cgroup.
    let cap = node_cpu().map(|cores| {
        CpuCap::new(id, p.pid(), cores).unwrap_or_else(|e| {
            panic!("PD_BENCH_NODE_CPU needs a writable cgroup cpu controller (root): {e}")
        })
    });
    p.wait_line("pd-node listening on ", Duration::from_secs(120));
    BenchNode {
        _proc: p,
        _cap: cap,
    }
}

async fn push(client: &reqwest::Client, admin: &str, policy: &str, config: &[(String, String)]) {
    let bytes = std::fs::read(bins::policy(policy)).expect("the policy file");
    let r = client
        .put(format!("{admin}/admin/policy"))
        .query(&[("name", policy)])
        .query(config)
        .bearer_auth(ADMIN_TOKEN)
        .body(bytes)
        .send()
        .await
        .expect("PUT /admin/policy");
    assert_eq!(r.status(), 200, "pushing {policy}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let s = Settings::from_args();
    let model: PathBuf = std::env::var_os("PD_MODEL_GGUF")
        .map(PathBuf::from)
        .expect("PD_MODEL_GGUF: the GGUF file (bash scripts/fetch-model.sh)");
    let model = model.to_str().expect("a UTF-8 path").to_owned();
    let dir = WorkDir::new("multi-turn-bench");
    let trace = std::env::var_os("PD_BENCH_TRACE").map(PathBuf::from);
    let gw_args: Vec<String> = match &trace {
        Some(t) => {
            std::fs::create_dir_all(t).expect("the trace directory");
            let _ = std::fs::remove_file(t.join("turns.jsonl"));
            let _ = std::fs::remove_file(t.join("decisions.jsonl"));
            vec![
                "--decision-log-every".into(),
                "1".into(),
                "--decision-log".into(),
                t.join("decisions.jsonl").display().to_string(),
            ]
        }
        None => Vec::new(),
    };
    let gw = Gateway::start(&dir, &gw_args);
    let _p = spawn_node(&dir, "p0", "kv_producer", &gw.registry, &model, &s);
    let _d0 = spawn_node(&dir, "d0", "kv_consumer", &gw.registry, &model, &s);
    let _d1 = spawn_node(&dir, "d1", "kv_consumer", &gw.registry, &model, &s);
    let client = reqwest::Client::new();
    // Until the gateway lists all three (and the decode nodes know P's side channel).
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let r = client
            .get(format!("{}/admin/nodes", gw.admin))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("GET /admin/nodes");
        let v: Value = r.json().await.unwrap_or(Value::Null);
        let n = v["nodes"].as_array().map_or(0, Vec::len);
        if n == 3 {
            break;
        }
        assert!(Instant::now() < until, "the nodes did not all register");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let system = format!("You are a helpful assistant. {}.", words(7, s.system_words));
    eprintln!("settings: {s:?}, node cpu cap: {:?}", node_cpu());
    let modes = std::env::var("PD_BENCH_MODES").unwrap_or_else(|_| "abc".into());
    let c_config: Vec<(String, String)> = std::env::var("PD_BENCH_C_CONFIG")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (format!("config.{}", k.trim()), v.trim().to_owned()))
        .collect();
    if !c_config.is_empty() {
        eprintln!("mode c config: {c_config:?}");
    }
    let mut rows = Vec::new();
    for (mode, policy) in [
        ('a', "round-robin"),
        ('b', "round-robin"),
        ('c', "prefix-aware"),
    ] {
        if !modes.contains(mode) {
            continue;
        }
        let config: &[(String, String)] = if mode == 'c' { &c_config } else { &[] };
        push(&client, &gw.admin, policy, config).await;
        let before = scrape(&client, &gw.http).await;
        let started = Instant::now();
        let turns = run_mode(&client, &gw.http, mode, &system, &s, trace.as_deref()).await;
        let after = scrape(&client, &gw.http).await;
        let how: Vec<String> = [
            "holder",
            "prefill_pulls",
            "decode_pulls",
            "partial",
            "not_used",
        ]
        .iter()
        .map(|h| {
            let f = [("how", *h)];
            let n = after.sum("pd_gateway_reverse_pulls_total", &f)
                - before.sum("pd_gateway_reverse_pulls_total", &f);
            format!("{h}={n}")
        })
        .collect();
        let last: Vec<f64> = turns.iter().map(|t| t.prompt_tokens as f64).collect();
        let max_prompt = last.iter().copied().fold(0.0, f64::max);
        let sm = summary(&turns);
        eprintln!(
            "mode {mode}: {} turns in {:.1} s; TTFT mean {:.3} s p50 {:.3} p99 {:.3}; TPOT mean {:.4} s; latency mean {:.3} s; longest prompt {max_prompt} tokens; {}",
            turns.len(),
            started.elapsed().as_secs_f64(),
            sm[0],
            sm[1],
            sm[2],
            sm[3],
            sm[4],
            how.join(" ")
        );
        let rate = turns.len() as f64 / started.elapsed().as_secs_f64();
        rows.push((mode, sm, turns.len(), rate, max_prompt, how.join(" ")));
    }
    println!(
        "| mode | turns | turns/s | TTFT mean | TTFT p50 | TTFT p99 | TPOT mean | latency mean | longest prompt | placement |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for (mode, sm, n, rate, max_prompt, how) in &rows {
        println!(
            "| {mode} | {n} | {rate:.3} | {:.3} s | {:.3} s | {:.3} s | {:.1} ms | {:.3} s | {max_prompt} | {how} |",
            sm[0],
            sm[1],
            sm[2],
            sm[3] * 1e3,
            sm[4]
        );
    }
    if let Some(t) = &trace {
        // The processes' logs, before the work directory goes.
        for entry in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::copy(entry.path(), t.join(entry.file_name()));
        }
    }
    let row = |m: char| rows.iter().find(|r| r.0 == m).map(|r| r.1);
    for (base, other) in [('a', row('a')), ('b', row('b'))] {
        if let (Some(o), Some(c)) = (other, row('c')) {
            println!(
                "c vs {base}: mean TTFT {:.2}x lower, p99 TTFT {:.2}x lower, TPOT {:+.1}%",
                o[0] / c[0],
                o[2] / c[2],
                (c[3] / o[3] - 1.0) * 100.0
            );
        }
    }
}

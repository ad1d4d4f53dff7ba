//! Our node against llama.cpp's `llama-server` on the same GGUF (SmolLM2-135M-Instruct Q4_1),
//! both over their OpenAI HTTP APIs, in one run, 2 threads each (this machine's cores).
//!
//! Run (release): `PD_MODEL_GGUF=$(bash scripts/fetch-model.sh) LLAMA_BIN=$(bash
//! scripts/llama-cpp.sh) cargo bench -p pd-node --bench llama_race [-- --repeat 3 --weights
//! fast,candle-kernels]` (`--weights`: our node once per `--gguf-weights` setting, default
//! `fast`).
//!
//! Three figures per server, each the median of `--repeat` runs, distinct prompts everywhere
//! (`cache_prompt: false` for llama.cpp; our prefix cache never hits), greedy, EOS ignored:
//! - **decode, 1 client**: `128 / (t(129 tokens) − t(1 token))` on same-length prompts: decode
//!   tokens/s with prefill and HTTP taken out.
//! - **decode, 16 clients**: 16 concurrent requests of 64 tokens on short prompts; completion
//!   tokens / wall time (`llama-server --parallel 16 --cont-batching`).
//! - **prefill**: one ~2000-token prompt, `max_tokens = 1`; prompt tokens / time
//!   (`llama-server --parallel 1`).
//!
//! llama.cpp gets `-t 2 -tb 2`, `-c` of slots × (prompt + max_tokens) and `-ngl 0`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A server process, killed on drop.
struct Server {
    child: Child,
    http: String,
    name: &'static str,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> BenchResult<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn pd_node(model: &Path, weights: &str) -> BenchResult<Server> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-node"))
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", "0", "--served-model-name", "m"])
        .args(["--gguf-weights", weights])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    loop {
        let mut line = String::new();
        if out.read_line(&mut line)? == 0 {
            return Err("pd-node exited before listening".into());
        }
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            return Ok(Server {
                child,
                http: a.to_string(),
                name: "pd-node",
            });
        }
    }
}

async fn llama_server(
    bin: &Path,
    model: &Path,
    parallel: usize,
    ctx: usize,
) -> BenchResult<Server> {
    let port = free_port()?;
    let child = Command::new(bin.join("llama-server"))
        .arg("-m")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["-t", "2", "-tb", "2", "-ngl", "0", "--cont-batching"])
        .args(["--parallel", &parallel.to_string(), "-c", &ctx.to_string()])
        .args(["--alias", "m"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let server = Server {
        child,
        http: format!("http://127.0.0.1:{port}"),
        name: "llama.cpp",
    };
    let client = reqwest::Client::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(120) {
        if let Ok(r) = client.get(format!("{}/health", server.http)).send().await
            && r.status().is_success()
        {
            return Ok(server);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err("llama-server did not become healthy in 120 s".into())
}

/// A distinct prompt of `words` two-syllable words (about two tokens each for this vocabulary;
/// no digits, which SmolLM's pre-tokenizer splits one by one).
fn prompt(salt: &mut u32, words: usize) -> String {
    const SYL: [&str; 16] = [
        "ka", "lo", "mi", "ren", "tas", "vor", "el", "qu", "dan", "si", "po", "ber", "nu", "gat",
        "is", "fe",
    ];
    *salt += 1;
    let mut x = u64::from(*salt).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..words)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
            format!(
                "{}{}",
                SYL[(r & 15) as usize],
                SYL[((r >> 4) & 15) as usize]
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One greedy completion; returns (seconds, prompt tokens, completion tokens).
async fn complete(
    client: &reqwest::Client,
    server: &Server,
    prompt: &str,
    max_tokens: usize,
) -> BenchResult<(f64, u64, u64)> {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "cache_prompt": false});
    let t = Instant::now();
    let r = client
        .post(format!("{}/v1/completions", server.http))
        .json(&body)
        .send()
        .await?;
    if !r.status().is_success() {
        return Err(format!("{}: {} {}", server.name, r.status(), r.text().await?).into());
    }
    let v: Value = r.json().await?;
    let secs = t.elapsed().as_secs_f64();
    let usage = &v["usage"];
    let tokens = |k: &str| {
        usage[k]
            .as_u64()
            .ok_or(format!("{}: no usage.{k}: {v}", server.name))
    };
    Ok((secs, tokens("prompt_tokens")?, tokens("completion_tokens")?))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Decode tokens/s of one client.
async fn decode_one(server: &Server, repeat: usize, salt: &mut u32) -> BenchResult<f64> {
    let client = reqwest::Client::new();
    complete(&client, server, &prompt(salt, 32), 8).await?; // warm-up
    let mut rates = Vec::new();
    for _ in 0..repeat {
        let (t1, _, c1) = complete(&client, server, &prompt(salt, 32), 1).await?;
        let (t129, _, c129) = complete(&client, server, &prompt(salt, 32), 129).await?;
        if c1 != 1 || c129 != 129 {
            return Err(format!("{}: {c1} and {c129} tokens generated", server.name).into());
        }
        rates.push(128.0 / (t129 - t1));
    }
    Ok(median(rates))
}

/// Aggregate decode tokens/s over `clients` concurrent requests of `max_tokens`.
async fn decode_many(
    server: &Server,
    clients: usize,
    max_tokens: usize,
    repeat: usize,
    salt: &mut u32,
) -> BenchResult<f64> {
    let client = reqwest::Client::new();
    let mut rates = Vec::new();
    for _ in 0..repeat {
        let prompts: Vec<String> = (0..clients).map(|_| prompt(salt, 32)).collect();
        let t = Instant::now();
        let answers = futures::future::join_all(
            prompts
                .iter()
                .map(|p| complete(&client, server, p, max_tokens)),
        )
        .await;
        let secs = t.elapsed().as_secs_f64();
        let mut tokens = 0;
        for a in answers {
            tokens += a?.2;
        }
        rates.push(tokens as f64 / secs);
    }
    Ok(median(rates))
}

/// Prefill tokens/s of one ~`words`-token prompt.
async fn prefill(server: &Server, words: usize, repeat: usize, salt: &mut u32) -> BenchResult<f64> {
    let client = reqwest::Client::new();
    complete(&client, server, &prompt(salt, 64), 1).await?; // warm-up
    let mut rates = Vec::new();
    for _ in 0..repeat {
        let (secs, p, _) = complete(&client, server, &prompt(salt, words), 1).await?;
        rates.push(p as f64 / secs);
    }
    Ok(median(rates))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> BenchResult<()> {
    let mut repeat = 3usize;
    // Our node once per `--gguf-weights` setting (e.g. `--weights fast,candle-kernels`).
    let mut weights = vec!["fast".to_string()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--repeat" => repeat = args.next().ok_or("--repeat N")?.parse()?,
            "--weights" => {
                weights = args
                    .next()
                    .ok_or("--weights W[,W...]")?
                    .split(',')
                    .map(str::to_string)
                    .collect()
            }
            "--bench" => {}
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let model = PathBuf::from(
        std::env::var("PD_MODEL_GGUF")
            .map_err(|_| "set PD_MODEL_GGUF=$(bash scripts/fetch-model.sh)")?,
    );
    let llama = PathBuf::from(
        std::env::var("LLAMA_BIN").map_err(|_| "set LLAMA_BIN=$(bash scripts/llama-cpp.sh)")?,
    );
    const CLIENTS: usize = 16;
    const MANY_TOKENS: usize = 64;
    const PREFILL_WORDS: usize = 900;
    let mut salt = 0u32;
    let mut ours_rows: Vec<(String, [f64; 3])> = Vec::new();
    let mut prefill_tokens = 0;
    for w in &weights {
        let ours = pd_node(&model, w)?;
        let a = decode_one(&ours, repeat, &mut salt).await?;
        let b = decode_many(&ours, CLIENTS, MANY_TOKENS, repeat, &mut salt).await?;
        let c = prefill(&ours, PREFILL_WORDS, repeat, &mut salt).await?;
        prefill_tokens = {
            let client = reqwest::Client::new();
            complete(&client, &ours, &prompt(&mut salt, PREFILL_WORDS), 1)
                .await?
                .1
        };
        drop(ours);
        ours_rows.push((w.clone(), [a, b, c]));
    }

    // llama.cpp: 16 slots for the decode figures, 1 for prefill; context for every slot.
    let many = llama_server(&llama, &model, CLIENTS, CLIENTS * 512).await?;
    let la = decode_one(&many, repeat, &mut salt).await?;
    let lb = decode_many(&many, CLIENTS, MANY_TOKENS, repeat, &mut salt).await?;
    drop(many);
    let one = llama_server(&llama, &model, 1, 4096).await?;
    let lc = prefill(&one, PREFILL_WORDS, repeat, &mut salt).await?;
    drop(one);

    println!(
        "SmolLM2-135M-Instruct Q4_1, 2 threads each, median of {repeat}; prefill prompt {prefill_tokens} tokens"
    );
    println!("| figure | pd-node --gguf-weights | pd-node | llama.cpp | ours / llama.cpp |");
    println!("|---|---|---:|---:|---:|");
    let names = [
        "decode tok/s, 1 client",
        "decode tok/s, 16 clients",
        "prefill tok/s",
    ];
    for (i, (name, theirs)) in names.into_iter().zip([la, lb, lc]).enumerate() {
        for (w, ours) in &ours_rows {
            println!(
                "| {name} | {w} | {:.1} | {theirs:.1} | {:.2}× |",
                ours[i],
                ours[i] / theirs
            );
        }
    }
    Ok(())
}

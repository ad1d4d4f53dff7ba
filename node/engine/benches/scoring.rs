//! What scoring a prompt costs (`prompt_logprobs`, `echo` with `logprobs`: lm-evaluation-
//! harness's loglikelihood requests): the same engine and prompt computed with one next-token
//! row (a plain prefill, the reference) and with every position's row scored, on the real
//! model when `PD_MODEL_GGUF` names it (else a generated one, whose 512-token vocabulary says
//! little about a real one's 49 152).
//!
//! Run (release): `PD_MODEL_GGUF=... cargo bench -p pd-engine --bench scoring`
//! (`PD_BENCH_REPEAT`, default 5; `PD_BENCH_LENS`, default `128,512,2048`). Results are
//! recorded in `BENCHMARKS.md` ("Scoring prompts").
//!
//! Rows per prompt length, interleaved `repeat` times so that background load hits all alike;
//! the prefix cache is off, so every row computes the whole prompt:
//! - *prefill*: `max_tokens: 1`, nothing scored (the reference);
//! - *scored, k = 0*: the same with `prompt_logprobs: 0` (each prompt token's own logprob and
//!   rank: the LM head on every row, a log-sum-exp and a rank count per row);
//! - *scored, k = 5*: with five alternatives per position (a top-k select per row).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use pd_engine::{
    Engine, EngineConfig, EngineHandle, GenerateRequest, RequestEvent, SamplingParams,
};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Seconds from submit to the end, and the prompt tokens scored.
async fn run(handle: &EngineHandle, prompt: &[u32], k: Option<usize>) -> BenchResult<(f64, usize)> {
    let started = Instant::now();
    let mut s = handle.submit(GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: Some(1),
            prompt_logprobs: k,
            ..SamplingParams::default()
        },
        kv: Default::default(),
        cache_salt: None,
        gateway: None,
    })?;
    let mut scored = 0;
    while let Some(e) = s.recv().await {
        match e {
            RequestEvent::PromptLogprobs { logprobs, .. } => scored += logprobs.len(),
            RequestEvent::Failed { message } => return Err(message.into()),
            _ => {}
        }
    }
    Ok((started.elapsed().as_secs_f64(), scored))
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() -> BenchResult<()> {
    let repeat: usize = std::env::var("PD_BENCH_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let lens: Vec<usize> = std::env::var("PD_BENCH_LENS")
        .unwrap_or_else(|_| "128,512,2048".into())
        .split(',')
        .map(|l| l.trim().parse())
        .collect::<Result<_, _>>()?;
    let model = std::env::var("PD_MODEL_GGUF").ok().map(PathBuf::from);
    println!(
        "command: PD_MODEL_GGUF=... cargo bench -p pd-engine --bench scoring (repeat {repeat})"
    );
    let _tmp;
    let model_dir = match model {
        Some(m) => m,
        None => {
            let d = std::env::temp_dir().join(format!("pd-bench-scoring-{}", std::process::id()));
            pd_model::tiny::generate(&pd_model::tiny::TinySpec::default(), &d)?;
            _tmp = TempDir(d.clone());
            d
        }
    };
    println!("model:   {}", model_dir.display());
    let engine = Engine::load(&EngineConfig {
        model_dir: model_dir.clone(),
        enable_prefix_caching: false,
        ..EngineConfig::default()
    })?;
    let handle = EngineHandle::spawn(engine)?;
    let tokenizer = handle.tokenizer().clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let passage = "The prefill node computes the prompt's key and value cache; the decode node \
                   pulls it over UCX and generates the answer token by token. ";
    println!(
        "\n| prompt tokens | prefill (reference) | scored, k = 0 | scored, k = 5 | k = 0 / prefill | scored tokens/s (k = 0) |\n|---:|---:|---:|---:|---:|---:|"
    );
    for &len in &lens {
        let mut prompt = Vec::new();
        while prompt.len() < len {
            prompt.extend(tokenizer.encode(passage, false)?);
        }
        prompt.truncate(len);
        rt.block_on(run(&handle, &prompt, Some(0)))?; // warm-up
        let (mut plain, mut k0, mut k5) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeat {
            plain.push(rt.block_on(run(&handle, &prompt, None))?.0);
            let (s, scored) = rt.block_on(run(&handle, &prompt, Some(0)))?;
            assert_eq!(scored, len - 1, "every prompt token after the first");
            k0.push(s);
            k5.push(rt.block_on(run(&handle, &prompt, Some(5)))?.0);
        }
        let (p, k0m, k5m) = (median(plain).0, median(k0).0, median(k5).0);
        println!(
            "| {len} | {:.1} ms | {:.1} ms | {:.1} ms | {:.2}× | {:.0} |",
            p * 1e3,
            k0m * 1e3,
            k5m * 1e3,
            k0m / p,
            (len - 1) as f64 / k0m
        );
    }
    drop(handle);
    std::thread::sleep(Duration::from_millis(10));
    Ok(())
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

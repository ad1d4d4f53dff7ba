//! What structured output costs a decode: the same engine, the same prompt, greedy, with and
//! without a JSON schema, on the real model when `PD_MODEL_GGUF` names it (else on a generated
//! model, whose 512-token byte-level vocabulary says little about a real one's 49 152).
//!
//! Run (release): `PD_MODEL_GGUF=... cargo bench -p pd-engine --bench structured`
//! (`PD_BENCH_REPEAT`, default 5). Results are recorded in `BENCHMARKS.md` ("Structured output").
//!
//! Rows, interleaved `repeat` times so that background load hits all alike:
//! - *schema*: a chat request whose answer must be a JSON object holding a list of 30 short
//!   strings (a long constrained answer: every token masked); decode tokens/s from its first
//!   token to its last.
//! - *plain*: the same request without the schema, `ignore_eos`, `max_tokens` = the schema
//!   answer's length: the same number of decode steps, unmasked.
//! - *mask + accept*: the schema answer's tokens replayed through a matcher off the engine (µs
//!   per token for `TokenMatcher::mask` then `accept`): for a schema met first (a fresh
//!   vocabulary: compile and lexer states from nothing) and for one seen before (the kept
//!   compile), with both compile times, against the reference of one argmax over a row of the
//!   same width (what greedy sampling itself costs per token).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_engine::{
    Engine, EngineConfig, EngineHandle, GenerateRequest, RequestEvent, SamplingParams,
    StructuredOutput,
};
use pd_grammar::{OutputSpec, Vocabulary};
use pd_tokenize::ChatMessage;

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "fruits": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 30,
                "maxItems": 30
            }
        },
        "required": ["fruits"],
        "additionalProperties": false
    })
}

/// Tokens of one greedy answer and the seconds from its first token to its last.
async fn answer(
    handle: &EngineHandle,
    prompt: &[u32],
    params: SamplingParams,
) -> BenchResult<(Vec<u32>, f64)> {
    let mut s = handle.submit(GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        params,
        kv: Default::default(),
        cache_salt: None,
        gateway: None,
    })?;
    let (mut tokens, mut first, mut last) = (Vec::new(), None, Instant::now());
    while let Some(e) = s.recv().await {
        match e {
            RequestEvent::Token { token_id, .. } => {
                tokens.push(token_id);
                last = Instant::now();
                first.get_or_insert(last);
            }
            RequestEvent::Failed { message } => return Err(message.into()),
            _ => {}
        }
    }
    let secs = first.map_or(0.0, |f| (last - f).as_secs_f64());
    Ok((tokens, secs))
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
    let model = std::env::var("PD_MODEL_GGUF").ok().map(PathBuf::from);
    println!(
        "command: PD_MODEL_GGUF=... cargo bench -p pd-engine --bench structured (repeat {repeat})"
    );
    let _tmp;
    let model_dir = match model {
        Some(m) => m,
        None => {
            let d =
                std::env::temp_dir().join(format!("pd-bench-structured-{}", std::process::id()));
            pd_model::tiny::generate(&pd_model::tiny::TinySpec::default(), &d)?;
            _tmp = TempDir(d.clone());
            d
        }
    };
    println!("model:   {}", model_dir.display());
    let engine = Engine::load(&EngineConfig {
        model_dir: model_dir.clone(),
        ..EngineConfig::default()
    })?;
    let handle = EngineHandle::spawn(engine)?;
    let tokenizer = handle.tokenizer().clone();
    let text = tokenizer.apply_chat_template(
        &[
            ChatMessage::new("system", "Answer in JSON."),
            ChatMessage::new("user", "List 30 fruits."),
        ],
        true,
    )?;
    let prompt = tokenizer.encode(&text, false)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let spec = OutputSpec::JsonSchema(schema());
    let structured = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(600),
        structured: Some(StructuredOutput {
            spec: spec.clone(),
            field: "response_format",
        }),
        ..SamplingParams::default()
    };
    // Warm-up, and the answer's length for the plain rows.
    let (tokens, _) = rt.block_on(answer(&handle, &prompt, structured.clone()))?;
    let text = tokenizer.decode(&tokens, true)?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    println!(
        "schema answer: {} tokens, {} fruits, valid JSON",
        tokens.len(),
        v["fruits"].as_array().map_or(0, Vec::len)
    );
    let plain = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(tokens.len()),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let steps = (tokens.len() - 1) as f64;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..repeat {
        let (t, s) = rt.block_on(answer(&handle, &prompt, structured.clone()))?;
        assert_eq!(t, tokens, "greedy answers differ between runs");
        with.push(steps / s);
        let (t, s) = rt.block_on(answer(&handle, &prompt, plain.clone()))?;
        assert_eq!(t.len(), tokens.len());
        without.push(steps / s);
    }

    // Mask + accept per token, off the engine, replaying the answer: a schema met for the first
    // time (a fresh vocabulary: compile from nothing, every lexer state built on the way) and
    // a repeated one (the kept compile, its lexer states already built).
    let mut eos = tokenizer.eos_token_ids().to_vec();
    eos.sort_unstable();
    let width = handle.info().vocab_size;
    let row: Vec<f32> = (0..width)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect();
    let replay = |m: &mut pd_grammar::TokenMatcher| -> BenchResult<f64> {
        let started = Instant::now();
        for &t in &tokens {
            let mut r = row.clone();
            m.mask(&mut r)?;
            m.accept(t)?;
        }
        Ok(started.elapsed().as_secs_f64() * 1e6 / tokens.len() as f64)
    };
    let kept = Vocabulary::new(Arc::clone(&tokenizer), &eos)?;
    kept.compile(&spec)?;
    let (mut cold_compile, mut kept_compile) = (Vec::new(), Vec::new());
    let (mut cold_us, mut warm_us, mut argmax_us) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeat {
        let fresh = Vocabulary::new(Arc::clone(&tokenizer), &eos)?;
        let started = Instant::now();
        let mut m = fresh.compile(&spec)?;
        cold_compile.push(started.elapsed().as_secs_f64() * 1e3);
        cold_us.push(replay(&mut m)?);
        let started = Instant::now();
        let mut m = kept.compile(&spec)?;
        kept_compile.push(started.elapsed().as_secs_f64() * 1e3);
        warm_us.push(replay(&mut m)?);
        let started = Instant::now();
        let mut sink = 0usize;
        for _ in &tokens {
            let r = row.clone();
            sink ^= r
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                )
                .0;
        }
        std::hint::black_box(sink);
        argmax_us.push(started.elapsed().as_secs_f64() * 1e6 / tokens.len() as f64);
    }
    let show = |name: &str, unit: &str, (m, lo, hi): (f64, f64, f64)| {
        println!("| {name} | {m:.1} {unit} | {lo:.1}–{hi:.1} |");
    };
    println!(
        "\n| row (batch 1, greedy, {} decode steps) | median | range |\n|---|---:|---:|",
        steps
    );
    show("schema (every token masked)", "tok/s", median(with));
    show("plain (same steps, no mask)", "tok/s", median(without));
    show(
        "mask + accept per token, schema seen before (kept compile)",
        "µs",
        median(warm_us),
    );
    show(
        "mask + accept per token, schema met first (fresh compile)",
        "µs",
        median(cold_us),
    );
    show("compile, schema seen before", "ms", median(kept_compile));
    show("compile, schema met first", "ms", median(cold_compile));
    show(
        &format!("reference: argmax over a {width}-wide row + its copy"),
        "µs",
        median(argmax_us),
    );
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

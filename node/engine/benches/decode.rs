//! Decode throughput of the engine at batch 1, 4 and 16 against candle-transformers' stock Llama
//! at batch 1, on the same generated model, in the same process.
//!
//! Run (release): `cargo bench -p pd-engine --bench decode [-- --quick --layers 8 ...]`
//! (`--help` lists the knobs). Results are recorded in `BENCHMARKS.md` ("Decode throughput").
//!
//! What is measured:
//! - Reference: prefill the prompt with one `Llama::forward`, then time `tokens` greedy steps
//!   (`forward` of a `(1, 1)` input + argmax on the host).
//! - Engine: submit `batch` requests with different prompts at once (greedy, `ignore_eos`,
//!   `max_tokens = tokens + 1`) and read their streams. Every request gets its first token from
//!   its prefill; the clock starts when the last request has its first token (all prefills done)
//!   and stops at the last token, so the window holds exactly `batch * tokens` decode tokens.
//!   The time includes everything a server pays per step: scheduling, the forward pass,
//!   sampling, detokenization and the event channel.
//!
//! On a GPU (`cargo bench -p pd-engine --features cuda --bench decode -- --device cuda`) both
//! run on CUDA device 0: the engine on its device pool and our kernels, the reference on
//! candle's CUDA backend; the reference's argmax reads its logits back each step, as the
//! engine's sampler does.
//!
//! Each configuration runs `--repeat` times, interleaved (reference, batch 1, 4, 16, then again)
//! so that background load hits all of them alike; the table shows the median and the range.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};
use pd_engine::{
    Engine, EngineConfig, EngineHandle, GenerateRequest, KvCompute, ModelDtype, RequestEvent,
    SamplingParams,
};
use pd_model::tiny::{TinyArch, TinySpec, generate};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Command-line knobs.
#[derive(Debug, Clone)]
struct Options {
    spec: TinySpec,
    prompt_len: usize,
    /// Decode tokens timed per sequence.
    tokens: usize,
    batches: Vec<usize>,
    repeat: usize,
    block_size: usize,
    /// What both sides compute in (`--dtype f32|f16|bf16`).
    dtype: DType,
    /// Where both sides run: `--device cpu` or `--device cuda` (CUDA device 0; a build with
    /// `--features cuda`).
    cuda: bool,
}

const USAGE: &str = "usage: cargo bench -p pd-engine --bench decode -- [--quick] [--layers N] \
[--hidden N] [--heads N] [--kv-heads N] [--vocab N] [--intermediate N] [--prompt N] \
[--tokens N] [--batches 1,4,16] [--repeat N] [--block-size N] [--dtype f32|f16|bf16] \
[--device cpu|cuda]";

impl Options {
    fn parse() -> BenchResult<Self> {
        let mut o = Options {
            spec: TinySpec {
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
            },
            prompt_len: 32,
            tokens: 128,
            batches: vec![1, 4, 16],
            repeat: 3,
            block_size: 16,
            dtype: DType::F32,
            cuda: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = |name: &str| -> BenchResult<usize> {
                let v = args.next().ok_or_else(|| format!("{name} needs a value"))?;
                Ok(v.parse().map_err(|e| format!("{name} {v}: {e}"))?)
            };
            match arg.as_str() {
                // `cargo bench` passes `--bench` to every bench binary.
                "--bench" => {}
                "--quick" => {
                    o.tokens = 32;
                    o.repeat = 1;
                }
                "--layers" => o.spec.layers = value("--layers")?,
                "--hidden" => o.spec.hidden = value("--hidden")?,
                "--heads" => o.spec.heads = value("--heads")?,
                "--kv-heads" => o.spec.kv_heads = value("--kv-heads")?,
                "--vocab" => o.spec.vocab = value("--vocab")?,
                "--intermediate" => o.spec.intermediate = value("--intermediate")?,
                "--prompt" => o.prompt_len = value("--prompt")?,
                "--tokens" => o.tokens = value("--tokens")?,
                "--repeat" => o.repeat = value("--repeat")?,
                "--block-size" => o.block_size = value("--block-size")?,
                "--device" => {
                    let v = args.next().ok_or("--device needs a value")?;
                    o.cuda = match v.as_str() {
                        "cpu" => false,
                        "cuda" => true,
                        _ => return Err(format!("--device {v}: cpu or cuda").into()),
                    };
                }
                "--dtype" => {
                    let v = args.next().ok_or("--dtype needs a value")?;
                    o.dtype = match v.as_str() {
                        "f32" => DType::F32,
                        "f16" => DType::F16,
                        "bf16" => DType::BF16,
                        _ => return Err(format!("--dtype {v}: f32, f16 or bf16").into()),
                    };
                }
                "--batches" => {
                    let v = args.next().ok_or("--batches needs a value")?;
                    o.batches = v
                        .split(',')
                        .map(|b| b.trim().parse::<usize>())
                        .collect::<Result<_, _>>()
                        .map_err(|e| format!("--batches {v}: {e}"))?;
                }
                "-h" | "--help" => {
                    println!("{USAGE}");
                    std::process::exit(0);
                }
                other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
            }
        }
        if o.prompt_len == 0 || o.tokens == 0 || o.repeat == 0 || o.batches.contains(&0) {
            return Err("prompt, tokens, repeat and batch sizes must be positive".into());
        }
        if o.prompt_len + o.tokens + 1 > o.spec.max_position_embeddings {
            return Err("prompt + tokens exceed the context length".into());
        }
        Ok(o)
    }

    fn shape(&self) -> String {
        let s = &self.spec;
        format!(
            "Llama, {} layers, hidden {}, {} heads / {} kv heads (head_dim {}), intermediate {}, \
             vocab {}, {} on {}; prompt {} tokens, {} timed decode tokens per sequence, block size {}",
            s.layers,
            s.hidden,
            s.heads,
            s.kv_heads,
            s.hidden / s.heads.max(1),
            s.intermediate,
            s.vocab,
            self.dtype.as_str(),
            if self.cuda {
                "CUDA device 0"
            } else {
                "the CPU"
            },
            self.prompt_len,
            self.tokens,
            self.block_size
        )
    }
}

/// A model directory in the temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "pd-engine-bench-decode-{}-{nanos}",
            std::process::id()
        ));
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Prompt `seq` of repeat `round`: byte tokens (< 256) from a xorshift stream, so that no two
/// prompts share a prefix block (the prefix cache would otherwise skip work across rounds).
fn prompt(len: usize, round: usize, seq: usize) -> Vec<u32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ ((round as u64) << 32 | seq as u64).wrapping_mul(31);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 256) as u32
        })
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0 as u32
}

/// Stock candle-transformers Llama with its contiguous per-sequence cache.
struct Reference {
    model: Llama,
    cfg: candle_transformers::models::llama::Config,
    dtype: DType,
    device: Device,
}

impl Reference {
    fn load(dir: &Path, dtype: DType, device: &Device) -> BenchResult<Self> {
        let files = pd_model::llama::safetensors_files(dir)?;
        // SAFETY: the files are ours, in a private temp dir, and not modified while mapped.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
        let text = std::fs::read_to_string(dir.join("config.json"))?;
        let cfg = serde_json::from_str::<LlamaConfig>(&text)?.into_config(false);
        Ok(Self {
            model: Llama::load(vb, &cfg)?,
            cfg,
            dtype,
            device: device.clone(),
        })
    }

    /// Prefills `prompt`, then times `tokens` greedy decode steps. Returns the decode time.
    fn decode(&self, prompt: &[u32], tokens: usize) -> BenchResult<Duration> {
        let dev = self.device.clone();
        let mut cache = Cache::new(true, self.dtype, &self.cfg, &dev)?;
        // (1, prompt_len) → logits of the last position, (1, vocab).
        let input = Tensor::new(prompt, &dev)?.unsqueeze(0)?;
        let logits = self.model.forward(&input, 0, &mut cache)?;
        let mut next = argmax(
            &logits
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
        let start = Instant::now();
        for pos in prompt.len()..prompt.len() + tokens {
            let input = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
            let logits = self.model.forward(&input, pos, &mut cache)?;
            next = argmax(
                &logits
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            );
        }
        Ok(start.elapsed())
    }
}

/// Submits `batch` requests at once and returns the decode window: from the moment every
/// request has its first (prefill) token to the last token, and the tokens generated in it.
async fn engine_decode(
    handle: &EngineHandle,
    prompt_len: usize,
    tokens: usize,
    batch: usize,
    round: usize,
) -> BenchResult<(Duration, usize)> {
    let mut streams = Vec::with_capacity(batch);
    for seq in 0..batch {
        streams.push(handle.submit(GenerateRequest {
            prompt_tokens: prompt(prompt_len, round, seq),
            params: SamplingParams {
                temperature: 0.0,
                max_tokens: Some(tokens + 1),
                ignore_eos: true,
                ..SamplingParams::default()
            },
            kv: Default::default(),
            cache_salt: None,
            gateway: None,
        })?);
    }
    let mut tasks = Vec::with_capacity(batch);
    for mut stream in streams {
        // Per request: when its first token arrived, when its last one did, how many.
        tasks.push(tokio::spawn(async move {
            let mut first = None;
            let mut last = None;
            let mut count = 0usize;
            while let Some(event) = stream.recv().await {
                match event {
                    RequestEvent::Token { .. } => {
                        let now = Instant::now();
                        first.get_or_insert(now);
                        last = Some(now);
                        count += 1;
                    }
                    RequestEvent::Failed { message } => return Err(message),
                    _ => {}
                }
            }
            match (first, last) {
                (Some(f), Some(l)) => Ok((f, l, count)),
                _ => Err("request produced no token".to_string()),
            }
        }));
    }
    let mut all_first: Option<Instant> = None;
    let mut all_last: Option<Instant> = None;
    let mut decoded = 0;
    for task in tasks {
        let (first, last, count) = task.await??;
        if count != tokens + 1 {
            return Err(format!("expected {} tokens, got {count}", tokens + 1).into());
        }
        all_first = Some(all_first.map_or(first, |a| a.max(first)));
        all_last = Some(all_last.map_or(last, |a| a.max(last)));
        // Token 0 comes from the prefill step; tokens 1.. from decode steps.
        decoded += count - 1;
    }
    let window = match (all_first, all_last) {
        (Some(f), Some(l)) => l.saturating_duration_since(f),
        _ => return Err("empty batch".into()),
    };
    Ok((window, decoded))
}

/// Median and range of a set of rates.
fn summarize(mut rates: Vec<f64>) -> (f64, f64, f64) {
    rates.sort_by(f64::total_cmp);
    let n = rates.len();
    let median = if n % 2 == 1 {
        rates[n / 2]
    } else {
        (rates[n / 2 - 1] + rates[n / 2]) / 2.0
    };
    (median, rates[0], rates[n - 1])
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn main() -> BenchResult<()> {
    let o = Options::parse()?;
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let extra = if args.is_empty() {
        String::new()
    } else {
        format!(" -- {}", args.join(" "))
    };
    // Thread-count variables change candle's matmul path (docs/bench-log/decode.md): show them.
    let env: String = ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"]
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| format!("{k}={v} ")))
        .collect();
    println!("command: {env}cargo bench -p pd-engine --bench decode{extra}");
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("machine: {}, {cores} cores", cpu_model());
    println!("model:   {}", o.shape());

    let dir = TempDir::new();
    generate(&o.spec, &dir.0)?;

    let device = if o.cuda {
        Device::new_cuda(0)?
    } else {
        Device::Cpu
    };
    let reference = Reference::load(&dir.0, o.dtype, &device)?;
    let max_batch = o.batches.iter().copied().max().unwrap_or(1);
    // Room for every sequence of the largest batch (prompt + tokens + 1), plus slack.
    let blocks_per_seq = (o.prompt_len + o.tokens + 2).div_ceil(o.block_size);
    let engine = Engine::load(&EngineConfig {
        model_dir: dir.0.clone(),
        block_size: o.block_size,
        num_blocks: Some(max_batch * blocks_per_seq + 16),
        max_num_batched_tokens: 4096.max(max_batch * o.prompt_len),
        max_num_seqs: 256.max(max_batch),
        kv_compute: if o.cuda {
            KvCompute::Cuda(0)
        } else {
            KvCompute::InPlace
        },
        dtype: match o.dtype {
            DType::F16 => ModelDtype::F16,
            DType::BF16 => ModelDtype::Bf16,
            _ => ModelDtype::F32,
        },
        ..EngineConfig::default()
    })?;
    let handle = EngineHandle::spawn(engine)?;
    // The runtime only waits on channels; one thread keeps it off the cores the model uses.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    // Warm-up: page in the weights, start the thread pools, size the allocators.
    reference.decode(&prompt(o.prompt_len, usize::MAX, 0), 8)?;
    rt.block_on(engine_decode(
        &handle,
        o.prompt_len,
        8,
        max_batch,
        usize::MAX - 1,
    ))?;

    let mut ref_rates = Vec::with_capacity(o.repeat);
    let mut ours: Vec<Vec<f64>> = vec![Vec::with_capacity(o.repeat); o.batches.len()];
    for round in 0..o.repeat {
        let t = reference.decode(&prompt(o.prompt_len, round, 0), o.tokens)?;
        let rate = o.tokens as f64 / t.as_secs_f64();
        eprintln!("round {round}: reference batch 1: {rate:.1} tok/s");
        ref_rates.push(rate);
        for (i, &b) in o.batches.iter().enumerate() {
            let (t, n) = rt.block_on(engine_decode(&handle, o.prompt_len, o.tokens, b, round))?;
            let rate = n as f64 / t.as_secs_f64();
            eprintln!("round {round}: engine batch {b}: {rate:.1} tok/s");
            ours[i].push(rate);
        }
    }

    let (ref_med, ref_lo, ref_hi) = summarize(ref_rates);
    println!();
    println!(
        "median of {} run(s); decode tok/s = decode tokens / decode wall time",
        o.repeat
    );
    println!();
    println!("| run | batch | decode tok/s | range | ms / step | × reference b1 |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| candle-transformers llama (reference) | 1 | {ref_med:.0} | {ref_lo:.0}–{ref_hi:.0} | \
         {:.2} | 1.00 |",
        1000.0 / ref_med
    );
    for (&b, rates) in o.batches.iter().zip(ours) {
        let (med, lo, hi) = summarize(rates);
        println!(
            "| pd-engine | {b} | {med:.0} | {lo:.0}–{hi:.0} | {:.2} | {:.2} |",
            1000.0 * b as f64 / med,
            med / ref_med
        );
    }
    Ok(())
}

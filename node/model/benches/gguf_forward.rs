//! The whole real model (SmolLM2-135M-Instruct Q4_1) through our paged forward pass, per
//! weight policy: prefill of a 512-token prompt in one step (`--prompt N` for another length),
//! then 64 decode steps at batch 1 (`--tokens M` for another count; context N to N + M), f32
//! KV (`--kv-dtype f16|bf16` for another). The model alone: no scheduler, sampler or HTTP.
//!
//! Run: `PD_MODEL_GGUF=$(bash scripts/fetch-model.sh) RAYON_NUM_THREADS=1 \
//!   cargo bench -p pd-model --bench gguf_forward [-- --policies fast,candle-kernels]
//!   [--prompt 2000] [--kv-dtype f16]`
//! (policies: `dense`, `fast`, `candle-kernels`, `as-stored`; all by default, interleaved per
//! round). Results are in `BENCHMARKS.md` ("GGUF weight formats").

use std::time::Instant;

use candle_core::Device;
use pd_model::ModelSource;
use pd_model::gguf::QuantPolicy;

#[path = "../tests/common/mod.rs"]
mod common;

fn main() {
    let Ok(path) = std::env::var("PD_MODEL_GGUF") else {
        eprintln!("set PD_MODEL_GGUF to the model file (bash scripts/fetch-model.sh)");
        std::process::exit(2);
    };
    let source = match ModelSource::open(std::path::Path::new(&path)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let mut policies = vec![
        QuantPolicy::Dense,
        QuantPolicy::Fast,
        QuantPolicy::CandleKernels,
        QuantPolicy::AsStored,
    ];
    let mut prompt_len = 512usize;
    let mut tokens = 64usize;
    let mut dtype = pd_kv_pool::KvDtype::F32;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--prompt" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n > 0 => prompt_len = n,
                _ => {
                    eprintln!("--prompt takes a positive token count");
                    std::process::exit(2);
                }
            },
            "--tokens" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n > 0 => tokens = n,
                _ => {
                    eprintln!("--tokens takes a positive count");
                    std::process::exit(2);
                }
            },
            "--kv-dtype" => {
                dtype = match args.next().as_deref() {
                    Some("f32") => pd_kv_pool::KvDtype::F32,
                    Some("f16") => pd_kv_pool::KvDtype::F16,
                    Some("bf16") => pd_kv_pool::KvDtype::BF16,
                    _ => {
                        eprintln!("--kv-dtype takes f32, f16 or bf16");
                        std::process::exit(2);
                    }
                }
            }
            "--policies" => {
                let v = args.next().unwrap_or_default();
                let parsed: Result<Vec<_>, _> = v
                    .split(',')
                    .map(|p| match p {
                        "dense" => Ok(QuantPolicy::Dense),
                        "fast" => Ok(QuantPolicy::Fast),
                        "candle-kernels" => Ok(QuantPolicy::CandleKernels),
                        "as-stored" => Ok(QuantPolicy::AsStored),
                        other => Err(other.to_owned()),
                    })
                    .collect();
                match parsed {
                    Ok(p) => policies = p,
                    Err(other) => {
                        eprintln!("unknown policy {other}");
                        std::process::exit(2);
                    }
                }
            }
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    println!(
        "threads: RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    );
    // Distinct, ordinary token ids.
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| 100 + (i * 37) % 20000)
        .collect();
    println!("KV cache: {dtype:?}");
    println!("| round | policy | prefill {prompt_len} tok/s | decode batch 1 tok/s |");
    println!("|---:|---|---:|---:|");
    for round in 0..2 {
        for &policy in &policies {
            let model = match source.load_model_with(&Device::Cpu, policy) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("{e}");
                    std::process::exit(1);
                }
            };
            let mut ours = common::Ours::with_dtype(&model, prompt_len + tokens + 1, dtype);
            let t = Instant::now();
            ours.step(&prompt, 0);
            let prefill = t.elapsed();
            let t = Instant::now();
            for i in 0..tokens {
                ours.step(&[200 + (i % 1000) as u32], prompt_len + i);
            }
            let decode = t.elapsed();
            println!(
                "| {round} | {policy:?} | {:.0} | {:.1} |",
                prompt_len as f64 / prefill.as_secs_f64(),
                tokens as f64 / decode.as_secs_f64()
            );
        }
    }
}

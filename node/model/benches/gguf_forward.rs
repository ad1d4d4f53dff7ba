//! The whole real model (SmolLM2-135M-Instruct Q4_1) through our paged forward pass, per
//! weight policy: prefill of a 512-token prompt in one step, then 64 decode steps at batch 1
//! (context 512–576), f32 KV. The model alone: no scheduler, sampler or HTTP.
//!
//! Run: `PD_MODEL_GGUF=$(bash scripts/fetch-model.sh) RAYON_NUM_THREADS=1 \
//!   cargo bench -p pd-model --bench gguf_forward [-- --policies fast,candle-kernels]`
//! (policies: `dense`, `fast`, `candle-kernels`, `as-stored`; all by default, interleaved per
//! round). Results are in `BENCHMARKS.md`.

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
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
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
    let prompt: Vec<u32> = (0..512u32).map(|i| 100 + (i * 37) % 20000).collect();
    println!("| round | policy | prefill 512 tok/s | decode batch 1 tok/s |");
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
            let mut ours = common::Ours::new(&model, 700);
            let t = Instant::now();
            ours.step(&prompt, 0);
            let prefill = t.elapsed();
            let t = Instant::now();
            for i in 0..64u32 {
                ours.step(&[200 + i], 512 + i as usize);
            }
            let decode = t.elapsed();
            println!(
                "| {round} | {policy:?} | {:.0} | {:.1} |",
                512.0 / prefill.as_secs_f64(),
                64.0 / decode.as_secs_f64()
            );
        }
    }
}

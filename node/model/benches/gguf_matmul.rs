//! What to do with GGUF weight types that candle-core 0.11.1 has no SIMD dot product for (Q4_1):
//! keep them (candle's scalar kernel, or ours: `pd_model::q4_1`, per SIMD kernel this CPU runs),
//! requantize them at load (Q8_0, Q4_0) or dequantize them (f32). Times one matmul of the real
//! model's shapes per format and batch size, and measures each format's error against the exact
//! Q4_1 weights.
//!
//! Run: `PD_MODEL_GGUF=$(bash scripts/fetch-model.sh) RAYON_NUM_THREADS=2 \
//!   cargo bench -p pd-model --bench gguf_matmul [-- --rows 1,4,16,64,512]`
//! Results are in `BENCHMARKS.md` ("GGUF weight formats"); the decision and its history in
//! `docs/bench-log/gguf.md`.

use std::time::{Duration, Instant};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor, gguf_file};
use candle_core::{Device, Module, Tensor};
use pd_model::q4_1::{Q4_1Kernel, Q4_1Matrix};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A weight in one of the formats compared.
enum Weight {
    Quantized(QMatMul),
    /// (in, out), contiguous: how `pd-model` keeps dense projections.
    Dense(Tensor),
    /// Q4_1 through `pd_model::q4_1`.
    Ours(Q4_1Matrix),
}

impl Weight {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Weight::Quantized(q) => q.forward(x),
            Weight::Dense(wt) => x.matmul(wt),
            Weight::Ours(w) => w.forward(x),
        }
    }
}

fn main() -> BenchResult<()> {
    let path = std::env::var("PD_MODEL_GGUF")
        .map_err(|_| "set PD_MODEL_GGUF to the model file (bash scripts/fetch-model.sh)")?;
    let mut rows = vec![1usize, 4, 16, 64, 512];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--rows" => {
                let v = args.next().ok_or("--rows needs a value")?;
                rows = v
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("--rows {v}: {e}"))?;
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let dev = Device::Cpu;
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    // One of each shape of a decoder layer, and the LM head (tied embeddings, Q8_0 in the file).
    let names = [
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.ffn_up.weight",
        "blk.0.ffn_down.weight",
    ];
    println!(
        "threads: RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into())
    );
    println!("| tensor (out×in) | format | rel. error vs exact | {} |", {
        rows.iter()
            .map(|m| format!("m={m} µs"))
            .collect::<Vec<_>>()
            .join(" | ")
    });
    println!("|---|---|---:|{}", "---:|".repeat(rows.len()));
    for name in names {
        let q = content.tensor(&mut file, name, &dev)?;
        let (out, inp) = q.shape().dims2()?;
        // Exact weights: Q4_1 dequantized, (out, in).
        let exact = q.dequantize(&dev)?;
        let mut formats: Vec<(String, Weight)> = Vec::new();
        if q.dtype() == GgmlDType::Q4_1 {
            for kernel in [Q4_1Kernel::AvxVnni, Q4_1Kernel::Avx2] {
                if kernel.is_available() {
                    let w = Q4_1Matrix::from_qtensor(&q)?.with_kernel(kernel)?;
                    formats.push((format!("Q4_1 (ours, {})", kernel.name()), Weight::Ours(w)));
                }
            }
        }
        formats.extend([
            (
                format!("{:?} (as stored)", q.dtype()),
                Weight::Quantized(QMatMul::from_qtensor(q)?),
            ),
            (
                "Q8_0 (requantized)".into(),
                Weight::Quantized(QMatMul::from_qtensor(QTensor::quantize(
                    &exact,
                    GgmlDType::Q8_0,
                )?)?),
            ),
            (
                "Q4_0 (requantized)".into(),
                Weight::Quantized(QMatMul::from_qtensor(QTensor::quantize(
                    &exact,
                    GgmlDType::Q4_0,
                )?)?),
            ),
            (
                "f32 (dequantized)".into(),
                Weight::Dense(exact.t()?.contiguous()?),
            ),
        ]);
        for (label, w) in &formats {
            // Error on a fixed pseudo-random input of 16 rows, against the exact weights in f32.
            let x = pseudo_random(16, inp, &dev)?;
            let want = x.matmul(&exact.t()?)?;
            let got = w.forward(&x)?;
            let err = ((got - &want)?.sqr()?.sum_all()?.to_scalar::<f32>()?
                / want.sqr()?.sum_all()?.to_scalar::<f32>()?)
            .sqrt();
            let times = rows
                .iter()
                .map(|&m| time(w, m, inp, &dev).map(|d| format!("{:.0}", d.as_secs_f64() * 1e6)))
                .collect::<BenchResult<Vec<_>>>()?;
            println!(
                "| {name} ({out}×{inp}) | {label} | {err:.2e} | {} |",
                times.join(" | ")
            );
        }
    }
    Ok(())
}

/// Median time of one `(m, in) @ W` over enough runs to fill ~0.3 s.
fn time(w: &Weight, m: usize, inp: usize, dev: &Device) -> BenchResult<Duration> {
    let x = pseudo_random(m, inp, dev)?;
    w.forward(&x)?; // warm-up (and the repacking of packed formats)
    let start = Instant::now();
    w.forward(&x)?;
    let once = start.elapsed().max(Duration::from_micros(1));
    let n = (Duration::from_millis(300).as_secs_f64() / once.as_secs_f64()).clamp(5.0, 2000.0);
    let mut samples = Vec::new();
    for _ in 0..n as usize {
        let t = Instant::now();
        w.forward(&x)?;
        samples.push(t.elapsed());
    }
    samples.sort();
    Ok(samples[samples.len() / 2])
}

/// Deterministic activations with a spread like a normalized hidden state.
fn pseudo_random(m: usize, k: usize, dev: &Device) -> candle_core::Result<Tensor> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let v: Vec<f32> = (0..m * k)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, (m, k), dev)
}

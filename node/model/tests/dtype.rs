//! A model computing in f16 or bf16 (a GPU node's usual `--dtype`), on the CPU: its logits
//! follow candle-transformers' stock Llama run in the same dtype, and stay near our own f32
//! model, at every step of prefill and decode. Both references are fed the same tokens (the
//! f32 model's greedy choices), so one rounding flip cannot derail the comparison.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pd_kv_pool::KvDtype;
use pd_model::gguf::QuantPolicy;
use pd_model::tiny::{TinySpec, generate};
use pd_model::{Model, ModelSource};

use crate::common::{Ours, argmax, max_diff, tmp_path};

/// candle-transformers' Llama in `dtype`, one sequence.
struct Stock {
    model: candle_transformers::models::llama::Llama,
    cache: candle_transformers::models::llama::Cache,
}

impl Stock {
    fn load(dir: &std::path::Path, dtype: DType) -> Self {
        use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};
        let files = pd_model::llama::safetensors_files(dir).unwrap();
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, &Device::Cpu) }.unwrap();
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let cfg = serde_json::from_str::<LlamaConfig>(&text)
            .unwrap()
            .into_config(false);
        Self {
            cache: Cache::new(true, dtype, &cfg, &Device::Cpu).unwrap(),
            model: Llama::load(vb, &cfg).unwrap(),
        }
    }

    /// The last position's logits after feeding `tokens` at `pos`, (vocab,) as f32.
    fn step(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let x = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = self.model.forward(&x, pos, &mut self.cache).unwrap();
        logits
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }
}

/// Our model of `dir`, computing in `dtype`.
fn load(dir: &std::path::Path, dtype: DType) -> Model {
    ModelSource::open(dir)
        .unwrap()
        .load_model_as(&Device::Cpu, QuantPolicy::default(), dtype)
        .unwrap()
}

/// Runs a prompt and `decode` steps through the f32 model, our `dtype` model and the stock
/// model in `dtype`; returns the worst logit difference of ours against each reference and the
/// f32 logits' largest magnitude.
fn run(dtype: DType, kv: KvDtype) -> (f32, f32, f32) {
    let dir = tmp_path(&format!("dtype-{}", dtype.as_str()));
    generate(
        &TinySpec {
            seed: 11,
            ..TinySpec::default()
        },
        &dir,
    )
    .unwrap();
    let (f32_model, model) = (load(&dir, DType::F32), load(&dir, dtype));
    assert_eq!(model.dtype(), dtype, "the model holds its weights as asked");
    let mut exact = Ours::new(&f32_model, 64);
    let mut ours = Ours::with_dtype(&model, 64, kv);
    let mut stock = Stock::load(&dir, dtype);
    let prompt: Vec<u32> = (0..21u32).map(|i| (i * 29 + 7) % 256).collect();
    let (mut vs_stock, mut vs_f32, mut scale) = (0f32, 0f32, 0f32);
    let (mut tokens, mut pos) = (prompt.clone(), 0);
    for step in 0..12 {
        let e = exact.step(&tokens, pos);
        let o = ours.step(&tokens, pos);
        let s = stock.step(&tokens, pos);
        vs_stock = vs_stock.max(max_diff(&o, &s));
        vs_f32 = vs_f32.max(max_diff(&o, &e));
        scale = scale.max(e.iter().fold(0f32, |m, x| m.max(x.abs())));
        assert!(
            step > 0 || o != e,
            "{dtype:?} logits equal f32's bit for bit"
        );
        pos += tokens.len();
        tokens = vec![argmax(&e)];
    }
    let _ = std::fs::remove_dir_all(&dir);
    (vs_stock, vs_f32, scale)
}

#[test]
fn a_bf16_model_follows_the_stock_bf16_llama_and_stays_near_f32() {
    let (vs_stock, vs_f32, scale) = run(DType::BF16, KvDtype::BF16);
    eprintln!("bf16: vs stock {vs_stock}, vs f32 {vs_f32}, logit scale {scale}");
    // bf16 keeps 8 bits of mantissa: ~0.4% per rounding, a few roundings deep.
    assert!(
        vs_stock < 0.05 * scale,
        "bf16 vs stock bf16: {vs_stock} (scale {scale})"
    );
    assert!(
        vs_f32 < 0.05 * scale,
        "bf16 vs f32: {vs_f32} (scale {scale})"
    );
}

#[test]
fn an_f16_model_follows_the_stock_f16_llama_and_stays_near_f32() {
    let (vs_stock, vs_f32, scale) = run(DType::F16, KvDtype::F16);
    eprintln!("f16: vs stock {vs_stock}, vs f32 {vs_f32}, logit scale {scale}");
    assert!(
        vs_stock < 0.01 * scale,
        "f16 vs stock f16: {vs_stock} (scale {scale})"
    );
    assert!(
        vs_f32 < 0.01 * scale,
        "f16 vs f32: {vs_f32} (scale {scale})"
    );
}

#[test]
fn a_gguf_model_refuses_a_half_dtype_by_name() {
    let dir = tmp_path("dtype-gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tiny.gguf");
    pd_model::tiny::generate_gguf(
        &TinySpec::default(),
        &file,
        candle_core::quantized::GgmlDType::F32,
    )
    .unwrap();
    let err = ModelSource::open(&file)
        .unwrap()
        .load_model_as(&Device::Cpu, QuantPolicy::default(), DType::BF16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("bf16") && err.contains("GGUF"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

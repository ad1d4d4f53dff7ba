//! A model computing in f16 or bf16 (a GPU node's usual `--dtype`), on the CPU: its logits
//! follow candle-transformers' stock Llama run in the same dtype, and stay near our own f32
//! model, at every step of prefill and decode. Both references are fed the same tokens (the
//! f32 model's greedy choices), so one rounding flip cannot derail the comparison.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pd_kv_pool::{BlockId, KvDtype, KvLayout, KvOrder, KvPool};
use pd_model::gguf::QuantPolicy;
use pd_model::tiny::{TinySpec, generate};
use pd_model::{BatchInput, Model, ModelSource};

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pd-model-dtype-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

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

/// Our model over its own pool, one sequence.
struct Ours {
    model: Model,
    pool: KvPool,
    table: Vec<BlockId>,
}

impl Ours {
    fn load(dir: &std::path::Path, dtype: DType, kv: KvDtype) -> Self {
        let model = ModelSource::open(dir)
            .unwrap()
            .load_model_as(&Device::Cpu, QuantPolicy::default(), dtype)
            .unwrap();
        let cfg = model.config().clone();
        let layout = KvLayout {
            num_blocks: 32,
            block_size: 4,
            num_layers: cfg.num_layers,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            dtype: kv,
            order: KvOrder::Hnd,
        };
        let mut pool = KvPool::new(layout).unwrap();
        // Any read of an unwritten slot turns the logits into NaN.
        for b in 0..layout.num_blocks {
            pool.poison_block(BlockId(b as u32));
        }
        Self {
            model,
            pool,
            table: (0..16).map(|i| BlockId(31 - 2 * i)).collect(),
        }
    }

    fn step(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let mut b = BatchInput::default();
        b.push_seq(tokens, pos, &self.table, 4, true).unwrap();
        self.model
            .forward(&b, &mut self.pool)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0 as u32
}

/// The largest absolute difference, after checking both are finite.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    assert!(
        a.iter().chain(b).all(|x| x.is_finite()),
        "non-finite logits"
    );
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Runs a prompt and `decode` steps through the f32 model, our `dtype` model and the stock
/// model in `dtype`; returns the worst logit difference of ours against each reference and the
/// f32 logits' largest magnitude.
fn run(dtype: DType, kv: KvDtype) -> (f32, f32, f32) {
    let dir = tmp_dir(dtype.as_str());
    generate(
        &TinySpec {
            seed: 11,
            ..TinySpec::default()
        },
        &dir,
    )
    .unwrap();
    let mut exact = Ours::load(&dir, DType::F32, KvDtype::F32);
    let mut ours = Ours::load(&dir, dtype, kv);
    assert_eq!(
        ours.model.dtype(),
        dtype,
        "the model holds its weights as asked"
    );
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
    let dir = tmp_dir("gguf");
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

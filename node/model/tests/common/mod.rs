//! Helpers shared by the GGUF tests: our paged model and candle-transformers' `quantized_llama`
//! stepped the same way.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use pd_kv_pool::{BlockId, KvDtype, KvLayout, KvPool};
use pd_model::{BatchInput, Model};

/// The model file, or `None` (after saying why) when it is missing outside CI.
pub fn model_file() -> Option<PathBuf> {
    match pd_model::testing::real_model_file() {
        Ok(path) => Some(path),
        Err(msg) => {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
            eprintln!("skipping: {msg}");
            None
        }
    }
}

/// A fresh temp path for this test process.
pub fn tmp_path(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("pd-model-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    let _ = std::fs::remove_file(&p);
    p
}

/// Our model over a private pool (f32 unless asked otherwise), one sequence.
pub struct Ours<'a> {
    pub model: &'a Model,
    pool: KvPool,
    table: Vec<BlockId>,
    block_size: usize,
}

impl<'a> Ours<'a> {
    /// An f32 pool big enough for `max_tokens`.
    pub fn new(model: &'a Model, max_tokens: usize) -> Self {
        Self::with_dtype(model, max_tokens, KvDtype::F32)
    }

    /// A pool of `dtype` big enough for `max_tokens`.
    pub fn with_dtype(model: &'a Model, max_tokens: usize, dtype: KvDtype) -> Self {
        let cfg = model.config();
        let block_size = 16;
        let blocks = max_tokens.div_ceil(block_size) + 1;
        let layout = KvLayout {
            num_blocks: blocks,
            block_size,
            num_layers: cfg.num_layers,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            dtype,
            order: pd_kv_pool::KvOrder::Hnd,
        };
        let mut pool = KvPool::new(layout).expect("pool");
        for b in 0..blocks {
            pool.poison_block(BlockId(b as u32));
        }
        // Descending: a table that is not the identity.
        let table = (0..blocks as u32).rev().map(BlockId).collect();
        Self {
            model,
            pool,
            table,
            block_size,
        }
    }

    /// Feeds `tokens` at `pos`; the last position's logits.
    pub fn step(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let mut b = BatchInput::default();
        b.push_seq(tokens, pos, &self.table, self.block_size, true)
            .expect("batch");
        self.model
            .forward(&b, &mut self.pool)
            .expect("forward")
            .flatten_all()
            .expect("flatten")
            .to_vec1()
            .expect("to_vec1")
    }
}

/// candle-transformers' own GGUF Llama (contiguous per-sequence cache).
pub struct Reference(pub ModelWeights);

impl Reference {
    pub fn load(path: &Path) -> Self {
        let mut file = std::fs::File::open(path).expect("open gguf");
        let content = gguf_file::Content::read(&mut file).expect("read gguf");
        Self(ModelWeights::from_gguf(content, &mut file, &Device::Cpu).expect("reference load"))
    }

    pub fn step(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let x = Tensor::new(tokens, &Device::Cpu)
            .expect("tensor")
            .unsqueeze(0)
            .expect("unsqueeze");
        self.0
            .forward(&x, pos)
            .expect("reference forward")
            .flatten_all()
            .expect("flatten")
            .to_vec1()
            .expect("to_vec1")
    }
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0 as u32
}

/// Largest absolute difference, after checking both are finite.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "vocab sizes differ");
    assert!(
        a.iter().chain(b).all(|x| x.is_finite()),
        "non-finite logits"
    );
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Greedy decoding of `n` tokens after `prompt` by `step` (prefill in one call).
pub fn greedy(
    mut step: impl FnMut(&[u32], usize) -> Vec<f32>,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let mut out = Vec::with_capacity(n);
    let mut logits = step(prompt, 0);
    for _ in 0..n {
        let next = argmax(&logits);
        out.push(next);
        let pos = prompt.len() + out.len() - 1;
        logits = step(&[next], pos);
    }
    out
}

//! Our paged forward pass against candle-transformers' stock Llama and Qwen2 on the same
//! generated weights: logits must agree at every step of prefill (whole or chunked) and decode,
//! and greedy tokens must be identical.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pd_kv_pool::{BlockId, KvDtype, KvLayout, KvPool};
use pd_model::tiny::{TinyArch, TinySpec, generate};
use pd_model::{BatchInput, Model};

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pd-model-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Stock candle-transformers model, one sequence, contiguous cache.
enum Reference {
    Llama(
        candle_transformers::models::llama::Llama,
        candle_transformers::models::llama::Cache,
    ),
    Qwen2(candle_transformers::models::qwen2::ModelForCausalLM),
}

impl Reference {
    fn load(dir: &std::path::Path, arch: TinyArch) -> Reference {
        let files = pd_model::llama::safetensors_files(dir).unwrap();
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).unwrap()
        };
        let cfg_text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        match arch {
            TinyArch::Llama => {
                use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};
                let cfg = serde_json::from_str::<LlamaConfig>(&cfg_text)
                    .unwrap()
                    .into_config(false);
                let cache = Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
                Reference::Llama(Llama::load(vb, &cfg).unwrap(), cache)
            }
            TinyArch::Qwen2 => {
                use candle_transformers::models::qwen2::{Config, ModelForCausalLM};
                let cfg: Config = serde_json::from_str(&cfg_text).unwrap();
                Reference::Qwen2(ModelForCausalLM::new(&cfg, vb).unwrap())
            }
        }
    }

    /// Feeds `tokens` at `pos`; returns the last position's logits, (vocab,).
    fn step(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let x = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = match self {
            Reference::Llama(m, cache) => m.forward(&x, pos, cache).unwrap(),
            Reference::Qwen2(m) => m.forward(&x, pos).unwrap(),
        };
        logits.flatten_all().unwrap().to_vec1().unwrap()
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

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: vocab sizes differ");
    // f32::max ignores NaN, so check finiteness first: a poisoned (NaN) block must fail here.
    assert!(
        a.iter().chain(b).all(|x| x.is_finite()),
        "{what}: non-finite logits"
    );
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(max < 2e-3, "{what}: logits differ by {max}");
}

/// Runs `prompt` through our model in prefill chunks of `chunk`, then `decode` greedy steps,
/// comparing each step's logits and token with the reference.
fn compare(arch: TinyArch, prompt: &[u32], chunk: usize, decode: usize) {
    let dir = tmp_dir(&format!("{arch:?}-{chunk}-{}", prompt.len()));
    let spec = TinySpec {
        arch,
        seed: 7,
        shards: if arch == TinyArch::Llama { 2 } else { 1 },
        ..TinySpec::default()
    };
    generate(&spec, &dir).unwrap();
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let cfg = model.config().clone();
    let bs = 4;
    let layout = KvLayout {
        num_blocks: 64,
        block_size: bs,
        num_layers: cfg.num_layers,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        dtype: KvDtype::F32,
        order: pd_kv_pool::KvOrder::Hnd,
    };
    let mut pool = KvPool::new(layout).unwrap();
    // Poison the whole pool: any read of an unwritten slot turns the logits into NaN.
    for b in 0..layout.num_blocks {
        pool.poison_block(BlockId(b as u32));
    }
    // Blocks deliberately scattered and descending.
    let table: Vec<BlockId> = (0..32).map(|i| BlockId(63 - 2 * i)).collect();
    let mut reference = Reference::load(&dir, arch);

    let mut tokens = prompt.to_vec();
    let mut done = 0;
    let mut ours_last = Vec::new();
    let mut ref_last = Vec::new();
    while done < prompt.len() {
        let end = (done + chunk).min(prompt.len());
        let mut b = BatchInput::default();
        b.push_seq(&prompt[done..end], done, &table, bs, true)
            .unwrap();
        ours_last = model
            .forward(&b, &mut pool)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        ref_last = reference.step(&prompt[done..end], done);
        assert_close(
            &ours_last,
            &ref_last,
            &format!("prefill chunk ending at {end}"),
        );
        done = end;
    }
    for step in 0..decode {
        let next = argmax(&ours_last);
        assert_eq!(
            next,
            argmax(&ref_last),
            "greedy token differs at decode step {step}"
        );
        tokens.push(next);
        let pos = tokens.len() - 1;
        let mut b = BatchInput::default();
        b.push_seq(&[next], pos, &table, bs, true).unwrap();
        ours_last = model
            .forward(&b, &mut pool)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        ref_last = reference.step(&[next], pos);
        assert_close(&ours_last, &ref_last, &format!("decode step {step}"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 256)
        .collect()
}

#[test]
fn llama_whole_prefill_then_decode_matches_candle_transformers() {
    compare(TinyArch::Llama, &prompt(23, 1), usize::MAX, 20);
}

#[test]
fn llama_chunked_prefill_matches_candle_transformers() {
    compare(TinyArch::Llama, &prompt(30, 2), 7, 10);
}

#[test]
fn qwen2_prefill_and_decode_match_candle_transformers() {
    compare(TinyArch::Qwen2, &prompt(17, 3), 5, 20);
}

#[test]
fn batch_of_sequences_equals_each_alone() {
    // Two sequences of different lengths in one step give the same logits as alone.
    let dir = tmp_dir("batch");
    generate(
        &TinySpec {
            seed: 3,
            ..TinySpec::default()
        },
        &dir,
    )
    .unwrap();
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let cfg = model.config().clone();
    let layout = KvLayout {
        num_blocks: 32,
        block_size: 4,
        num_layers: cfg.num_layers,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        dtype: KvDtype::F32,
        order: pd_kv_pool::KvOrder::Hnd,
    };
    let (p1, p2) = (prompt(9, 4), prompt(14, 5));
    let t1: Vec<BlockId> = (0..4).map(BlockId).collect();
    let t2: Vec<BlockId> = (10..14).map(BlockId).collect();
    let mut pool = KvPool::new(layout).unwrap();
    let mut b = BatchInput::default();
    b.push_seq(&p1, 0, &t1, 4, true).unwrap();
    b.push_seq(&p2, 0, &t2, 4, true).unwrap();
    let both = model
        .forward(&b, &mut pool)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (p, t, row) in [(&p1, &t1, 0), (&p2, &t2, 1)] {
        let mut pool = KvPool::new(layout).unwrap();
        let mut b = BatchInput::default();
        b.push_seq(p, 0, t, 4, true).unwrap();
        let alone = model
            .forward(&b, &mut pool)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_close(&both[row], &alone, "batched vs alone");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unsupported_architecture_fails_at_load_naming_it() {
    let dir = tmp_dir("arch");
    generate(&TinySpec::default(), &dir).unwrap();
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("LlamaForCausalLM", "GPTNeoXForCausalLM");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let err = Model::load(&dir, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("GPTNeoXForCausalLM"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn batch_not_covered_by_block_table_is_an_error() {
    let mut b = BatchInput::default();
    assert!(
        b.push_seq(&[1, 2, 3, 4, 5], 0, &[BlockId(0)], 4, true)
            .is_err()
    );
}

//! Writes a real Hugging Face model directory with seeded random weights: `config.json`,
//! `model.safetensors` (or shards plus `model.safetensors.index.json`), `generation_config.json`
//! (EOS ids `<|endoftext|>` and `<|im_end|>`, written by the tokenizer writer),
//! and a byte-level tokenizer with a ChatML template. Tests and the demo load it through the same
//! path a downloaded model takes.
//!
//! Weights come from a ChaCha8 stream seeded with [`TinySpec::seed`] (candle's own RNG cannot be
//! seeded), so the same spec always gives byte-identical files.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::ModelError;

/// Which architecture to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyArch {
    /// `LlamaForCausalLM`, untied embeddings.
    Llama,
    /// `Qwen2ForCausalLM`: q/k/v biases, tied embeddings.
    Qwen2,
}

/// Shape and seed of a generated model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    /// Architecture.
    pub arch: TinyArch,
    /// RNG seed.
    pub seed: u64,
    /// Decoder layers.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Vocabulary size (≥ 259: 256 bytes + 3 special tokens).
    pub vocab: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Context length written to the config.
    pub max_position_embeddings: usize,
    /// Number of safetensors shards (1 = a single `model.safetensors`).
    pub shards: usize,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            arch: TinyArch::Llama,
            seed: 0,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            vocab: 512,
            intermediate: 128,
            max_position_embeddings: 2048,
            shards: 1,
        }
    }
}

/// Token ids of the generated tokenizer's special tokens.
pub const TINY_EOS_ID: u32 = 256;

/// Writes the model directory described by `spec` into `out` (created if needed).
///
/// # Errors
/// Invalid shapes, or I/O errors naming the file.
pub fn generate(spec: &TinySpec, out: &Path) -> Result<(), ModelError> {
    let bad = |m: String| Err(ModelError::InvalidConfig(m));
    if spec.heads == 0
        || spec.kv_heads == 0
        || !spec.heads.is_multiple_of(spec.kv_heads)
        || !spec.hidden.is_multiple_of(spec.heads)
    {
        return bad(format!(
            "hidden ({}) must divide into heads ({}) and heads into kv_heads ({})",
            spec.hidden, spec.heads, spec.kv_heads
        ));
    }
    if !(spec.hidden / spec.heads).is_multiple_of(2) {
        return bad("head_dim (hidden / heads) must be even".into());
    }
    if spec.layers == 0 || spec.intermediate == 0 || spec.shards == 0 {
        return bad("layers, intermediate and shards must be positive".into());
    }
    std::fs::create_dir_all(out).map_err(|source| ModelError::Io {
        path: out.to_path_buf(),
        source,
    })?;
    pd_tokenize::write_byte_level_tokenizer(out, spec.vocab)?;

    let head_dim = spec.hidden / spec.heads;
    let tied = spec.arch == TinyArch::Qwen2;
    let config = serde_json::json!({
        "architectures": [match spec.arch { TinyArch::Llama => "LlamaForCausalLM", TinyArch::Qwen2 => "Qwen2ForCausalLM" }],
        "model_type": match spec.arch { TinyArch::Llama => "llama", TinyArch::Qwen2 => "qwen2" },
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": head_dim,
        "vocab_size": spec.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "bos_token_id": TINY_EOS_ID,
        "eos_token_id": TINY_EOS_ID,
        "hidden_act": "silu",
    });
    let mut config = config;
    if spec.arch == TinyArch::Qwen2 {
        config["sliding_window"] = serde_json::json!(spec.max_position_embeddings);
        config["max_window_layers"] = serde_json::json!(spec.layers);
        config["use_sliding_window"] = serde_json::json!(false);
    }
    write_json(&out.join("config.json"), &config)?;

    // Weights. Scales keep activations O(1) and logits peaked, so greedy decoding has clear
    // winners (near-ties would make token-exact comparisons fragile).
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let dev = Device::Cpu;
    let (h, i, v, kvd) = (
        spec.hidden,
        spec.intermediate,
        spec.vocab,
        spec.kv_heads * head_dim,
    );
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut push = |name: String,
                    shape: &[usize],
                    std: f32,
                    mean: f32,
                    rng: &mut ChaCha8Rng|
     -> Result<(), ModelError> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| mean + std * normal(rng)).collect();
        tensors.push((name, Tensor::from_vec(data, shape, &dev)?));
        Ok(())
    };
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    push(
        "model.embed_tokens.weight".into(),
        &[v, h],
        1.0,
        0.0,
        &mut rng,
    )?;
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        push(
            format!("{p}.input_layernorm.weight"),
            &[h],
            0.1,
            1.0,
            &mut rng,
        )?;
        push(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            0.1,
            1.0,
            &mut rng,
        )?;
        push(
            format!("{p}.self_attn.q_proj.weight"),
            &[h, h],
            2.0 * lin(h),
            0.0,
            &mut rng,
        )?;
        push(
            format!("{p}.self_attn.k_proj.weight"),
            &[kvd, h],
            2.0 * lin(h),
            0.0,
            &mut rng,
        )?;
        push(
            format!("{p}.self_attn.v_proj.weight"),
            &[kvd, h],
            lin(h),
            0.0,
            &mut rng,
        )?;
        push(
            format!("{p}.self_attn.o_proj.weight"),
            &[h, h],
            lin(h),
            0.0,
            &mut rng,
        )?;
        if spec.arch == TinyArch::Qwen2 {
            push(
                format!("{p}.self_attn.q_proj.bias"),
                &[h],
                0.1,
                0.0,
                &mut rng,
            )?;
            push(
                format!("{p}.self_attn.k_proj.bias"),
                &[kvd],
                0.1,
                0.0,
                &mut rng,
            )?;
            push(
                format!("{p}.self_attn.v_proj.bias"),
                &[kvd],
                0.1,
                0.0,
                &mut rng,
            )?;
        }
        push(
            format!("{p}.mlp.gate_proj.weight"),
            &[i, h],
            lin(h),
            0.0,
            &mut rng,
        )?;
        push(
            format!("{p}.mlp.up_proj.weight"),
            &[i, h],
            lin(h),
            0.0,
            &mut rng,
        )?;
        push(
            format!("{p}.mlp.down_proj.weight"),
            &[h, i],
            lin(i),
            0.0,
            &mut rng,
        )?;
    }
    push("model.norm.weight".into(), &[h], 0.1, 1.0, &mut rng)?;
    if !tied {
        push(
            "lm_head.weight".into(),
            &[v, h],
            4.0 * lin(h),
            0.0,
            &mut rng,
        )?;
    }

    if spec.shards == 1 {
        save(&tensors, &out.join("model.safetensors"))?;
    } else {
        let per = tensors.len().div_ceil(spec.shards);
        let mut weight_map = BTreeMap::new();
        let mut total = 0usize;
        for (s, chunk) in tensors.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, spec.shards);
            for (name, t) in chunk {
                weight_map.insert(name.clone(), file.clone());
                total += t.elem_count() * 4;
            }
            save(chunk, &out.join(&file))?;
        }
        write_json(
            &out.join("model.safetensors.index.json"),
            &serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )?;
    }
    Ok(())
}

/// Standard normal sample (Box–Muller).
fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
    let u2: f32 = rng.random::<f32>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
}

fn save(tensors: &[(String, Tensor)], path: &Path) -> Result<(), ModelError> {
    let map: std::collections::HashMap<String, Tensor> = tensors.iter().cloned().collect();
    candle_core::safetensors::save(&map, path)?;
    Ok(())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), ModelError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::write(path, text).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

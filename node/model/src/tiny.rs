//! Writes a real Hugging Face model directory (or, with [`generate_gguf`], a GGUF file) with
//! seeded random weights: `config.json`,
//! `model.safetensors` (or shards plus `model.safetensors.index.json`), `generation_config.json`
//! (EOS ids `<|endoftext|>` and `<|im_end|>`, written by the tokenizer writer),
//! and a byte-level tokenizer with a ChatML template. Tests and the demo load it through the same
//! path a downloaded model takes.
//!
//! Weights come from a ChaCha8 stream seeded with [`TinySpec::seed`] (candle's own RNG cannot be
//! seeded), so the same spec always gives byte-identical files.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::ModelError;
use crate::gguf::gguf_name;

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
    validate(spec)?;
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

    let tensors = weights(spec)?;
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

/// Checks that `spec` describes a model the engine can build.
fn validate(spec: &TinySpec) -> Result<(), ModelError> {
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
    Ok(())
}

/// The seeded weights of `spec`, by Hugging Face name, in checkpoint order.
fn weights(spec: &TinySpec) -> Result<Vec<(String, Tensor)>, ModelError> {
    let head_dim = spec.hidden / spec.heads;
    let tied = spec.arch == TinyArch::Qwen2;
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

    Ok(tensors)
}

/// Writes the model of `spec` as one GGUF file at `out`, the way llama.cpp's converter writes
/// a Hugging Face checkpoint: `general.architecture` `llama` or `qwen2` with its `{arch}.*`
/// keys, tensors under GGUF names (`blk.N.attn_q.weight`, ...), `attn_q` / `attn_k` rows of
/// `llama` permuted for GPT-J style RoPE, 2-D weights stored as `weight_type` (norms and biases
/// stay F32), and the byte-level tokenizer of [`generate`] as `tokenizer.ggml.*` metadata
/// ([`pd_tokenize::byte_level_gguf_vocab`]). The same `spec` gives the same weights as
/// [`generate`] (up to `weight_type`'s rounding).
///
/// # Errors
/// Invalid shapes, a `weight_type` whose block does not divide the widths, or I/O errors.
pub fn generate_gguf(
    spec: &TinySpec,
    out: &Path,
    weight_type: GgmlDType,
) -> Result<(), ModelError> {
    validate(spec)?;
    let arch = match spec.arch {
        TinyArch::Llama => "llama",
        TinyArch::Qwen2 => "qwen2",
    };
    let head_dim = spec.hidden / spec.heads;
    let mut tensors = Vec::new();
    for (name, t) in weights(spec)? {
        let gguf = gguf_name(&name)
            .ok_or_else(|| ModelError::InvalidConfig(format!("no GGUF name for {name}")))?;
        let t = match (spec.arch, name.rsplit('.').nth(1)) {
            (TinyArch::Llama, Some("q_proj")) if name.ends_with(".weight") => {
                permute_for_gguf(&t, spec.heads, head_dim)?
            }
            (TinyArch::Llama, Some("k_proj")) if name.ends_with(".weight") => {
                permute_for_gguf(&t, spec.kv_heads, head_dim)?
            }
            _ => t,
        };
        let dtype = if t.rank() == 2 {
            weight_type
        } else {
            GgmlDType::F32
        };
        tensors.push((gguf, QTensor::quantize(&t, dtype)?));
    }
    let vocab = pd_tokenize::byte_level_gguf_vocab(spec.vocab)?;
    let key = |k: &str| format!("{arch}.{k}");
    let u32v = |n: usize| Value::U32(n as u32);
    let strings = |v: &[String]| Value::Array(v.iter().cloned().map(Value::String).collect());
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(format!("tiny-{arch}"))),
        (key("block_count"), u32v(spec.layers)),
        (key("context_length"), u32v(spec.max_position_embeddings)),
        (key("embedding_length"), u32v(spec.hidden)),
        (key("feed_forward_length"), u32v(spec.intermediate)),
        (key("attention.head_count"), u32v(spec.heads)),
        (key("attention.head_count_kv"), u32v(spec.kv_heads)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (key("rope.freq_base"), Value::F32(10_000.0)),
        (key("rope.dimension_count"), u32v(head_dim)),
        (
            "tokenizer.ggml.model".into(),
            Value::String(vocab.model.clone()),
        ),
        ("tokenizer.ggml.tokens".into(), strings(&vocab.tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(vocab.token_types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        ("tokenizer.ggml.merges".into(), strings(&vocab.merges)),
    ];
    if let Some(pre) = &vocab.pre {
        meta.push(("tokenizer.ggml.pre".into(), Value::String(pre.clone())));
    }
    for (k, id) in [
        ("bos_token_id", vocab.bos_token_id),
        ("eos_token_id", vocab.eos_token_id),
        ("eot_token_id", vocab.eot_token_id),
        ("padding_token_id", vocab.padding_token_id),
    ] {
        if let Some(id) = id {
            meta.push((format!("tokenizer.ggml.{k}"), Value::U32(id)));
        }
    }
    for (k, b) in [
        ("add_bos_token", vocab.add_bos_token),
        ("add_eos_token", vocab.add_eos_token),
    ] {
        if let Some(b) = b {
            meta.push((format!("tokenizer.ggml.{k}"), Value::Bool(b)));
        }
    }
    if let Some(t) = &vocab.chat_template {
        meta.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let io = |source| ModelError::Io {
        path: out.to_path_buf(),
        source,
    };
    let mut file = std::io::BufWriter::new(std::fs::File::create(out).map_err(io)?);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
    std::io::Write::flush(&mut file).map_err(io)?;
    Ok(())
}

/// llama.cpp's `permute` of `attn_q` / `attn_k` rows: HF row `h·d + i·d/2 + j` goes to
/// `h·d + 2j + i`. `w`: (heads·d, in).
fn permute_for_gguf(w: &Tensor, heads: usize, d: usize) -> Result<Tensor, ModelError> {
    let (out, inp) = w.dims2()?;
    // (heads, 2, d/2, in) → (heads, d/2, 2, in) → (out, in)
    Ok(w.reshape((heads, 2, d / 2, inp))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((out, inp))?)
}

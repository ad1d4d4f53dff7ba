//! `config.json` as Hugging Face writes it ([`HfConfig`]) and as the model uses it ([`ModelConfig`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// The fields of a Hugging Face `config.json` this engine reads. Unknown fields are ignored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfConfig {
    /// e.g. `["LlamaForCausalLM"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// e.g. `llama`, `qwen2`.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RoPE scaling (`{"rope_type": "llama3", ...}` is supported).
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Longest context the model was trained for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether `lm_head` reuses `embed_tokens`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o projections (Llama variants); Qwen2 always has q/k/v biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// Weight dtype as saved (`float32`, `float16`, `bfloat16`).
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s): a number or a list.
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// Mistral's attention window (`null` from v0.2 on: full attention).
    #[serde(default)]
    pub sliding_window: Option<usize>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}

/// Which graph to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, TinyLlama, SmolLM (and other `LlamaForCausalLM` checkpoints).
    Llama,
    /// Qwen2 / Qwen2.5: Llama graph with q/k/v biases.
    Qwen2,
}

/// Llama-3 style RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// Overall scale.
    pub factor: f64,
    /// Low-frequency factor.
    pub low_freq_factor: f64,
    /// High-frequency factor.
    pub high_freq_factor: f64,
    /// Context the base model was trained with.
    pub original_max_position_embeddings: usize,
}

/// The resolved configuration the layers are built from.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Graph family.
    pub arch: Arch,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama-3 RoPE scaling, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Longest context.
    pub max_position_embeddings: usize,
    /// `lm_head` shares `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// q/k/v projections have biases.
    pub qkv_bias: bool,
    /// o projection has a bias.
    pub o_bias: bool,
    /// EOS ids from `config.json`.
    pub eos_token_ids: Vec<u32>,
}

impl HfConfig {
    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`ModelError::Io`] / [`ModelError::Json`] naming the file.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ModelError::Json { path, source })
    }

    /// Checks the architecture, dtype and shapes and fills defaults.
    ///
    /// # Errors
    /// [`ModelError::UnsupportedArchitecture`], [`ModelError::UnsupportedDtype`] or
    /// [`ModelError::InvalidConfig`], naming what is wrong.
    pub fn resolve(&self) -> Result<ModelConfig, ModelError> {
        let arch_name = self
            .architectures
            .first()
            .cloned()
            .or_else(|| self.model_type.clone())
            .unwrap_or_else(|| "<none>".to_string());
        let arch = match arch_name.as_str() {
            "LlamaForCausalLM" | "llama" => Arch::Llama,
            // Mistral is Llama's layers; only its sliding window (v0.1) would differ.
            "MistralForCausalLM" | "mistral" => match self.sliding_window {
                Some(w) if w < self.max_position_embeddings => {
                    return Err(ModelError::InvalidConfig(format!(
                        "sliding-window attention (a window of {w} of {} positions) is not supported",
                        self.max_position_embeddings
                    )));
                }
                _ => Arch::Llama,
            },
            "Qwen2ForCausalLM" | "qwen2" => Arch::Qwen2,
            other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
        };
        if let Some(dtype) = &self.torch_dtype
            && !matches!(dtype.as_str(), "float32" | "float16" | "bfloat16")
        {
            return Err(ModelError::UnsupportedDtype(dtype.clone()));
        }
        let num_heads = self.num_attention_heads;
        let num_kv_heads = self.num_key_value_heads.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::InvalidConfig(format!(
                "num_attention_heads ({num_heads}) must be a positive multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let head_dim = self.head_dim.unwrap_or(self.hidden_size / num_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(ModelError::InvalidConfig(format!(
                "head_dim must be even and positive, got {head_dim}"
            )));
        }
        if self.hidden_size == 0 || self.num_hidden_layers == 0 || self.vocab_size == 0 {
            return Err(ModelError::InvalidConfig(
                "hidden_size, num_hidden_layers and vocab_size must be positive".into(),
            ));
        }
        let rope_scaling = match &self.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let kind = v
                    .get("rope_type")
                    .or_else(|| v.get("type"))
                    .and_then(|t| t.as_str())
                    .unwrap_or("");
                match kind {
                    "default" => None,
                    "llama3" => {
                        let f = |k: &str| {
                            v.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                                ModelError::InvalidConfig(format!(
                                    "rope_scaling.{k} missing for llama3 scaling"
                                ))
                            })
                        };
                        Some(Llama3RopeScaling {
                            factor: f("factor")?,
                            low_freq_factor: f("low_freq_factor")?,
                            high_freq_factor: f("high_freq_factor")?,
                            original_max_position_embeddings: f("original_max_position_embeddings")?
                                as usize,
                        })
                    }
                    other => {
                        return Err(ModelError::InvalidConfig(format!(
                            "unsupported rope_scaling type {other:?} (supported: default, llama3)"
                        )));
                    }
                }
            }
        };
        let eos_token_ids = match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|n| vec![n as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|n| n as u32)
                .collect(),
            _ => Vec::new(),
        };
        Ok(ModelConfig {
            arch,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            qkv_bias: arch == Arch::Qwen2 || self.attention_bias,
            o_bias: arch == Arch::Llama && self.attention_bias,
            eos_token_ids,
        })
    }
}

impl ModelConfig {
    /// Inverse RoPE frequencies, `(head_dim / 2,)`, with Llama-3 scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| 1f32 / (self.rope_theta as f32).powf(i as f32 / d as f32))
            .collect();
        let Some(s) = self.rope_scaling else {
            return base;
        };
        let low_wavelen = s.original_max_position_embeddings as f32 / s.low_freq_factor as f32;
        let high_wavelen = s.original_max_position_embeddings as f32 / s.high_freq_factor as f32;
        base.into_iter()
            .map(|freq| {
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / s.factor as f32
                } else {
                    let smooth = (s.original_max_position_embeddings as f32 / wavelen
                        - s.low_freq_factor as f32)
                        / (s.high_freq_factor as f32 - s.low_freq_factor as f32);
                    (1.0 - smooth) * freq / s.factor as f32 + smooth * freq
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300
        })
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["MambaForCausalLM"]);
        let cfg: HfConfig = serde_json::from_value(v).unwrap();
        let err = cfg.resolve().unwrap_err().to_string();
        assert!(err.contains("MambaForCausalLM"), "{err}");
    }

    #[test]
    fn mistral_without_a_sliding_window_is_llama() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        v["sliding_window"] = serde_json::Value::Null;
        let c = serde_json::from_value::<HfConfig>(v.clone())
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(c.arch, Arch::Llama);
        v["sliding_window"] = serde_json::json!(64);
        v["max_position_embeddings"] = serde_json::json!(4096);
        let err = serde_json::from_value::<HfConfig>(v)
            .unwrap()
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(err.contains("sliding-window"), "{err}");
    }

    #[test]
    fn unsupported_dtype_is_named() {
        let mut v = base();
        v["torch_dtype"] = serde_json::json!("float8_e4m3fn");
        let cfg: HfConfig = serde_json::from_value(v).unwrap();
        let err = cfg.resolve().unwrap_err().to_string();
        assert!(err.contains("float8_e4m3fn"), "{err}");
    }

    #[test]
    fn qwen2_has_qkv_bias_and_defaults() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        v["eos_token_id"] = serde_json::json!([5, 7]);
        let c = serde_json::from_value::<HfConfig>(v)
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.qkv_bias && !c.o_bias);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.eos_token_ids, vec![5, 7]);
    }
}

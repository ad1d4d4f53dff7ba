//! Llama-family decoder (Llama 2/3, TinyLlama, SmolLM) and Qwen2, over a paged KV pool.
//!
//! Follows Hugging Face's `modeling_llama.py`: RMSNorm → attention (RoPE, grouped-query) →
//! residual → RMSNorm → SwiGLU MLP → residual; Qwen2 adds q/k/v biases. Weights are loaded by
//! their checkpoint names (`model.layers.{i}.self_attn.q_proj.weight`, ...).
//!
//! The batch is flattened: all scheduled tokens of all sequences form one `(num_tokens, hidden)`
//! matrix, so every projection is one matmul per step whatever the batch's lengths; only
//! attention looks at sequence boundaries, through [`crate::paged_attention`].

use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, RmsNorm};
use pd_kv_pool::KvLayout;

use crate::batch::BatchInput;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv_store::{LayerQkv, PagedKv};
use crate::source::ModelSource;
use crate::weights::{Proj, WeightSource};

/// Self-attention of one layer.
#[derive(Debug)]
pub struct Attention {
    /// q, k and v fused: (hidden, (num_heads + 2·num_kv_heads)·head_dim).
    qkv_proj: Proj,
    o_proj: Proj,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    layer: usize,
}

impl Attention {
    /// `p`: the layer's attention prefix, `model.layers.{layer}.self_attn`.
    fn load(
        w: &dyn WeightSource,
        p: &str,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Self, ModelError> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Ok(Self {
            qkv_proj: w.projection(
                h,
                &[
                    (cfg.num_heads * d, &format!("{p}.q_proj")),
                    (cfg.num_kv_heads * d, &format!("{p}.k_proj")),
                    (cfg.num_kv_heads * d, &format!("{p}.v_proj")),
                ],
                cfg.qkv_bias,
            )?,
            o_proj: w.projection(
                cfg.num_heads * d,
                &[(h, &format!("{p}.o_proj"))],
                cfg.o_bias,
            )?,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
            layer,
        })
    }

    /// `x`: (num_tokens, hidden) → (num_tokens, hidden). Writes this step's K/V into `kv`.
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        batch: &BatchInput,
        kv: &mut dyn PagedKv,
    ) -> Result<Tensor, ModelError> {
        let (t, _hidden) = x.dims2()?;
        let (hd, nh, nkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        // (t, nh*hd) → (1, t, nh, hd): rope_thd wants (batch, seq, heads, dim).
        // (t, (nh + 2·nkv)·hd), split by columns.
        let qkv = self.qkv_proj.forward(x)?;
        let q = qkv.narrow(1, 0, nh * hd)?.reshape((1, t, nh, hd))?;
        let k = qkv.narrow(1, nh * hd, nkv * hd)?.reshape((1, t, nkv, hd))?;
        let v = qkv
            .narrow(1, (nh + nkv) * hd, nkv * hd)?
            .reshape((t * nkv * hd,))?;
        let q = candle_nn::rotary_emb::rope_thd(&q, &rope.cos, &rope.sin)?;
        let k = candle_nn::rotary_emb::rope_thd(&k, &rope.cos, &rope.sin)?;
        let scale = 1.0 / (hd as f32).sqrt();
        // The pool's kernels read f32 queries, keys and values whatever the model computes in
        // (the pool's own dtype is the KV's); a no-op for an f32 model.
        let dtype = x.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let qkv = LayerQkv {
            q: &q,
            k: &k,
            v: &v,
            num_heads: nh,
            scale,
        };
        // (t, nh·hd) f32 → the model's dtype → o_proj → (t, hidden)
        let out = kv.attention(self.layer, qkv, batch)?.to_dtype(dtype)?;
        Ok(self.o_proj.forward(&out)?)
    }
}

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct Mlp {
    /// gate and up fused: (hidden, 2·intermediate).
    gate_up_proj: Proj,
    down_proj: Proj,
    intermediate: usize,
}

impl Mlp {
    /// `p`: the layer's MLP prefix, `model.layers.{layer}.mlp`.
    fn load(w: &dyn WeightSource, p: &str, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_up_proj: w.projection(
                h,
                &[(i, &format!("{p}.gate_proj")), (i, &format!("{p}.up_proj"))],
                false,
            )?,
            down_proj: w.projection(i, &[(h, &format!("{p}.down_proj"))], false)?,
            intermediate: i,
        })
    }

    /// `x`: (num_tokens, hidden) → (num_tokens, hidden).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // (t, 2·i) → gate (t, i), up (t, i)
        let gate_up = self.gate_up_proj.forward(x)?;
        let i = self.intermediate;
        let gate = candle_nn::ops::silu(&gate_up.narrow(1, 0, i)?)?;
        self.down_proj.forward(&(gate * gate_up.narrow(1, i, i)?)?)
    }
}

/// One decoder layer.
#[derive(Debug)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn load(w: &dyn WeightSource, cfg: &ModelConfig, layer: usize) -> Result<Self, ModelError> {
        let p = format!("model.layers.{layer}");
        Ok(Self {
            input_layernorm: rms_norm(w, &format!("{p}.input_layernorm"), cfg)?,
            self_attn: Attention::load(w, &format!("{p}.self_attn"), cfg, layer)?,
            post_attention_layernorm: rms_norm(w, &format!("{p}.post_attention_layernorm"), cfg)?,
            mlp: Mlp::load(w, &format!("{p}.mlp"), cfg)?,
        })
    }

    /// `x`: (num_tokens, hidden) → (num_tokens, hidden).
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        batch: &BatchInput,
        kv: &mut dyn PagedKv,
    ) -> Result<Tensor, ModelError> {
        let h = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rope, batch, kv)?;
        let x = (x + h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok((x + h)?)
    }
}

/// The RMSNorm whose weight is `{prefix}.weight`, (hidden,).
fn rms_norm(w: &dyn WeightSource, prefix: &str, cfg: &ModelConfig) -> Result<RmsNorm, ModelError> {
    let weight = w.tensor(&format!("{prefix}.weight"), &[cfg.hidden_size])?;
    Ok(RmsNorm::new(weight, cfg.rms_norm_eps))
}

/// cos/sin of this step's positions, in the model's dtype.
struct Rope {
    /// (num_tokens, head_dim / 2)
    cos: Tensor,
    /// (num_tokens, head_dim / 2)
    sin: Tensor,
}

/// The whole model: embeddings, decoder layers, final norm, LM head.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Proj,
    /// (max_position_embeddings, head_dim / 2)
    cos: Tensor,
    /// (max_position_embeddings, head_dim / 2)
    sin: Tensor,
    device: Device,
    /// What the weights and activations are held in ([`Model::dtype`]).
    dtype: DType,
}

/// Every `*.safetensors` file of a model directory: the shards listed in
/// `model.safetensors.index.json` if present, else all `*.safetensors` files, sorted.
///
/// # Errors
/// [`ModelError::NoWeights`] when there is none; I/O and JSON errors name the file.
pub fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
            path: index.clone(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: index.clone(),
                source,
            })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                ModelError::InvalidConfig(format!("{} has no weight_map", index.display()))
            })?;
        let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        let rd = std::fs::read_dir(dir).map_err(|source| ModelError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut f: Vec<_> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        f.sort();
        f
    };
    if files.is_empty() {
        return Err(ModelError::NoWeights(dir.to_path_buf()));
    }
    for f in &files {
        if !f.exists() {
            return Err(ModelError::Io {
                path: f.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "shard listed in index is missing",
                ),
            });
        }
    }
    Ok(files)
}

impl Model {
    /// Loads the model at `path` onto `device`, computing in f32: a Hugging Face directory
    /// (config.json + safetensors), a GGUF file, or a directory holding one GGUF file (see
    /// [`ModelSource::open`]).
    ///
    /// # Errors
    /// Names the unsupported architecture or weight type, the missing file or tensor.
    pub fn load(path: &Path, device: &Device) -> Result<Self, ModelError> {
        ModelSource::open(path)?.load_model(device)
    }

    /// Builds the model from an already-open weight source, whose tensors have the Hugging
    /// Face names of `cfg`'s architecture. The model computes in the dtype of the source's
    /// embeddings (f32, or f16/bf16 from [`crate::weights::SafetensorsWeights::open`]).
    ///
    /// # Errors
    /// A missing tensor or a shape mismatch, naming the tensor.
    pub fn from_weights(
        cfg: ModelConfig,
        w: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        // (vocab, hidden)
        let embeddings = w.tensor("model.embed_tokens.weight", &[v, h])?;
        let dtype = embeddings.dtype();
        let embed_tokens = Embedding::new(embeddings, h);
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(w, &cfg, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = rms_norm(w, "model.norm", &cfg)?;
        let lm_head = if cfg.tie_word_embeddings {
            w.projection(h, &[(v, "model.embed_tokens")], false)?
        } else {
            w.projection(h, &[(v, "lm_head")], false)?
        };
        // (max_pos, 1) x (1, head_dim/2) → (max_pos, head_dim/2)
        let inv_freq = cfg.rope_inv_freq();
        let half = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
        let pos = Tensor::arange(0u32, cfg.max_position_embeddings as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_position_embeddings, 1))?;
        // Angles in f32, rounded to the model's dtype once (rope_thd wants its input's dtype).
        let angles = pos.matmul(&inv_freq)?;
        Ok(Self {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            device: device.clone(),
            dtype,
        })
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// What the weights and activations are held in: f32, or f16/bf16 (a GPU's usual choice;
    /// attention still reads f32 queries and accumulates in f32, and logits are f32).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Runs one step: writes K/V of every token in `batch` into `kv` (the transfer pool itself
    /// on a CPU node, or a compute pool: [`crate::kv_store`]) and returns the logits of the rows
    /// in `batch.logits_rows`, `(logits_rows.len(), vocab_size)`, f32.
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] when the batch is inconsistent with the pool or the model;
    /// candle errors otherwise.
    pub fn forward(&self, batch: &BatchInput, kv: &mut dyn PagedKv) -> Result<Tensor, ModelError> {
        self.check_batch(batch, kv.layout())?;
        kv.begin_step(batch)?;
        let t = batch.num_tokens();
        let ids = Tensor::from_slice(&batch.tokens, (t,), &self.device)?;
        let positions = Tensor::from_slice(&batch.positions, (t,), &self.device)?;
        // (t, head_dim/2) each.
        let rope = Rope {
            cos: self.cos.index_select(&positions, 0)?,
            sin: self.sin.index_select(&positions, 0)?,
        };
        // (t,) → (t, hidden)
        let mut x = self.embed_tokens.forward(&ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, &rope, batch, kv)?;
        }
        // (t, hidden) → (n_logits, hidden) → (n_logits, vocab)
        let rows =
            Tensor::from_slice(&batch.logits_rows, (batch.logits_rows.len(),), &self.device)?;
        let x = self.norm.forward(&x.index_select(&rows, 0)?)?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    fn check_batch(&self, batch: &BatchInput, l: &KvLayout) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::InvalidBatch(m));
        if l.num_layers != self.cfg.num_layers
            || l.num_kv_heads != self.cfg.num_kv_heads
            || l.head_dim != self.cfg.head_dim
        {
            return bad(format!("pool layout {l:?} does not match the model"));
        }
        let t = batch.tokens.len();
        if t == 0 || batch.positions.len() != t || batch.slots.len() != t {
            return bad(format!(
                "{t} tokens, {} positions, {} slots",
                batch.positions.len(),
                batch.slots.len()
            ));
        }
        if let Some(&tok) = batch
            .tokens
            .iter()
            .find(|&&x| x as usize >= self.cfg.vocab_size)
        {
            return bad(format!(
                "token id {tok} is outside the vocabulary ({})",
                self.cfg.vocab_size
            ));
        }
        if let Some(&p) = batch
            .positions
            .iter()
            .find(|&&p| p as usize >= self.cfg.max_position_embeddings)
        {
            return bad(format!(
                "position {p} exceeds max_position_embeddings {}",
                self.cfg.max_position_embeddings
            ));
        }
        let slots_total = l.num_blocks * l.block_size;
        if batch.slots.iter().any(|&s| s >= slots_total) {
            return bad("slot outside the pool".into());
        }
        let mut covered = 0;
        for s in &batch.seqs {
            if s.query_start != covered
                || s.query_len > s.context_len
                || s.block_table.len() * l.block_size < s.context_len
            {
                return bad(format!("sequence view {s:?} is inconsistent"));
            }
            if s.block_table.iter().any(|b| b.index() >= l.num_blocks) {
                return bad("block id outside the pool".into());
            }
            covered += s.query_len;
        }
        if covered != t || batch.logits_rows.iter().any(|&r| r as usize >= t) {
            return bad("sequence views do not cover the tokens".into());
        }
        Ok(())
    }
}

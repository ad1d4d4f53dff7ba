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
use candle_nn::{Embedding, RmsNorm, VarBuilder};
use pd_kv_pool::KvPool;

use crate::batch::BatchInput;
use crate::config::{HfConfig, ModelConfig};
use crate::error::ModelError;
use crate::paged_attention;

/// Linear projections of the flattened batch, stored transposed: `y = x @ wt + b`.
///
/// Checkpoints store `(out, in)`; multiplying by `w.t()` makes gemm repack the weight on every
/// call once the batch has more than one row. Keeping `(in, out)` contiguous avoids that, and
/// projections reading the same input (q/k/v, gate/up) are fused into one matmul.
#[derive(Debug)]
pub struct Proj {
    /// (in_dim, sum of out_dims), contiguous.
    wt: Tensor,
    /// (sum of out_dims,)
    bias: Option<Tensor>,
}

impl Proj {
    /// Loads `weight` (and `bias` when `bias`) of every `(out_dim, vb)` part and fuses them
    /// along the output dimension, in order.
    fn load(in_dim: usize, parts: &[(usize, VarBuilder)], bias: bool) -> candle_core::Result<Self> {
        let ws = parts
            .iter()
            .map(|(out, vb)| vb.get((*out, in_dim), "weight"))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // (sum_out, in) → (in, sum_out)
        let wt = Tensor::cat(&ws, 0)?.t()?.contiguous()?;
        let bias = if bias {
            let bs = parts
                .iter()
                .map(|(out, vb)| vb.get(*out, "bias"))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        Ok(Self { wt, bias })
    }

    /// From an `(out, in)` weight already loaded (tied embeddings).
    fn from_weight(w: &Tensor) -> candle_core::Result<Self> {
        Ok(Self {
            wt: w.t()?.contiguous()?,
            bias: None,
        })
    }

    /// `x`: (t, in) → (t, out).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.wt)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

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
    fn load(vb: VarBuilder, cfg: &ModelConfig, layer: usize) -> candle_core::Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Ok(Self {
            qkv_proj: Proj::load(
                h,
                &[
                    (cfg.num_heads * d, vb.pp("q_proj")),
                    (cfg.num_kv_heads * d, vb.pp("k_proj")),
                    (cfg.num_kv_heads * d, vb.pp("v_proj")),
                ],
                cfg.qkv_bias,
            )?,
            o_proj: Proj::load(cfg.num_heads * d, &[(h, vb.pp("o_proj"))], cfg.o_bias)?,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
            layer,
        })
    }

    /// `x`: (num_tokens, hidden) → (num_tokens, hidden). Writes this step's K/V into `pool`.
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        batch: &BatchInput,
        pool: &mut KvPool,
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
        // Host copies, (t, heads, hd) row-major, for the paged kernels.
        let q = q.flatten_all()?.to_vec1::<f32>()?;
        let k = k.flatten_all()?.to_vec1::<f32>()?;
        let v = v.to_vec1::<f32>()?;
        let layout = *pool.layout();
        paged_attention::write_kv(pool.data_mut(), &layout, self.layer, &k, &v, &batch.slots);
        let scale = 1.0 / (hd as f32).sqrt();
        let out =
            paged_attention::attend(pool.data(), &layout, self.layer, &q, nh, &batch.seqs, scale);
        // (t, nh*hd) → o_proj → (t, hidden)
        let out = Tensor::from_vec(out, (t, nh * hd), x.device())?;
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
    fn load(vb: VarBuilder, cfg: &ModelConfig) -> candle_core::Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_up_proj: Proj::load(h, &[(i, vb.pp("gate_proj")), (i, vb.pp("up_proj"))], false)?,
            down_proj: Proj::load(i, &[(h, vb.pp("down_proj"))], false)?,
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
    fn load(vb: VarBuilder, cfg: &ModelConfig, layer: usize) -> candle_core::Result<Self> {
        Ok(Self {
            input_layernorm: candle_nn::rms_norm(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("input_layernorm"),
            )?,
            self_attn: Attention::load(vb.pp("self_attn"), cfg, layer)?,
            post_attention_layernorm: candle_nn::rms_norm(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
        })
    }

    /// `x`: (num_tokens, hidden) → (num_tokens, hidden).
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        batch: &BatchInput,
        pool: &mut KvPool,
    ) -> Result<Tensor, ModelError> {
        let h = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rope, batch, pool)?;
        let x = (x + h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok((x + h)?)
    }
}

/// cos/sin of this step's positions.
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
    /// Loads `dir` (config.json + safetensors) onto `device`, computing in f32.
    ///
    /// # Errors
    /// Names the unsupported architecture or dtype, the missing file or tensor.
    pub fn load(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let cfg = HfConfig::from_dir(dir)?.resolve()?;
        let files = safetensors_files(dir)?;
        check_weight_dtypes(&files)?;
        // SAFETY: the files are memory-mapped read-only; the engine does not modify them, and a
        // model directory changing under a running server is outside our contract (as for every
        // HF loader).
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, device)? };
        Self::from_var_builder(cfg, vb, device)
    }

    /// Builds the model from an already-open weight source.
    ///
    /// # Errors
    /// A missing tensor or a shape mismatch, naming the tensor.
    pub fn from_var_builder(
        cfg: ModelConfig,
        vb: VarBuilder,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let m = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, m.pp("embed_tokens"))?;
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(m.pp("layers").pp(i), &cfg, i))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = candle_nn::rms_norm(cfg.hidden_size, cfg.rms_norm_eps, m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Proj::from_weight(embed_tokens.embeddings())?
        } else {
            Proj::load(
                cfg.hidden_size,
                &[(cfg.vocab_size, vb.pp("lm_head"))],
                false,
            )?
        };
        // (max_pos, 1) x (1, head_dim/2) → (max_pos, head_dim/2)
        let inv_freq = cfg.rope_inv_freq();
        let half = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
        let pos = Tensor::arange(0u32, cfg.max_position_embeddings as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_position_embeddings, 1))?;
        let angles = pos.matmul(&inv_freq)?;
        Ok(Self {
            cos: angles.cos()?,
            sin: angles.sin()?,
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            device: device.clone(),
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

    /// Runs one step: writes K/V of every token in `batch` into `pool` and returns the logits of
    /// the rows in `batch.logits_rows`, `(logits_rows.len(), vocab_size)`, f32.
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] when the batch is inconsistent with the pool or the model;
    /// candle errors otherwise.
    pub fn forward(&self, batch: &BatchInput, pool: &mut KvPool) -> Result<Tensor, ModelError> {
        self.check_batch(batch, pool)?;
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
            x = layer.forward(&x, &rope, batch, pool)?;
        }
        // (t, hidden) → (n_logits, hidden) → (n_logits, vocab)
        let rows =
            Tensor::from_slice(&batch.logits_rows, (batch.logits_rows.len(),), &self.device)?;
        let x = self.norm.forward(&x.index_select(&rows, 0)?)?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    fn check_batch(&self, batch: &BatchInput, pool: &KvPool) -> Result<(), ModelError> {
        let l = pool.layout();
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

/// Rejects weight files whose tensors are not float32/float16/bfloat16, naming the dtype.
/// Reads only each file's JSON header (8-byte little-endian length, then the header).
fn check_weight_dtypes(files: &[std::path::PathBuf]) -> Result<(), ModelError> {
    use std::io::Read;
    for f in files {
        let io = |source| ModelError::Io {
            path: f.clone(),
            source,
        };
        let mut file = std::fs::File::open(f).map_err(io)?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(io)?;
        let len = u64::from_le_bytes(len);
        if len > 100 << 20 {
            return Err(ModelError::InvalidConfig(format!(
                "{}: safetensors header of {len} bytes",
                f.display()
            )));
        }
        let mut header = vec![0u8; len as usize];
        file.read_exact(&mut header).map_err(io)?;
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
            .map_err(|source| ModelError::Json {
                path: f.clone(),
                source,
            })?;
        for (name, info) in &header {
            let Some(dtype) = info.get("dtype").and_then(|d| d.as_str()) else {
                continue;
            };
            if !matches!(dtype, "F32" | "F16" | "BF16") {
                return Err(ModelError::UnsupportedDtype(format!(
                    "{dtype} (tensor {name} in {})",
                    f.display()
                )));
            }
        }
    }
    Ok(())
}

//! GGUF model files (llama.cpp's format), read with candle's [`gguf_file`] reader:
//! [`GgufFile`] gives the resolved [`ModelConfig`] from the metadata, the tokenizer metadata as
//! a [`GgufVocab`], and [`GgufWeights`], a [`WeightSource`] that serves the GGUF tensors under
//! the Hugging Face names the model asks for.
//!
//! What each tensor type becomes by default ([`QuantPolicy::Fast`], decided by measurement,
//! see `BENCHMARKS.md`, "GGUF weight formats"):
//! - `F32`, `F16`, `BF16` (norms, biases): dense f32.
//! - `Q4_0`, `Q8_0`, `Q2_K`…`Q6_K`: kept as they are; candle has SIMD dot products for them.
//! - `Q4_1`: kept, and multiplied by our own AVX2 / AVX-VNNI kernel ([`crate::q4_1`], llama.cpp's
//!   Q4_1 × Q8_1 arithmetic; candle-core 0.11.1 has it in scalar form only), except where the
//!   input width is a multiple of 256: there candle's tiled `Q8_0` kernel is faster, so the
//!   weight is requantized to `Q8_0` as below.
//! - `Q5_0`, `Q5_1`: requantized to `Q8_0` at load. candle-core 0.11.1 has no SIMD dot product
//!   for them; `Q8_0` keeps their values to within 1/254 of each block's range (`Q4_0` would
//!   add a second 4-bit rounding). [`QuantPolicy::CandleKernels`] does the same with `Q4_1`.
//! - `Q8_1`, `Q8_K` (activation formats, never weights) and types candle does not know are
//!   refused at start, naming the tensor or the type.
//! - A quantized projection whose input width is not a multiple of 256 (candle's tiled batch
//!   kernels need that) also keeps an f32 copy for steps of
//!   [`crate::weights::DENSE_MIN_ROWS`] rows or more, where f32 gemm is several times faster
//!   (than candle's untiled kernels and ours alike).
//!
//! The load log says what each stored type became, e.g. `Q4_1→Q4_1(avx-vnni)+f32 ×180,
//! Q4_1→Q8_0 ×30` (the kernel in brackets is the one this CPU runs).
//!
//! The token embedding is dequantized to f32 for the lookup; a tied LM head multiplies by the
//! embedding in its stored (quantized) form.
//!
//! llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of `llama` models so that
//! RoPE rotates adjacent pairs (GPT-J style). The rows are put back in Hugging Face order at
//! load (a row permutation moves whole rows of blocks, so it works on any block type), so the
//! one model implementation, with Hugging Face's rotate-half RoPE, serves both formats.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The GGUF tensor types (candle's), as the tiny-model generator takes them.
pub use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{Device, Tensor};
use pd_tokenize::GgufVocab;

use crate::config::{Arch, HfConfig, ModelConfig};
use crate::error::ModelError;
use crate::q4_1::{Q4_1Kernel, Q4_1Matrix};

mod checks;

use crate::weights::{Proj, WeightSource};
use checks::{check_alignment, check_tensor_extents};

/// Whether a Q4_1 projection reading `in_dim` features goes to our kernel ([`crate::q4_1`]) under
/// [`QuantPolicy::Fast`]; else it is requantized to `Q8_0`. Decided by measurement
/// (`docs/bench-log/gguf.md`): where the width is a multiple of 256, candle's tiled VNNI `Q8_0`
/// kernel is about twice as fast as ours at 1–15 rows (SmolLM2's `ffn_down`, input 1536), and it
/// also serves large batches, where ours has no f32 copy to fall back on.
fn own_q4_1(in_dim: usize) -> bool {
    !in_dim.is_multiple_of(256)
}

/// Whether this CPU has the VNNI instructions candle's tiled `Q8_0` kernel needs (it falls
/// back to its untiled kernel on plain AVX2).
fn cpu_has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avxvnni") || is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `rows` rows of `Q8_0` blocks over `in_dim` columns, each widened with zero blocks (scale
/// 0, values 0) to `width` columns: the product with an input widened by zeros is unchanged.
fn pad_q8_0_rows(bytes: &[u8], rows: usize, in_dim: usize, width: usize) -> Vec<u8> {
    // Q8_0: f16 scale + 32 i8 values.
    const BLOCK: usize = 34;
    let row = in_dim / 32 * BLOCK;
    let padded = width / 32 * BLOCK;
    let mut out = vec![0u8; rows * padded];
    for (src, dst) in bytes.chunks_exact(row).zip(out.chunks_exact_mut(padded)) {
        dst[..row].copy_from_slice(src);
    }
    out
}

/// An open GGUF file: its parsed header (metadata and tensor directory, not the tensor data).
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: gguf_file::Content,
}

/// What happens to a weight of a given type at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Dequantized to a dense f32 tensor.
    Dense,
    /// Kept in its block format.
    Keep,
    /// Requantized to this block format.
    Requantize(GgmlDType),
    /// Kept in Q4_1 and multiplied by our own kernel ([`crate::q4_1`]).
    OwnQ4_1,
}

/// How GGUF weights are held in memory. On a CUDA device every policy but
/// [`QuantPolicy::Dense`] holds the weights as stored, for candle's CUDA kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantPolicy {
    /// Types with SIMD dot products in candle-core 0.11.1 (`Q4_0`, `Q8_0`, K-quants) are kept;
    /// `Q4_1` is kept and multiplied by our own kernel ([`crate::q4_1`]) unless its input width
    /// is a multiple of 256 (candle's tiled `Q8_0` kernel wins there); the others without a
    /// SIMD kernel (`Q5_0`, `Q5_1`, and `Q4_1` where ours does not run) are requantized to
    /// `Q8_0` at load, within `Q8_0`'s rounding of the stored values. The default; the
    /// measurements behind it are in `docs/bench-log/gguf.md`.
    #[default]
    Fast,
    /// [`QuantPolicy::Fast`] with candle's kernels only, the default before [`crate::q4_1`]:
    /// `Q4_1` is requantized to `Q8_0` too. Kept to compare against.
    CandleKernels,
    /// Every quantized type kept as stored: exactly the file's arithmetic (what
    /// candle-transformers' `quantized_llama` computes), slow for `Q4_1`/`Q5_*`.
    AsStored,
    /// Everything dequantized to dense f32: the file's exact weights in f32 arithmetic.
    Dense,
}

/// The plan for a projection weight stored as `dtype`, or `None` if it cannot be served.
fn plan(dtype: GgmlDType, policy: QuantPolicy) -> Option<Plan> {
    use GgmlDType as T;
    let quantized = |fast: Plan| match policy {
        QuantPolicy::Fast => fast,
        QuantPolicy::CandleKernels => match fast {
            Plan::OwnQ4_1 => Plan::Requantize(T::Q8_0),
            other => other,
        },
        QuantPolicy::AsStored => Plan::Keep,
        QuantPolicy::Dense => Plan::Dense,
    };
    match dtype {
        T::F32 | T::F16 | T::BF16 => Some(Plan::Dense),
        T::Q4_0 | T::Q8_0 | T::Q2K | T::Q3K | T::Q4K | T::Q5K | T::Q6K => {
            Some(quantized(Plan::Keep))
        }
        T::Q4_1 => Some(quantized(Plan::OwnQ4_1)),
        T::Q5_0 | T::Q5_1 => Some(quantized(Plan::Requantize(T::Q8_0))),
        T::Q8_1 | T::Q8K => None,
    }
}

impl GgufFile {
    /// Reads the header of the GGUF file at `path` and checks that every tensor's type can be
    /// served.
    ///
    /// # Errors
    /// [`ModelError::Io`] if it cannot be opened, [`ModelError::Gguf`] if it is not a GGUF
    /// file or uses a tensor type candle does not know (the message names the type id),
    /// [`ModelError::UnsupportedTensorType`] naming a tensor of a type that is not a weight
    /// format.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let malformed = |why: String| ModelError::Gguf {
            path: path.to_path_buf(),
            source: candle_core::Error::Msg(why),
        };
        // candle's reader divides by the header's `general.alignment`: a 0 there is a panic
        // inside it (a file from outside must be an error, not a crash), caught here; any other
        // alignment is checked after.
        let content = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gguf_file::Content::read(&mut file)
        }))
        .map_err(|_| malformed("the header cannot be placed: general.alignment is 0".into()))?
        .map_err(|source| ModelError::Gguf {
            path: path.to_path_buf(),
            source,
        })?;
        check_alignment(&content.metadata).map_err(malformed)?;
        let file_len = file
            .metadata()
            .map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        check_tensor_extents(&content, file_len).map_err(malformed)?;
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        for name in names {
            let dtype = content.tensor_infos[name].ggml_dtype;
            if plan(dtype, QuantPolicy::default()).is_none() {
                return Err(ModelError::UnsupportedTensorType {
                    tensor: name.clone(),
                    dtype: format!("{dtype:?}"),
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            content,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata (`general.*`, `llama.*`, `tokenizer.*`...).
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Whether the file holds the tensor `name` (a GGUF name, e.g. `output.weight`).
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn get(&self, key: &str) -> Result<&Value, ModelError> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| ModelError::InvalidConfig(format!("GGUF metadata {key} is missing")))
    }

    fn uint(&self, key: &str) -> Result<usize, ModelError> {
        let v = self.get(key)?;
        as_u64(v)
            .map(|n| n as usize)
            .ok_or_else(|| invalid_value(key, v, "an unsigned integer"))
    }

    fn opt_uint(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.content.metadata.contains_key(key) {
            true => self.uint(key).map(Some),
            false => Ok(None),
        }
    }

    fn float(&self, key: &str) -> Result<f64, ModelError> {
        let v = self.get(key)?;
        match v {
            // The shortest decimal of the f32 (1e-5 stays 1e-5, not 9.99999974e-6).
            Value::F32(x) => Ok(x.to_string().parse().unwrap_or(f64::from(*x))),
            Value::F64(x) => Ok(*x),
            other => as_u64(other)
                .map(|n| n as f64)
                .ok_or_else(|| invalid_value(key, v, "a number")),
        }
    }

    fn opt_string(&self, key: &str) -> Result<Option<String>, ModelError> {
        match self.content.metadata.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(invalid_value(key, v, "a string")),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.content.metadata.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(invalid_value(key, v, "a boolean")),
        }
    }

    fn opt_id(&self, key: &str) -> Result<Option<u32>, ModelError> {
        Ok(self.opt_uint(key)?.map(|n| n as u32))
    }

    fn strings(&self, key: &str) -> Result<Vec<String>, ModelError> {
        let v = self.get(key)?;
        let Value::Array(items) = v else {
            return Err(invalid_value(key, v, "an array of strings"));
        };
        items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(s.clone()),
                other => Err(invalid_value(key, other, "an array of strings")),
            })
            .collect()
    }

    /// `general.architecture`, mapped to the graph that runs it.
    fn arch(&self) -> Result<(Arch, String), ModelError> {
        let name = self
            .opt_string("general.architecture")?
            .unwrap_or_else(|| "<none>".into());
        let arch = match name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => {
                return Err(ModelError::UnsupportedArchitecture(format!(
                    "{other} (GGUF general.architecture)"
                )));
            }
        };
        Ok((arch, name))
    }

    /// The model configuration from `general.architecture` and the `{arch}.*` keys (block
    /// count, widths, heads, RMSNorm epsilon, RoPE base, context length); the vocabulary size
    /// from `token_embd.weight`; tied embeddings when there is no `output.weight`; EOS ids from
    /// `tokenizer.ggml.eos_token_id` and `eot_token_id`.
    ///
    /// # Errors
    /// [`ModelError::UnsupportedArchitecture`] naming the architecture, or
    /// [`ModelError::InvalidConfig`] naming a missing or unsupported key (RoPE scaling, partial
    /// rotary dimensions, Llama 3.1 `rope_freqs`).
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let (arch, name) = self.arch()?;
        let key = |k: &str| format!("{name}.{k}");
        let hidden = self.uint(&key("embedding_length"))?;
        let heads = self.uint(&key("attention.head_count"))?;
        let head_dim = self
            .opt_uint(&key("attention.key_length"))?
            .unwrap_or(hidden / heads.max(1));
        if let Some(rot) = self.opt_uint(&key("rope.dimension_count"))?
            && rot != head_dim
        {
            return Err(ModelError::InvalidConfig(format!(
                "{} = {rot} differs from the head dimension {head_dim}: partial rotary \
                 embeddings are not supported",
                key("rope.dimension_count")
            )));
        }
        if let Some(kind) = self.opt_string(&key("rope.scaling.type"))?
            && kind != "none"
        {
            return Err(ModelError::InvalidConfig(format!(
                "{} = {kind:?} is not supported",
                key("rope.scaling.type")
            )));
        }
        if self.has_tensor("rope_freqs.weight") {
            return Err(ModelError::InvalidConfig(
                "rope_freqs.weight (per-frequency RoPE factors, as in Llama 3.1) is not \
                 supported"
                    .into(),
            ));
        }
        let vocab = match self.content.tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims2().map(|(v, _)| v)?,
            None => {
                return Err(ModelError::InvalidConfig(
                    "GGUF has no token_embd.weight".into(),
                ));
            }
        };
        let eos: Vec<u32> = [
            self.opt_id("tokenizer.ggml.eos_token_id")?,
            self.opt_id("tokenizer.ggml.eot_token_id")?,
        ]
        .into_iter()
        .flatten()
        .collect();
        let hf = HfConfig {
            architectures: vec![name.clone()],
            model_type: Some(name.clone()),
            hidden_size: hidden,
            intermediate_size: self.uint(&key("feed_forward_length"))?,
            num_hidden_layers: self.uint(&key("block_count"))?,
            num_attention_heads: heads,
            num_key_value_heads: self.opt_uint(&key("attention.head_count_kv"))?,
            head_dim: Some(head_dim),
            vocab_size: vocab,
            rms_norm_eps: self.float(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: match self.content.metadata.contains_key(&key("rope.freq_base")) {
                true => self.float(&key("rope.freq_base"))?,
                false => 10_000.0,
            },
            rope_scaling: None,
            max_position_embeddings: self.uint(&key("context_length"))?,
            tie_word_embeddings: !self.has_tensor("output.weight"),
            attention_bias: false,
            torch_dtype: None,
            bos_token_id: self.opt_id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: Some(serde_json::json!(eos)),
            sliding_window: None,
        };
        let mut cfg = hf.resolve()?;
        debug_assert_eq!(cfg.arch, arch);
        // Biases are whatever the file has (Qwen2 has q/k/v biases).
        cfg.qkv_bias = self.has_tensor("blk.0.attn_q.bias");
        cfg.o_bias = self.has_tensor("blk.0.attn_output.bias");
        Ok(cfg)
    }

    /// The tokenizer metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`) as plain data.
    ///
    /// # Errors
    /// [`ModelError::InvalidConfig`] when the file has no tokenizer or a key has the wrong
    /// type, naming the key.
    pub fn vocab(&self) -> Result<GgufVocab, ModelError> {
        let model = self.opt_string("tokenizer.ggml.model")?.ok_or_else(|| {
            ModelError::InvalidConfig(
                "the GGUF file has no tokenizer (tokenizer.ggml.model is missing)".into(),
            )
        })?;
        let token_types = match self.content.metadata.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::I32(x) => Ok(*x),
                    other => as_u64(other).map(|x| x as i32).ok_or_else(|| {
                        invalid_value("tokenizer.ggml.token_type", other, "an array of integers")
                    }),
                })
                .collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(invalid_value(
                    "tokenizer.ggml.token_type",
                    v,
                    "an array of integers",
                ));
            }
        };
        Ok(GgufVocab {
            model,
            pre: self.opt_string("tokenizer.ggml.pre")?,
            tokens: self.strings("tokenizer.ggml.tokens")?,
            token_types,
            merges: match self.content.metadata.contains_key("tokenizer.ggml.merges") {
                true => self.strings("tokenizer.ggml.merges")?,
                false => Vec::new(),
            },
            bos_token_id: self.opt_id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: self.opt_id("tokenizer.ggml.eos_token_id")?,
            eot_token_id: self.opt_id("tokenizer.ggml.eot_token_id")?,
            unknown_token_id: self.opt_id("tokenizer.ggml.unknown_token_id")?,
            padding_token_id: self.opt_id("tokenizer.ggml.padding_token_id")?,
            add_bos_token: self.opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos_token: self.opt_bool("tokenizer.ggml.add_eos_token")?,
            chat_template: self.opt_string("tokenizer.chat_template")?,
        })
    }

    /// The tensors, served under Hugging Face names for a model of `cfg`, held as `policy`
    /// says.
    ///
    /// # Errors
    /// [`ModelError::Io`] if the file cannot be opened again.
    pub fn weights(
        &self,
        cfg: &ModelConfig,
        device: &Device,
        policy: QuantPolicy,
    ) -> Result<GgufWeights<'_>, ModelError> {
        let file = std::fs::File::open(&self.path).map_err(|source| ModelError::Io {
            path: self.path.clone(),
            source,
        })?;
        // On a GPU only candle's own CUDA kernels multiply quantized weights (ours for Q4_1
        // and the CPU tiling tricks are CPU code): every stored type is kept as stored, and
        // candle's CUDA matmul handles batches (dequantizing for large ones) itself.
        let policy = match policy {
            QuantPolicy::Dense => QuantPolicy::Dense,
            _ if !device.is_cpu() => QuantPolicy::AsStored,
            p => p,
        };
        Ok(GgufWeights {
            gguf: self,
            file: RefCell::new(file),
            device: device.clone(),
            permuted_qk: cfg.arch == Arch::Llama,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            formats: RefCell::new(BTreeMap::new()),
            policy,
        })
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn invalid_value(key: &str, v: &Value, want: &str) -> ModelError {
    ModelError::InvalidConfig(format!(
        "GGUF metadata {key} is {:?}, expected {want}",
        v.value_type()
    ))
}

/// The GGUF name of a Hugging Face tensor name of a Llama/Qwen2 checkpoint.
pub(crate) fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_owned());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let module = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{module}.{kind}"))
}

/// A [`WeightSource`] over a [`GgufFile`]'s tensors. Reads each tensor from the file when the
/// model asks for it, and records what each stored type became, for the start-up log
/// ([`GgufWeights::summary`]).
#[derive(Debug)]
pub struct GgufWeights<'a> {
    gguf: &'a GgufFile,
    file: RefCell<std::fs::File>,
    device: Device,
    /// `attn_q` / `attn_k` rows are in llama.cpp's permuted order (`llama` files).
    permuted_qk: bool,
    num_heads: usize,
    num_kv_heads: usize,
    /// "stored type → held as" → tensor count.
    formats: RefCell<BTreeMap<String, usize>>,
    policy: QuantPolicy,
}

impl GgufWeights<'_> {
    /// What the stored weight types became, e.g. `Q4_1→Q4_1(avx2)+f32 ×180, Q4_1→Q8_0 ×30,
    /// F32→f32 ×61, ...`.
    pub fn summary(&self) -> String {
        self.formats
            .borrow()
            .iter()
            .map(|(k, n)| format!("{k} ×{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn note(&self, from: GgmlDType, to: &str, n: usize) {
        *self
            .formats
            .borrow_mut()
            .entry(format!("{from:?}→{to}"))
            .or_default() += n;
    }

    /// The stored tensor of the Hugging Face name `hf`, with its GGUF name, in host memory (it
    /// is reordered, requantized or fused there, then placed on the model's device).
    fn read(&self, hf: &str) -> Result<(QTensor, String), ModelError> {
        let name = gguf_name(hf).ok_or_else(|| {
            ModelError::InvalidConfig(format!("no GGUF name for the tensor {hf}"))
        })?;
        if !self.gguf.has_tensor(&name) {
            return Err(ModelError::InvalidConfig(format!(
                "{} has no tensor {name} ({hf})",
                self.gguf.path.display()
            )));
        }
        let mut file = self.file.borrow_mut();
        let t = self
            .gguf
            .content
            .tensor(&mut *file, &name, &Device::Cpu)
            .map_err(|source| ModelError::Gguf {
                path: self.gguf.path.clone(),
                source,
            })?;
        Ok((t, name))
    }

    /// Rows of `q` (out, in) from llama.cpp's order back to Hugging Face's, for `heads` heads.
    ///
    /// The converter wrote HF row `h·d + i·d/2 + j` (i ∈ {0, 1}, j < d/2) at `h·d + 2j + i`.
    fn unpermute(&self, q: &QTensor, heads: usize) -> Result<QTensor, ModelError> {
        let (out, inp) = q.shape().dims2()?;
        let d = out / heads;
        let row = inp / q.dtype().block_size() * q.dtype().type_size();
        let data = q.data()?;
        let mut dst = vec![0u8; data.len()];
        for h in 0..heads {
            for i in 0..2 {
                for j in 0..d / 2 {
                    let to = h * d + i * d / 2 + j;
                    let from = h * d + 2 * j + i;
                    dst[to * row..(to + 1) * row]
                        .copy_from_slice(&data[from * row..(from + 1) * row]);
                }
            }
        }
        let storage = QStorage::from_data(std::borrow::Cow::Owned(dst), &Device::Cpu, q.dtype())?;
        Ok(QTensor::new(storage, (out, inp))?)
    }
}

impl WeightSource for GgufWeights<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let (q, gguf) = self.read(name)?;
        if q.shape().dims() != shape {
            return Err(ModelError::InvalidConfig(format!(
                "{gguf} has shape {:?}, expected {shape:?}",
                q.shape().dims()
            )));
        }
        self.note(q.dtype(), "f32", 1);
        Ok(q.dequantize(&self.device)?)
    }

    fn projection(
        &self,
        in_dim: usize,
        parts: &[(usize, &str)],
        bias: bool,
    ) -> Result<Proj, ModelError> {
        let mut weights = Vec::with_capacity(parts.len());
        for &(out, prefix) in parts {
            let (mut q, gguf) = self.read(&format!("{prefix}.weight"))?;
            if q.shape().dims2()? != (out, in_dim) {
                return Err(ModelError::InvalidConfig(format!(
                    "{gguf} has shape {:?}, expected ({out}, {in_dim})",
                    q.shape().dims()
                )));
            }
            if self.permuted_qk {
                if prefix.ends_with(".q_proj") {
                    q = self.unpermute(&q, self.num_heads)?;
                } else if prefix.ends_with(".k_proj") {
                    q = self.unpermute(&q, self.num_kv_heads)?;
                }
            }
            weights.push(q);
        }
        let bias = if bias {
            let bs = parts
                .iter()
                .map(|&(out, prefix)| self.tensor(&format!("{prefix}.bias"), &[out]))
                .collect::<Result<Vec<_>, _>>()?;
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        // Every part of a fused projection must end in one format: dense if any part is dense,
        // else the common block format, else (a mix such as Q4_K with Q6_K) all in Q8_0.
        let plans: Vec<Plan> = weights
            .iter()
            .map(|q| match plan(q.dtype(), self.policy) {
                Some(Plan::OwnQ4_1) if !own_q4_1(in_dim) => Plan::Requantize(GgmlDType::Q8_0),
                Some(p) => p,
                None => Plan::Dense,
            })
            .collect();
        let target = |q: &QTensor, p: Plan| match p {
            Plan::Dense => None,
            Plan::Keep | Plan::OwnQ4_1 => Some(q.dtype()),
            Plan::Requantize(t) => Some(t),
        };
        let targets: Vec<Option<GgmlDType>> = weights
            .iter()
            .zip(&plans)
            .map(|(q, &p)| target(q, p))
            .collect();
        let common = if targets.iter().any(Option::is_none) {
            None
        } else if targets.windows(2).all(|w| w[0] == w[1]) {
            targets[0]
        } else {
            Some(GgmlDType::Q8_0)
        };
        let Some(dtype) = common else {
            let ws = weights
                .iter()
                .map(|q| {
                    self.note(q.dtype(), "f32", 1);
                    q.dequantize(&self.device)
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            // (sum_out, in)
            return Proj::dense(&Tensor::cat(&ws, 0)?, bias);
        };
        let mut bytes = Vec::new();
        let mut rows = 0;
        let mut dense_parts = Vec::new();
        // candle's fast x86 kernels for batches of rows (repacked Q8_0 / K-quant tiles) need
        // the input width to be a multiple of 256; below that, f32 gemm wins from
        // DENSE_MIN_ROWS rows (docs/bench-log/gguf.md), so such projections also keep an f32
        // copy.
        let keep_dense = matches!(self.policy, QuantPolicy::Fast | QuantPolicy::CandleKernels)
            && !in_dim.is_multiple_of(256);
        // All parts Q4_1 (a mix was requantized to Q8_0 above): our kernel.
        let own = dtype == GgmlDType::Q4_1 && plans.iter().all(|p| *p == Plan::OwnQ4_1);
        // Q8_0 whose input width candle's tiled VNNI kernel cannot take (a multiple of 256,
        // and out rows a multiple of 16): widen every row with zero blocks, when this CPU runs
        // that kernel (docs/bench-log/llama-cpp.md, "The tied LM head on candle's tiled
        // kernel").
        let total_rows: usize = parts.iter().map(|&(out, _)| out).sum();
        let padded_in = (self.policy == QuantPolicy::Fast
            && dtype == GgmlDType::Q8_0
            && total_rows.is_multiple_of(16)
            && !in_dim.is_multiple_of(256)
            && cpu_has_vnni())
        .then(|| in_dim.next_multiple_of(256));
        // The tiled kernel beats f32 gemm at every batch size (as for `ffn_down`): no f32 copy.
        let keep_dense = keep_dense && padded_in.is_none();
        let held = format!(
            "{}{}",
            match (own, padded_in) {
                (true, _) => format!("Q4_1({})", Q4_1Kernel::detect().name()),
                (false, Some(k)) => format!("{dtype:?}(padded to {k})"),
                (false, None) => format!("{dtype:?}"),
            },
            if keep_dense { "+f32" } else { "" }
        );
        for q in weights {
            self.note(q.dtype(), &held, 1);
            if keep_dense {
                dense_parts.push(q.dequantize(&self.device)?);
            }
            let q = if q.dtype() == dtype {
                q
            } else {
                QTensor::quantize(&q.dequantize(&Device::Cpu)?, dtype)?
            };
            rows += q.shape().dims2()?.0;
            bytes.extend_from_slice(&q.data()?);
        }
        let dense = match dense_parts.is_empty() {
            true => None,
            // (sum_out, in)
            false => Some(Tensor::cat(&dense_parts, 0)?),
        };
        if own {
            // (sum_out, in) in Q4_1 blocks.
            let w = Q4_1Matrix::new(&bytes, rows, in_dim)?;
            return Proj::q4_1(w, dense.as_ref(), bias);
        }
        let (bytes, width) = match padded_in {
            Some(k) => (pad_q8_0_rows(&bytes, rows, in_dim, k), k),
            None => (bytes, in_dim),
        };
        // (sum_out, width) in `dtype` blocks: rows of a fused projection are contiguous per
        // part.
        let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &self.device, dtype)?;
        let fused = QTensor::new(storage, (rows, width))?;
        Proj::quantized(
            QMatMul::from_qtensor(fused)?,
            dtype,
            padded_in,
            dense.as_ref(),
            bias,
        )
    }

    fn contains(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|n| self.gguf.has_tensor(&n))
    }
}

#[cfg(test)]
mod tests;

//! Where the model's tensors come from: [`WeightSource`], with one implementation per file
//! format ([`SafetensorsWeights`] here, [`crate::gguf::GgufWeights`]), and [`Proj`], the linear
//! layer whose weight is either dense f32 or kept in a quantized GGUF block format.
//!
//! The model asks for tensors by their Hugging Face names (`model.layers.0.self_attn.q_proj`);
//! a source translates them to its own. There is one model implementation ([`crate::llama`]);
//! sources differ only in how a named tensor becomes a [`Tensor`] or a [`Proj`].

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

use crate::error::ModelError;
use crate::q4_1::Q4_1Matrix;

/// A model's weights by Hugging Face name.
pub trait WeightSource {
    /// The dense f32 tensor `name` (a full name such as `model.norm.weight`), checked to have
    /// `shape`.
    ///
    /// # Errors
    /// A missing tensor or a shape mismatch, naming the tensor.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError>;

    /// The projection reading `in_dim` features made of `parts` fused along the output
    /// dimension, in order: each `(out_dim, prefix)` is the weight `{prefix}.weight`
    /// `(out_dim, in_dim)` and, when `bias`, the bias `{prefix}.bias` `(out_dim,)`.
    ///
    /// # Errors
    /// A missing tensor, a shape mismatch or an unsupported weight type, naming the tensor.
    fn projection(
        &self,
        in_dim: usize,
        parts: &[(usize, &str)],
        bias: bool,
    ) -> Result<Proj, ModelError>;

    /// Whether the source holds the tensor `name`.
    fn contains(&self, name: &str) -> bool;
}

/// How a [`Proj`] holds its weight.
#[derive(Debug)]
enum ProjWeight {
    /// (in_dim, out_dim), contiguous f32.
    ///
    /// Checkpoints store `(out, in)`; multiplying by `w.t()` makes gemm repack the weight on
    /// every call once the batch has more than one row. Keeping `(in, out)` contiguous avoids
    /// that.
    Dense(Tensor),
    /// (out_dim, in_dim) in GGUF blocks (rows of `in_dim / block_size` blocks), multiplied by
    /// candle's quantized kernels (the input is quantized per row on the fly).
    Quantized {
        /// (out_dim, padded_in) when `padded_in` is set, else (out_dim, in_dim).
        w: QMatMul,
        dtype: GgmlDType,
        /// The weight's rows were widened with zero blocks to this many columns (a multiple
        /// of 256, so candle's tiled kernel runs it); the input is widened with zeros to match.
        padded_in: Option<usize>,
        /// (in_dim, out_dim), contiguous f32: the same weights dequantized, used for batches of
        /// at least [`DENSE_MIN_ROWS`] rows where f32 gemm beats the quantized kernel.
        dense: Option<Tensor>,
    },
    /// (out_dim, in_dim) in Q4_1 blocks, multiplied by our own kernel ([`crate::q4_1`]).
    Q4_1 {
        w: Q4_1Matrix,
        /// (in_dim, out_dim), contiguous f32, for batches of at least [`DENSE_MIN_ROWS`] rows.
        dense: Option<Tensor>,
    },
}

/// A dense copy `(out, in)` as the `(in, out)` contiguous weight its projection multiplies by.
fn transposed(dense: Option<&Tensor>) -> Result<Option<Tensor>, ModelError> {
    Ok(match dense {
        Some(d) => Some(d.t()?.contiguous()?),
        None => None,
    })
}

/// Batches of at least this many rows use a quantized projection's dense copy, when it has
/// one. Below it, the quantized kernel: through the whole model a decode step of 16, 32 or 48
/// rows runs 1.8×, 1.45× and 1.26× faster on the Q4_1 kernel than on the f32 copies, whose
/// 320 MB stream from memory every step (a single matmul in cache favours f32 from 16 rows:
/// `docs/bench-log/gguf.md`, and `docs/bench-log/llama-cpp.md`, "Batched decode on the Q4_1
/// kernel").
pub const DENSE_MIN_ROWS: usize = 64;

/// A linear projection of the flattened batch: `y = x @ W^T + b`, `x`: (t, in) → (t, out).
/// Projections reading the same input (q/k/v, gate/up) are fused into one along the output
/// dimension, so a layer runs one matmul where a checkpoint names several.
#[derive(Debug)]
pub struct Proj {
    weight: ProjWeight,
    /// (out_dim,)
    bias: Option<Tensor>,
}

impl Proj {
    /// A dense projection from its `(out, in)` weight (f32, or the model's f16/bf16).
    ///
    /// # Errors
    /// A candle error (not 2-D).
    pub fn dense(w: &Tensor, bias: Option<Tensor>) -> Result<Self, ModelError> {
        let (_out, _in) = w.dims2()?;
        Ok(Self {
            weight: ProjWeight::Dense(w.t()?.contiguous()?),
            bias,
        })
    }

    /// A projection over a quantized `(out, in)` weight; `dense`, its `(out, in)` f32 values,
    /// serves batches of [`DENSE_MIN_ROWS`] rows or more.
    /// `padded_in`: the weight's rows were widened with zero blocks to that many columns.
    pub(crate) fn quantized(
        w: QMatMul,
        dtype: GgmlDType,
        padded_in: Option<usize>,
        dense: Option<&Tensor>,
        bias: Option<Tensor>,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            weight: ProjWeight::Quantized {
                w,
                dtype,
                padded_in,
                dense: transposed(dense)?,
            },
            bias,
        })
    }

    /// A projection over a Q4_1 `(out, in)` weight multiplied by [`crate::q4_1`]; `dense`, its
    /// `(out, in)` f32 values, serves batches of [`DENSE_MIN_ROWS`] rows or more.
    pub(crate) fn q4_1(
        w: Q4_1Matrix,
        dense: Option<&Tensor>,
        bias: Option<Tensor>,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            weight: ProjWeight::Q4_1 {
                w,
                dense: transposed(dense)?,
            },
            bias,
        })
    }

    /// `x`: (t, in) → (t, out).
    ///
    /// # Errors
    /// A candle error (shape mismatch).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (rows, _in) = x.dims2()?;
        let y = match &self.weight {
            ProjWeight::Dense(wt) => x.matmul(wt)?,
            ProjWeight::Quantized {
                dense: Some(wt), ..
            } if rows >= DENSE_MIN_ROWS => x.matmul(wt)?,
            ProjWeight::Quantized {
                w,
                padded_in: Some(k),
                ..
            } => {
                let (_, in_dim) = x.dims2()?;
                // (t, in) → (t, k): zeros meet the weight's zero blocks.
                w.forward(
                    &x.pad_with_zeros(1, 0, k.saturating_sub(in_dim))?
                        .contiguous()?,
                )?
            }
            ProjWeight::Quantized { w, .. } => w.forward(&x.contiguous()?)?,
            ProjWeight::Q4_1 {
                dense: Some(wt), ..
            } if rows >= DENSE_MIN_ROWS => x.matmul(wt)?,
            ProjWeight::Q4_1 { w, .. } => w.forward(x)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// How the weight is held: `f32` (`f16`, `bf16`), the GGUF block type (`Q8_0`, ...; `Q4_1(avx2)` names
    /// the kernel of [`crate::q4_1`] that runs it), or both (`Q8_0+f32`: the block type for
    /// small batches, f32 from [`DENSE_MIN_ROWS`] rows).
    pub fn weight_format(&self) -> String {
        let (held, dense) = match &self.weight {
            ProjWeight::Dense(w) => return w.dtype().as_str().into(),
            ProjWeight::Quantized {
                dtype,
                dense,
                padded_in,
                ..
            } => match padded_in {
                Some(k) => (format!("{dtype:?}(padded to {k})"), dense),
                None => (format!("{dtype:?}"), dense),
            },
            ProjWeight::Q4_1 { w, dense } => (format!("Q4_1({})", w.kernel().name()), dense),
        };
        match dense {
            Some(_) => format!("{held}+f32"),
            None => held,
        }
    }
}

/// Weights from a Hugging Face directory's safetensors files, converted at load to the dtype
/// the model computes in (f32 by default; f16 or bf16 on request).
pub struct SafetensorsWeights<'a> {
    vb: VarBuilder<'a>,
}

impl std::fmt::Debug for SafetensorsWeights<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsWeights").finish_non_exhaustive()
    }
}

impl SafetensorsWeights<'static> {
    /// Memory-maps `files` (all of a checkpoint's shards); every tensor is read as `dtype`
    /// (f32, f16 or bf16), whatever the file stores.
    ///
    /// # Errors
    /// A file that cannot be mapped or parsed; [`ModelError::UnsupportedDtype`] for a `dtype`
    /// other than those three.
    pub fn open(
        files: &[std::path::PathBuf],
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(ModelError::UnsupportedDtype(format!(
                "{dtype:?} as the compute dtype (f32, f16 or bf16)"
            )));
        }
        // SAFETY: the files are memory-mapped read-only; the engine does not modify them, and
        // a model directory changing under a running server is outside our contract (as for
        // every HF loader).
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(files, dtype, device)? };
        Ok(Self { vb })
    }
}

impl<'a> SafetensorsWeights<'a> {
    /// Over an already-open [`VarBuilder`] (names are looked up from its root).
    pub fn from_var_builder(vb: VarBuilder<'a>) -> Self {
        Self { vb }
    }
}

impl WeightSource for SafetensorsWeights<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        Ok(self.vb.get(shape, name)?)
    }

    fn projection(
        &self,
        in_dim: usize,
        parts: &[(usize, &str)],
        bias: bool,
    ) -> Result<Proj, ModelError> {
        let ws = parts
            .iter()
            .map(|(out, prefix)| self.vb.get((*out, in_dim), &format!("{prefix}.weight")))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let bias = if bias {
            let bs = parts
                .iter()
                .map(|(out, prefix)| self.vb.get(*out, &format!("{prefix}.bias")))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        // (sum_out, in)
        Proj::dense(&Tensor::cat(&ws, 0)?, bias)
    }

    fn contains(&self, name: &str) -> bool {
        self.vb.contains_tensor(name)
    }
}

/// Rejects weight files whose tensors are not float32/float16/bfloat16, naming the dtype, the
/// tensor and the file. Reads the headers through candle's safetensors reader (the files are
/// mapped, not read).
pub(crate) fn check_weight_dtypes(files: &[std::path::PathBuf]) -> Result<(), ModelError> {
    for f in files {
        // SAFETY: mapped read-only for this check; a model directory changing under a starting
        // server is outside our contract (as for every HF loader).
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(f)? };
        for (name, view) in st.tensors() {
            let supported = DType::try_from(view.dtype())
                .is_ok_and(|d| matches!(d, DType::F32 | DType::F16 | DType::BF16));
            if !supported {
                return Err(ModelError::UnsupportedDtype(format!(
                    "{:?} (tensor {name} in {})",
                    view.dtype(),
                    f.display()
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// A weight file holding an integer tensor is refused at load, naming the dtype, the tensor
    /// and the file; float files pass.
    #[test]
    fn weight_files_with_integer_tensors_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("pd-weight-dtypes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (good, bad) = (dir.join("good.safetensors"), dir.join("bad.safetensors"));
        let f = Tensor::zeros((2, 3), DType::F16, &Device::Cpu).unwrap();
        let ids = Tensor::zeros(4, DType::I64, &Device::Cpu).unwrap();
        candle_core::safetensors::save(&HashMap::from([("w", f.clone())]), &good).unwrap();
        candle_core::safetensors::save(&HashMap::from([("w", f), ("model.ids", ids)]), &bad)
            .unwrap();
        assert!(check_weight_dtypes(std::slice::from_ref(&good)).is_ok());
        match check_weight_dtypes(&[good, bad]) {
            Err(ModelError::UnsupportedDtype(m)) => assert!(
                m.contains("I64") && m.contains("model.ids") && m.contains("bad.safetensors"),
                "{m}"
            ),
            other => panic!("expected the I64 tensor refused, got {other:?}"),
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

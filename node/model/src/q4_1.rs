//! Q4_1 weights multiplied directly, for small batches: [`Q4_1Matrix`], the `(out, in)` weight in
//! GGUF's Q4_1 blocks, and its matmul `x: (m, in) f32 → y: (m, out) f32`, a candle
//! [`CustomOp1`].
//!
//! The arithmetic is llama.cpp's `ggml_vec_dot_q4_1_q8_1` (candle-core has it in scalar form
//! only, `BlockQ4_1::vec_dot`): each input row is quantized once to Q8_1 with candle's own
//! `BlockQ8_1::from_float` (32 values per block: scale `d_x`, `s_x = d_x · Σ q_x`, 32 `i8`), and
//! for each weight block (scale `d_w`, minimum `m_w`, 32 nibbles `q_w`)
//!
//! ```text
//! y[r, o] = Σ_blocks  d_w · d_x · Σ_i q_w[i] · q_x[i]  +  m_w · s_x
//! ```
//!
//! Kernels ([`Q4_1Kernel`], chosen at run time with `is_x86_feature_detected!`): AVX2 + FMA +
//! F16C (nibbles unpacked to bytes, `vpmaddubsw` + `vpmaddwd`, one FMA per block, as llama.cpp
//! does), the same with AVX-VNNI's `vpdpbusd` in place of the two multiplies, and a scalar
//! fallback that any target runs. Integer sums per block are exact in all three; only the
//! order of the float additions differs. A tile of weight rows × input rows shares the
//! unpacked nibbles and the quantized input across its dot products, and output rows are split
//! over candle's barrier pool (the one its own kernels use) in chunks large enough to pay for
//! the hand-off.
//!
//! Measurements and the decision of where this kernel runs are in `BENCHMARKS.md`
//! ("GGUF weight formats") and `docs/bench-log/gguf.md` ("Our Q4_1 × Q8_1 kernel").

use candle_core::backend::BackendStorage;
use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8_1, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use half::f16;

/// Values per block (Q4_1 and Q8_1).
const QK: usize = 32;
/// Bytes of a Q4_1 block: f16 `d`, f16 `m`, 16 bytes of nibbles (value `i` in the low nibble
/// of byte `i`, value `i + 16` in its high nibble).
const Q4_1_BYTES: usize = 20;
/// Bytes of a Q8_1 block: f16 `d`, f16 `s`, 32 `i8`.
const Q8_1_BYTES: usize = 36;
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == Q4_1_BYTES);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == Q8_1_BYTES);
const _: () = assert!(std::mem::align_of::<BlockQ8_1>() <= 2);

/// Block dot products (`out · in/32 · m`) below which one thread does a whole matmul. A 576×576
/// matmul of one row (10 368 block dots, ~16 µs on one core) stays on one thread; larger ones
/// are split. Measured only coarsely: on this 2-core machine, shared with other work, the
/// 2-thread timings were too noisy to tune it (`docs/bench-log/gguf.md`).
const MIN_PARALLEL_WORK: usize = 8 * 1024;

/// Which implementation computes the block dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q4_1Kernel {
    /// Plain Rust, any target: the reference.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX2 + FMA + F16C with AVX-VNNI's `vpdpbusd` (256-bit, VEX-encoded; no AVX-512).
    AvxVnni,
}

impl Q4_1Kernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        [Self::AvxVnni, Self::Avx2]
            .into_iter()
            .find(|k| k.is_available())
            .unwrap_or(Self::Scalar)
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni => Self::Avx2.is_available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 | Self::AvxVnni => false,
        }
    }

    /// A short name for logs: `scalar`, `avx2`, `avx-vnni`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avx-vnni",
        }
    }
}

/// A weight `(out_dim, in_dim)` in Q4_1 blocks, row-major: each row is `in_dim / 32` blocks.
/// Multiplies f32 inputs through [`Q4_1Matrix::forward`] (or [`CustomOp1`]).
///
/// The blocks' fields are held in three arrays (the same 20 bytes a block): the kernels load
/// eight blocks' scales at once and each block's nibbles with one load.
#[derive(Debug, Clone)]
pub struct Q4_1Matrix {
    /// (out_dim, in_dim / 32): each block's 32 nibbles (value `i` in the low nibble of byte
    /// `i`, value `i + 16` in its high nibble).
    qs: Vec<[u8; 16]>,
    /// (out_dim, padded(in_dim / 32)): each block's scale `d`, f16 bits; each row zero-padded
    /// to whole vectors of 8 ([`padded`]).
    d: Vec<u16>,
    /// (out_dim, padded(in_dim / 32)): each block's minimum `m`, f16 bits, padded as `d`.
    m: Vec<u16>,
    out_dim: usize,
    in_dim: usize,
    kernel: Q4_1Kernel,
}

impl Q4_1Matrix {
    /// The weight from its raw Q4_1 blocks, `(out_dim, in_dim)`, with the fastest kernel of
    /// this CPU.
    ///
    /// # Errors
    /// `in_dim` not a multiple of 32, or `blocks` not `out_dim · in_dim / 32` blocks long.
    pub fn new(blocks: &[u8], out_dim: usize, in_dim: usize) -> candle_core::Result<Self> {
        if !in_dim.is_multiple_of(QK) {
            candle_core::bail!("Q4_1 weight: input width {in_dim} is not a multiple of {QK}");
        }
        let want = out_dim * in_dim / QK * Q4_1_BYTES;
        if blocks.len() != want {
            candle_core::bail!(
                "Q4_1 weight ({out_dim}, {in_dim}): {} bytes, expected {want}",
                blocks.len()
            );
        }
        let (raw, _) = blocks.as_chunks::<Q4_1_BYTES>();
        let nb = in_dim / QK;
        let nbp = padded(nb);
        let mut qs = Vec::with_capacity(raw.len());
        let mut d = vec![0u16; out_dim * nbp];
        let mut m = vec![0u16; out_dim * nbp];
        if nb > 0 {
            for (row, (d, m)) in raw
                .chunks_exact(nb)
                .zip(d.chunks_exact_mut(nbp).zip(m.chunks_exact_mut(nbp)))
            {
                for (b, (d, m)) in row.iter().zip(d.iter_mut().zip(m)) {
                    *d = u16::from_ne_bytes([b[0], b[1]]);
                    *m = u16::from_ne_bytes([b[2], b[3]]);
                    let mut q = [0u8; 16];
                    q.copy_from_slice(&b[4..]);
                    qs.push(q);
                }
            }
        }
        Ok(Self {
            qs,
            d,
            m,
            out_dim,
            in_dim,
            kernel: Q4_1Kernel::detect(),
        })
    }

    /// The weight of a 2-D Q4_1 [`QTensor`] `(out_dim, in_dim)`.
    ///
    /// # Errors
    /// Not Q4_1, not 2-D, or not on the CPU.
    pub fn from_qtensor(q: &QTensor) -> candle_core::Result<Self> {
        if q.dtype() != GgmlDType::Q4_1 {
            candle_core::bail!("Q4_1 weight: the tensor is {:?}", q.dtype());
        }
        let (out_dim, in_dim) = q.shape().dims2()?;
        Self::new(&q.data()?, out_dim, in_dim)
    }

    /// The same weight computed by `kernel` (tests and benchmarks compare kernels).
    ///
    /// # Errors
    /// This CPU cannot run `kernel`.
    pub fn with_kernel(mut self, kernel: Q4_1Kernel) -> candle_core::Result<Self> {
        if !kernel.is_available() {
            candle_core::bail!("the {} Q4_1 kernel does not run on this CPU", kernel.name());
        }
        self.kernel = kernel;
        Ok(self)
    }

    /// The kernel that runs the dot products.
    pub fn kernel(&self) -> Q4_1Kernel {
        self.kernel
    }

    /// `(out_dim, in_dim)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.out_dim, self.in_dim)
    }

    /// `x`: (m, in) f32 → (m, out) f32.
    ///
    /// # Errors
    /// `x` is not 2-D f32 on the CPU or its width is not `in_dim`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(self)
    }

    /// `y = x · Wᵀ` on slices: `x` (m, in) row-major → `y` (m, out) row-major.
    ///
    /// # Errors
    /// `x` is not a whole number of rows of `in_dim`, or `y` is not `m · out_dim` long.
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) -> candle_core::Result<()> {
        if self.in_dim == 0 || !x.len().is_multiple_of(self.in_dim) {
            candle_core::bail!(
                "Q4_1 matmul: input of {} values is not rows of {}",
                x.len(),
                self.in_dim
            );
        }
        let m = x.len() / self.in_dim;
        if y.len() != m * self.out_dim {
            candle_core::bail!(
                "Q4_1 matmul: output of {} values for ({m}, {})",
                y.len(),
                self.out_dim
            );
        }
        if m == 0 || self.out_dim == 0 {
            return Ok(());
        }
        let xq = Q8Rows::quantize(x, self.in_dim);
        if m == 1 {
            // (1, out) is also (out, 1): no transpose.
            self.rows_split(&xq, y);
        } else {
            // (out, m), transposed into (m, out) below.
            let mut yt = vec![0f32; self.out_dim * m];
            self.rows_split(&xq, &mut yt);
            for (o, col) in yt.chunks_exact(m).enumerate() {
                for (r, v) in col.iter().enumerate() {
                    y[r * self.out_dim + o] = *v;
                }
            }
        }
        Ok(())
    }

    /// All output rows into `yt` (out, m), split over candle's barrier pool (the threads its
    /// own quantized kernels run on, still spinning from the op before) when the work pays
    /// for it. rayon's pool was tried first: its worker then competed for the second core with
    /// candle's spinning one, and two threads gained nothing (`docs/bench-log/llama-cpp.md`,
    /// "The race again, with our Q4_1 kernel").
    fn rows_split(&self, xq: &Q8Rows, yt: &mut [f32]) {
        let m = xq.rows;
        let nb = xq.blocks;
        let work = self.out_dim * nb * m;
        let pool = candle_core::utils::barrier_pool();
        let tasks = (work / MIN_PARALLEL_WORK).min(pool.n_workers() + 1).max(1);
        if tasks == 1 {
            self.rows(self.view(0..self.out_dim), xq, yt);
            return;
        }
        // Whole tiles of 4 weight rows, a few chunks per thread so that a thread the machine
        // delays hands its share to the others (the pool's shared cursor).
        let per_chunk = self.out_dim.div_ceil(tasks * 4).next_multiple_of(4);
        // Each chunk is taken by one thread; the locks are never contended.
        let chunks: Vec<std::sync::Mutex<&mut [f32]>> = yt
            .chunks_mut(per_chunk * m)
            .map(std::sync::Mutex::new)
            .collect();
        pool.execute_chunked(chunks.len(), |range| {
            for i in range {
                let mut yt = chunks[i].lock().unwrap_or_else(|e| e.into_inner());
                let o = i * per_chunk;
                let rows = yt.len() / m;
                self.rows(self.view(o..o + rows), xq, &mut yt);
            }
        });
    }

    /// Weight rows `rows`.
    fn view(&self, rows: std::ops::Range<usize>) -> Rows<'_> {
        let nb = self.in_dim / QK;
        let nbp = padded(nb);
        Rows {
            blocks: nb,
            qs: &self.qs[rows.start * nb..rows.end * nb],
            d: &self.d[rows.start * nbp..rows.end * nbp],
            m: &self.m[rows.start * nbp..rows.end * nbp],
        }
    }

    /// The weight rows `w` against every input row, into `yt` (rows of `w`, m).
    fn rows(&self, w: Rows<'_>, xq: &Q8Rows, yt: &mut [f32]) {
        match self.kernel {
            Q4_1Kernel::Scalar => scalar::rows(w, xq, yt),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `with_kernel` and `detect` only select a kernel that `is_available`
            // confirmed this CPU runs (avx2, fma, f16c).
            Q4_1Kernel::Avx2 => unsafe { x86::rows_avx2(w, xq, yt) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, plus avxvnni.
            Q4_1Kernel::AvxVnni => unsafe { x86::rows_avx_vnni(w, xq, yt) },
            #[cfg(not(target_arch = "x86_64"))]
            Q4_1Kernel::Avx2 | Q4_1Kernel::AvxVnni => scalar::rows(w, xq, yt),
        }
    }
}

impl CustomOp1 for Q4_1Matrix {
    fn name(&self) -> &'static str {
        "q4_1-matmul"
    }

    /// `x`: (m, in) f32, contiguous → (m, out) f32.
    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("Q4_1 matmul: input is {:?}, not f32", storage.dtype());
        };
        let (m, k) = layout.shape().dims2()?;
        if k != self.in_dim {
            candle_core::bail!(
                "Q4_1 matmul: input ({m}, {k}) against weight ({}, {})",
                self.out_dim,
                self.in_dim
            );
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("Q4_1 matmul: input ({m}, {k}) is not contiguous");
        };
        let mut y = vec![0f32; m * self.out_dim];
        self.matmul(&data[start..end], &mut y)?;
        Ok((CpuStorage::F32(y), Shape::from((m, self.out_dim))))
    }
}

/// `blocks` rounded up to whole vectors of 8: the row length of the scale arrays.
fn padded(blocks: usize) -> usize {
    blocks.next_multiple_of(8)
}

/// Consecutive weight rows of a [`Q4_1Matrix`]: `qs` is (rows, blocks), `d` and `m` are
/// (rows, padded(blocks)).
#[derive(Debug, Clone, Copy)]
struct Rows<'a> {
    blocks: usize,
    qs: &'a [[u8; 16]],
    d: &'a [u16],
    m: &'a [u16],
}

impl<'a> Rows<'a> {
    fn len(&self) -> usize {
        self.qs.len() / self.blocks
    }

    /// Rows `range` of these.
    fn sub(&self, range: std::ops::Range<usize>) -> Rows<'a> {
        let nbp = padded(self.blocks);
        Rows {
            blocks: self.blocks,
            qs: &self.qs[range.start * self.blocks..range.end * self.blocks],
            d: &self.d[range.start * nbp..range.end * nbp],
            m: &self.m[range.start * nbp..range.end * nbp],
        }
    }
}

/// Input rows quantized to Q8_1, laid out for the kernels: per block its 32 `i8`, `d` and `s`
/// as f32. `qs` is (rows, blocks), `d` and `s` are (rows, padded(blocks)) with zeros after
/// each row's blocks.
#[derive(Debug)]
struct Q8Rows {
    rows: usize,
    blocks: usize,
    qs: Vec<[i8; QK]>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Q8Rows {
    /// `x`: (rows, in_dim) with `in_dim` a multiple of 32, each row quantized by candle's
    /// `BlockQ8_1::from_float`.
    fn quantize(x: &[f32], in_dim: usize) -> Self {
        let blocks = in_dim / QK;
        let rows = x.len() / in_dim;
        let mut q8 = vec![BlockQ8_1::zeros(); blocks];
        let mut out = Self {
            rows,
            blocks,
            qs: Vec::with_capacity(rows * blocks),
            d: Vec::with_capacity(rows * padded(blocks)),
            s: Vec::with_capacity(rows * padded(blocks)),
        };
        for row in x.chunks_exact(in_dim) {
            BlockQ8_1::from_float(row, &mut q8);
            let pad = padded(blocks) - blocks;
            // SAFETY: `BlockQ8_1` is `#[repr(C)] { d: f16, s: f16, qs: [i8; 32] }`, 36 bytes
            // (asserted above), so it has no padding and every byte is initialized; `u8` has
            // alignment 1, and the byte view lives no longer than `q8`, which is not written
            // while it exists.
            let bytes = unsafe {
                std::slice::from_raw_parts(q8.as_ptr().cast::<u8>(), q8.len() * Q8_1_BYTES)
            };
            let (blocks, _) = bytes.as_chunks::<Q8_1_BYTES>();
            for b in blocks {
                out.d.push(f16::from_ne_bytes([b[0], b[1]]).to_f32());
                out.s.push(f16::from_ne_bytes([b[2], b[3]]).to_f32());
                let mut qs = [0i8; QK];
                for (q, &byte) in qs.iter_mut().zip(&b[4..]) {
                    *q = byte as i8;
                }
                out.qs.push(qs);
            }
            out.d.extend(std::iter::repeat_n(0.0, pad));
            out.s.extend(std::iter::repeat_n(0.0, pad));
        }
        out
    }
}

mod scalar {
    use half::f16;

    use super::{Q8Rows, Rows, padded};

    /// Weight rows `w` × every input row → `yt` (rows of `w`, m).
    pub(super) fn rows(w: Rows<'_>, xq: &Q8Rows, yt: &mut [f32]) {
        for (o, out) in yt.chunks_exact_mut(xq.rows).enumerate() {
            for (r, y) in out.iter_mut().enumerate() {
                *y = dot(w.sub(o..o + 1), xq, r);
            }
        }
    }

    /// One weight row · input row `r`, in the order of candle's `BlockQ4_1::vec_dot`.
    fn dot(w: Rows<'_>, xq: &Q8Rows, r: usize) -> f32 {
        let nb = xq.blocks;
        let nbp = padded(nb);
        let mut sum = 0f32;
        for (b, ((qx, dx), sx)) in xq.qs[r * nb..(r + 1) * nb]
            .iter()
            .zip(&xq.d[r * nbp..(r + 1) * nbp])
            .zip(&xq.s[r * nbp..(r + 1) * nbp])
            .enumerate()
        {
            let qw = &w.qs[b];
            let dw = f16::from_bits(w.d[b]).to_f32();
            let mw = f16::from_bits(w.m[b]).to_f32();
            let mut sumi = 0i32;
            for j in 0..16 {
                let lo = i32::from(qw[j] & 0x0f);
                let hi = i32::from(qw[j] >> 4);
                sumi += lo * i32::from(qx[j]) + hi * i32::from(qx[j + 16]);
            }
            sum += sumi as f32 * dw * dx + mw * sx;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Q8Rows, QK, Rows, padded};

    /// Blocks whose scales a tile converts and multiplies at once, before their dot products.
    const KB: usize = 32;

    /// A block's 32 nibbles as 32 `u8` in 0..=15: values 0..16 (low nibbles) in the low lane,
    /// values 16..32 (high nibbles) in the high lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn nibbles(qs: &[u8; 16]) -> __m256i {
        // SAFETY: reads the 16 bytes of `qs` (an unaligned load).
        let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        // Both lanes hold the 16 bytes (a broadcast load, no shuffle); the high lane is shifted.
        let both = _mm256_broadcastsi128_si256(q);
        let shifted = _mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0));
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load_q8(qs: &[i8; QK]) -> __m256i {
        // SAFETY: reads the 32 bytes of `qs` (an unaligned load).
        unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
    }

    /// Eight f16 (bits) as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn load_f16(h: &[u16; 8]) -> __m256 {
        // SAFETY: reads the 16 bytes of `h` (an unaligned load).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr().cast()) })
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load_f32(v: &[f32; 8]) -> __m256 {
        // SAFETY: reads the 32 bytes of `v` (an unaligned load).
        unsafe { _mm256_loadu_ps(v.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn store_f32(to: &mut [f32; 8], v: __m256) {
        // SAFETY: writes the 32 bytes of `to` (an unaligned store).
        unsafe { _mm256_storeu_ps(to.as_mut_ptr(), v) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Σ over 8 lanes of pairs of `u8 · i8` products: `vpmaddubsw` then `vpmaddwd` with ones
    /// (no saturation: |15 · 127 · 2| < 2^15).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(qw: __m256i, qx: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), _mm256_set1_epi16(1))
    }

    /// As [`dot_avx2`], in one `vpdpbusd`.
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    fn dot_avx_vnni(qw: __m256i, qx: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), qw, qx)
    }

    /// Generates, for one dot product of 32 `u8 · i8` (`$dot`), the tile kernel (`R` weight
    /// rows × `C` input rows) and the driver over all rows, with `$features` enabled.
    macro_rules! kernel {
        ($rows:ident, $tile:ident, $dot:ident, $features:literal) => {
            /// Weight rows `w` × every input row → `yt` (rows of `w`, m). Callers check that
            /// the CPU has the target features.
            #[target_feature(enable = $features)]
            pub(super) fn $rows(w: Rows<'_>, xq: &Q8Rows, yt: &mut [f32]) {
                let m = xq.rows;
                let n = w.len();
                let mut o = 0;
                while o < n {
                    // Wide tiles share each loaded input block over more weight rows.
                    let r = match (m, n - o) {
                        (1, left) if left >= 4 => 4,
                        (_, left) if left >= 2 => 2,
                        _ => 1,
                    };
                    let w = w.sub(o..o + r);
                    let y = &mut yt[o * m..(o + r) * m];
                    let mut c = 0;
                    while c < m {
                        let cols = (m - c).min(4);
                        match (r, cols) {
                            // r = 4 only when m = 1.
                            (4, _) => $tile::<4, 1>(w, xq, c, y),
                            (2, 1) => $tile::<2, 1>(w, xq, c, y),
                            (2, 2) => $tile::<2, 2>(w, xq, c, y),
                            (2, 3) => $tile::<2, 3>(w, xq, c, y),
                            (2, _) => $tile::<2, 4>(w, xq, c, y),
                            (_, 1) => $tile::<1, 1>(w, xq, c, y),
                            (_, 2) => $tile::<1, 2>(w, xq, c, y),
                            (_, 3) => $tile::<1, 3>(w, xq, c, y),
                            (_, _) => $tile::<1, 4>(w, xq, c, y),
                        }
                        c += cols;
                    }
                    o += r;
                }
            }

            /// `R` weight rows (`w`) × input rows `c0..c0 + C` into `y[row · m + c0 + col]`.
            /// Per chunk of [`KB`] blocks, first every block's `d_w · d_x` and the chunk's
            /// `Σ m_w · s_x` (eight blocks a vector), then one FMA per block.
            #[inline]
            #[target_feature(enable = $features)]
            fn $tile<const R: usize, const C: usize>(
                w: Rows<'_>,
                xq: &Q8Rows,
                c0: usize,
                y: &mut [f32],
            ) {
                let nb = xq.blocks;
                let nbp = padded(nb);
                let m = xq.rows;
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                let mut mins = [[_mm256_setzero_ps(); C]; R];
                let mut k0 = 0;
                while k0 < nb {
                    let len = (nb - k0).min(KB);
                    let lanes = len.div_ceil(8);
                    // (R, C, KB): d_w · d_x per block (the padding multiplies zeros).
                    let mut scale = [[[0f32; KB]; C]; R];
                    for r in 0..R {
                        let i = r * nbp + k0;
                        let (dw, _) = w.d[i..i + lanes * 8].as_chunks::<8>();
                        let (mw, _) = w.m[i..i + lanes * 8].as_chunks::<8>();
                        for c in 0..C {
                            let i = (c0 + c) * nbp + k0;
                            let (dx, _) = xq.d[i..i + lanes * 8].as_chunks::<8>();
                            let (sx, _) = xq.s[i..i + lanes * 8].as_chunks::<8>();
                            let (sc, _) = scale[r][c].as_chunks_mut::<8>();
                            for l in 0..lanes {
                                let d = _mm256_mul_ps(load_f16(&dw[l]), load_f32(&dx[l]));
                                store_f32(&mut sc[l], d);
                                mins[r][c] =
                                    _mm256_fmadd_ps(load_f16(&mw[l]), load_f32(&sx[l]), mins[r][c]);
                            }
                        }
                    }
                    let wq: [&[[u8; 16]]; R] = std::array::from_fn(|r| &w.qs[r * nb + k0..][..len]);
                    let xs: [&[[i8; QK]]; C] =
                        std::array::from_fn(|c| &xq.qs[(c0 + c) * nb + k0..][..len]);
                    for b in 0..len {
                        let mut qx = [_mm256_setzero_si256(); C];
                        for c in 0..C {
                            qx[c] = load_q8(&xs[c][b]);
                        }
                        for r in 0..R {
                            let qw = nibbles(&wq[r][b]);
                            for c in 0..C {
                                let p = _mm256_cvtepi32_ps($dot(qw, qx[c]));
                                let s = _mm256_broadcast_ss(&scale[r][c][b]);
                                acc[r][c] = _mm256_fmadd_ps(s, p, acc[r][c]);
                            }
                        }
                    }
                    k0 += len;
                }
                for r in 0..R {
                    for c in 0..C {
                        y[r * m + c0 + c] = hsum(_mm256_add_ps(acc[r][c], mins[r][c]));
                    }
                }
            }
        };
    }

    kernel!(rows_avx2, tile_avx2, dot_avx2, "avx2,fma,f16c");
    kernel!(
        rows_avx_vnni,
        tile_avx_vnni,
        dot_avx_vnni,
        "avx2,fma,f16c,avxvnni"
    );
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    /// Seeded values in [-1, 1), with every 37th scaled by 8 (outliers, as in hidden states).
    fn values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = rng.random::<f32>() * 2.0 - 1.0;
                if i % 37 == 0 { v * 8.0 } else { v }
            })
            .collect()
    }

    /// A seeded Q4_1 weight `(out, in)` as candle quantizes it.
    fn weight(rng: &mut ChaCha8Rng, out: usize, inp: usize) -> QTensor {
        let w = Tensor::from_vec(values(rng, out * inp), (out, inp), &Device::Cpu).unwrap();
        QTensor::quantize(&w, GgmlDType::Q4_1).unwrap()
    }

    /// Asserts `got` ≈ `want` to within `rel` of `want`'s largest magnitude.
    fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= rel * scale,
                "{what}: element {i}: {g} against {w} (max |y| {scale})"
            );
        }
    }

    const SHAPES: [(usize, usize); 7] = [
        (576, 576),
        (1536, 576),
        (576, 1536),
        (192, 576),
        // Output rows that are not whole tiles, and a single block per row.
        (13, 64),
        (7, 32),
        (579, 96),
    ];

    #[test]
    fn simd_kernels_equal_the_scalar_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let simd: Vec<Q4_1Kernel> = [Q4_1Kernel::Avx2, Q4_1Kernel::AvxVnni]
            .into_iter()
            .filter(|k| k.is_available())
            .collect();
        if simd.is_empty() {
            eprintln!("no SIMD Q4_1 kernel runs on this CPU: nothing to compare");
        }
        for (out, inp) in SHAPES {
            let q = weight(&mut rng, out, inp);
            let reference = Q4_1Matrix::from_qtensor(&q)
                .unwrap()
                .with_kernel(Q4_1Kernel::Scalar)
                .unwrap();
            // Up to 63 rows: batches below `weights::DENSE_MIN_ROWS` (64) run here.
            for m in [1, 2, 3, 5, 8, 15, 16, 33, 63] {
                let x = values(&mut rng, m * inp);
                let mut want = vec![0f32; m * out];
                reference.matmul(&x, &mut want).unwrap();
                for &kernel in &simd {
                    let w = reference.clone().with_kernel(kernel).unwrap();
                    let mut got = vec![f32::NAN; m * out];
                    w.matmul(&x, &mut got).unwrap();
                    let what = format!("{} ({out}×{inp}) m={m}", kernel.name());
                    assert_close(&got, &want, 1e-5, &what);
                    // A row's result does not depend on the batch it came in: the last row
                    // alone gives the same bits (a P/D handoff computes rows in other
                    // batches than one node does).
                    let mut alone = vec![f32::NAN; out];
                    w.matmul(&x[(m - 1) * inp..], &mut alone).unwrap();
                    assert_eq!(alone, got[(m - 1) * out..], "{what}: last row alone");
                }
            }
        }
    }

    #[test]
    fn kernels_equal_candles_q4_1_matmul() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let dev = Device::Cpu;
        // candle's scalar Q4_1 dot product asserts (in debug builds) an even number of blocks
        // per row: compare on the shapes it accepts.
        for (out, inp) in SHAPES
            .into_iter()
            .filter(|(_, inp)| (inp / 32).is_multiple_of(2))
        {
            let q = weight(&mut rng, out, inp);
            let ours = Q4_1Matrix::from_qtensor(&q).unwrap();
            let scalar = ours.clone().with_kernel(Q4_1Kernel::Scalar).unwrap();
            let candle = QMatMul::from_qtensor(q).unwrap();
            for m in [1, 3, 15, 63] {
                // (m, in)
                let x = Tensor::from_vec(values(&mut rng, m * inp), (m, inp), &dev).unwrap();
                let flat = |y: candle_core::Result<Tensor>| -> Vec<f32> {
                    y.unwrap().flatten_all().unwrap().to_vec1().unwrap()
                };
                let want = flat(candle.forward(&x));
                let got = flat(ours.forward(&x));
                let what = format!("{} ({out}×{inp}) m={m}", ours.kernel().name());
                assert_close(&got, &want, 1e-5, &what);
                // The scalar kernel adds in candle's order: the same bits.
                let got = flat(scalar.forward(&x));
                assert_eq!(got, want, "scalar ({out}×{inp}) m={m}");
            }
        }
    }

    #[test]
    fn forward_takes_strided_input_and_checks_shapes() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let dev = Device::Cpu;
        let w = Q4_1Matrix::from_qtensor(&weight(&mut rng, 40, 64)).unwrap();
        // (64, 3) transposed: a (3, 64) view that is not contiguous.
        let xt = Tensor::from_vec(values(&mut rng, 3 * 64), (64, 3), &dev).unwrap();
        let x = xt.t().unwrap();
        let want = w.forward(&x.contiguous().unwrap()).unwrap();
        let got = w.forward(&x).unwrap();
        assert_eq!(got.dims(), &[3, 40]);
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        // Wrong width, wrong dtype, wrong rank: errors, not panics.
        let bad = Tensor::zeros((2, 32), candle_core::DType::F32, &dev).unwrap();
        assert!(w.forward(&bad).is_err());
        let bad = Tensor::zeros((2, 64), candle_core::DType::F16, &dev).unwrap();
        assert!(w.forward(&bad).is_err());
        let bad = Tensor::zeros(64, candle_core::DType::F32, &dev).unwrap();
        assert!(w.forward(&bad).is_err());
        let mut y = vec![0f32; 39];
        assert!(w.matmul(&[0.0; 64], &mut y).is_err());
        assert!(Q4_1Matrix::new(&[0; 20], 1, 48).is_err());
        assert!(Q4_1Matrix::new(&[0; 19], 1, 32).is_err());
    }
}

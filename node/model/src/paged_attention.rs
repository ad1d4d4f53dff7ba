//! Attention over a paged KV pool: write one step's K/V into pool slots, then let every query
//! token attend to its sequence's positions through the sequence's block table.
//!
//! These are the CPU reference kernels (query rows × heads split over candle's barrier pool).
//! The pool holds f32, f16 or bf16 ([`KvDtype`]); the kernels compute in f32 either way: each
//! chunk of rows widens a half-precision sequence's K and V tiles once into its scratch's f32
//! copy, which every query row and every head of the GQA group it then takes for that sequence
//! reads (a prefill chunk's rows share it), and a step's K/V are rounded to the pool's type when
//! written. A CUDA build implements the same two calls over device memory; the CPU versions
//! stay as its reference.

use std::sync::Mutex;

use pd_kv_pool::{BlockId, KvDtype, KvElem, KvLayout, KvPool};

use crate::batch::SeqView;

/// Writes K and V of `layer` for every token of the step into its slot.
///
/// - `k`, `v`: `(num_tokens, num_kv_heads, head_dim)`, row-major.
/// - `slots`: `(num_tokens,)`, `block * block_size + offset`; only these blocks are touched.
pub fn write_kv(pool: &mut KvPool, layer: usize, k: &[f32], v: &[f32], slots: &[usize]) {
    match pool.layout().dtype {
        KvDtype::F32 => write_kv_as::<f32>(pool, layer, k, v, slots),
        KvDtype::F16 => write_kv_as::<half::f16>(pool, layer, k, v, slots),
        KvDtype::BF16 => write_kv_as::<half::bf16>(pool, layer, k, v, slots),
    }
}

/// [`write_kv`] into a pool of `T`.
fn write_kv_as<T: KvElem>(pool: &mut KvPool, layer: usize, k: &[f32], v: &[f32], slots: &[usize]) {
    let layout = *pool.layout();
    let (hd, kvh, bs) = (layout.head_dim, layout.num_kv_heads, layout.block_size);
    for (t, &slot) in slots.iter().enumerate() {
        let (block, off) = (BlockId((slot / bs) as u32), slot % bs);
        for (kv, src) in [(0, k), (1, v)] {
            // (num_kv_heads · block_size · head_dim) in the layout's order.
            let slab = pool.slab_mut::<T>(block, layer, kv);
            for h in 0..kvh {
                let (from, to) = ((t * kvh + h) * hd, layout.row(h, off));
                T::store_f32(&src[from..from + hd], &mut slab[to..to + hd]);
            }
        }
    }
}

/// Causal attention of every query token over its own sequence's K/V in the pool.
///
/// - `q`: `(num_tokens, num_heads, head_dim)`, already rotated.
/// - returns `(num_tokens, num_heads, head_dim)`.
///
/// Query token `i` of a sequence with `query_len` new tokens sits at position
/// `context_len - query_len + i` and attends to positions `0..=that`. Only the blocks in the
/// sequences' block tables are read.
pub fn attend(
    pool: &KvPool,
    layer: usize,
    q: &[f32],
    num_heads: usize,
    seqs: &[SeqView],
    scale: f32,
) -> Vec<f32> {
    match pool.layout().dtype {
        KvDtype::F32 => attend_as::<f32>(pool, layer, q, num_heads, seqs, scale),
        KvDtype::F16 => attend_as::<half::f16>(pool, layer, q, num_heads, seqs, scale),
        KvDtype::BF16 => attend_as::<half::bf16>(pool, layer, q, num_heads, seqs, scale),
    }
}

/// [`attend`] over a pool of `T`.
fn attend_as<T: KvElem>(
    pool: &KvPool,
    layer: usize,
    q: &[f32],
    num_heads: usize,
    seqs: &[SeqView],
    scale: f32,
) -> Vec<f32> {
    let layout = pool.layout();
    let hd = layout.head_dim;
    let group = num_heads / layout.num_kv_heads;
    // (num_tokens,) → (sequence index, absolute position).
    let mut rows: Vec<(usize, usize)> = Vec::with_capacity(q.len() / (num_heads * hd).max(1));
    for (s, seq) in seqs.iter().enumerate() {
        let first = seq.context_len - seq.query_len;
        rows.extend((0..seq.query_len).map(|i| (s, first + i)));
    }
    #[cfg(target_arch = "x86_64")]
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    let mut out = vec![0f32; q.len()];
    // One (query token, head) pair, `idx = token · num_heads + head`, into `o` (head_dim,).
    let one = |scratch: &mut Scratch, idx: usize, o: &mut [f32]| {
        let (t, h) = (idx / num_heads, idx % num_heads);
        let (s, pos) = rows[t];
        let row = Row {
            pool,
            layout,
            layer,
            seq: s,
            table: &seqs[s].block_table,
            kvh: h / group,
            q: &q[idx * hd..(idx + 1) * hd],
            n: pos + 1,
            scale,
        };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU supports AVX2 and FMA (detected above).
            unsafe { attend_row_avx2::<T>(&row, scratch, o) };
            return;
        }
        attend_row::<T>(&row, scratch, o);
    };
    // Split over candle's barrier pool, the threads every matmul of the step runs on (still
    // spinning from the op before), not over rayon's: a second pool's worker would compete
    // with candle's spinning one for the same core (as the Q4_1 kernel found, `q4_1.rs`).
    // Chunks of consecutive pairs keep a GQA group's heads together; each chunk takes one of
    // the scratches (its widened tiles stay valid for the whole call: they are keyed by the
    // step's sequence index and the pool only changes between calls).
    let bp = candle_core::utils::barrier_pool();
    let items = out.len() / hd.max(1);
    let threads = bp.n_workers() + 1;
    if threads == 1 || items == 1 {
        let mut scratch = Scratch::default();
        for (idx, o) in out.chunks_mut(hd).enumerate() {
            one(&mut scratch, idx, o);
        }
        return out;
    }
    let per_chunk = items.div_ceil(threads * 4).max(1);
    // Each chunk is taken by one thread; the locks are never contended.
    let chunks: Vec<Mutex<&mut [f32]>> = out.chunks_mut(per_chunk * hd).map(Mutex::new).collect();
    let scratches: Mutex<Vec<Scratch>> = Mutex::new(Vec::with_capacity(threads));
    bp.execute_chunked(chunks.len(), |range| {
        let taken = scratches.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut scratch = taken.unwrap_or_default();
        for c in range {
            let mut o = chunks[c].lock().unwrap_or_else(|e| e.into_inner());
            for (i, o) in o.chunks_mut(hd).enumerate() {
                one(&mut scratch, c * per_chunk + i, o);
            }
        }
        scratches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(scratch);
    });
    drop(chunks);
    out
}

/// Per-worker buffers of [`attend_row`].
#[derive(Default)]
struct Scratch {
    /// (n,) scores, then probabilities.
    scores: Vec<f32>,
    /// Half-precision pools only: the sequence whose tiles `k` and `v` hold.
    seq: Option<usize>,
    /// Per KV head, (blocks widened so far, block_size, head_dim) of K, in table order.
    k: Vec<Vec<f32>>,
    /// The same for V.
    v: Vec<Vec<f32>>,
}

impl Scratch {
    /// Widens, for a half-precision pool, the row's sequence's K and V tiles of its KV head up
    /// to block `blocks` (exclusive), keeping what earlier rows of that sequence widened.
    fn widen<T: KvElem>(&mut self, row: &Row<'_>, blocks: usize) {
        let l = row.layout;
        if self.seq != Some(row.seq) {
            self.seq = Some(row.seq);
            self.k.resize_with(l.num_kv_heads, Vec::new);
            self.v.resize_with(l.num_kv_heads, Vec::new);
            self.k
                .iter_mut()
                .chain(self.v.iter_mut())
                .for_each(Vec::clear);
        }
        let te = l.tile_elems();
        let (k, v) = (&mut self.k[row.kvh], &mut self.v[row.kvh]);
        let have = k.len() / te;
        if have >= blocks {
            return;
        }
        k.resize(blocks * te, 0.0);
        v.resize(blocks * te, 0.0);
        for (b, &block) in row.table.iter().enumerate().take(blocks).skip(have) {
            for (kv, out) in [(0, &mut *k), (1, &mut *v)] {
                let slab = row.pool.slab::<T>(block, row.layer, kv);
                // (block_size, head_dim) of this head, contiguous here.
                let dst = &mut out[b * te..(b + 1) * te];
                if l.pos_stride() == l.head_dim {
                    // The head's rows are contiguous in the pool too (`hnd`).
                    let first = l.row(row.kvh, 0);
                    T::load_f32(&slab[first..first + te], dst);
                } else {
                    for (p, d) in dst.chunks_exact_mut(l.head_dim).enumerate() {
                        let r = l.row(row.kvh, p);
                        T::load_f32(&slab[r..r + l.head_dim], d);
                    }
                }
            }
        }
    }
}

/// One (query token, head) pair: what [`attend_row`] reads.
struct Row<'a> {
    pool: &'a KvPool,
    layout: &'a KvLayout,
    layer: usize,
    /// Index of the row's sequence in the step.
    seq: usize,
    table: &'a [BlockId],
    kvh: usize,
    /// (head_dim,)
    q: &'a [f32],
    /// Positions attended to: `0..n`.
    n: usize,
    scale: f32,
}

/// [`attend_row`] compiled with AVX2 + FMA (8-wide vectors), chosen at run time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_row_avx2<T: KvElem>(row: &Row<'_>, scratch: &mut Scratch, o: &mut [f32]) {
    attend_row::<T>(row, scratch, o)
}

/// `o` (head_dim,) = softmax(q · Kᵀ · scale) · V over positions `0..n` of the row's sequence.
#[inline(always)]
fn attend_row<T: KvElem>(row: &Row<'_>, scratch: &mut Scratch, o: &mut [f32]) {
    let Row {
        pool,
        layout,
        layer,
        table,
        kvh,
        q,
        n,
        scale,
        ..
    } = *row;
    let (hd, bs) = (layout.head_dim, layout.block_size);
    let te = layout.tile_elems();
    let blocks = n.div_ceil(bs);
    let half = T::DTYPE != KvDtype::F32;
    if half {
        scratch.widen::<T>(row, blocks);
    }
    let Scratch { scores, k, v, .. } = scratch;
    // Block `b` of the table's K (`kv` 0) or V (1) of this head, in f32, and the elements
    // between its positions' rows: the widened (block_size, head_dim) copy, or the pool's slab
    // read in place from the head's first row.
    let (first, stride) = if half {
        (0, hd)
    } else {
        (layout.row(kvh, 0), layout.pos_stride())
    };
    let rows = |b: usize, kv: usize| -> &[f32] {
        if half {
            let widened = if kv == 0 { &k[kvh] } else { &v[kvh] };
            &widened[b * te..(b + 1) * te]
        } else {
            &pool.slab::<f32>(table[b], layer, kv)[first..]
        }
    };
    scores.clear();
    scores.reserve(n);
    let mut max = f32::NEG_INFINITY;
    for b in 0..blocks {
        let keys = rows(b, 0);
        let len = bs.min(n - b * bs);
        for j in 0..len {
            let d = dot(q, &keys[j * stride..j * stride + hd]) * scale;
            max = max.max(d);
            scores.push(d);
        }
    }
    let mut denom = 0f32;
    for x in scores.iter_mut() {
        *x = (*x - max).exp();
        denom += *x;
    }
    let inv = 1.0 / denom;
    o.fill(0.0);
    for b in 0..blocks {
        let values = rows(b, 1);
        let len = bs.min(n - b * bs);
        for j in 0..len {
            let p = scores[b * bs + j] * inv;
            for (acc, x) in o.iter_mut().zip(&values[j * stride..j * stride + hd]) {
                *acc += p * x;
            }
        }
    }
}

/// Dot product with 8 independent accumulators, so the compiler vectorises it (a plain
/// `iter().sum()` is a serial chain of adds it may not reorder).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_kv_pool::{KvDtype, KvOrder};

    /// Naive attention over contiguous K/V: (seq, kvh, hd).
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: usize,
        kvh: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f32> {
        let n = k.len() / (kvh * hd);
        let qn = q.len() / (heads * hd);
        let mut out = vec![0f32; q.len()];
        for t in 0..qn {
            let pos = n - qn + t;
            for h in 0..heads {
                let g = h / (heads / kvh);
                let qv = &q[(t * heads + h) * hd..][..hd];
                let s: Vec<f32> = (0..=pos)
                    .map(|j| {
                        qv.iter()
                            .zip(&k[(j * kvh + g) * hd..][..hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, w) in e.iter().enumerate() {
                    for d in 0..hd {
                        out[(t * heads + h) * hd + d] += w / z * v[(j * kvh + g) * hd + d];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn paged_equals_contiguous_with_scattered_blocks_in_every_dtype_and_order() {
        let cases = [KvDtype::F32, KvDtype::F16, KvDtype::BF16]
            .into_iter()
            .flat_map(|d| [(d, KvOrder::Hnd), (d, KvOrder::Nhd)]);
        for (dtype, order) in cases {
            // 10 positions over blocks of 4 → 3 blocks, deliberately out of order in the pool.
            let layout = KvLayout {
                num_blocks: 6,
                block_size: 4,
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                dtype,
                order,
            };
            let (heads, kvh, hd, n) = (4, 2, 8, 10);
            let mut x = 0.37f32;
            let mut rnd = || {
                x = (x * 9301.0 + 0.49297).fract();
                x - 0.5
            };
            let k: Vec<f32> = (0..n * kvh * hd).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..n * kvh * hd).map(|_| rnd()).collect();
            let q: Vec<f32> = (0..3 * heads * hd).map(|_| rnd()).collect(); // last 3 positions
            let table = vec![BlockId(5), BlockId(1), BlockId(3)];
            let slots: Vec<usize> = (0..n).map(|p| table[p / 4].index() * 4 + p % 4).collect();
            let mut pool = KvPool::new(layout).unwrap();
            for b in 0..layout.num_blocks {
                pool.poison_block(BlockId(b as u32));
            }
            write_kv(&mut pool, 1, &k, &v, &slots);
            let seqs = [SeqView {
                query_start: 0,
                query_len: 3,
                context_len: n,
                block_table: table,
            }];
            let got = attend(&pool, 1, &q, heads, &seqs, 0.35);
            // The pool stores K/V rounded to its type; attention itself is f32 either way, so
            // the paged result equals the contiguous one over the rounded K/V.
            let round = |x: &f32| match dtype {
                KvDtype::F32 => *x,
                KvDtype::F16 => half::f16::from_f32(*x).to_f32(),
                KvDtype::BF16 => half::bf16::from_f32(*x).to_f32(),
            };
            let (kr, vr): (Vec<f32>, Vec<f32>) =
                (k.iter().map(round).collect(), v.iter().map(round).collect());
            let want = reference(&q, &kr, &vr, heads, kvh, hd, 0.35);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{dtype:?} {order:?}: {a} vs {b}");
            }
            // And within the type's precision of the f32 answer.
            let exact = reference(&q, &k, &v, heads, kvh, hd, 0.35);
            let tol = if dtype == KvDtype::BF16 { 2e-2 } else { 2e-3 };
            for (a, b) in got.iter().zip(&exact) {
                assert!((a - b).abs() < tol, "{dtype:?} {order:?}: {a} vs {b}");
            }
        }
    }
}

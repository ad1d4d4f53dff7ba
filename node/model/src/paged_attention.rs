//! Attention over a paged KV pool: write one step's K/V into pool slots, then let every query
//! token attend to its sequence's positions through the sequence's block table.
//!
//! These are the CPU reference kernels, split over candle's barrier pool in work items of up to
//! 16 query tokens of one sequence times the heads of one GQA group. The pool holds f32, f16 or
//! bf16 ([`KvDtype`]); the kernels compute in f32 either way: an item widens its KV head's K,
//! then V, 64 positions at a time into an f32 tile that all its rows read while it is in L1,
//! and a step's K/V are rounded to the pool's type when written. The per-row arithmetic lives
//! in [`crate::attention_math`]. A CUDA build implements the same two calls over device memory;
//! the CPU versions stay as its reference.

use std::sync::Mutex;

use pd_kv_pool::{BlockId, KvDtype, KvElem, KvLayout, KvPool};

use crate::attention_math::{self, Isa};
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

/// Query tokens of one sequence that share each widened key tile (one work item's rows, times
/// the GQA group).
const TILE_TOKENS: usize = 16;
/// Positions of one head's K or V widened to f32 at a time: 64 × head_dim stays in L1 while
/// every row of the item reads it. A multiple of 8 ([`attention_math::dot8`] takes 8 keys).
const TILE_KEYS: usize = 64;

/// Causal attention of every query token over its own sequence's K/V in the pool.
///
/// - `q`: `(num_tokens, num_heads, head_dim)`, already rotated.
/// - returns `(num_tokens, num_heads, head_dim)`.
///
/// Query token `i` of a sequence with `query_len` new tokens sits at position
/// `context_len - query_len + i` and attends to positions `0..=that`. Only the blocks in the
/// sequences' block tables are read. Each (token, head) gets the same bits however the step
/// grouped its tokens, whatever the block size or layout ([`attention_math`]).
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

/// One work item: up to [`TILE_TOKENS`] consecutive query tokens of one sequence, with the
/// heads of one KV head's GQA group: `len · group` rows that read the same K/V.
struct Item {
    /// Index of the sequence in the step.
    seq: usize,
    /// The first token's row in the step.
    token: usize,
    /// Tokens in the item.
    len: usize,
    /// The first token's absolute position.
    pos: usize,
    kvh: usize,
}

/// What every item of one [`attend`] call reads.
struct Step<'a> {
    pool: &'a KvPool,
    layout: &'a KvLayout,
    layer: usize,
    seqs: &'a [SeqView],
    /// `(num_tokens, num_heads, head_dim)`
    q: &'a [f32],
    num_heads: usize,
    scale: f32,
    isa: Isa,
}

/// Per-thread buffers of [`attend_item`].
#[derive(Default)]
struct Scratch {
    /// (rows, stride): scores by absolute position, then numerators.
    scores: Vec<f32>,
    /// (TILE_KEYS, head_dim): one head's K or V at consecutive positions, in f32.
    tile: Vec<f32>,
    /// (rows, head_dim): Σ numerator · V so far.
    acc: Vec<f32>,
    /// (rows,): 1 / denominator.
    inv: Vec<f32>,
    /// (rows,): positions attended to, all and within the current tile.
    ends: Vec<usize>,
    tile_ends: Vec<usize>,
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
    let (hd, kv_heads) = (layout.head_dim, layout.num_kv_heads);
    let group = num_heads / kv_heads;
    let mut items = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let first = seq.context_len - seq.query_len;
        for start in (0..seq.query_len).step_by(TILE_TOKENS) {
            items.extend((0..kv_heads).map(|kvh| Item {
                seq: s,
                token: seq.query_start + start,
                len: (seq.query_len - start).min(TILE_TOKENS),
                pos: first + start,
                kvh,
            }));
        }
    }
    // Heaviest first (causal: an item's work grows with its positions), so the last items
    // the threads grab are the light ones and neither waits long for the other.
    items.sort_by_key(|i| std::cmp::Reverse(i.len * (i.pos + i.len)));
    let step = Step {
        pool,
        layout,
        layer,
        seqs,
        q,
        num_heads,
        scale,
        isa: Isa::detect(hd),
    };
    let mut out = vec![0f32; q.len()];
    // Cell `token · kv_heads + kvh`: that token's rows of that group, (group, head_dim). Each is
    // written by the one item holding the token and KV head; the locks are never contended.
    let cells: Vec<Mutex<&mut [f32]>> = out.chunks_mut(group * hd).map(Mutex::new).collect();
    // Split over candle's barrier pool, the threads every matmul of the step runs on (still
    // spinning from the op before), not over rayon's: a second pool's worker would compete
    // with candle's spinning one for the same core (as the Q4_1 kernel found, `q4_1.rs`).
    let bp = candle_core::utils::barrier_pool();
    if bp.n_workers() == 0 || items.len() == 1 {
        let mut scratch = Scratch::default();
        for item in &items {
            attend_item::<T>(&step, &mut scratch, item, &cells);
        }
    } else {
        let scratches: Mutex<Vec<Scratch>> = Mutex::new(Vec::new());
        bp.execute_chunked(items.len(), |range| {
            let taken = scratches.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let mut scratch = taken.unwrap_or_default();
            for item in &items[range] {
                attend_item::<T>(&step, &mut scratch, item, &cells);
            }
            scratches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(scratch);
        });
    }
    drop(cells);
    out
}

/// The rows of one [`Item`]: scores tile by tile of K, the softmax per row, then the weighted
/// sum of V tile by tile, written into the item's cells.
fn attend_item<T: KvElem>(
    step: &Step<'_>,
    scratch: &mut Scratch,
    item: &Item,
    cells: &[Mutex<&mut [f32]>],
) {
    let Step { layout, isa, .. } = *step;
    let (hd, kv_heads) = (layout.head_dim, layout.num_kv_heads);
    let group = step.num_heads / kv_heads;
    let rows = item.len * group;
    // Row r = (token r / group, head kvh · group + r % group) attends to 0..ends[r].
    let n_max = item.pos + item.len;
    let stride = n_max.div_ceil(8) * 8;
    let Scratch {
        scores,
        tile,
        acc,
        inv,
        ends,
        tile_ends,
    } = scratch;
    scores.resize(rows * stride, 0.0);
    tile.resize(TILE_KEYS * hd, 0.0);
    ends.clear();
    ends.extend((0..rows).map(|r| item.pos + r / group + 1));
    for j0 in (0..n_max).step_by(TILE_KEYS) {
        let j1 = (j0 + TILE_KEYS).min(n_max);
        widen::<T>(step, item, 0, j0..j1, tile);
        for (r, &end) in ends.iter().enumerate().filter(|(_, e)| **e > j0) {
            let (t, h) = (item.token + r / group, item.kvh * group + r % group);
            let q = &step.q[(t * step.num_heads + h) * hd..][..hd];
            for k in (j0..end.min(j1)).step_by(8) {
                let out = &mut scores[r * stride + k..(r + 1) * stride];
                attention_math::dot8(isa, q, &tile[(k - j0) * hd..], step.scale, out);
            }
        }
    }
    inv.clear();
    for (r, &end) in ends.iter().enumerate() {
        let s = &mut scores[r * stride..(r + 1) * stride];
        let max = s[..end].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        inv.push(1.0 / attention_math::exp_sum(isa, s, end, max));
    }
    acc.clear();
    acc.resize(rows * hd, 0.0);
    for j0 in (0..n_max).step_by(TILE_KEYS) {
        let j1 = (j0 + TILE_KEYS).min(n_max);
        widen::<T>(step, item, 1, j0..j1, tile);
        tile_ends.clear();
        tile_ends.extend(ends.iter().map(|&e| e.min(j1)));
        attention_math::accumulate(isa, acc, scores, stride, tile, j0, tile_ends);
    }
    for i in 0..item.len {
        let mut cell = cells[(item.token + i) * kv_heads + item.kvh]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for (h, o) in cell.chunks_mut(hd).enumerate() {
            let r = i * group + h;
            for (o, a) in o.iter_mut().zip(&acc[r * hd..(r + 1) * hd]) {
                *o = a * inv[r];
            }
        }
    }
}

/// Widens K (`kv` 0) or V (1) of the item's KV head at `positions` into `tile`, row `j −
/// positions.start` holding position `j`: `(positions.len(), head_dim)` f32.
fn widen<T: KvElem>(
    step: &Step<'_>,
    item: &Item,
    kv: usize,
    positions: std::ops::Range<usize>,
    tile: &mut [f32],
) {
    let l = step.layout;
    let (hd, bs) = (l.head_dim, l.block_size);
    let table = &step.seqs[item.seq].block_table;
    let mut j = positions.start;
    while j < positions.end {
        let (b, off) = (j / bs, j % bs);
        let run = (bs - off).min(positions.end - j);
        let slab = step.pool.slab::<T>(table[b], step.layer, kv);
        let at = j - positions.start;
        let dst = &mut tile[at * hd..(at + run) * hd];
        if l.pos_stride() == hd {
            // The head's rows are contiguous in the pool (`hnd`).
            let first = l.row(item.kvh, off);
            T::load_f32(&slab[first..first + run * hd], dst);
        } else {
            for (p, d) in dst.chunks_exact_mut(hd).enumerate() {
                let r = l.row(item.kvh, off + p);
                T::load_f32(&slab[r..r + hd], d);
            }
        }
        j += run;
    }
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

    /// The property P/D, prefix caching and heterogeneous peers rely on: a (token, head)'s
    /// output bits do not depend on which tokens share its step (one prefill, chunks after a
    /// cached prefix, one decode token at a time, beside another sequence), nor on the block
    /// size or layout of the pool. 150 positions cross several key tiles and token tiles.
    #[test]
    fn a_rows_bits_do_not_depend_on_its_step_or_the_pools_block_size_and_order() {
        let (heads, kvh, hd, n) = (9, 3, 64, 150usize);
        let mut x = 0.11f32;
        let mut rnd = || {
            x = (x * 9301.0 + 0.49297).fract();
            x - 0.5
        };
        let k: Vec<f32> = (0..n * kvh * hd).map(|_| rnd() * 4.0).collect();
        let v: Vec<f32> = (0..n * kvh * hd).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..n * heads * hd).map(|_| rnd() * 4.0).collect();
        let row = heads * hd;
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            let mut reference: Option<Vec<u32>> = None;
            for (bs, order) in [(16, KvOrder::Hnd), (32, KvOrder::Nhd), (5, KvOrder::Hnd)] {
                let blocks = n.div_ceil(bs);
                let layout = KvLayout {
                    num_blocks: 2 * blocks + 1,
                    block_size: bs,
                    num_layers: 1,
                    num_kv_heads: kvh,
                    head_dim: hd,
                    dtype,
                    order,
                };
                let mut pool = KvPool::new(layout).unwrap();
                // The sequence in every other block, backwards; a second one in the rest.
                let table: Vec<BlockId> = (0..blocks)
                    .rev()
                    .map(|b| BlockId((2 * b + 1) as u32))
                    .collect();
                let other: Vec<BlockId> = (0..blocks).map(|b| BlockId((2 * b) as u32)).collect();
                for t in [&table, &other] {
                    let slots: Vec<usize> =
                        (0..n).map(|p| t[p / bs].index() * bs + p % bs).collect();
                    write_kv(&mut pool, 0, &k, &v, &slots);
                }
                let seq =
                    |start: usize, len: usize, table: &[BlockId], query_start: usize| SeqView {
                        query_start,
                        query_len: len,
                        context_len: start + len,
                        block_table: table[..(start + len).div_ceil(bs)].to_vec(),
                    };
                let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                // One prefill of all 150 tokens.
                let whole = bits(&attend(&pool, 0, &q, heads, &[seq(0, n, &table, 0)], 0.125));
                // Chunks, as after prefix-cache hits.
                let mut chunked = Vec::new();
                for (a, b) in [(0, 37), (37, 100), (100, n)] {
                    let s = [seq(a, b - a, &table, 0)];
                    chunked.extend(bits(&attend(
                        &pool,
                        0,
                        &q[a * row..b * row],
                        heads,
                        &s,
                        0.125,
                    )));
                }
                assert_eq!(
                    whole, chunked,
                    "{dtype:?} bs {bs} {order:?}: chunked prefill"
                );
                // One token at a time (decode), and each token beside another sequence's chunk.
                for p in [0, 15, 16, 63, 64, 65, 149] {
                    let one = attend(
                        &pool,
                        0,
                        &q[p * row..(p + 1) * row],
                        heads,
                        &[seq(p, 1, &table, 0)],
                        0.125,
                    );
                    assert_eq!(bits(&one), whole[p * row..(p + 1) * row], "decode at {p}");
                    let mut both = q[..20 * row].to_vec();
                    both.extend_from_slice(&q[p * row..(p + 1) * row]);
                    let s = [seq(0, 20, &other, 0), seq(p, 1, &table, 20)];
                    let out = attend(&pool, 0, &both, heads, &s, 0.125);
                    assert_eq!(
                        bits(&out[20 * row..]),
                        whole[p * row..(p + 1) * row],
                        "batched at {p}"
                    );
                    assert_eq!(
                        bits(&out[..20 * row]),
                        whole[..20 * row],
                        "the other sequence"
                    );
                }
                match &reference {
                    None => reference = Some(whole),
                    Some(r) => assert_eq!(*r, whole, "{dtype:?}: block size {bs} {order:?}"),
                }
            }
        }
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

//! CPU reference of `cuda/paged_attention.cu`.

use pd_kv_pool::{KvElem, KvLayout};

/// Causal attention of each query token over positions `0..=token_pos[t]` of sequence
/// `token_seq[t]`, through `block_tables` (`(num_seqs, max_blocks)`), in the kernel's order:
/// per (token, head), the scores and their maximum, the softmax numerators and their sum, then
/// each output dimension.
///
/// - `out`, `q`: `(num_tokens, num_heads, head_dim)`
/// - `pool`: the whole pool's elements, laid out as `l`
#[allow(clippy::too_many_arguments)] // the kernel's own argument list
pub fn reference<T: KvElem>(
    out: &mut [f32],
    q: &[f32],
    pool: &[T],
    block_tables: &[i32],
    max_blocks: usize,
    token_seq: &[i32],
    token_pos: &[i32],
    num_heads: usize,
    layer: usize,
    scale: f32,
    l: &KvLayout,
) {
    let hd = l.head_dim;
    let group = num_heads / l.num_kv_heads;
    let elem = |x: &T| {
        let mut f = [0f32];
        T::load_f32(std::slice::from_ref(x), &mut f);
        f[0]
    };
    for t in 0..token_seq.len() {
        let n = token_pos[t] as usize + 1;
        let table = &block_tables[token_seq[t] as usize * max_blocks..][..max_blocks];
        for h in 0..num_heads {
            let kvh = h / group;
            let qv = &q[(t * num_heads + h) * hd..][..hd];
            let row = |p: usize, kv: usize| {
                let block = table[p / l.block_size] as usize;
                &pool[l.slab_offset(block, layer, kv) + l.row(kvh, p % l.block_size)..][..hd]
            };
            let mut scores: Vec<f32> = (0..n)
                .map(|p| {
                    let key = row(p, 0);
                    qv.iter().zip(key).map(|(a, b)| a * elem(b)).sum::<f32>() * scale
                })
                .collect();
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0f32;
            for s in &mut scores {
                *s = (*s - m).exp();
                z += *s;
            }
            let inv = 1.0 / z;
            for d in 0..hd {
                let acc: f32 = (0..n).map(|p| scores[p] * elem(&row(p, 1)[d])).sum();
                out[(t * num_heads + h) * hd + d] = acc * inv;
            }
        }
    }
}

//! CPU reference of `cuda/reshape_and_cache.cu`.

use pd_kv_pool::{KvElem, KvLayout};

/// Writes K and V of `layer` for every token into its slot of `pool` (the whole pool's
/// elements, laid out as `l`): one iteration of the outer loop per thread block, of the inner
/// per thread.
///
/// - `k`, `v`: `(num_tokens, num_kv_heads, head_dim)`
/// - `slots`: `(num_tokens,)`, `block * block_size + offset`; negative: skipped (padding)
pub fn reference<T: KvElem>(
    k: &[f32],
    v: &[f32],
    slots: &[i64],
    pool: &mut [T],
    layer: usize,
    l: &KvLayout,
) {
    let n = l.num_kv_heads * l.head_dim;
    for (t, &slot) in slots.iter().enumerate() {
        let Ok(slot) = usize::try_from(slot) else {
            continue;
        };
        let (block, pos) = (slot / l.block_size, slot % l.block_size);
        for i in 0..n {
            let (h, d) = (i / l.head_dim, i % l.head_dim);
            let r = l.row(h, pos) + d;
            for (kv, src) in [(0, k), (1, v)] {
                T::store_f32(
                    &src[t * n + i..t * n + i + 1],
                    &mut pool[l.slab_offset(block, layer, kv) + r..][..1],
                );
            }
        }
    }
}

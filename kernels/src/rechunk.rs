//! CPU reference of `cuda/rechunk.cu`.

use pd_kv_pool::KvLayout;

/// Copies the K/V of tokens `token_start..token_start + num_tokens` from `src`'s blocks
/// `src_blocks` (laid out as `from`; `src_blocks[0]` holds token `token_start`) into `dst`'s
/// blocks `dst_blocks` (laid out as `to`), one element per iteration, in the kernel's element
/// order (token, layer, K/V, head, dim). `E` is the element's bits (`u16` or `u32`).
#[allow(clippy::too_many_arguments)] // the kernel's own argument list
pub fn reference<E: Copy>(
    dst: &mut [E],
    src: &[E],
    src_blocks: &[i32],
    dst_blocks: &[i32],
    token_start: usize,
    num_tokens: usize,
    from: &KvLayout,
    to: &KvLayout,
) {
    let (hd, heads) = (from.head_dim, from.num_kv_heads);
    let total = num_tokens * from.num_layers * 2 * heads * hd;
    for i in 0..total {
        let d = i % hd;
        let h = (i / hd) % heads;
        let kv = (i / (hd * heads)) % 2;
        let layer = (i / (hd * heads * 2)) % from.num_layers;
        let t = token_start + i / (hd * heads * 2 * from.num_layers);
        let sb = t / from.block_size - token_start / from.block_size;
        let db = t / to.block_size - token_start / to.block_size;
        let s = from.slab_offset(src_blocks[sb] as usize, layer, kv)
            + from.row(h, t % from.block_size)
            + d;
        let o =
            to.slab_offset(dst_blocks[db] as usize, layer, kv) + to.row(h, t % to.block_size) + d;
        dst[o] = src[s];
    }
}

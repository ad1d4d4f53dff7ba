// rechunk: copy a sequence's K/V of tokens [token_start, token_start + num_tokens) from blocks
// laid out one way (block size, order) into blocks laid out another way — a peer whose block
// size (16 <-> 32) or order (hnd <-> nhd) differs. Element types match (bytes move, numbers do
// not change): E is a 16- or 32-bit word.
//
// CPU reference: `pd_kernels::rechunk::reference` (equal to `pd_kv_pool::rechunk`).
//
//   src_blocks: the source pool's blocks holding the tokens; src_blocks[0] holds token
//               token_start, so it starts at token (token_start / from_block_size) *
//               from_block_size
//   dst_blocks: the same for the destination pool and to_block_size
//
// Grid: 1-D over num_tokens * num_layers * 2 * num_kv_heads * head_dim elements, one per
// thread; consecutive threads take consecutive head_dim elements of one row.
#include "pool.cuh"

template <typename E>
__device__ void rechunk(E* __restrict__ dst, const E* __restrict__ src,
                        const int* __restrict__ src_blocks, const int* __restrict__ dst_blocks,
                        int token_start, int num_tokens, pd::Layout from, pd::Layout to) {
  const int64_t hd = from.head_dim, heads = from.num_kv_heads;
  const int64_t total = (int64_t)num_tokens * from.num_layers * 2 * heads * hd;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int d = (int)(i % hd);
    const int h = (int)((i / hd) % heads);
    const int kv = (int)((i / (hd * heads)) % 2);
    const int layer = (int)((i / (hd * heads * 2)) % from.num_layers);
    const int t = token_start + (int)(i / (hd * heads * 2 * from.num_layers));
    const int sb = t / from.block_size - token_start / from.block_size;
    const int db = t / to.block_size - token_start / to.block_size;
    const int64_t s = from.slab_offset(src_blocks[sb], layer, kv) +
                      from.row(h, t % from.block_size) + d;
    const int64_t o = to.slab_offset(dst_blocks[db], layer, kv) + to.row(h, t % to.block_size) + d;
    dst[o] = src[s];
  }
}

#define RECHUNK(NAME, E)                                                                       \
  extern "C" __global__ void NAME(E* dst, const E* src, const int* src_blocks,                 \
                                  const int* dst_blocks, int token_start, int num_tokens,      \
                                  int num_layers, int num_kv_heads, int head_dim,              \
                                  int from_block_size, int from_order, int to_block_size,      \
                                  int to_order) {                                              \
    rechunk<E>(dst, src, src_blocks, dst_blocks, token_start, num_tokens,                      \
               pd::layout(num_layers, num_kv_heads, from_block_size, head_dim, from_order),    \
               pd::layout(num_layers, num_kv_heads, to_block_size, head_dim, to_order));       \
  }

RECHUNK(rechunk_b16, uint16_t)
RECHUNK(rechunk_b32, uint32_t)

// gather_blocks / scatter_blocks: move a list of whole pool blocks into / out of a contiguous
// staging buffer (a pull from GPU memory through host memory: gather -> D2H -> UCX -> H2D ->
// scatter). A block is block_words 32-bit words (every KV block is a multiple of 4 bytes: its
// head_dim is even).
//
// CPU reference: `pd_kernels::block_copy::{gather_reference, scatter_reference}` (equal to
// reading / writing `pd_kv_pool::KvPool::block`).
//
//   gather:  staging[i] = pool[ids[i]] for i in 0..n
//   scatter: pool[ids[i]] = staging[i] for i in 0..n
//
// Grid: one thread block per listed block; its threads stride over the block's words.
#include <stdint.h>

extern "C" __global__ void gather_blocks(uint32_t* __restrict__ staging,
                                         const uint32_t* __restrict__ pool,
                                         const int* __restrict__ ids, int64_t block_words) {
  const int i = blockIdx.x;
  const uint32_t* src = pool + (int64_t)ids[i] * block_words;
  uint32_t* dst = staging + (int64_t)i * block_words;
  for (int64_t w = threadIdx.x; w < block_words; w += blockDim.x) dst[w] = src[w];
}

extern "C" __global__ void scatter_blocks(uint32_t* __restrict__ pool,
                                          const uint32_t* __restrict__ staging,
                                          const int* __restrict__ ids, int64_t block_words) {
  const int i = blockIdx.x;
  const uint32_t* src = staging + (int64_t)i * block_words;
  uint32_t* dst = pool + (int64_t)ids[i] * block_words;
  for (int64_t w = threadIdx.x; w < block_words; w += blockDim.x) dst[w] = src[w];
}

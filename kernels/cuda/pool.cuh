// Addressing of a node's KV pool, as `pd_kv_pool::KvLayout` defines it (read that first).
//
// The pool is one allocation of `num_blocks` blocks; a block holds K and V of every layer for
// `block_size` consecutive token positions, contiguously:
//   (num_blocks, num_layers, 2 /* 0 = K, 1 = V */, slab)
// and a slab is (num_kv_heads, block_size, head_dim) in order 0 (`hnd`, the CPU kernels') or
// (block_size, num_kv_heads, head_dim) in order 1 (`nhd`, the GPU layout: one position's heads
// are one row, as in a FlashAttention / vLLM cache block). One (head, position) row of
// `head_dim` elements is contiguous in both.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace pd {

struct Layout {
  int num_layers;
  int num_kv_heads;
  int block_size;
  int head_dim;
  int order;  // 0 = hnd, 1 = nhd

  __device__ __forceinline__ int64_t slab_elems() const {
    return (int64_t)num_kv_heads * block_size * head_dim;
  }
  // Element offset of the slab of (block, layer, kv) in the pool.
  __device__ __forceinline__ int64_t slab_offset(int64_t block, int layer, int kv) const {
    return ((block * num_layers + layer) * 2 + kv) * slab_elems();
  }
  // Element offset, inside a slab, of the head_dim row of (head, pos).
  __device__ __forceinline__ int64_t row(int head, int pos) const {
    return order == 0 ? ((int64_t)head * block_size + pos) * head_dim
                      : ((int64_t)pos * num_kv_heads + head) * head_dim;
  }
};

__device__ __forceinline__ Layout layout(int num_layers, int num_kv_heads, int block_size,
                                         int head_dim, int order) {
  Layout l;
  l.num_layers = num_layers;
  l.num_kv_heads = num_kv_heads;
  l.block_size = block_size;
  l.head_dim = head_dim;
  l.order = order;
  return l;
}

// f32 <-> the pool's element type (round to nearest even, as `half`'s from_f32 does).
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace pd

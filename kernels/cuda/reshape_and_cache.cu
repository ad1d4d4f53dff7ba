// reshape_and_cache: write one step's K and V of one layer into their pool slots.
//
// CPU reference: `pd_kernels::reshape_and_cache::reference` (equal to
// `pd_model::paged_attention::write_kv`).
//
//   k, v:   (num_tokens, num_kv_heads, head_dim), f32, row-major
//   slots:  (num_tokens,), block * block_size + offset; a negative slot is skipped (padding)
//   pool:   the node's KV pool (pool.cuh), element type T
//
// Grid: one thread block per token; its threads stride over num_kv_heads * head_dim.
#include "pool.cuh"

template <typename T>
__device__ void reshape_and_cache(const float* __restrict__ k, const float* __restrict__ v,
                                  const int64_t* __restrict__ slots, T* __restrict__ pool,
                                  int layer, pd::Layout l) {
  const int t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t block = slot / l.block_size;
  const int pos = (int)(slot % l.block_size);
  const int n = l.num_kv_heads * l.head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / l.head_dim, d = i % l.head_dim;
    const int64_t src = (int64_t)t * n + i;
    const int64_t r = l.row(h, pos) + d;
    pool[l.slab_offset(block, layer, 0) + r] = pd::from_f32<T>(k[src]);
    pool[l.slab_offset(block, layer, 1) + r] = pd::from_f32<T>(v[src]);
  }
}

#define RESHAPE_AND_CACHE(NAME, T)                                                          \
  extern "C" __global__ void NAME(const float* k, const float* v, const int64_t* slots,    \
                                  T* pool, int layer, int num_layers, int num_kv_heads,    \
                                  int block_size, int head_dim, int order) {               \
    reshape_and_cache<T>(k, v, slots, pool, layer,                                          \
                         pd::layout(num_layers, num_kv_heads, block_size, head_dim, order)); \
  }

RESHAPE_AND_CACHE(reshape_and_cache_f32, float)
RESHAPE_AND_CACHE(reshape_and_cache_f16, __half)
RESHAPE_AND_CACHE(reshape_and_cache_bf16, __nv_bfloat16)

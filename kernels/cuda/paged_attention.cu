// paged_attention: causal attention of query tokens over their sequences' K/V in the pool,
// through block tables. One kernel for decode (one query token per sequence) and for a prefill
// chunk over a cached prefix (many query tokens per sequence): each query token names its
// sequence and its absolute position, and attends to positions 0..=pos.
//
// CPU reference: `pd_kernels::paged_attention::reference` (equal to
// `pd_model::paged_attention::attend`).
//
//   out:          (num_tokens, num_heads, head_dim), f32
//   q:            (num_tokens, num_heads, head_dim), f32, already rotated
//   pool:         the node's KV pool (pool.cuh), element type T
//   block_tables: (num_seqs, max_blocks), the pool blocks of each sequence in order
//   token_seq:    (num_tokens,), the sequence of each query token
//   token_pos:    (num_tokens,), its absolute position in that sequence
//
// Grid: (num_tokens, num_heads); one thread block per (token, head). Dynamic shared memory:
// (max_pos + 1 + 2 * blockDim.x) floats — the scores, then the reduction scratch.
// Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
#include "pool.cuh"

__device__ float block_reduce(float x, float* scratch, bool is_max) {
  scratch[threadIdx.x] = x;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float o = scratch[threadIdx.x + s];
      scratch[threadIdx.x] = is_max ? fmaxf(scratch[threadIdx.x], o) : scratch[threadIdx.x] + o;
    }
    __syncthreads();
  }
  const float r = scratch[0];
  __syncthreads();
  return r;
}

template <typename T>
__device__ void paged_attention(float* __restrict__ out, const float* __restrict__ q,
                                const T* __restrict__ pool, const int* __restrict__ block_tables,
                                int max_blocks, const int* __restrict__ token_seq,
                                const int* __restrict__ token_pos, int num_heads, int layer,
                                float scale, pd::Layout l) {
  extern __shared__ float smem[];
  const int t = blockIdx.x, h = blockIdx.y;
  const int hd = l.head_dim;
  const int kvh = h / (num_heads / l.num_kv_heads);
  const int n = token_pos[t] + 1;
  const int* table = block_tables + (int64_t)token_seq[t] * max_blocks;
  const float* qv = q + ((int64_t)t * num_heads + h) * hd;
  float* scores = smem;
  float* scratch = smem + n;

  // 1. scores[p] = q . K[p] * scale, and their maximum.
  float m = -INFINITY;
  for (int p = threadIdx.x; p < n; p += blockDim.x) {
    const T* key = pool + l.slab_offset(table[p / l.block_size], layer, 0) +
                   l.row(kvh, p % l.block_size);
    float s = 0.f;
    for (int d = 0; d < hd; ++d) s += qv[d] * pd::to_f32(key[d]);
    s *= scale;
    scores[p] = s;
    m = fmaxf(m, s);
  }
  m = block_reduce(m, scratch, true);
  // 2. Softmax numerators and their sum.
  float z = 0.f;
  for (int p = threadIdx.x; p < n; p += blockDim.x) {
    const float e = __expf(scores[p] - m);
    scores[p] = e;
    z += e;
  }
  z = block_reduce(z, scratch, false);
  const float inv = 1.f / z;
  // 3. out[d] = sum_p softmax[p] * V[p][d], one dimension per thread.
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
    for (int p = 0; p < n; ++p) {
      const T* value = pool + l.slab_offset(table[p / l.block_size], layer, 1) +
                       l.row(kvh, p % l.block_size);
      acc += scores[p] * pd::to_f32(value[d]);
    }
    out[((int64_t)t * num_heads + h) * hd + d] = acc * inv;
  }
}

#define PAGED_ATTENTION(NAME, T)                                                               \
  extern "C" __global__ void NAME(float* out, const float* q, const T* pool,                  \
                                  const int* block_tables, int max_blocks,                    \
                                  const int* token_seq, const int* token_pos, int num_heads,  \
                                  int layer, float scale, int num_layers, int num_kv_heads,   \
                                  int block_size, int head_dim, int order) {                  \
    paged_attention<T>(out, q, pool, block_tables, max_blocks, token_seq, token_pos,          \
                       num_heads, layer, scale,                                               \
                       pd::layout(num_layers, num_kv_heads, block_size, head_dim, order));    \
  }

PAGED_ATTENTION(paged_attention_f32, float)
PAGED_ATTENTION(paged_attention_f16, __half)
PAGED_ATTENTION(paged_attention_bf16, __nv_bfloat16)

// Row-wise operators of the decoder forward pass (RMSNorm, RoPE, SwiGLU,
// causal grouped-query attention). Each has a plain scalar twin in
// kernels/ref/ops_ref.h that the tests compare against. Matrix products live
// in kernels/cpu/matmul.h.
#pragma once

#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/shapes.h"

namespace loom {

// out[t, :] = x[t, :] / rms(x[t, :]) * w   for t < T rows of n elements. out may alias x.
void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps);

// out[i] = silu(gate[i]) * up[i]; out may alias gate.
void swiglu(float* out, const float* gate, const float* up, int64_t n);

// y[i] += x[i]
void add_inplace(float* y, const float* x, int64_t n);

// Rotates x[t, h, :] for t < T, h < n_heads by angle pos[t] * inv_freq.
void rope_apply(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos);
// Rotation by direction * angle: +1 is rope_apply, -1 its inverse (= transpose,
// which is also RoPE's backward).
void rope_rotate(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos, float direction);

// Causal GQA attention of T query rows against a KV store.
//   q:   [T, n_heads * head_dim], query row t sits at position pos[t]
//   kv:  [n_kv_rows, kv_stride] keys and values (f32 or f16), position p at row p
//        (head g at offset g*head_dim)
//   out: [T, n_heads * head_dim]
// Query t attends to positions [seq_start[t], pos[t]] (seq_start lets packed rows restart).
// An f16 store gives the bits of an f32 store holding the widened values.
void attention(ThreadPool& pool, const AttentionShape& s, const float* q, const KvRows& kv, float* out,
               int64_t T, const int32_t* pos, const int32_t* seq_start);
inline void attention(ThreadPool& pool, const AttentionShape& s, const float* q, const float* k,
                      const float* v, float* out, int64_t T, const int32_t* pos, const int32_t* seq_start) {
  attention(pool, s, q, KvRows{k, v, DType::f32}, out, T, pos, seq_start);
}

// dst[i] = src[i] rounded to IEEE half (nearest even) for i < n: rows into an f16 KV store.
void store_f16(uint16_t* dst, const float* src, int64_t n);

}  // namespace loom

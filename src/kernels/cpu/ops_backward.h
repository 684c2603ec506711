// Training versions of the decoder's row-wise operators: forwards that save what
// the backward needs, and the backward passes (llm.c style: outputs, saved state,
// inputs, weights, dims). Scalar double-precision twins: kernels/ref/ops_backward_ref.h.
//
// Gradient semantics, per argument:
//   rmsnorm_backward:   dx +=, dw += (dw may be nullptr for a frozen norm weight)
//   rope_backward:      d overwritten in place (d(out) on entry, d(in) on exit)
//   swiglu_backward:    dgate, dup OVERWRITTEN (may alias gate / up)
//   attention_backward: dq +=, dk +=, dv += (dk/dv sum over the query heads of a group)
//   embedding_backward: dW +=
// Every result is deterministic and independent of the thread count: each output
// element is summed by one thread in a fixed order.
#pragma once

#include <cstdint>

#include "core/thread_pool.h"
#include "kernels/cpu/ops.h"

namespace loom {

// out[t, :] = x[t, :] * rstd[t] * w, rstd[t] = 1 / sqrt(mean(x[t, :]^2) + eps).
// Saves rstd [T]. out must not alias x (the backward needs x).
void rmsnorm_forward_train(float* out, float* rstd, const float* x, const float* w, int64_t T, int64_t n,
                           float eps);
// dx [T, n] +=, dw [n] += (nullptr: frozen), from dout [T, n] and the saved rstd.
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                      int64_t T, int64_t n);

// Inverse rotation (angle -pos[t] * inv_freq) of d [T, n_heads, head_dim], in place:
// turns the gradient w.r.t. rope_apply's output into the gradient w.r.t. its input.
// pos are per-token positions (restarting per packed sample).
void rope_backward(const RopeTable& rope, float* d, int64_t T, int64_t n_heads, const int32_t* pos);

// For out = silu(gate) * up: dgate = dout * up * silu'(gate), dup = dout * silu(gate).
// Overwrites dgate and dup; dgate may alias gate and dup may alias up.
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n);

// Causal GQA self-attention over T packed token rows (no KV cache):
//   q, out: [T, n_heads * head_dim];  k, v: [T, kv_stride] (kv head g at g * head_dim)
//   seq_start[t]: ROW index of the first token of t's sample (nullptr: all 0), so
//   query row t attends to key rows [seq_start[t], t] and never crosses a sample.
//   lse [T, n_heads]: log-sum-exp of the scaled scores of each (row, head), saved.
void attention_forward_train(ThreadPool& pool, float* out, float* lse, const float* q, const float* k,
                             const float* v, const AttentionShape& s, int64_t T, const int32_t* seq_start);
// dq +=, dk +=, dv += (same shapes as q, k, v). Recomputes the probabilities from
// q, k and lse (flash-attention style tiles: no T x T buffer); see
// kernels/cpu/attention_train.h for the work split.
void attention_backward(ThreadPool& pool, float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        const AttentionShape& s, int64_t T, const int32_t* seq_start);

// dW[tokens[t], :] += dout[t, :] for a [vocab, H] f32 embedding gradient.
// Throws loom::Error(invalid_input) for a token outside [0, vocab).
void embedding_backward(ThreadPool& pool, float* dW, const float* dout, const int32_t* tokens, int64_t T,
                        int64_t vocab, int64_t H);

}  // namespace loom

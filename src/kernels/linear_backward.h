// Backward of a linear layer y = x W^T (+ b), W {N, K}: the input gradient for
// weights of any dtype (frozen quantized/f16 weights included) and the weight and
// bias gradients of trainable f32 weights. Double-precision references:
// ref::linear_backward in kernels/ref/ops_backward_ref.h.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace loom {

// dx [T, K] += dy [T, N] W. W is any dtype that dequantize_row_ref handles; it is
// dequantized tile by tile (64 rows x a block-aligned column slice) into a small
// per-thread f32 buffer, never as a whole f32 copy. Every dx element is one fixed
// chain of f32 FMAs over n = 0..N-1, so results do not depend on the thread count.
// (Tiles use the scalar dequantize_row_ref for now: simple and exact, but it is a
// visible share of the time for small T.)
void linear_backward_input(ThreadPool& pool, const Tensor& W, const float* dy, float* dx, int64_t T);

// dW [N, K] += dy^T [N, T] x [T, K]   (f32; a trainable weight's gradient).
// Each element is one FMA chain over t = 0..T-1 (thread-count independent).
void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                            int64_t K);

// db [N] += sum_t dy [t, :]
void linear_backward_bias(const float* dy, float* db, int64_t T, int64_t N);

}  // namespace loom

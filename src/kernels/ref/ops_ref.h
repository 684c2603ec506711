// Scalar references of kernels/cpu/ops.h, computed in double. Kept forever as the
// yardstick for the vectorised versions.
#pragma once

#include <cstdint>

#include "kernels/shapes.h"

namespace loom::ref {

void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps);
void swiglu(float* out, const float* gate, const float* up, int64_t n);
void rope_apply(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos);
void attention(const AttentionShape& s, const float* q, const float* k, const float* v, float* out, int64_t T,
               const int32_t* pos, const int32_t* seq_start);

}  // namespace loom::ref

// Scalar reference of kernels/cpu/paged_attention.h, computed in double by walking
// each row's block table position by position.
#pragma once

#include <cstdint>

#include "kernels/shapes.h"

namespace loom::ref {

void paged_attention(const AttentionShape& s, const PagedKv& kv, const float* q, float* out, int64_t T,
                     const int32_t* pos, const int32_t* const* tables);

}  // namespace loom::ref

// Production dequantization of weight rows to f32 (embedding gathers, load-time
// expansion, the backward's weight tiles): AVX2 on the x86-64-v3 baseline.
// Bit-identical to the scalar reference dequantize_row_ref
// (kernels/ref/dequant_ref.h), which the tests check on every type, except for
// NaN payloads: F16C quiets signalling NaNs of f16 values.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace loom {

// Converts `n` elements of `type` at `src` to float. Handles every DType
// (plain, integer and block types). `n` must be a multiple of the block size.
// `src` and `dst` need no particular alignment.
void dequantize_row(DType type, const void* src, float* dst, int64_t n);

}  // namespace loom

// Rounding f32 values to the precision of bf16 or fp16, kept as f32: the
// operands of mixed-precision products (training's `precision: bf16 | fp16`),
// multiplied afterwards by f32 FMA kernels. A product of two rounded values is
// exact in f32 (8 + 8 or 11 + 11 significant bits), so only the sums round.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace loom {

// dst [n] = src rounded (dst may alias src); `to` is bf16, f16 or f32 (a copy).
//  bf16: to nearest even as vcvtneps2bf16 (round_to_bf16 of kernels/cpu/bf16_gemm.h:
//        f32 subnormals become signed zeros, NaNs stay NaN) so the dpbf16ps / AMX
//        kernels would see the same operands;
//  f16:  to nearest even as vcvtps2ph (fp32_to_fp16 of core/half.h): magnitudes
//        from 65520 up become inf, small ones fp16 subnormals or zero.
// AVX2 (+F16C) body, scalar tail; every element is rounded alone, so the result
// does not depend on n's split. Throws internal for another dtype.
void round_to_precision(DType to, float* dst, const float* src, int64_t n);

// The scalar definition (the reference the tests compare the vector body with).
float round_to_precision_scalar(DType to, float x);

}  // namespace loom

// Scalar reference of kernels/cpu/bf16_rows.h: bf16 rounding written out from
// its definition (bit arithmetic, no intrinsics).
#pragma once

#include <cstdint>

namespace loom::ref {

// To nearest, ties to even; NaN -> quiet NaN with its sign and top bits; an f32
// subnormal (exponent 0) -> the signed zero.
uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t h);

}  // namespace loom::ref

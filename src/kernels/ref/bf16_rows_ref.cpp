// Scalar bf16 conversion (see bf16_rows_ref.h).
#include "kernels/ref/bf16_rows_ref.h"

#include <cstring>

namespace loom::ref {

uint16_t f32_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t exponent = u & 0x7f800000u, mantissa = u & 0x007fffffu;
  if (exponent == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (exponent == 0x7f800000u && mantissa != 0) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t upper = u >> 16, lower = u & 0xffffu;
  uint32_t r = upper;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++r;  // may carry into the exponent: inf
  return static_cast<uint16_t>(r);
}

float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace loom::ref

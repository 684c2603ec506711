// Scalar reference of kernels/cpu/lora_rows.h in float, one element at a time,
// in the exact operation order the kernel promises (so tests compare bits):
// a dot product of length n is 8 lane sums (lane l takes elements l, l+8, ...
// by fused multiply-add from 0), then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)),
// then the elements past the last multiple of 8 by fused multiply-add.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/backend.h"

namespace loom::ref {

// That dot product of a and b over n floats.
float lora_dot(const float* a, const float* b, int64_t n);

// y[row] += B u for each listed row with a factor, u = scale * (A x[row]) (each
// element lora_dot, times scale), y[row][n] += lora_dot(B[n, :], u). A 4-bit
// factor's A and B are its unpack_int4_rows values, a bf16 one's its values widened.
// An int8 factor (kernels/lora_i8.h) is summed on its codes, its scales applied
// outside the sums: u[j] = (lora_dot(x, A codes of row j) * A scale of row j) *
// scale, and for output n in column block q, y[n] += lora_dot(u * B scales of
// block q (element-wise), B codes of column n).
void lora_rows(std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows);

}  // namespace loom::ref

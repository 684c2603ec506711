// The layout of a LoRA B factor kept in bf16 (LoraFactor::b16): column blocks
// of kLoraBlockCols, each stored transposed, so that the LoRA kernel's second
// pass runs one row's B u with B's columns in the SIMD lanes: rank FMAs per 8
// (or 16) outputs from contiguous loads, where B's own [out, rank] rows needed a
// horizontal sum per output (kernels/cpu/lora_rows.cpp says what it gained).
// Block q covers columns [64 q, 64 q + w_q) and holds B[64 q + n][j] at
// 64 q r + j w_q + n; w_q is 64 but for the last block, whose width is rounded
// up to 8 and zero-padded. The values are the same, so no sum changes.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/half.h"

namespace loom {

constexpr int64_t kLoraBlockCols = 64;

// Columns of block q, padded (a multiple of 8).
inline int64_t lora_b16_block_width(int64_t out, int64_t q) {
  const int64_t out8 = (out + 7) / 8 * 8;
  return std::min(kLoraBlockCols, out8 - kLoraBlockCols * q);
}

// bf16 elements of a B factor [out, rank] in this layout.
inline int64_t lora_b16_elements(int64_t out, int64_t rank) { return (out + 7) / 8 * 8 * rank; }

// Where B[n][j] is.
inline int64_t lora_b16_index(int64_t out, int64_t rank, int64_t n, int64_t j) {
  const int64_t q = n / kLoraBlockCols;
  return kLoraBlockCols * q * rank + j * lora_b16_block_width(out, q) + n % kLoraBlockCols;
}

// dst[lora_b16_elements(out, rank)] = b [out, rank] rounded to bf16 (nearest
// even), in the layout above, the padding zero.
inline void pack_lora_b16(const float* b, int64_t out, int64_t rank, uint16_t* dst) {
  for (int64_t c0 = 0; c0 < out; c0 += kLoraBlockCols) {
    const int64_t w = lora_b16_block_width(out, c0 / kLoraBlockCols), cols = std::min(w, out - c0);
    uint16_t* block = dst + c0 * rank;
    for (int64_t j = 0; j < rank; ++j) {
      for (int64_t n = 0; n < cols; ++n) block[j * w + n] = fp32_to_bf16(b[(c0 + n) * rank + j]);
      std::fill(block + j * w + cols, block + (j + 1) * w, uint16_t{0});
    }
  }
}

}  // namespace loom

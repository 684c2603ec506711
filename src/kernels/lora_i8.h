// LoRA factors kept in int8 for serving (serve --lora-bits 8): half the bytes
// of bf16, which is what decode rows of many adapters wait for (each row
// streams its own adapter's factors from DRAM), read with bf16's arithmetic:
// one widening and one FMA per value, the scales applied outside the sums
// (kernels/ref/lora_rows_ref.h states the order).
//
// Symmetric, the compressed-tensors rule of kernels/int_quant.h (scale =
// max|x| / 127.5, codes in [-128, 127], rounding half to even); a value stands
// for float(code) * scale (unpack_lora_a8 / unpack_lora_b8).
//   A [rank, in]: `rank` f32 scales (one per row), then the rank x in codes
//     row by row: lora_a8_bytes(rank, in).
//   B [out, rank]: the scales of every column block (kernels/lora_b16.h: block
//     q covers columns [64 q, 64 q + w_q)), `rank` per block, one per rank row
//     of the block (64 values of one column of B), padded to a multiple of 64
//     bytes; then the blocks' codes in lora_b16.h's layout (each transposed,
//     w_q padded to 8 with zeros). So a block's codes start on a cache line
//     when B does, and the kernel's prefetch, which requests whole lines,
//     requests each block's lines once (it had fallen behind on blocks that
//     shared lines).
// Both start 4-byte aligned (the server puts every factor on a cache line).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/lora_b16.h"

namespace loom {

inline size_t lora_a8_bytes(int64_t rank, int64_t in) {
  return static_cast<size_t>(rank) * sizeof(float) + static_cast<size_t>(rank * in);
}
inline const float* lora_a8_scales(const uint8_t* a8) { return reinterpret_cast<const float*>(a8); }
inline const int8_t* lora_a8_codes(const uint8_t* a8, int64_t rank) {
  return reinterpret_cast<const int8_t*>(a8 + rank * static_cast<int64_t>(sizeof(float)));
}

inline int64_t lora_b8_blocks(int64_t out) { return (out + kLoraBlockCols - 1) / kLoraBlockCols; }
// Bytes of B's scales with their padding: where its codes start.
inline size_t lora_b8_scale_bytes(int64_t out, int64_t rank) {
  return (static_cast<size_t>(lora_b8_blocks(out) * rank) * sizeof(float) + 63) & ~size_t{63};
}
inline size_t lora_b8_bytes(int64_t out, int64_t rank) {
  return lora_b8_scale_bytes(out, rank) + static_cast<size_t>(lora_b16_elements(out, rank));
}
// Block q's scales and its codes (rank rows of lora_b16_block_width(out, q)).
inline const float* lora_b8_scales(const uint8_t* b8, int64_t rank, int64_t q) {
  return reinterpret_cast<const float*>(b8) + q * rank;
}
inline size_t lora_b8_codes_offset(int64_t out, int64_t rank, int64_t q) {
  return lora_b8_scale_bytes(out, rank) + static_cast<size_t>(q * kLoraBlockCols * rank);
}
inline const int8_t* lora_b8_codes(const uint8_t* b8, int64_t out, int64_t rank, int64_t q) {
  return reinterpret_cast<const int8_t*>(b8 + lora_b8_codes_offset(out, rank, q));
}

// dst (4-byte aligned) = A [rank, in] / B [out, rank] in the layouts above.
void pack_lora_a8(const float* a, int64_t rank, int64_t in, uint8_t* dst);
void pack_lora_b8(const float* b, int64_t out, int64_t rank, uint8_t* dst);
// The values the codes stand for: a [rank, in], b [out, rank].
void unpack_lora_a8(const uint8_t* a8, int64_t rank, int64_t in, float* a);
void unpack_lora_b8(const uint8_t* b8, int64_t out, int64_t rank, float* b);

}  // namespace loom

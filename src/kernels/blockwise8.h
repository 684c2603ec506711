// bitsandbytes' block-wise 8-bit quantization (the state of its 8-bit
// optimizers): the dynamic (tree) map of 256 values, an f32 absmax per block of
// 256 elements, and the 65536-entry table its CPU quantize_blockwise looks
// codes up in (bitsandbytes 0.50: index ((x/absmax + 1) / 2) * 65535 + 0.5,
// truncated; each entry the nearest map value, ties to the lower one).
// Bit-equal to bitsandbytes.functional.{create_dynamic_map, quantize_blockwise,
// dequantize_blockwise} on CPU (tests/unit/test_optim8bit.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace loom {

inline constexpr size_t kBlockwise8Block = 256;  // bnb's optimizer state block size
inline constexpr size_t kBlockwise8Lut = 65536;

inline size_t blockwise8_blocks(size_t n) { return (n + kBlockwise8Block - 1) / kBlockwise8Block; }

// create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), sorted, as
// torch computes it in f32 (linspace with fused steps, scale times the mean).
std::array<float, 256> dynamic_map(bool is_signed);

// A map and its lookup table; lives in a backend's memory (66.5 KiB).
struct Blockwise8Map {
  float code[256];
  uint8_t lut[kBlockwise8Lut];
};
// Fills `m` for the signed (first moment) or unsigned (second moment) map.
void build_blockwise8_map(Blockwise8Map& m, bool is_signed);

// The table index of normalized value `x` (clamped to [-1, 1]; NaN -> 0, as
// the x86 conversion bitsandbytes uses gives).
uint16_t blockwise8_lut_index(float x);

}  // namespace loom

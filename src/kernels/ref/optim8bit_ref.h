// Scalar references of the block-wise 8-bit ops (kernels/cpu/optim8bit.h):
// bitsandbytes 0.50's CPU quantize_blockwise / dequantize_blockwise and its
// blockwise 8-bit Adam step (backends/cpu/ops.py), element by element in its
// order of f32 operations. Kept as the yardstick for the CPU kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/backend.h"
#include "kernels/blockwise8.h"

namespace loom::ref {

// codes [n], absmax [blockwise8_blocks(n)].
void quantize_blockwise(const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes, float* absmax);
void dequantize_blockwise(const Blockwise8Map& map, const uint8_t* codes, const float* absmax, size_t n, float* out);
// One AdamW step of a tensor of n elements whose moments are 8-bit (blocks from its start).
void adamw8bit_update(const Adam8bitUpdate& u, float* p, const float* g, const Adam8bitState& s, size_t n);

}  // namespace loom::ref

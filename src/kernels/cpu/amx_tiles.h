// What the AMX kernels (panel_kernels_amx_avx512.cpp, bf16_gemm_amx_avx512.cpp)
// share: the LDTILECFG memory layout and a compiler barrier for tile code.
#pragma once

#include <cstdint>

namespace loom::cpu {

// The tile intrinsics are asm statements without memory operands: keep plain
// stores and loads from moving across them.
inline void amx_compiler_barrier() { __asm__ volatile("" ::: "memory"); }

// LDTILECFG's 64-byte operand (palette 1): bytes per row and rows of each tile.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace loom::cpu

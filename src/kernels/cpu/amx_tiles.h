// What the AMX kernels (panel_kernels_amx_avx512.cpp, bf16_gemm_amx_avx512.cpp)
// share: the LDTILECFG memory layout and a compiler barrier for tile code.
#pragma once

#include <immintrin.h>

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

// Include only from *_amx_avx512.cpp files (built with the AMX and AVX-512 flags).

// All eight tiles as 16 rows x 64 bytes (the bf16 kernels' shape).
inline void amx_configure_16x64() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  amx_compiler_barrier();
  _tile_loadconfig(&cfg);
}

// Writes (or adds, with accumulate) a finished 16 x 16 f32 result `buf` to rows
// [16 tt, 16 tt + 16) and columns [16 p, 16 p + 16) of dx [T, K] (row stride ldx),
// clipped to T and K.
inline void amx_write_dx_tile(float* dx, int64_t ldx, int64_t T, int64_t K, bool accumulate, const float* buf,
                              int64_t tt, int64_t p) {
  const int64_t k0 = 16 * p, cols = K - k0 < 16 ? K - k0 : 16;
  const auto mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < 16; ++r) {
    const int64_t t = 16 * tt + r;
    if (t >= T) break;
    float* o = dx + t * ldx + k0;
    __m512 v = _mm512_load_ps(buf + 16 * r);
    if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), v);
    _mm512_mask_storeu_ps(o, mask, v);
  }
}

}  // namespace loom::cpu

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

// The inner loop of the bf16 kernels: accumulators tmm0..3 (TT x PP: tmm0 =
// (a0, b0), tmm1 = (a0, b1), tmm2 = (a1, b0), tmm3 = (a1, b1)), A tiles in
// tmm4/5, B tiles in tmm6/7; `n` steps over consecutive 1 KiB tiles.
template <int TT, int PP>
inline void amx_bf16_dot_steps(const uint8_t* a0, const uint8_t* a1, const uint8_t* b0, const uint8_t* b1,
                               int64_t n) {
  for (int64_t s = 0; s < n; ++s) {
    const size_t off = static_cast<size_t>(s) * 1024;
    _tile_loadd(4, a0 + off, 64);
    _tile_loadd(6, b0 + off, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PP == 2) {
      _tile_loadd(7, b1 + off, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TT == 2) {
      _tile_loadd(5, a1 + off, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (PP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

}  // namespace loom::cpu

// AVX-512 form of lora_rows.cpp's second pass on a bf16 B (kernels/lora_b16.h):
// 16 columns in the lanes where the AVX2 loop has 8, each lane the same
// operations (FMA chains over the rank in chunks of 8, the same tree, the same
// tail, then y + s), so the same bits. AVX-512 F/BW/VL only; chosen at run
// time (CpuFeatures::has_avx512_f32). (The first pass's bf16 tiles with two
// factor rows a zmm ran no faster on an Emerald Rapids: not kept.)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/lora_rows_isa.h"

namespace loom::detail {

// y[0, w) += B u for one row u, B's block transposed: bt[j * ld + n] = B[n][j]
// as bf16 bits, ld (>= w, a multiple of 8) columns a rank row, the padding zero.
void add_bt16_times_u_avx512(const uint16_t* bt, int64_t ld, int64_t r, const float* u, float* y, int64_t w) {
  const int64_t r8 = r & ~int64_t{7};
  for (int64_t n = 0; n < w; n += 16) {
    // Lanes past the block's padded width are not loaded (zero), past w not stored.
    const auto held = static_cast<__mmask16>((1u << std::min<int64_t>(16, ld - n)) - 1);
    const auto kept = static_cast<__mmask16>((1u << std::min<int64_t>(16, w - n)) - 1);
    auto column = [&](int64_t j) {
      const __m256i h = _mm256_maskz_loadu_epi16(held, bt + j * ld + n);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    };
    __m512 acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = _mm512_setzero_ps();
    for (int64_t c = 0; c < r8; c += 8)
      for (int l = 0; l < 8; ++l) acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(u[c + l]), column(c + l), acc[l]);
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                             _mm512_add_ps(_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7])));
    for (int64_t c = r8; c < r; ++c) s = _mm512_fmadd_ps(_mm512_set1_ps(u[c]), column(c), s);
    _mm512_mask_storeu_ps(y + n, kept, _mm512_add_ps(_mm512_maskz_loadu_ps(kept, y + n), s));
  }
}

}  // namespace loom::detail

// AVX2 NF4 dequantization (kernels/ref/nf4_ref.h): 8 elements at a time, the
// code looked up in the 16-entry table with two 8-entry permutes, times the
// block's absmax (one f32 product, as the reference and bitsandbytes).
#include "kernels/cpu/nf4.h"

#include <immintrin.h>

#include <cstring>

#include "kernels/ref/nf4_ref.h"

namespace loom::cpu {

void dequantize_row_nf4(const void* src, float* dst, int64_t n) {
  const __m256 tab_lo = _mm256_loadu_ps(kNf4Code), tab_hi = _mm256_loadu_ps(kNf4Code + 8);
  // Byte i of 4 feeds elements 2i (high nibble) and 2i + 1 (low nibble).
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i shift = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0);
  const __m256i m = _mm256_set1_epi32(0x0f);
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / kNf4Block; ++b, p += sizeof(BlockNF4), dst += kNf4Block) {
    float d;
    std::memcpy(&d, p, 4);
    const __m256 vd = _mm256_set1_ps(d);
    for (int j = 0; j < 8; ++j) {
      int32_t four;
      std::memcpy(&four, p + 4 + 4 * j, 4);
      const __m128i bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(four), dup);
      const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(bytes), shift), m);
      const __m256 lo = _mm256_permutevar8x32_ps(tab_lo, idx), hi = _mm256_permutevar8x32_ps(tab_hi, idx);
      const __m256 w = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
      _mm256_storeu_ps(dst + 8 * j, _mm256_mul_ps(w, vd));
    }
  }
}

}  // namespace loom::cpu

namespace loom::cpu {

void pack_nf4_row(const uint8_t* row, int r, int64_t K, uint8_t* panel) {
  for (int64_t b = 0; b < K / kNf4Block; ++b) {
    const uint8_t* src = row + b * sizeof(BlockNF4);
    uint8_t* pb = panel + b * kNf4PanelBlockBytes;
    std::memcpy(pb + 4 * r, src, 4);
    for (int j = 0; j < 32; ++j) pb[64 + 16 * j + r] = src[4 + j];
  }
}

}  // namespace loom::cpu

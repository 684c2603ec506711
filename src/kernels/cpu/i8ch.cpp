// i8_ch rows (layouts in kernels/cpu/i8ch.h): AVX2 dequantization, bit-identical
// to dequantize_row_i8ch_ref, and the packing of rows into matmul panels.
#include "kernels/cpu/i8ch.h"

#include <immintrin.h>

#include <cstring>

#include "core/error.h"
#include "kernels/ref/i8ch_ref.h"

namespace loom::cpu {

void dequantize_i8ch_cols(const void* row, int64_t c0, float* dst, int64_t n) {
  const I8ChHeader h = i8ch_header(row);
  const auto* q = static_cast<const int8_t*>(row) + kI8ChHeaderBytes + c0;
  // scale * (float(q) - zero): the subtraction is exact, the product rounds once.
  const __m256 s = _mm256_set1_ps(h.scale), z = _mm256_set1_ps(h.zero);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
    _mm256_storeu_ps(dst + k, _mm256_mul_ps(s, _mm256_sub_ps(_mm256_cvtepi32_ps(v), z)));
  }
  for (; k < n; ++k) {
    const float d = static_cast<float>(q[k]) - h.zero;
    dst[k] = h.scale * d;
  }
}

void dequantize_row_i8ch(const void* row, float* dst, int64_t n) { dequantize_i8ch_cols(row, 0, dst, n); }

void pack_i8ch_panel(const uint8_t* const* rows, int nrows, int64_t K, uint8_t* dst) {
  LOOM_ASSERT(nrows >= 0 && nrows <= 16 && K >= 1);
  const int64_t nw = i8ch_words(K);
  std::memset(dst, 0, kI8ChPanelHeader);
  if (nrows < 16 || K % 4 != 0) std::memset(dst + kI8ChPanelHeader, 0, 64 * static_cast<size_t>(nw));
  for (int r = 0; r < nrows; ++r) {
    const I8ChHeader h = i8ch_header(rows[r]);
    LOOM_ASSERT(i8ch_header_valid(h));  // matmul's weight check refuses others first
    const auto* q = reinterpret_cast<const int8_t*>(rows[r] + kI8ChHeaderBytes);
    const auto zero = static_cast<int32_t>(h.zero);
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += q[k];
    const int32_t corr = -128 * sum;
    std::memcpy(dst + 4 * r, &h.scale, 4);
    std::memcpy(dst + 64 + 4 * r, &zero, 4);
    std::memcpy(dst + 128 + 4 * r, &corr, 4);
    uint8_t* words = dst + kI8ChPanelHeader + 4 * r;
    const int64_t full = K / 4;
    for (int64_t o = 0; o < full; ++o) std::memcpy(words + 64 * o, q + 4 * o, 4);
    if (K % 4 != 0) std::memcpy(words + 64 * full, q + 4 * full, static_cast<size_t>(K % 4));
  }
}

}  // namespace loom::cpu

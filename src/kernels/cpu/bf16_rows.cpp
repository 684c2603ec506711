// f32 <-> bf16 row conversion (AVX2).
#include "kernels/cpu/bf16_rows.h"

#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/bf16_gemm.h"

namespace loom {

void f32_to_bf16_rows(uint16_t* dst, const float* src, int64_t n) { cpu::round_to_bf16(src, dst, n); }

void bf16_to_f32_rows(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  for (; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, sizeof u);
  }
}

}  // namespace loom

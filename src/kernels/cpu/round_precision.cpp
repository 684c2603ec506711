// bf16 / fp16 rounding of f32 operands (AVX2 + F16C).
#include "kernels/cpu/round_precision.h"

#include <immintrin.h>

#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/bf16_gemm.h"

namespace loom {

namespace {

// round_to_bf16 on 8 lanes, the result's bits in the top half of each lane.
inline __m256 bf16_8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                                     _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1)));
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
  const __m256i q = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));
  const __m256i z = _mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i y = _mm256_blendv_epi8(_mm256_blendv_epi8(r, q, nan), z, sub);
  return _mm256_castsi256_ps(_mm256_and_si256(y, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m256 f16_8(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }

}  // namespace

float round_to_precision_scalar(DType to, float x) {
  switch (to) {
    case DType::bf16: return bf16_to_fp32(cpu::round_to_bf16(x));
    case DType::f16: return fp16_to_fp32(fp32_to_fp16(x));
    case DType::f32: return x;
    default: break;
  }
  fail(ErrorKind::internal, "round_to_precision: no rounding to {}", dtype_name(to));
}

void round_to_precision(DType to, float* dst, const float* src, int64_t n) {
  if (to == DType::f32) {
    if (dst != src) std::memmove(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  if (to != DType::bf16 && to != DType::f16)
    fail(ErrorKind::internal, "round_to_precision: no rounding to {}", dtype_name(to));
  int64_t i = 0;
  if (to == DType::bf16)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16_8(_mm256_loadu_ps(src + i)));
  else
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, f16_8(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = round_to_precision_scalar(to, src[i]);
}

}  // namespace loom

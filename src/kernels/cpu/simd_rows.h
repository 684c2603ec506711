// AVX2 dot products of one f32 vector with 4 or 8 rows (f32 or IEEE half) at
// once (attention scores, small LoRA products). Each result is one FMA chain
// over 8-element chunks, a fixed reduction tree, then a scalar tail, so a
// row's result never depends on which other rows share the call: callers pad
// with any valid row.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace loom::simd {

// A bf16 element (its bits), as rows of LoRA factors kept in bf16 hold them.
struct Bf16 {
  uint16_t bits;
};

// An int8 code, as rows of LoRA factors kept in int8 hold them (kernels/lora_i8.h).
struct I8 {
  int8_t code;
};

// 8 (1) elements as f32; uint16_t holds IEEE half bits; Bf16 and I8 widen exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const I8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float load1(const float* p) { return *p; }
inline float load1(const I8* p) { return static_cast<float>(p->code); }
inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }
inline float load1(const Bf16* p) {
  const uint32_t u = static_cast<uint32_t>(p->bits) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// dst[0, n) = src[0, n) as f32 (exact).
template <typename E>
inline void widen(float* dst, const E* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = load1(src + i);
}

// s[j] = dot(x, r[j]) for j < 4, over n floats.
template <typename R>
inline void dot4(const float* x, const R* const* r, int64_t n, float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t c = 0; c < n8; c += 8) {
    const __m256 xc = _mm256_loadu_ps(x + c);
    a0 = _mm256_fmadd_ps(xc, load8(r[0] + c), a0);
    a1 = _mm256_fmadd_ps(xc, load8(r[1] + c), a1);
    a2 = _mm256_fmadd_ps(xc, load8(r[2] + c), a2);
    a3 = _mm256_fmadd_ps(xc, load8(r[3] + c), a3);
  }
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  for (int64_t c = n8; c < n; ++c)
    for (int j = 0; j < 4; ++j) s[j] = std::fma(x[c], load1(r[j] + c), s[j]);
}

// Returns {dot(x, r[0]), ..., dot(x, r[7])} over n floats.
template <typename R>
inline __m256 dot8(const float* x, const R* const* r, int64_t n) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t c = 0; c < n8; c += 8) {
    const __m256 xc = _mm256_loadu_ps(x + c);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(xc, load8(r[j] + c), a[j]);
  }
  // lanes: t0 = [r0 r1 r2 r3 | r0 r1 r2 r3] partial sums, t1 the same for r4..r7
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
  if (n8 < n) {
    alignas(32) float v[8];
    _mm256_store_ps(v, s);
    for (int64_t c = n8; c < n; ++c)
      for (int j = 0; j < 8; ++j) v[j] = std::fma(x[c], load1(r[j] + c), v[j]);
    s = _mm256_load_ps(v);
  }
  return s;
}

}  // namespace loom::simd

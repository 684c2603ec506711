// Horizontal sums of 8-lane vectors in simd::hsum's order of additions (lanes i
// and i + 4, then 0 + 2 and 1 + 3, then the two), for kernels whose results
// must equal the per-key AVX2 loop bit for bit. Included by files built with
// different ISA flags, so the helpers stay local to each file (as in
// panel_kernels.h); simd::hsum itself (simd_avx2.h, external linkage) must not
// be compiled into an AVX-512 file, hence the copy here.
#pragma once

#include <immintrin.h>

namespace loom::cpu {
namespace {

// simd::hsum bit for bit: (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 + l7), then the two.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// out[j] = simd::hsum(v[j]) bit for bit, for 4 vectors at once.
inline void hsum4(const __m256 v[4], float out[4]) {
  const __m256 r01 = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
  const __m256 r23 = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x31));
  // lanes: r01 = [r0 r1 r2 r3 | r0' r1' r2' r3'] of v0 | v1; r23 likewise of v2 | v3.
  const __m256 x = _mm256_shuffle_ps(r01, r23, _MM_SHUFFLE(1, 0, 1, 0));  // [r0 r1 r0'' r1'' | ...]
  const __m256 y = _mm256_shuffle_ps(r01, r23, _MM_SHUFFLE(3, 2, 3, 2));  // [r2 r3 r2'' r3'' | ...]
  const __m256 s = _mm256_add_ps(x, y);  // [s0 s1 of v0, s0 s1 of v2 | s0 s1 of v1, s0 s1 of v3]
  const __m256 u = _mm256_shuffle_ps(s, s, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 w = _mm256_shuffle_ps(s, s, _MM_SHUFFLE(3, 1, 3, 1));
  const __m256 d = _mm256_add_ps(u, w);  // [d0 d2 d0 d2 | d1 d3 d1 d3]
  alignas(32) float t[8];
  _mm256_store_ps(t, d);
  out[0] = t[0];
  out[1] = t[4];
  out[2] = t[1];
  out[3] = t[5];
}

}  // namespace
}  // namespace loom::cpu

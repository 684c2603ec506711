// AVX2 dequantization of spans of a 4-bit matrix (kernels/int4_rows.h) into
// f32, for kernels that read the codes in place (the server's LoRA factors)
// a small L1-resident piece at a time. Every value is float(code - 8) * scale:
// a small integer, exact in f32, times its group's scale, one rounding; so
// the bits are those of unpack_int4_rows, whichever path computes them.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/int4_rows.h"

namespace loom::int4 {

// Element e of the flattened codes with its group's scale.
inline float value(const uint8_t* codes, int64_t e, float scale) {
  return static_cast<float>(((codes[e / 2] >> (e % 2 * 4)) & 0xF) - 8) * scale;
}

// The codes of the low 8 (16) bytes of `v`, element order (low nibble first), minus 8, one per byte.
inline __m128i signed_codes(__m128i v) {
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i q = _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
  return _mm_sub_epi8(q, _mm_set1_epi8(8));
}
// The 8 codes in the low bytes of q as floats times s.
inline __m256 scaled8(__m128i q, __m256 s) { return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s); }

// out[0, n) = elements [e, e + n) of `codes`, all in one group of scale s.
inline void dequant_run(const uint8_t* codes, int64_t e, int64_t n, float s, float* out) {
  int64_t i = 0;
  if (e % 2 != 0 && n > 0) out[i++] = value(codes, e, s);  // from here on e + i is even
  const __m256 sv = _mm256_set1_ps(s);
  for (; i + 16 <= n; i += 16) {
    const __m128i q = signed_codes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (e + i) / 2)));
    _mm256_storeu_ps(out + i, scaled8(q, sv));
    _mm256_storeu_ps(out + i + 8, scaled8(_mm_unpackhi_epi64(q, q), sv));
  }
  if (i + 8 <= n) {
    int32_t w;
    std::memcpy(&w, codes + (e + i) / 2, sizeof w);
    _mm256_storeu_ps(out + i, scaled8(signed_codes(_mm_cvtsi32_si128(w)), sv));
    i += 8;
  }
  for (; i < n; ++i) out[i] = value(codes, e + i, s);
}

// The 32 codes of 16 bytes at p, minus 8: elements 0..15 in q[0], 16..31 in q[1].
inline void signed_codes32(const uint8_t* p, __m128i (&q)[2]) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
  q[0] = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
  q[1] = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
}
// out[0, 32) from q (signed_codes32), chunk k of 8 times s[k].
inline void store32(const __m128i (&q)[2], const __m256 (&s)[4], float* out) {
  _mm256_storeu_ps(out, scaled8(q[0], s[0]));
  _mm256_storeu_ps(out + 8, scaled8(_mm_unpackhi_epi64(q[0], q[0]), s[1]));
  _mm256_storeu_ps(out + 16, scaled8(q[1], s[2]));
  _mm256_storeu_ps(out + 24, scaled8(_mm_unpackhi_epi64(q[1], q[1]), s[3]));
}

// The fast paths: n32 elements (a multiple of 32) from e (a multiple of 32),
// 16 bytes of codes at a time. Groups of G = 8 or 16 (B's rows at ranks 8
// and 16): 4 or 2 groups per step.
template <int G>
inline void dequant_small_groups(const Int4Rows& m, int64_t e, int64_t n32, float* out) {
  const float* sp = m.scales + e / G;
  for (int64_t i = 0; i < n32; i += 32, sp += 32 / G) {
    __m128i q[2];
    signed_codes32(m.codes + (e + i) / 2, q);
    const __m256 s[4] = {_mm256_broadcast_ss(sp), _mm256_broadcast_ss(sp + 8 / G), _mm256_broadcast_ss(sp + 16 / G),
                         _mm256_broadcast_ss(sp + 24 / G)};
    store32(q, s, out + i);
  }
}
// Groups a multiple of 32 (A's rows): one scale per step, the next at each group's end.
inline void dequant_large_groups(const Int4Rows& m, int64_t e, int64_t n32, float* out) {
  const float* sp = m.scales + e / m.group;
  int64_t left = (m.group - e % m.group) / 32;  // steps left in this group
  for (int64_t i = 0; i < n32; i += 32, --left) {
    if (left == 0) {
      ++sp;
      left = m.group / 32;
    }
    __m128i q[2];
    signed_codes32(m.codes + (e + i) / 2, q);
    const __m256 sv = _mm256_broadcast_ss(sp);
    const __m256 s[4] = {sv, sv, sv, sv};
    store32(q, s, out + i);
  }
}

// out[0, n) = elements [e, e + n) of m flattened row-major (a group never
// crosses a row, so element e's scale is scales[e / group]).
inline void dequant_span(const Int4Rows& m, int64_t e, int64_t n, float* out) {
  if (e % 32 == 0 && (m.group == 8 || m.group == 16 || m.group % 32 == 0)) {
    const int64_t n32 = n & ~int64_t{31};
    if (m.group == 8)
      dequant_small_groups<8>(m, e, n32, out);
    else if (m.group == 16)
      dequant_small_groups<16>(m, e, n32, out);
    else
      dequant_large_groups(m, e, n32, out);
    e += n32;
    out += n32;
    n -= n32;
  }
  int64_t g = e / m.group, left = m.group - e % m.group;
  while (n > 0) {
    const int64_t take = std::min(left, n);
    dequant_run(m.codes, e, take, m.scales[g], out);
    e += take;
    out += take;
    n -= take;
    ++g;
    left = m.group;
  }
}

}  // namespace loom::int4

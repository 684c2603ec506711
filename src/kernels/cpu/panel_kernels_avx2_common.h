// Helpers of the AVX2 panel kernels (panel_kernels_avx2_impl.h, which includes
// this first): loads and stores of a tile, the unpacking of nibbles, bits and
// codebooks into operands, and the integer block dots with their scales. Like
// the kernels, compiled once per including file (LOOM_AVX2_VNNI 0 or 1).
#pragma once  // (one inclusion per file)

#ifndef LOOM_AVX2_VNNI
#error "define LOOM_AVX2_VNNI (0 or 1) before including panel_kernels_avx2_common.h"
#endif

#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/panel.h"
#include "kernels/cpu/panel_kernels.h"
#include "kernels/quant_blocks.h"

namespace loom::cpu {
namespace {

// Decode prefetch distance of this kernel family (panel_kernels.h: AVX-VNNI's
// cores take the AVX-512 kernels' distance).
constexpr size_t kAhead = LOOM_AVX2_VNNI ? kPrefetchBytesAvx512 : kPrefetchBytesAvx2;

inline __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 load_f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 rows' scales of a 32-element panel block: f16, or bf16 (kBf16Scale).
template <class L>
inline __m256 load_scales8(const uint8_t* p) {
  if constexpr (L::kU8Scale)
    return _mm256_cvtph_ps(
        _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7));
  else if constexpr (L::kBf16Scale)
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  else
    return load_f16x8(p);
}

inline void store_rows(float* y, __m256 v, int64_t nv) {
  if (nv >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (nv > 0) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nv)), idx), v);
  }
}

template <int P, int C>
inline void zero_tile(__m256 (&acc)[P][2][C]) {
  for (int p = 0; p < P; ++p)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < C; ++c) acc[p][h][c] = _mm256_setzero_ps();
}

template <int P, int C>
inline void store_tile(const TileArgs& ta, __m256 (&acc)[P][2][C]) {
  for (int c = 0; c < C; ++c)
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h)
        store_rows(ta.y + c * ta.ldy + p * 16 + h * 8, acc[p][h][c], ta.nv - p * 16 - h * 8);
}

// ops[o] = elements 4o..4o+3 of a nibble group for the 8 rows of half h.
inline void unpack_nibbles(const uint8_t* p, int h, __m256i (&ops)[8]) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  for (int o = 0; o < 4; ++o) {
    const __m256i w = load256(p + 64 * o + 32 * h);
    ops[o] = _mm256_and_si256(w, m);
    ops[o + 4] = _mm256_and_si256(_mm256_srli_epi32(w, 4), m);
  }
}

// A codebook (iq4_nl / iq4_xs: kIq4Values, mxfp4: kMxfp4Values) as bytes, its
// values + bias, in both lanes (for vpshufb).
inline __m256i iq4_table(const int8_t* codebook = kIq4Values, int bias = 0) {
  return _mm256_broadcastsi128_si256(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook)),
                                                  _mm_set1_epi8(static_cast<char>(bias))));
}

// unpack_nibbles' operands looked up in the codebook (values + bias).
inline void unpack_iq4(const uint8_t* p, int h, __m256i (&ops)[8], const int8_t* codebook = kIq4Values,
                       int bias = 0) {
  unpack_nibbles(p, h, ops);
  const __m256i table = iq4_table(codebook, bias);
  for (int o = 0; o < 8; ++o) ops[o] = _mm256_shuffle_epi8(table, ops[o]);
}

// Operand o of half h of a nibble group at p (unpack_iq4's ops[o]) alone.
inline __m256i iq4_operand(const uint8_t* p, int h, int o) {
  const __m256i w = load256(p + 64 * (o % 4) + 32 * h);
  return _mm256_shuffle_epi8(iq4_table(),
                             _mm256_and_si256(o < 4 ? w : _mm256_srli_epi32(w, 4), _mm256_set1_epi8(0x0f)));
}

inline __m256i shift_bits(__m256i w, int left) {
  return left >= 0 ? _mm256_slli_epi32(w, left) : _mm256_srli_epi32(w, -left);
}

inline void add_bit4(const uint8_t* p, int h, __m256i (&ops)[8]) {
  const __m256i w = load256(p + 32 * h), m = _mm256_set1_epi8(0x10);
  for (int o = 0; o < 8; ++o) ops[o] = _mm256_or_si256(ops[o], _mm256_and_si256(shift_bits(w, 4 - o), m));
}

inline void add_bits45(const uint8_t* p, int h, __m256i (&ops)[8]) {
  const __m256i m = _mm256_set1_epi8(0x30);
  for (int j = 0; j < 2; ++j) {
    const __m256i w = load256(p + 64 * j + 32 * h);
    for (int s = 0; s < 4; ++s)
      ops[4 * j + s] = _mm256_or_si256(ops[4 * j + s], _mm256_and_si256(shift_bits(w, 4 - 2 * s), m));
  }
}

// An empty asm the value passes through: GCC otherwise reassociates a chain of
// integer sums into a tree whose 32 partial products spill from 16 registers
// (measured: the q8_0 tile 1.45x with it, AMD Zen 4 under LOOM_CPU=avx2).
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// 8 rows' int8 scales, each in both int16 halves of its row's lane: vpmaddwd of
// a row's int16 pair sums by it is the row's scaled sum (exact in int32).
inline __m256i scales_x2(const uint8_t* p) {
  __m128i s;
  std::memcpy(&s, p, 8);  // (the upper 8 bytes are not used)
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s));
}

inline __m256i madd1(__m256i v16) { return _mm256_madd_epi16(v16, _mm256_set1_epi16(1)); }

constexpr bool kVnni = LOOM_AVX2_VNNI != 0;

// acc + per int32 lane the dot of u's 4 bytes (u8) with s's (s8): vpdpbusd
// under AVX-VNNI, else vpmaddubsw then vpmaddwd by ones. The same sums where the
// int16 pair sums fit, as at every caller (the sign trick's |w| <= 128 with
// |x| <= 127; the 4- and 5-bit values).
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if LOOM_AVX2_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, madd1(_mm256_maddubs_epi16(u, s)));
#endif
}

// Sum over operands [O0, O1) of ops[o] . x[4o..], u8 values below 2^kBits. Partial
// int16 sums hold at most 2^15 / (2 * 128 * (2^kBits - 1)) operands: 8 for 4-bit
// (or fewer bits), 4 for 5-bit, 2 for 6-bit values.
template <int kBits, int O0, int O1>
inline __m256i idot(const __m256i (&ops)[8], const int8_t* x) {
  constexpr int kRun = kBits == 4 ? 8 : kBits == 5 ? 4 : 2;
  __m256i total = _mm256_setzero_si256();
  if constexpr (kVnni) {
    for (int o = O0; o < O1; ++o) total = dot_add(total, ops[o], bcast32(x + 4 * o));
    return total;
  }
  for (int o0 = O0; o0 < O1; o0 += kRun) {
    __m256i s = _mm256_maddubs_epi16(ops[o0], bcast32(x + 4 * o0));
    for (int o = o0 + 1; o < o0 + kRun && o < O1; ++o)
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(ops[o], bcast32(x + 4 * o)));
    total = _mm256_add_epi32(total, madd1(s));
  }
  return total;
}

// s8 x s8 with the sign trick; each product pair fits int16 (|w| <= 128, |x| <= 127).
inline __m256i idot_s8_range(const __m256i (&absw)[8], const __m256i (&w)[8], const int8_t* x, int o0,
                             int o1) {
  __m256i total = _mm256_setzero_si256();
  for (int o = o0; o < o1; ++o) total = dot_add(total, absw[o], _mm256_sign_epi8(bcast32(x + 4 * o), w[o]));
  return total;
}
inline __m256i idot_s8(const __m256i (&absw)[8], const __m256i (&w)[8], const int8_t* x) {
  return idot_s8_range(absw, w, x, 0, 8);
}

// A k-quant half's mins (u8, two sub-blocks per row in each int16 pair) at p:
// Q row pairs of 16 bytes, half h at byte 16h of each 32.
template <int Q>
inline void load_mins(const uint8_t* p, int h, __m256i (&mins)[Q]) {
  for (int q = 0; q < Q; ++q)
    mins[q] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * q + 16 * h)));
}

// sum over the sub-blocks of min * (act sum), per row: the int16 act sums s in pairs.
template <int Q>
inline __m256i min_sums(const __m256i (&mins)[Q], const int16_t* s) {
  __m256i im = _mm256_setzero_si256();
  for (int q = 0; q < Q; ++q) im = _mm256_add_epi32(im, _mm256_madd_epi16(mins[q], bcast32(s + 2 * q)));
  return im;
}

// One 8-row half of a k-quant superblock, finished for a token: acc += float(isc)
// * d * d_x, then with kQ pairs of mins (q4_k, q5_k, q2_k) acc -= float(sum of
// min * act sum) * dmin * d_x. The batch and decode tiles of both families share it.
template <int kQ>
struct HalfScales {
  __m256 dw, dm = _mm256_setzero_ps();
  __m256i mins[kQ > 0 ? kQ : 1];
  // pb: the superblock (d @0, dmin @32, the mins @mins_at when kQ > 0).
  HalfScales(const uint8_t* pb, int h, size_t mins_at) : dw(load_f16x8(pb + 16 * h)) {
    if constexpr (kQ > 0) {
      dm = load_f16x8(pb + 32 + 16 * h);
      load_mins(pb + mins_at, h, mins);
    }
  }
  // sums: the token's int16 act sums per sub-block of a min (ActQ8K s32 or s16).
  __m256 update(__m256 acc, __m256i isc, float d, const int16_t* sums) const {
    const __m256 xd = _mm256_set1_ps(d);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isc), _mm256_mul_ps(dw, xd), acc);
    if constexpr (kQ > 0)
      acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min_sums(mins, sums)), _mm256_mul_ps(dm, xd), acc);
    return acc;
  }
};

#if LOOM_AVX2_VNNI
// acc + d * sc per int32 lane, for |d| < 2^23 and scale words sw = (sc, 256 sc)
// (scale_words): d's low byte and d >> 8 become the lane's two int16 words
// (vpshufb), then one vpdpwssd multiplies and adds, exactly -- where vpmulld
// takes two uops and ten cycles on Intel's cores.
inline __m256i add_scaled(__m256i acc, __m256i d, __m256i sw) {
  const __m256i split = _mm256_setr_epi8(0, -128, 1, 2, 4, -128, 5, 6, 8, -128, 9, 10, 12, -128, 13, 14,  //
                                         0, -128, 1, 2, 4, -128, 5, 6, 8, -128, 9, 10, 12, -128, 13, 14);
  return _mm256_dpwssd_avx_epi32(acc, _mm256_shuffle_epi8(d, split), sw);
}
// scales_x2's (sc, sc) int16 pairs as (sc, 256 sc) (i8 scales: 256 sc fits int16).
inline __m256i scale_words(__m256i sc2) { return _mm256_blend_epi16(sc2, _mm256_slli_epi16(sc2, 8), 0xAA); }

// Operand o of a group into token sums of scale units of kUnit operands: d gets
// its dot (vpdpbusd of the unsigned u with the signed s, from zero at a unit's
// first operand); at a unit's last, isc += d times the unit's scale words sw[o / 4].
template <int kUnit>
[[gnu::always_inline]] inline void unit_dot(int o, __m256i u, __m256i s, const __m256i (&sw)[2], __m256i& d,
                                            __m256i& isc) {
  d = _mm256_dpbusd_avx_epi32(o % kUnit == 0 ? _mm256_setzero_si256() : d, u, s);
  keep_in_register(d);
  if (o % kUnit == kUnit - 1) isc = add_scaled(isc, d, sw[o / 4]);
}
#endif

// isc + d times the 8 rows' i8 scales at p (scales below 128 read as u8 the
// same), exact: add_scaled under AVX-VNNI, else vpmulld.
inline __m256i add_scaled_rows(__m256i isc, __m256i d, const uint8_t* p) {
#if LOOM_AVX2_VNNI
  return add_scaled(isc, d, scale_words(scales_x2(p)));
#else
  __m128i s;
  std::memcpy(&s, p, 8);
  return _mm256_add_epi32(isc, _mm256_mullo_epi32(d, _mm256_cvtepi8_epi32(s)));
#endif
}

// isc[c] += the 8 operands of a group of 32 dotted with token c's 32 values (xq[c]),
// operand-major (each operand loaded or unpacked once for the C tokens): runs of
// kRun operands summed in int16 (the sums fit, see idot), then vpmaddwd by the
// run's sub-block scales sc[o / 4] (scales_x2; ones for a plain sum) into the
// int32 sums. kUnsignedActs: the act values are the unsigned operand of
// vpmaddubsw and the weights the signed one (ActKind::q8k_u8). With AVX-VNNI each
// scale unit's kUnit operands (4, or 8 where sc[0] and sc[1] are one scale) go
// to int32 by vpdpbusd and are scaled once (add_scaled): the same int32 sums
// (a unit's dot is under 2^18: at most 32 values of 255 x 32 or 31 x 128).
template <int kRun, int C, bool kUnsignedActs = false, int kUnit = 4, class Operand>
[[gnu::always_inline]] inline void group_dots(const Operand& operand, const int8_t* const (&xq)[C],
                                              const __m256i (&sc)[2], __m256i (&isc)[C]) {
#if LOOM_AVX2_VNNI
  static_assert(kUnit == 4 || kUnit == 8);
  const __m256i sw[2] = {scale_words(sc[0]), scale_words(sc[1])};
  __m256i d[C];
#pragma GCC unroll 8
  for (int o = 0; o < 8; ++o) {
    const __m256i w = operand(o);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256i xb = bcast32(xq[c] + 4 * o);
      if constexpr (kUnsignedActs)
        unit_dot<kUnit>(o, xb, w, sw, d[c], isc[c]);
      else
        unit_dot<kUnit>(o, w, xb, sw, d[c], isc[c]);
      keep_in_register(isc[c]);
    }
  }
#else
  __m256i part[C]{};  // (each run sets its part first)
#pragma GCC unroll 8
  for (int o = 0; o < 8; ++o) {
    const __m256i w = operand(o);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256i xb = bcast32(xq[c] + 4 * o);
      const __m256i m = kUnsignedActs ? _mm256_maddubs_epi16(xb, w) : _mm256_maddubs_epi16(w, xb);
      part[c] = o % kRun == 0 ? m : _mm256_add_epi16(part[c], m);
      keep_in_register(part[c]);
      if (o % kRun == kRun - 1) isc[c] = _mm256_add_epi32(isc[c], _mm256_madd_epi16(part[c], sc[o / 4]));
      keep_in_register(isc[c]);
    }
  }
#endif
}

}  // namespace
}  // namespace loom::cpu

// AVX-512 forms of lora_rows.cpp's loops: the second pass on a bf16 or int8 B
// (kernels/lora_b16.h, lora_i8.h), 16 columns in the lanes where the AVX2 loop has 8, each
// lane the same operations (FMA chains over the rank in chunks of 8, the same
// tree, the same tail, then y + s), so the same bits; and 4-bit factors
// unpacked in registers (A rows two to a zmm, B's columns in the lanes), the
// same values and sums as the buffered AVX2 path. AVX-512 F/BW/VL/DQ only;
// chosen at run time (CpuFeatures::has_avx512_f32). (The first pass's bf16
// tiles with two factor rows a zmm ran no faster on an Emerald Rapids: that
// pass waits on its loads; the 4-bit one waits on the unpacking, so it gains.)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized and -Wuninitialized on
// their own _mm512_undefined_* helpers (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/lora_rows_isa.h"

namespace loom::detail {

namespace {

// y[0, w) += B u for one row u, B's block transposed, ld (>= w, a multiple of
// 8) columns a rank row, the padding zero; column(j, n, held): the 16 values of
// rank row j from column n as f32 (lanes outside `held` zero).
template <typename Column>
void add_columns_times_u(Column column, int64_t ld, int64_t r, const float* u, float* y, int64_t w) {
  const int64_t r8 = r & ~int64_t{7};
  for (int64_t n = 0; n < w; n += 16) {
    // Lanes past the block's padded width are not loaded (zero), past w not stored.
    const auto held = static_cast<__mmask16>((1u << std::min<int64_t>(16, ld - n)) - 1);
    const auto kept = static_cast<__mmask16>((1u << std::min<int64_t>(16, w - n)) - 1);
    __m512 acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = _mm512_setzero_ps();
    for (int64_t c = 0; c < r8; c += 8)
      for (int l = 0; l < 8; ++l)
        acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(u[c + l]), column(c + l, n, held), acc[l]);
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                             _mm512_add_ps(_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7])));
    for (int64_t c = r8; c < r; ++c) s = _mm512_fmadd_ps(_mm512_set1_ps(u[c]), column(c, n, held), s);
    _mm512_mask_storeu_ps(y + n, kept, _mm512_add_ps(_mm512_maskz_loadu_ps(kept, y + n), s));
  }
}

}  // namespace

// bt[j * ld + n] = B[n][j] as bf16 bits.
void add_bt16_times_u_avx512(const uint16_t* bt, int64_t ld, int64_t r, const float* u, float* y, int64_t w) {
  auto column = [&](int64_t j, int64_t n, __mmask16 held) {
    const __m256i h = _mm256_maskz_loadu_epi16(held, bt + j * ld + n);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  add_columns_times_u(column, ld, r, u, y, w);
}

// bt[j * ld + n]: the int8 code of B[n][j], widened exactly.
void add_bt8_times_u_avx512(const int8_t* bt, int64_t ld, int64_t r, const float* u, float* y, int64_t w) {
  auto column = [&](int64_t j, int64_t n, __mmask16 held) {
    const __m128i c = _mm_maskz_loadu_epi8(held, bt + j * ld + n);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  };
  add_columns_times_u(column, ld, r, u, y, w);
}

// Lane l holds column c0 + n + l; its rank values c.. c + 7 are the 8 nibbles of
// one dword (low nibble first), at byte (column * r + c) / 2. Each value is
// fma(code, s, -8 s): the exact product plus an exact term, rounded once, so
// (code - 8) * s as int4::value rounds it.
void add_b4_times_u_avx512(const uint8_t* codes, const float* scales, int64_t r, const float* u, float* y,
                           int64_t c0, int64_t c1) {
  for (int64_t n = c0; n < c1; n += 16) {
    const auto kept = static_cast<__mmask16>((1u << std::min<int64_t>(16, c1 - n)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(kept, scales + n), m8s = _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
    // The lanes' dwords of rank chunk k: rank 8, one dword a column; rank 16, two
    // (the even ones for k = 0, the odd for k = 1).
    auto chunk = [&](int64_t k) {
      if (r == 8) return _mm512_maskz_loadu_epi32(kept, codes + n * 4);
      const __mmask16 lo =
          static_cast<__mmask16>(kept & 0xFF ? (1u << (2 * std::min<int64_t>(8, c1 - n))) - 1 : 0);
      const __mmask16 hi =
          static_cast<__mmask16>(c1 - n > 8 ? (1u << (2 * std::min<int64_t>(8, c1 - n - 8))) - 1 : 0);
      const __m512i a = _mm512_maskz_loadu_epi32(lo, codes + n * 8),
                    b = _mm512_maskz_loadu_epi32(hi, codes + n * 8 + 64);
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      return _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(static_cast<int>(k))), b);
    };
    __m512 acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = _mm512_setzero_ps();
    for (int64_t c = 0; c < r; c += 8) {
      const __m512i w = chunk(c / 8);
      for (int l = 0; l < 8; ++l) {
        const __m512i q =
            _mm512_and_si512(_mm512_srli_epi32(w, static_cast<unsigned>(4 * l)), _mm512_set1_epi32(0xF));
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, m8s);
        acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(u[c + l]), v, acc[l]);
      }
    }
    const __m512 sum =
        _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
                      _mm512_add_ps(_mm512_add_ps(acc[4], acc[5]), _mm512_add_ps(acc[6], acc[7])));
    _mm512_mask_storeu_ps(y + n, kept, _mm512_add_ps(_mm512_maskz_loadu_ps(kept, y + n), sum));
  }
}

// The 8 lane sums of a, b, c, d reduced as lora_rows.cpp's reduce4 does. A copy
// on purpose: an inline function shared with that AVX2 file could be linked from
// this unit's AVX-512 code into the AVX2 path of a CPU without AVX-512.
static __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Factor rows 2p and 2p + 1 share a zmm: lanes 0-7 the first's chunk of 8
// columns, 8-15 the second's, each lane the same FMA chain as the AVX2 tile's
// lane (each x row's chunk in both halves). A value is fma(code, s, -8 s) =
// (code - 8) s rounded once.
template <int NR, int NA>
static void dot_rows_int4(const float* const* x, const uint8_t* const* codes, const float* const* scales,
                          int64_t n, int64_t group, float* s) {
  constexpr int P = NA / 2;
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i nibble = _mm512_set1_epi32(0xF);
  __m512 acc[NR][P], sc[P], m8s[P];
  for (int i = 0; i < NR; ++i)
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_ps();
  auto pair = [](float lo, float hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(lo)), _mm256_set1_ps(hi), 1);
  };
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    const int64_t g = g0 / group;
    for (int p = 0; p < P; ++p) {
      sc[p] = pair(scales[2 * p][g], scales[2 * p + 1][g]);
      m8s[p] = _mm512_mul_ps(sc[p], _mm512_set1_ps(-8.0f));
    }
    for (int64_t c = g0; c < g0 + group; c += 8) {
      __m512 xc[NR];
      for (int i = 0; i < NR; ++i)
        xc[i] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x[i] + c))));
      for (int p = 0; p < P; ++p) {
        int32_t lo, hi;
        std::memcpy(&lo, codes[2 * p] + c / 2, sizeof lo);
        std::memcpy(&hi, codes[2 * p + 1] + c / 2, sizeof hi);
        const __m512i w =
            _mm512_inserti32x8(_mm512_castsi256_si512(_mm256_set1_epi32(lo)), _mm256_set1_epi32(hi), 1);
        const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(w, shifts), nibble);
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sc[p], m8s[p]);
        for (int i = 0; i < NR; ++i) acc[i][p] = _mm512_fmadd_ps(xc[i], v, acc[i][p]);
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    __m256 rows[NA];
    for (int p = 0; p < P; ++p) {
      rows[2 * p] = _mm512_castps512_ps256(acc[i][p]);
      rows[2 * p + 1] = _mm512_extractf32x8_ps(acc[i][p], 1);
    }
    for (int j = 0; j < NA; j += 4)
      _mm_storeu_ps(s + i * NA + j, reduce4(rows[j], rows[j + 1], rows[j + 2], rows[j + 3]));
  }
}

void dot_rows_int4_avx512(int nr, int na, const float* const* x, const uint8_t* const* codes,
                          const float* const* scales, int64_t n, int64_t group, float* s) {
  if (nr == 1 && na == 8) return dot_rows_int4<1, 8>(x, codes, scales, n, group, s);
  if (nr == 2 && na == 4) return dot_rows_int4<2, 4>(x, codes, scales, n, group, s);
  if (nr == 3 && na == 4) return dot_rows_int4<3, 4>(x, codes, scales, n, group, s);
  LOOM_ASSERT(false);
}

}  // namespace loom::detail

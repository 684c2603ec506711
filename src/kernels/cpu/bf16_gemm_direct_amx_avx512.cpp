// AMX-BF16 kernel of the direct bf16 input-gradient product (bf16_gemm_direct.h)
// and its AVX-512 dequantizers: W [N, K] blocks become B tiles right before use.
// 2 x 2 result tiles (32 rows t x 32 columns k) in tmm0-3, dy tiles in tmm4-5, B
// tiles in tmm6-7, as in bf16_gemm_amx_avx512.cpp.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Products then sums, each rounded, exactly like dequantize_row_ref (whose file
// turns contraction off): an FMA would change some q4_1 / q5_1 values.
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/bf16_gemm_direct.h"

#include "kernels/cpu/amx_tiles.h"

namespace loom::cpu {
namespace {

constexpr size_t kTile = 1024;

// fp16 -> f32 broadcast (exact, as fp16_to_fp32).
inline __m512 bcast_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
}

// Columns [k0, k0 + 32) of W row n as f32: lo = k0 .. k0 + 15, hi = the rest;
// zeros past K (plain types only: block types have K a multiple of 32).
template <DirectType Ty>
inline void row32(const Bf16DirectWork& w, int64_t n, int64_t k0, __m512& lo, __m512& hi) {
  const uint8_t* row = w.w + static_cast<size_t>(n) * w.w_row_bytes;
  if constexpr (Ty == DirectType::q4_0 || Ty == DirectType::q4_1) {
    const uint8_t* b = row + static_cast<size_t>(k0 / 32) * (Ty == DirectType::q4_0 ? 18 : 20);
    const uint8_t* qs = b + (Ty == DirectType::q4_0 ? 2 : 4);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(15)), qh = _mm512_srli_epi32(q, 4);
    const __m512 d = bcast_half(b);
    if constexpr (Ty == DirectType::q4_0) {
      ql = _mm512_sub_epi32(ql, _mm512_set1_epi32(8));
      qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(ql), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(qh), d);
    } else {
      const __m512 m = bcast_half(b + 2);
      lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ql), d), m);
      hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qh), d), m);
    }
  } else if constexpr (Ty == DirectType::q5_0 || Ty == DirectType::q5_1) {
    const uint8_t* b = row + static_cast<size_t>(k0 / 32) * (Ty == DirectType::q5_0 ? 22 : 24);
    const uint8_t* qhp = b + (Ty == DirectType::q5_0 ? 2 : 4);
    uint32_t bits;
    std::memcpy(&bits, qhp, 4);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qhp + 4)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(15)), qh = _mm512_srli_epi32(q, 4);
    // The 5th bit of element j is bit j of qh.
    ql = _mm512_mask_or_epi32(ql, static_cast<__mmask16>(bits & 0xffffu), ql, sixteen);
    qh = _mm512_mask_or_epi32(qh, static_cast<__mmask16>(bits >> 16), qh, sixteen);
    const __m512 d = bcast_half(b);
    if constexpr (Ty == DirectType::q5_0) {
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ql, sixteen)), d);
      hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(qh, sixteen)), d);
    } else {
      const __m512 m = bcast_half(b + 2);
      lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ql), d), m);
      hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qh), d), m);
    }
  } else if constexpr (Ty == DirectType::q8_0) {
    const uint8_t* b = row + static_cast<size_t>(k0 / 32) * 34;
    const __m512 d = bcast_half(b);
    lo = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), d);
    hi = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), d);
  } else {
    const int64_t cols = w.K - k0;
    const auto m0 = static_cast<__mmask16>(cols >= 16 ? 0xffff : (1u << cols) - 1);
    const auto m1 = static_cast<__mmask16>(cols >= 32 ? 0xffff : cols > 16 ? (1u << (cols - 16)) - 1 : 0);
    if constexpr (Ty == DirectType::f32) {
      const float* x = reinterpret_cast<const float*>(row) + k0;
      lo = _mm512_maskz_loadu_ps(m0, x);
      hi = _mm512_maskz_loadu_ps(m1, x + 16);
    } else {
      const auto* x = reinterpret_cast<const uint16_t*>(row) + k0;
      const __m256i a = _mm256_maskz_loadu_epi16(m0, x), c = _mm256_maskz_loadu_epi16(m1, x + 16);
      if constexpr (Ty == DirectType::f16) {
        lo = _mm512_cvtph_ps(a);
        hi = _mm512_cvtph_ps(c);
      } else {
        lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
        hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(c), 16));
      }
    }
  }
}

// Pair row of two W rows' 16 values: lane r = (bf16 e[r], bf16 o[r]).
// vcvtne2ps2bf16 rounds as round_to_bf16 (nearest even, subnormals to zero).
inline __m512i pair_row(__m512 e, __m512 o) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(o, e)));
}

// Bytes from a row's start to column k0 (a block boundary for block types).
template <DirectType Ty>
constexpr size_t col_offset(int64_t k0) {
  switch (Ty) {
    case DirectType::q4_0: return static_cast<size_t>(k0 / 32) * 18;
    case DirectType::q4_1: return static_cast<size_t>(k0 / 32) * 20;
    case DirectType::q5_0: return static_cast<size_t>(k0 / 32) * 22;
    case DirectType::q5_1: return static_cast<size_t>(k0 / 32) * 24;
    case DirectType::q8_0: return static_cast<size_t>(k0 / 32) * 34;
    case DirectType::f32: return static_cast<size_t>(k0) * 4;
    default: return static_cast<size_t>(k0) * 2;
  }
}

// Rows ahead that a dequantization prefetches: a panel pair walks down the rows
// of W, one or two cache lines per row, a stride the hardware prefetchers do
// not follow well when W comes from memory (the loss projection's 30 MB).
constexpr int64_t kPrefetchRows = 64;

template <DirectType Ty>
void dequant_tiles(const Bf16DirectWork& w, int64_t n0, int64_t k0, uint8_t* dst0, uint8_t* dst1) {
  const __m512 z = _mm512_setzero_ps();
  const size_t off = col_offset<Ty>(k0);
  for (int j = 0; j < 16; ++j) {
    const int64_t n = n0 + 2 * j;
    for (int e = 0; e < 2; ++e)
      if (n + e + kPrefetchRows < w.N) {
        const char* pf = reinterpret_cast<const char*>(w.w + static_cast<size_t>(n + e + kPrefetchRows) * w.w_row_bytes + off);
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 63, _MM_HINT_T0);
      }
    __m512 el = z, eh = z, ol = z, oh = z;
    if (n < w.N) row32<Ty>(w, n, k0, el, eh);
    if (n + 1 < w.N) row32<Ty>(w, n + 1, k0, ol, oh);
    _mm512_storeu_si512(dst0 + j * 64, pair_row(el, ol));
    if (dst1 != nullptr) _mm512_storeu_si512(dst1 + j * 64, pair_row(eh, oh));
  }
}

using DequantFn = void (*)(const Bf16DirectWork&, int64_t, int64_t, uint8_t*, uint8_t*);
DequantFn dequant_fn(DirectType t) {
  switch (t) {
    case DirectType::q4_0: return dequant_tiles<DirectType::q4_0>;
    case DirectType::q4_1: return dequant_tiles<DirectType::q4_1>;
    case DirectType::q5_0: return dequant_tiles<DirectType::q5_0>;
    case DirectType::q5_1: return dequant_tiles<DirectType::q5_1>;
    case DirectType::q8_0: return dequant_tiles<DirectType::q8_0>;
    case DirectType::f16: return dequant_tiles<DirectType::f16>;
    case DirectType::bf16: return dequant_tiles<DirectType::bf16>;
    case DirectType::f32: break;
  }
  return dequant_tiles<DirectType::f32>;
}

void configure_tiles() { amx_configure_16x64(); }

void write_dx(const Bf16DirectWork& w, const float* buf, int64_t tt, int64_t p) {
  amx_write_dx_tile(w.dx, w.ldx, w.T, w.K, w.accumulate, buf, tt, p);
}

struct Pos {
  int64_t g0, s0, s1;
  bool first, last;
};

inline float* c_tile(const Bf16DirectWork& w, const Pos& q, int64_t tt, int64_t p) {
  return w.cbuf + ((tt - q.g0) * (w.p1 - w.p0) + (p - w.p0)) * 256;
}

#define LOOM_DIRECT_START(C, tt, p)            \
  do {                                         \
    if (q.first)                               \
      _tile_zero(C);                           \
    else                                       \
      _tile_loadd(C, c_tile(w, q, tt, p), 64); \
  } while (0)
#define LOOM_DIRECT_FINISH(C, tt, p)                                             \
  do {                                                                           \
    if (!q.last) {                                                               \
      _tile_stored(C, c_tile(w, q, tt, p), 64);                                  \
    } else if (!w.accumulate && 16 * (tt) + 16 <= w.T && 16 * (p) + 16 <= w.K) { \
      _tile_stored(C, w.dx + 16 * (tt)*w.ldx + 16 * (p), w.ldx * sizeof(float)); \
    } else {                                                                     \
      _tile_stored(C, buf, 64);                                                  \
      amx_compiler_barrier();                                                    \
      write_dx(w, buf, tt, p);                                                   \
    }                                                                            \
  } while (0)

// TT t-tiles x PP panels from (tt, p) over the chunk's steps; B tiles of panel p
// (and p + 1) at bbuf (+ chunk KB), one per step.
template <int TT, int PP>
void micro(const Bf16DirectWork& w, const Pos& q, int64_t tt, int64_t p) {
  alignas(64) float buf[256];
  LOOM_DIRECT_START(0, tt, p);
  if constexpr (PP == 2) LOOM_DIRECT_START(1, tt, p + 1);
  if constexpr (TT == 2) LOOM_DIRECT_START(2, tt + 1, p);
  if constexpr (TT == 2 && PP == 2) LOOM_DIRECT_START(3, tt + 1, p + 1);
  const uint8_t* a0 = w.a + static_cast<size_t>(tt * w.n_steps + q.s0) * kTile;
  [[maybe_unused]] const uint8_t* a1 = a0 + static_cast<size_t>(w.n_steps) * kTile;
  const uint8_t* b0 = w.bbuf;
  [[maybe_unused]] const uint8_t* b1 = w.bbuf + static_cast<size_t>(w.chunk) * kTile;
  amx_bf16_dot_steps<TT, PP>(a0, a1, b0, b1, q.s1 - q.s0);
  LOOM_DIRECT_FINISH(0, tt, p);
  if constexpr (PP == 2) LOOM_DIRECT_FINISH(1, tt, p + 1);
  if constexpr (TT == 2) LOOM_DIRECT_FINISH(2, tt + 1, p);
  if constexpr (TT == 2 && PP == 2) LOOM_DIRECT_FINISH(3, tt + 1, p + 1);
}

}  // namespace

void bf16_direct_dequant_tiles(const Bf16DirectWork& w, int64_t n0, int64_t k0, uint8_t* dst0, uint8_t* dst1) {
  dequant_fn(w.type)(w, n0, k0, dst0, dst1);
}

// Loop nest: t-groups, then chunks of the n reduction, then panel pairs: each
// pair's chunk of B is dequantized once per group and used by every t-tile of
// the group, whose dy chunk stays in L2 across the pairs. Every dx element is one
// chain of TDPBF16PS over the steps in order (partial sums stored exactly between
// chunks), so neither the split over threads nor the grouping changes a bit.
void bf16_direct_work_amx(const Bf16DirectWork& w) {
  const DequantFn dq = dequant_fn(w.type);
  const int64_t ntt = (w.T + 15) / 16;
  configure_tiles();
  amx_compiler_barrier();  // dy tiles were written with plain stores
  for (int64_t g0 = 0; g0 < ntt; g0 += w.tgroup) {
    const int64_t g1 = g0 + w.tgroup < ntt ? g0 + w.tgroup : ntt;
    for (int64_t s0 = 0; s0 < w.n_steps; s0 += w.chunk) {
      const int64_t s1 = s0 + w.chunk < w.n_steps ? s0 + w.chunk : w.n_steps;
      const Pos q{g0, s0, s1, s0 == 0, s1 == w.n_steps};
      for (int64_t p = w.p0; p < w.p1; p += 2) {
        const bool pp2 = p + 1 < w.p1;
        for (int64_t s = s0; s < s1; ++s)
          dq(w, 32 * s, 16 * p, w.bbuf + static_cast<size_t>(s - s0) * kTile,
             pp2 ? w.bbuf + static_cast<size_t>(w.chunk + s - s0) * kTile : nullptr);
        amx_compiler_barrier();
        for (int64_t tt = g0; tt < g1; tt += 2) {
          const bool tt2 = tt + 1 < g1;
          if (tt2 && pp2)
            micro<2, 2>(w, q, tt, p);
          else if (tt2)
            micro<2, 1>(w, q, tt, p);
          else if (pp2)
            micro<1, 2>(w, q, tt, p);
          else
            micro<1, 1>(w, q, tt, p);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace loom::cpu

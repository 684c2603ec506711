// AMX-INT8 kernels for prompt batches of 32-element block types (q4_0, q4_1,
// q5_0, q5_1, q8_0): one tile multiply gives the exact integer block dots of 16
// tokens x 16 rows; the f32 scaling then runs per lane in the same order as the
// AVX2/AVX-512 kernels, so results are bit-identical to them.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/panel.h"

#pragma GCC target("amx-tile,amx-int8")

#include "kernels/cpu/amx_tiles.h"

namespace loom::cpu {
namespace {

using TileConfig = AmxTileConfig;
inline void compiler_barrier() { amx_compiler_barrier(); }

// Two sets (tmm0-2, tmm3-5) so the tile multiply of block b+1 overlaps the f32
// work on block b: C (16 tokens x 16 rows int32), A (16 tokens x 32 s8 acts),
// B (8 x [16 rows x 4 bytes]) = one 32-element block of a panel.
void configure_tiles() {
  TileConfig cfg;
  for (int s = 0; s < 2; ++s) {
    cfg.colsb[3 * s + 0] = 64;
    cfg.rows[3 * s + 0] = 16;
    cfg.colsb[3 * s + 1] = 32;
    cfg.rows[3 * s + 1] = 16;
    cfg.colsb[3 * s + 2] = 64;
    cfg.rows[3 * s + 2] = 8;
  }
  compiler_barrier();
  _tile_loadconfig(&cfg);
}

inline __m512 load_f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct Layout {
  size_t pb;     // panel block bytes
  size_t d, m;   // offsets of scales, mins (m unused without mins)
  size_t qs;     // nibbles or q8 words
  int64_t bit4;  // offset of the 5th-bit word, -1 if none
  bool min, s8;  // has mins (q8_1 acts); s8 weights (q8_0)
};

Layout layout_of(DType type) {
  switch (type) {
    case DType::q4_0:
      return {288, 0, 0, 32, -1, false, false};
    case DType::q4_1:
      return {320, 0, 32, 64, -1, true, false};
    case DType::q5_0:
      return {352, 0, 0, 96, 32, false, false};
    case DType::q5_1:
      return {384, 0, 32, 128, 64, true, false};
    default:
      return {544, 0, 0, 32, -1, false, true};  // q8_0
  }
}

// Unpacks one block's nibbles (+ 5th bits) into 8 x 64 bytes of u8 values.
inline void unpack_block(const uint8_t* pb, const Layout& L, uint8_t* out) {
  const __m512i m = _mm512_set1_epi8(0x0f);
  __m512i h = _mm512_setzero_si512();
  if (L.bit4 >= 0) h = _mm512_loadu_si512(pb + L.bit4);
  const __m512i m10 = _mm512_set1_epi8(0x10);
  for (int o = 0; o < 4; ++o) {
    const __m512i w = _mm512_loadu_si512(pb + L.qs + 64 * o);
    __m512i lo = _mm512_and_si512(w, m), hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), m);
    if (L.bit4 >= 0) {
      // bit o (low operands) and bit 4+o (high operands) of each byte go to bit 4
      lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(h, 4 - o), m10));
      hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi32(h, o), m10));
    }
    _mm512_storeu_si512(out + 64 * o, lo);
    _mm512_storeu_si512(out + 64 * (o + 4), hi);
  }
}

// Stores C tile `t` into a 16x16 int32 buffer. Unlike _tile_stored (which clobbers
// all memory and so forces the accumulators out of registers) this names
// exactly the memory it writes.
#define LOOM_AMX_STORE_C(t, buf)                                   \
  __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)"             \
                   : "=m"(*reinterpret_cast<int32_t(*)[256]>(buf)) \
                   : "r"(buf), "r"(64L))

// Issues the tile multiply of one block into tile set 0 (tmm0-2) or 1 (tmm3-5);
// the asm needs literal tile numbers, hence the macro.
#define LOOM_AMX_ISSUE(C, A, B, act, astride, bsrc, s8) \
  do {                                                  \
    _tile_loadd(A, act, astride);                       \
    _tile_loadd(B, bsrc, 64);                           \
    _tile_zero(C);                                      \
    if (s8)                                             \
      _tile_dpbssd(C, A, B);                            \
    else                                                \
      _tile_dpbsud(C, A, B);                            \
  } while (0)

template <bool kMin, bool kAux>
inline void scale_block(const int32_t* cbuf, const uint8_t* act, size_t astride, int64_t b, const uint8_t* pb,
                        const Layout& L, __m512 (&acc)[16]) {
  const __m512 dw = load_f16x16(pb + L.d);
  __m512 mw = _mm512_setzero_ps();
  if constexpr (kMin) mw = load_f16x16(pb + L.m);
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const auto* x = reinterpret_cast<const ActQ8x32*>(act + t * astride) + b;
    __m512i i = _mm512_load_si512(cbuf + 16 * t);
    if constexpr (kAux) i = _mm512_add_epi32(i, _mm512_set1_epi32(x->aux));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_set1_ps(x->d)), acc[t]);
    if constexpr (kMin) {
      float s;
      std::memcpy(&s, &x->aux, 4);
      acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(s), acc[t]);
    }
  }
}

template <bool kMin, bool kAux, bool kS8>
void run_panels(const KernelArgs& a, const Layout& L) {
  alignas(64) int32_t cbuf[16 * 16];
  const int64_t nb = a.K / 32;
  auto* bbuf = static_cast<uint8_t*>(a.tmp);
  for (int64_t p = 0; p < a.n_panels; ++p) {
    const uint8_t* pan = a.panels + p * a.panel_stride;
    if constexpr (!kS8) {
      for (int64_t b = 0; b < nb; ++b) unpack_block(pan + b * L.pb, L, bbuf + b * 512);
      compiler_barrier();
    }
    auto bsrc = [&](int64_t b) { return kS8 ? pan + b * L.pb + L.qs : bbuf + b * 512; };
    const int64_t nv = a.n_valid - p * 16;
    for (int64_t t0 = 0; t0 < a.T; t0 += 16) {
      const int64_t tn = a.T - t0 < 16 ? a.T - t0 : 16;
      const uint8_t* act = a.act + t0 * a.act_stride;
      auto actb = [&](int64_t b) { return act + b * sizeof(ActQ8x32); };
      __m512 acc[16];
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
      LOOM_AMX_ISSUE(0, 1, 2, actb(0), a.act_stride, bsrc(0), kS8);
      for (int64_t b = 0; b < nb; b += 2) {
        // Block b is in flight in set 0; start b+1 in set 1, then finish b.
        if (b + 1 < nb) LOOM_AMX_ISSUE(3, 4, 5, actb(b + 1), a.act_stride, bsrc(b + 1), kS8);
        LOOM_AMX_STORE_C(0, cbuf);
        scale_block<kMin, kAux>(cbuf, act, a.act_stride, b, pan + b * L.pb, L, acc);
        if (b + 1 >= nb) break;
        if (b + 2 < nb) LOOM_AMX_ISSUE(0, 1, 2, actb(b + 2), a.act_stride, bsrc(b + 2), kS8);
        LOOM_AMX_STORE_C(3, cbuf);
        scale_block<kMin, kAux>(cbuf, act, a.act_stride, b + 1, pan + (b + 1) * L.pb, L, acc);
      }
      const __mmask16 mask =
          nv >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << nv) - 1);
      // Constant indices keep acc[] in registers (a runtime bound would not).
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t)
        if (t < tn) _mm512_mask_storeu_ps(a.y + (t0 + t) * a.ldy + p * 16, mask, acc[t]);
    }
  }
}

}  // namespace

void panel_kernel_amx(DType type, const KernelArgs& a) {
  configure_tiles();
  const Layout L = layout_of(type);
  switch (type) {
    case DType::q4_0:
    case DType::q5_0:
      run_panels<false, true, false>(a, L);
      break;
    case DType::q4_1:
    case DType::q5_1:
      run_panels<true, false, false>(a, L);
      break;
    case DType::q8_0:
      run_panels<false, false, true>(a, L);
      break;
    default:
      __builtin_trap();
  }
  _tile_release();
}

}  // namespace loom::cpu

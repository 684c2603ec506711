// AVX-512 VNNI i8_ch panel kernel (layouts and arithmetic: kernels/cpu/i8ch.h):
// vpdpbusd of the activations' u8 codes (qx + 128, a broadcast 4-byte word per
// token) with the panel's s8 weight words; the accumulator starts at
// -128 * sum(q) - zero * xsum, so it ends at the exact int32 acc; then
// y = float(acc) * (scale * s). No float work inside the K loop. (No AMX-INT8
// version: the machine this was written on has no AMX to test one.)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/panel.h"

namespace loom::cpu {
namespace {

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void store_rows(float* y, __m512 v, int64_t nv) {
  if (nv >= 16)
    _mm512_storeu_ps(y, v);
  else if (nv > 0)
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << nv) - 1), v);
}

// Register tiles of P panels x C tokens: P * C accumulators, P weight vectors
// and a broadcast; batches run 4 x 6 tiles (24 accumulators) through the
// assembly loop dot_4x6 (2 x 6 through dot_2x6), the other edges (fewer panels
// or tokens) the same loop in intrinsics. Decode (T = 1) runs 4 panels with two
// accumulator chains per output (even / odd words) to hide vpdpbusd's latency.
//
// Cache blocking: for a batch, the words of a panel group are taken in chunks
// of at most kChunkWords (4 panels x 256 words x 64 bytes = 64 KiB, in L2) and
// every token tile runs over one chunk before the next chunk starts; between
// chunks the int32 partial sums wait in the outputs' own y slots (masked to the
// valid rows). Integer sums are exact, so neither the chunks, the chains nor
// the tile shapes change any result: the float operations happen once, after
// the last chunk.
constexpr int kP1 = 4, kPB = 4, kCB = 6;
constexpr int64_t kChunkWords = 256;

struct Tile {
  const uint8_t* pan;  // first panel
  size_t ps;           // panel stride
  const uint8_t* act;  // first token's act row
  size_t as;           // act row stride
  float* y;            // y of (first token, first row of first panel)
  int64_t ldy;
  int64_t nv;          // valid rows counted from the first panel
  int64_t o0, o1;      // words of this chunk
  bool first, last;    // first / last chunk
};

inline __mmask16 row_mask(int64_t nv) { return nv >= 16 ? 0xffff : nv > 0 ? static_cast<__mmask16>((1u << nv) - 1) : 0; }

// acc[p][c] before the K loop: the first chunk starts at corr - zero * xsum,
// later ones at the sums stored in y.
template <int P, int C>
inline void start_acc(const Tile& ta, __m512i (&acc)[P][C]) {
  for (int p = 0; p < P; ++p) {
    const __m512i corr = _mm512_loadu_si512(ta.pan + p * ta.ps + 128);
    const __m512i zero = _mm512_loadu_si512(ta.pan + p * ta.ps + 64);
    const __mmask16 m = row_mask(ta.nv - p * 16);
    for (int c = 0; c < C; ++c)
      acc[p][c] = ta.first ? _mm512_sub_epi32(corr, _mm512_mullo_epi32(zero, _mm512_set1_epi32(load_i32(ta.act + c * ta.as + 4))))
                           : _mm512_maskz_loadu_epi32(m, ta.y + c * ta.ldy + p * 16);
  }
}

// After the K loop: the partial sums back to y, or after the last chunk
// y = float(acc) * (scale * s).
template <int P, int C>
inline void finish_acc(const Tile& ta, const __m512i (&acc)[P][C]) {
  if (!ta.last) {
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < C; ++c)
        _mm512_mask_storeu_epi32(ta.y + c * ta.ldy + p * 16, row_mask(ta.nv - p * 16), acc[p][c]);
    return;
  }
  for (int p = 0; p < P; ++p) {
    const __m512 scale = _mm512_loadu_ps(ta.pan + p * ta.ps);
    for (int c = 0; c < C; ++c) {
      const __m512 f = _mm512_mul_ps(scale, _mm512_set1_ps(load_f32(ta.act + c * ta.as)));
      store_rows(ta.y + c * ta.ldy + p * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[p][c]), f), ta.nv - p * 16);
    }
  }
}

template <int P, int C>
void run_tile(const Tile& ta) {
  constexpr bool kTwo = P * C < 8;
  constexpr int P2 = kTwo ? P : 1, C2 = kTwo ? C : 1;  // the second chain only where used
  const size_t ps = ta.ps, as = ta.as;
  __m512i acc[P][C], acc2[P2][C2];
  start_acc<P, C>(ta, acc);
  if constexpr (kTwo)
    for (int p = 0; p < P2; ++p)
      for (int c = 0; c < C2; ++c) acc2[p][c] = _mm512_setzero_si512();
  const uint8_t* wq = ta.pan + kI8ChPanelHeader;
  const uint8_t* xq = ta.act + kI8ChActHeader;
  int64_t o = ta.o0;
  if constexpr (kTwo) {
    for (; o + 2 <= ta.o1; o += 2) {
      __m512i w[P], v[P];
      for (int p = 0; p < P; ++p) {
        w[p] = _mm512_loadu_si512(wq + p * ps + 64 * o);
        v[p] = _mm512_loadu_si512(wq + p * ps + 64 * o + 64);
      }
      for (int c = 0; c < C; ++c) {
        const __m512i xb = _mm512_set1_epi32(load_i32(xq + c * as + 4 * o));
        const __m512i xb2 = _mm512_set1_epi32(load_i32(xq + c * as + 4 * o + 4));
        for (int p = 0; p < P; ++p) {
          acc[p][c] = _mm512_dpbusd_epi32(acc[p][c], xb, w[p]);
          acc2[p % P2][c % C2] = _mm512_dpbusd_epi32(acc2[p % P2][c % C2], xb2, v[p]);
        }
      }
    }
  }
  for (; o < ta.o1; ++o) {
    __m512i w[P];
    for (int p = 0; p < P; ++p) w[p] = _mm512_loadu_si512(wq + p * ps + 64 * o);
    for (int c = 0; c < C; ++c) {
      const __m512i xb = _mm512_set1_epi32(load_i32(xq + c * as + 4 * o));
      for (int p = 0; p < P; ++p) acc[p][c] = _mm512_dpbusd_epi32(acc[p][c], xb, w[p]);
    }
  }
  if constexpr (kTwo)
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < C; ++c) acc[p][c] = _mm512_add_epi32(acc[p][c], acc2[p % P2][c % C2]);
  finish_acc<P, C>(ta, acc);
}

// The full 4 x 6 tile's K loop in assembly: 24 accumulators in zmm0..23 for the
// whole chunk, the 4 weight words in zmm24..27, broadcasts in zmm28/29. (GCC 12
// compiles the same loop from intrinsics with a register copy per vpdpbusd.)
// AT&T order: vpdpbusd s8 (weights), u8 (activations), accumulator.
void dot_4x6(__m512i* acc, const uint8_t* w, size_t ps, const uint8_t* x, size_t as, int64_t n) {
  const uint8_t* w3 = w + 3 * ps;
  const uint8_t* x3 = x + 3 * as;
#define LOOM_ACC(i) "vmovdqa64 " #i "*64(%[acc]), %%zmm" #i "\n\t"
#define LOOM_PUT(i) "vmovdqa64 %%zmm" #i ", " #i "*64(%[acc])\n\t"
#define LOOM_TOKEN(xaddr, a0, a1, a2, a3)                   \
  "vpbroadcastd " xaddr ", %%zmm28\n\t"                     \
  "vpdpbusd %%zmm24, %%zmm28, %%zmm" #a0 "\n\t"             \
  "vpdpbusd %%zmm25, %%zmm28, %%zmm" #a1 "\n\t"             \
  "vpdpbusd %%zmm26, %%zmm28, %%zmm" #a2 "\n\t"             \
  "vpdpbusd %%zmm27, %%zmm28, %%zmm" #a3 "\n\t"
  asm volatile(
      LOOM_ACC(0) LOOM_ACC(1) LOOM_ACC(2) LOOM_ACC(3) LOOM_ACC(4) LOOM_ACC(5) LOOM_ACC(6) LOOM_ACC(7)
      LOOM_ACC(8) LOOM_ACC(9) LOOM_ACC(10) LOOM_ACC(11) LOOM_ACC(12) LOOM_ACC(13) LOOM_ACC(14) LOOM_ACC(15)
      LOOM_ACC(16) LOOM_ACC(17) LOOM_ACC(18) LOOM_ACC(19) LOOM_ACC(20) LOOM_ACC(21) LOOM_ACC(22) LOOM_ACC(23)
      "1:\n\t"
      "vmovdqu64 (%[w]), %%zmm24\n\t"
      "vmovdqu64 (%[w],%[ps]), %%zmm25\n\t"
      "vmovdqu64 (%[w],%[ps],2), %%zmm26\n\t"
      "vmovdqu64 (%[w3]), %%zmm27\n\t"
      // acc index = p * 6 + c
      LOOM_TOKEN("(%[x])", 0, 6, 12, 18)
      LOOM_TOKEN("(%[x],%[as])", 1, 7, 13, 19)
      LOOM_TOKEN("(%[x],%[as],2)", 2, 8, 14, 20)
      LOOM_TOKEN("(%[x3])", 3, 9, 15, 21)
      LOOM_TOKEN("(%[x3],%[as])", 4, 10, 16, 22)
      LOOM_TOKEN("(%[x3],%[as],2)", 5, 11, 17, 23)
      "add $64, %[w]\n\t"
      "add $64, %[w3]\n\t"
      "add $4, %[x]\n\t"
      "add $4, %[x3]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      LOOM_PUT(0) LOOM_PUT(1) LOOM_PUT(2) LOOM_PUT(3) LOOM_PUT(4) LOOM_PUT(5) LOOM_PUT(6) LOOM_PUT(7)
      LOOM_PUT(8) LOOM_PUT(9) LOOM_PUT(10) LOOM_PUT(11) LOOM_PUT(12) LOOM_PUT(13) LOOM_PUT(14) LOOM_PUT(15)
      LOOM_PUT(16) LOOM_PUT(17) LOOM_PUT(18) LOOM_PUT(19) LOOM_PUT(20) LOOM_PUT(21) LOOM_PUT(22) LOOM_PUT(23)
      : [w] "+r"(w), [w3] "+r"(w3), [x] "+r"(x), [x3] "+r"(x3), [n] "+r"(n)
      : [acc] "r"(acc), [ps] "r"(ps), [as] "r"(as)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",
        "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28");
#undef LOOM_ACC
#undef LOOM_PUT
#undef LOOM_TOKEN
}

// The 2 x 6 tile (a thread's last 2 panels, e.g. SmolLM2's 576 rows on 2
// threads: 18 panels each): 12 accumulators in zmm0..11, weights in zmm24/25.
void dot_2x6(__m512i* acc, const uint8_t* w, size_t ps, const uint8_t* x, size_t as, int64_t n) {
  const uint8_t* x3 = x + 3 * as;
#define LOOM_ACC(i) "vmovdqa64 " #i "*64(%[acc]), %%zmm" #i "\n\t"
#define LOOM_PUT(i) "vmovdqa64 %%zmm" #i ", " #i "*64(%[acc])\n\t"
#define LOOM_TOKEN(xaddr, a0, a1)               \
  "vpbroadcastd " xaddr ", %%zmm28\n\t"         \
  "vpdpbusd %%zmm24, %%zmm28, %%zmm" #a0 "\n\t" \
  "vpdpbusd %%zmm25, %%zmm28, %%zmm" #a1 "\n\t"
  asm volatile(
      LOOM_ACC(0) LOOM_ACC(1) LOOM_ACC(2) LOOM_ACC(3) LOOM_ACC(4) LOOM_ACC(5) LOOM_ACC(6) LOOM_ACC(7)
      LOOM_ACC(8) LOOM_ACC(9) LOOM_ACC(10) LOOM_ACC(11)
      "1:\n\t"
      "vmovdqu64 (%[w]), %%zmm24\n\t"
      "vmovdqu64 (%[w],%[ps]), %%zmm25\n\t"
      // acc index = p * 6 + c
      LOOM_TOKEN("(%[x])", 0, 6)
      LOOM_TOKEN("(%[x],%[as])", 1, 7)
      LOOM_TOKEN("(%[x],%[as],2)", 2, 8)
      LOOM_TOKEN("(%[x3])", 3, 9)
      LOOM_TOKEN("(%[x3],%[as])", 4, 10)
      LOOM_TOKEN("(%[x3],%[as],2)", 5, 11)
      "add $64, %[w]\n\t"
      "add $4, %[x]\n\t"
      "add $4, %[x3]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      LOOM_PUT(0) LOOM_PUT(1) LOOM_PUT(2) LOOM_PUT(3) LOOM_PUT(4) LOOM_PUT(5) LOOM_PUT(6) LOOM_PUT(7)
      LOOM_PUT(8) LOOM_PUT(9) LOOM_PUT(10) LOOM_PUT(11)
      : [w] "+r"(w), [x] "+r"(x), [x3] "+r"(x3), [n] "+r"(n)
      : [acc] "r"(acc), [ps] "r"(ps), [as] "r"(as)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm24", "xmm25", "xmm28");
#undef LOOM_ACC
#undef LOOM_PUT
#undef LOOM_TOKEN
}

// A P x 6 tile through its assembly loop: the accumulators go through memory
// once per tile (start and finish stay in intrinsics).
template <int P>
void run_tile_asm(const Tile& ta, void (*dot)(__m512i*, const uint8_t*, size_t, const uint8_t*, size_t, int64_t)) {
  __m512i acc[P][6];
  start_acc<P, 6>(ta, acc);
  if (ta.o1 > ta.o0) {
    alignas(64) __m512i mem[P * 6];
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < 6; ++c) mem[p * 6 + c] = acc[p][c];
    dot(mem, ta.pan + kI8ChPanelHeader + 64 * ta.o0, ta.ps, ta.act + kI8ChActHeader + 4 * ta.o0, ta.as,
        ta.o1 - ta.o0);
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < 6; ++c) acc[p][c] = mem[p * 6 + c];
  }
  finish_acc<P, 6>(ta, acc);
}

template <>
void run_tile<4, 6>(const Tile& ta) {
  run_tile_asm<4>(ta, dot_4x6);
}
template <>
void run_tile<2, 6>(const Tile& ta) {
  run_tile_asm<2>(ta, dot_2x6);
}

template <int P, int C>
void dispatch(int pn, int cn, const Tile& ta) {
  if constexpr (P >= 1 && C >= 1) {
    if (pn < P) return dispatch<P - 1, C>(pn, cn, ta);
    if (cn < C) return dispatch<P, C - 1>(pn, cn, ta);
    run_tile<P, C>(ta);
  }
}

}  // namespace

void i8ch_panel_kernel_avx512(const KernelArgs& a) {
  const int64_t nw = i8ch_words(a.K);
  const bool decode = a.T == 1;
  const int PT = decode ? kP1 : kPB, CT = decode ? 1 : kCB;
  // Chunks only pay when several token tiles reuse them.
  const int64_t n_chunks = a.T > CT ? (nw + kChunkWords - 1) / kChunkWords : 1;
  for (int64_t p = 0; p < a.n_panels; p += PT) {
    const int pn = static_cast<int>(std::min<int64_t>(PT, a.n_panels - p));
    for (int64_t ch = 0; ch < n_chunks; ++ch) {
      for (int64_t t = 0; t < a.T; t += CT) {
        const int cn = static_cast<int>(std::min<int64_t>(CT, a.T - t));
        const Tile ta{a.panels + p * a.panel_stride,
                      a.panel_stride,
                      a.act + t * a.act_stride,
                      a.act_stride,
                      a.y + t * a.ldy + p * kPanelRows,
                      a.ldy,
                      a.n_valid - p * kPanelRows,
                      nw * ch / n_chunks,
                      nw * (ch + 1) / n_chunks,
                      ch == 0,
                      ch == n_chunks - 1};
        if (decode)
          dispatch<kP1, 1>(pn, cn, ta);
        else
          dispatch<kPB, kCB>(pn, cn, ta);
      }
    }
  }
}

}  // namespace loom::cpu

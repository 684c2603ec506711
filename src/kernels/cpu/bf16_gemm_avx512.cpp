// AVX512-BF16 kernel of the bf16 input-gradient product (bf16_gemm.h): register
// tiles of up to 3 panels x 8 rows, vdpbf16ps on one pair row (16 lanes x 2 n)
// per instruction, f32 accumulation per lane over n in order.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/bf16_gemm.h"

namespace loom::cpu {
namespace {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// Rows 8h .. 8h + 7 of t-tile tt, panels p .. p + P - 1.
template <int P>
void micro(const Bf16Work& w, int64_t tt, int h, int64_t p, int64_t s0, int64_t s1, bool first, bool last) {
  __m512 acc[P][8];
  for (int i = 0; i < P; ++i) {
    const float* ct = first ? nullptr : c_tile(w, tt, p + i) + 8 * h * 16;
    for (int c = 0; c < 8; ++c) acc[i][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(ct + c * 16);
  }
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* bs = b_tile(w, p, s);
    const uint8_t* as = a_tile(w, tt, s) + 8 * h * 64;
    for (int j = 0; j < 16; ++j) {
      __m512i b[P];
      for (int i = 0; i < P; ++i) b[i] = _mm512_loadu_si512(bs + i * w.pstride + j * 64);
      for (int c = 0; c < 8; ++c) {
        int32_t pair;
        std::memcpy(&pair, as + c * 64 + j * 4, 4);
        const __m512bh a = as_bh(_mm512_set1_epi32(pair));
        for (int i = 0; i < P; ++i) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, as_bh(b[i]));
      }
    }
  }
  if (!last) {
    for (int i = 0; i < P; ++i) {
      float* ct = c_tile(w, tt, p + i) + 8 * h * 16;
      for (int c = 0; c < 8; ++c) _mm512_storeu_ps(ct + c * 16, acc[i][c]);
    }
    return;
  }
  for (int i = 0; i < P; ++i) {
    const int64_t k0 = 16 * (p + i), cols = w.K - k0 < 16 ? w.K - k0 : 16;
    const auto mask = static_cast<__mmask16>((1u << cols) - 1);
    for (int c = 0; c < 8; ++c) {
      const int64_t t = 16 * tt + 8 * h + c;
      if (t >= w.T) break;
      float* o = w.dx + t * w.ldx + k0;
      __m512 v = acc[i][c];
      if (w.accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), v);
      _mm512_mask_storeu_ps(o, mask, v);
    }
  }
}

struct Avx512Impl {
  static void block(const Bf16Work& w, int64_t tt0, int64_t tt1, int64_t p0, int64_t p1, int64_t s0,
                    int64_t s1, bool first, bool last) {
    for (int64_t p = p0; p < p1; p += 3) {
      const int64_t pn = p1 - p < 3 ? p1 - p : 3;
      for (int64_t tt = tt0; tt < tt1; ++tt)
        for (int h = 0; h < 2 && 16 * tt + 8 * h < w.T; ++h) {
          if (pn == 3)
            micro<3>(w, tt, h, p, s0, s1, first, last);
          else if (pn == 2)
            micro<2>(w, tt, h, p, s0, s1, first, last);
          else
            micro<1>(w, tt, h, p, s0, s1, first, last);
        }
    }
  }
};

}  // namespace

void pack_dy_tiles_avx512(const float* dy, int64_t ldy, int64_t N, int64_t T, int64_t tt0, int64_t tt1,
                          int64_t n_steps, uint8_t* dst) {
  for (int64_t tt = tt0; tt < tt1; ++tt)
    for (int64_t s = 0; s < n_steps; ++s) {
      uint8_t* tile = dst + static_cast<size_t>((tt - tt0) * n_steps + s) * kBf16TileBytes;
      const int64_t n0 = s * kBf16Step, len = N - n0 < kBf16Step ? N - n0 : kBf16Step;
      // Masked loads read zeros past N (and nothing at all past T).
      const auto m0 = static_cast<__mmask16>(len >= 16 ? 0xffff : (1u << len) - 1);
      const auto m1 = static_cast<__mmask16>(len >= 32 ? 0xffff : len > 16 ? (1u << (len - 16)) - 1 : 0);
      for (int r = 0; r < 16; ++r) {
        const int64_t t = 16 * tt + r;
        __m512i v = _mm512_setzero_si512();
        if (t < T) {
          const float* x = dy + t * ldy + n0;
          // vcvtne2ps2bf16: round to nearest even, subnormals to zero (round_to_bf16).
          v = reinterpret_cast<__m512i>(
              _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, x + 16), _mm512_maskz_loadu_ps(m0, x)));
        }
        _mm512_storeu_si512(tile + r * 64, v);
      }
    }
}

void bf16_work_avx512(const Bf16Work& w) { drive_bf16<Avx512Impl>(w); }

}  // namespace loom::cpu

// AVX-512 NF4 panel kernel (layout and arithmetic: kernels/cpu/nf4.h): the
// 4-bit codes index a 16-float table with vpermps, f32 FMA with f32 activations.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/cpu/nf4.h"
#include "kernels/cpu/panel.h"
#include "kernels/cpu/panel_kernels.h"
#include "kernels/ref/nf4_ref.h"

namespace loom::cpu {
namespace {

// Decode prefetch distance of this kernel family (panel_kernels.h).
constexpr size_t kAhead = kPrefetchBytesAvx512;

inline void store_rows(float* y, __m512 v, int64_t nv) {
  if (nv >= 16)
    _mm512_storeu_ps(y, v);
  else if (nv > 0)
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << nv) - 1), v);
}

struct Nf4Impl {
  static constexpr int kP1 = 4, kPB = 2, kCB = 8;
  template <int P, int C>
  static void run(const TileArgs& ta) {
    const __m512 tab = _mm512_loadu_ps(kNf4Code);
    __m512 acc[P][C];
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < C; ++c) acc[p][c] = _mm512_setzero_ps();
    const float* x[C];
    for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const float*>(ta.act + c * ta.astride);
    const int64_t nb = ta.K / kNf4Block;
    for (int64_t b = 0; b < nb; ++b) {
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + b * kNf4PanelBlockBytes;
        if constexpr (C == 1) prefetch_ahead<kAhead, kNf4PanelBlockBytes>(pb);
        __m512 s[C];
        for (int c = 0; c < C; ++c) s[c] = _mm512_setzero_ps();
        for (int j = 0; j < 32; ++j) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + 64 + 16 * j)));
          const __m512 w0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);
          const __m512 w1 = _mm512_permutexvar_ps(v, tab);  // vpermps reads the low 4 bits
          const int64_t k = b * kNf4Block + 2 * j;
          for (int c = 0; c < C; ++c) {
            s[c] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[c][k]), s[c]);
            s[c] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[c][k + 1]), s[c]);
          }
        }
        const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(pb));
        for (int c = 0; c < C; ++c) acc[p][c] = _mm512_fmadd_ps(s[c], d, acc[p][c]);
      }
    }
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < P; ++p) store_rows(ta.y + c * ta.ldy + p * 16, acc[p][c], ta.nv - p * 16);
  }
};

}  // namespace

void nf4_panel_kernel_avx512(const KernelArgs& a) { drive_tiles<Nf4Impl>(a); }

}  // namespace loom::cpu

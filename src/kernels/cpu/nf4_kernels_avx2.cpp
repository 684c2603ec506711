// AVX2 NF4 panel kernel (layout and arithmetic: kernels/cpu/nf4.h): a panel is
// two ymm halves of 8 rows; the 16-entry code table is two 8-entry permutes and
// a blend on bit 3. Same per-lane f32 sequence as the AVX-512 kernel.
#include <immintrin.h>

#include "kernels/cpu/nf4.h"
#include "kernels/cpu/panel.h"
#include "kernels/cpu/panel_kernels.h"
#include "kernels/ref/nf4_ref.h"

namespace loom::cpu {
namespace {

inline void store_rows(float* y, __m256 v, int64_t nv) {
  if (nv >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (nv > 0) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nv)), idx), v);
  }
}

// The table entry of the low 4 bits of each lane of idx.
inline __m256 lookup(__m256 lo, __m256 hi, __m256i idx) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

struct Nf4Impl {
  static constexpr int kP1 = 2, kPB = 1, kCB = 3;
  template <int P, int C>
  static void run(const TileArgs& ta) {
    const __m256 tlo = _mm256_loadu_ps(kNf4Code), thi = _mm256_loadu_ps(kNf4Code + 8);
    __m256 acc[P][2][C];
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < C; ++c) acc[p][h][c] = _mm256_setzero_ps();
    const float* x[C];
    for (int c = 0; c < C; ++c) x[c] = reinterpret_cast<const float*>(ta.act + c * ta.astride);
    const int64_t nb = ta.K / kNf4Block;
    for (int64_t b = 0; b < nb; ++b) {
      for (int p = 0; p < P; ++p) {
        const uint8_t* pb = ta.pan + p * ta.pstride + b * kNf4PanelBlockBytes;
        for (int h = 0; h < 2; ++h) {
          __m256 s[C];
          for (int c = 0; c < C; ++c) s[c] = _mm256_setzero_ps();
          for (int j = 0; j < 32; ++j) {
            const __m256i v =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pb + 64 + 16 * j + 8 * h)));
            const __m256 w0 = lookup(tlo, thi, _mm256_srli_epi32(v, 4));
            const __m256 w1 = lookup(tlo, thi, v);
            const int64_t k = b * kNf4Block + 2 * j;
            for (int c = 0; c < C; ++c) {
              s[c] = _mm256_fmadd_ps(w0, _mm256_set1_ps(x[c][k]), s[c]);
              s[c] = _mm256_fmadd_ps(w1, _mm256_set1_ps(x[c][k + 1]), s[c]);
            }
          }
          const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(pb) + 8 * h);
          for (int c = 0; c < C; ++c) acc[p][h][c] = _mm256_fmadd_ps(s[c], d, acc[p][h][c]);
        }
      }
    }
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < 2; ++h)
          store_rows(ta.y + c * ta.ldy + p * 16 + h * 8, acc[p][h][c], ta.nv - p * 16 - h * 8);
  }
};

}  // namespace

void nf4_panel_kernel_avx2(const KernelArgs& a) { drive_tiles<Nf4Impl>(a); }

}  // namespace loom::cpu

// AVX2 i8_ch panel kernel (layouts and arithmetic: kernels/cpu/i8ch.h): a
// panel is two ymm halves of 8 rows; ggml's sign trick turns s8 x s8 into
// vpmaddubsw's u8 x s8 without saturation: |q| (u8, at most 128) times
// sign(qx, q) (s8, qx in [-127, 127]) gives pairs of at most 2 * 128 * 127 =
// 32512 < 32767; vpmaddwd with ones widens them to int32. The accumulator
// starts at -zero * xsum and ends at the exact int32 acc; then the same
// y = float(acc) * (scale * s) as the AVX-512 kernel.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/i8ch.h"
#include "kernels/cpu/panel.h"
#include "kernels/cpu/panel_kernels.h"

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
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline void store_rows(float* y, __m256 v, int64_t nv) {
  if (nv >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (nv > 0) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nv)), idx), v);
  }
}

struct I8ChImpl {
  static constexpr int kP1 = 2, kPB = 1, kCB = 4;
  template <int P, int C>
  static void run(const TileArgs& ta) {
    const int64_t nw = i8ch_words(ta.K);
    const uint8_t* pan[P];
    const uint8_t* act[C];
    for (int p = 0; p < P; ++p) pan[p] = ta.pan + p * ta.pstride;
    for (int c = 0; c < C; ++c) act[c] = ta.act + c * ta.astride;

    __m256i acc[P][2][C];
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256i zero = load256(pan[p] + 64 + 32 * h);
        for (int c = 0; c < C; ++c)
          acc[p][h][c] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                          _mm256_mullo_epi32(zero, _mm256_set1_epi32(load_i32(act[c] + 4))));
      }
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8(static_cast<char>(0x80));
    const uint8_t* wq = ta.pan + kI8ChPanelHeader;
    const uint8_t* xq = ta.act + kI8ChActHeader;
    for (int64_t o = 0; o < nw; ++o) {
      __m256i w[P][2], aw[P][2];
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < 2; ++h) {
          w[p][h] = load256(wq + p * ta.pstride + 64 * o + 32 * h);
          aw[p][h] = _mm256_abs_epi8(w[p][h]);
        }
      for (int c = 0; c < C; ++c) {
        // The act row holds qx + 128: back to s8.
        const __m256i xb = _mm256_xor_si256(_mm256_set1_epi32(load_i32(xq + c * ta.astride + 4 * o)), bias);
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < 2; ++h) {
            const __m256i prod = _mm256_maddubs_epi16(aw[p][h], _mm256_sign_epi8(xb, w[p][h]));
            acc[p][h][c] = _mm256_add_epi32(acc[p][h][c], _mm256_madd_epi16(prod, ones));
          }
      }
    }

    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(pan[p] + 32 * h));
        for (int c = 0; c < C; ++c) {
          const __m256 f = _mm256_mul_ps(scale, _mm256_set1_ps(load_f32(act[c])));
          store_rows(ta.y + c * ta.ldy + p * 16 + h * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[p][h][c]), f),
                     ta.nv - p * 16 - h * 8);
        }
      }
  }
};

}  // namespace

void i8ch_panel_kernel_avx2(const KernelArgs& a) { drive_tiles<I8ChImpl>(a); }

}  // namespace loom::cpu

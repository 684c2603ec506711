// AVX-512 register tiles (4 rows x 64 columns) for the linear-layer gradients
// of linear_backward.cpp: the same per-element fma chains as its AVX2 tiles,
// twice the width. AVX-512 F only (Skylake-X and later); chosen at run time
// (CpuFeatures::has_avx512_f32).
#include <immintrin.h>

#include <cstdint>

namespace loom::detail {
namespace {

// C[r, c] += sum_{i < n} a(r, i) B[i, c] for R rows and `cols` columns; each C
// element is one chain fma(a, B, acc) over i in order (columns past a 16-multiple
// use masked lanes, which compute the same fma).
template <int R>
void tile_fma512(float* C, int64_t ldc, const float* a, int64_t lda_r, int64_t lda_i, const float* B, int64_t ldb,
                 int64_t n, int64_t cols) {
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_loadu_ps(C + r * ldc + c + 16 * v);
    for (int64_t i = 0; i < n; ++i) {
      const float* b = B + i * ldb + c;
      const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32),
                   b3 = _mm512_loadu_ps(b + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 av = _mm512_set1_ps(a[r * lda_r + i * lda_i]);
        acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(av, b3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(C + r * ldc + c + 16 * v, acc[r][v]);
  }
  for (; c < cols; c += 16) {
    const int64_t w = cols - c < 16 ? cols - c : 16;
    const auto m = static_cast<__mmask16>((1u << w) - 1);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_maskz_loadu_ps(m, C + r * ldc + c);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 b = _mm512_maskz_loadu_ps(m, B + i * ldb + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda_r + i * lda_i]), b, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(C + r * ldc + c, m, acc[r]);
  }
}

}  // namespace

void rows_fma_avx512(float* C, int64_t ldc, const float* a, int64_t lda_r, int64_t lda_i, const float* B,
                     int64_t ldb, int64_t n, int64_t cols, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) tile_fma512<4>(C + r * ldc, ldc, a + r * lda_r, lda_r, lda_i, B, ldb, n, cols);
  for (; r < r1; ++r) tile_fma512<1>(C + r * ldc, ldc, a + r * lda_r, lda_r, lda_i, B, ldb, n, cols);
}

}  // namespace loom::detail

// Linear-layer gradients with AVX2 FMA register tiles (4 rows x 16 columns).
#include "kernels/linear_backward.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

constexpr int64_t kTileRows = 64;  // rows of W dequantized at a time

// C[r, c] += sum_{i < n} A(r, i) B[i, c] for r < 4 rows of C (ldc) and `cols`
// columns, with A(r, i) = a[r * lda_r + i * lda_i] and B rows of ldb floats.
// Each C element is a chain fma(A, B, acc) over i in order, whatever `rows` is.
template <int R>
void tile_fma(float* C, int64_t ldc, const float* a, int64_t lda_r, int64_t lda_i, const float* B, int64_t ldb,
              int64_t n, int64_t cols) {
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_loadu_ps(C + r * ldc + c);
      acc[r][1] = _mm256_loadu_ps(C + r * ldc + c + 8);
    }
    for (int64_t i = 0; i < n; ++i) {
      const __m256 b0 = _mm256_loadu_ps(B + i * ldb + c), b1 = _mm256_loadu_ps(B + i * ldb + c + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + r * lda_r + i * lda_i);
        acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(C + r * ldc + c, acc[r][0]);
      _mm256_storeu_ps(C + r * ldc + c + 8, acc[r][1]);
    }
  }
  for (; c < cols; ++c)
    for (int r = 0; r < R; ++r) {
      float acc = C[r * ldc + c];
      for (int64_t i = 0; i < n; ++i) acc = std::fma(a[r * lda_r + i * lda_i], B[i * ldb + c], acc);
      C[r * ldc + c] = acc;
    }
}

// Rows [r0, r1) of C, 4 at a time.
void rows_fma(float* C, int64_t ldc, const float* a, int64_t lda_r, int64_t lda_i, const float* B, int64_t ldb,
              int64_t n, int64_t cols, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) tile_fma<4>(C + r * ldc, ldc, a + r * lda_r, lda_r, lda_i, B, ldb, n, cols);
  for (; r < r1; ++r) tile_fma<1>(C + r * ldc, ldc, a + r * lda_r, lda_r, lda_i, B, ldb, n, cols);
}

}  // namespace

void linear_backward_input(ThreadPool& pool, const Tensor& W, const float* dy, float* dx, int64_t T) {
  const int64_t N = W.rows(), K = W.cols(), bs = dtype_block_size(W.dtype);
  if (T <= 0 || N <= 0 || K <= 0) return;
  LOOM_ASSERT(K % bs == 0);
  const bool direct = W.dtype == DType::f32;
  // Column slices: block aligned, wide enough for the 16-column register tiles.
  const int64_t cw = std::max<int64_t>(bs, 128) / bs * bs;
  const int64_t n_cc = (K + cw - 1) / cw;
  // Split rows of dx too when there are few slices; every split re-dequantizes W.
  const int64_t want = 2 * pool.size();
  int64_t n_tc = std::max<int64_t>(1, std::min((want + n_cc - 1) / n_cc, (T + 31) / 32));
  int64_t tr = (T + n_tc - 1) / n_tc;
  tr = (tr + 3) / 4 * 4;
  n_tc = (T + tr - 1) / tr;
  const int64_t units = n_cc * n_tc;
  pool.run([&](int ti, int tn) {
    std::vector<float> tile(direct ? 0 : static_cast<size_t>(kTileRows * cw));
    for (int64_t u = ti; u < units; u += tn) {
      const int64_t c0 = (u % n_cc) * cw, c1 = std::min(K, c0 + cw), cols = c1 - c0;
      const int64_t t0 = (u / n_cc) * tr, t1 = std::min(T, t0 + tr);
      const size_t col_off = dtype_row_bytes(W.dtype, c0);
      for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
        const int64_t nr = std::min(kTileRows, N - n0);
        const float* B;
        int64_t ldb;
        if (direct) {
          B = W.as<const float>() + n0 * K + c0;
          ldb = K;
        } else {
          for (int64_t i = 0; i < nr; ++i)
            dequantize_row_ref(W.dtype, W.row_ptr(n0 + i) + col_off, tile.data() + i * cw, cols);
          B = tile.data();
          ldb = cw;
        }
        // dx[t, c0 + c] += sum_i dy[t, n0 + i] B[i, c]
        rows_fma(dx + c0, K, dy + n0, N, 1, B, ldb, nr, cols, t0, t1);
      }
    }
  });
}

void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                            int64_t K) {
  if (T <= 0 || N <= 0 || K <= 0) return;
  // Units of 16 dW rows (dy's 16 columns transposed in one cache line per t) by
  // column slices; slices only when there are too few row blocks (small N, e.g. LoRA).
  constexpr int64_t kRows = 16;
  const int64_t n_nb = (N + kRows - 1) / kRows;
  const int64_t n_kc = std::min((K + 63) / 64, std::max<int64_t>(1, (4 * pool.size() + n_nb - 1) / n_nb));
  const int64_t kw = ((K + n_kc - 1) / n_kc + 15) / 16 * 16;
  pool.parallel_for(n_nb * n_kc, [&](int64_t u0, int64_t u1) {
    std::vector<float> dyT(static_cast<size_t>(kRows * T));
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = (u / n_kc) * kRows, nr = std::min(kRows, N - n0);
      const int64_t c0 = (u % n_kc) * kw, c1 = std::min(K, c0 + kw);
      if (c0 >= c1) continue;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < nr; ++r) dyT[static_cast<size_t>(r * T + t)] = dy[t * N + n0 + r];
      // dW[n0 + r, c] += sum_t dyT[r, t] x[t, c], 64-column strips of x kept in cache
      // across the row groups.
      for (int64_t s0 = c0; s0 < c1; s0 += 64)
        rows_fma(dW + n0 * K + s0, K, dyT.data(), T, 1, x + s0, K, T, std::min<int64_t>(64, c1 - s0), 0, nr);
    }
  });
}

void linear_backward_bias(const float* dy, float* db, int64_t T, int64_t N) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) db[n] += dy[t * N + n];
}

}  // namespace loom

// Linear-layer gradients with AVX2 FMA register tiles (4 rows x 16 columns).
#include "kernels/cpu/linear_backward.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/bf16_gemm_direct.h"
#include "kernels/cpu/dequant.h"
#include "kernels/cpu/panel.h"

namespace loom {
namespace detail {
// linear_backward_avx512f.cpp
void rows_fma_avx512(float* C, int64_t ldc, const float* a, int64_t lda_r, int64_t lda_i, const float* B,
                     int64_t ldb, int64_t n, int64_t cols, int64_t r0, int64_t r1);
}  // namespace detail
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

// Rows [r0, r1) of C, 4 at a time (AVX-512 tiles where the CPU has AVX-512 F:
// the same chains, so the same results).
void rows_fma(float* C, int64_t ldc, const float* a, int64_t lda_r, int64_t lda_i, const float* B, int64_t ldb,
              int64_t n, int64_t cols, int64_t r0, int64_t r1) {
  if (usable_cpu_features().has_avx512_f32())
    return detail::rows_fma_avx512(C, ldc, a, lda_r, lda_i, B, ldb, n, cols, r0, r1);
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
      for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
        const int64_t nr = std::min(kTileRows, N - n0);
        const float* B;
        int64_t ldb;
        if (direct) {
          B = W.as<const float>() + n0 * K + c0;
          ldb = K;
        } else {
          for (int64_t i = 0; i < nr; ++i)
            dequantize_row_cols(W.dtype, W.row_ptr(n0 + i), c0, tile.data() + i * cw, cols);
          B = tile.data();
          ldb = cw;
        }
        // dx[t, c0 + c] += sum_i dy[t, n0 + i] B[i, c]
        rows_fma(dx + c0, K, dy + n0, N, 1, B, ldb, nr, cols, t0, t1);
      }
    }
  });
}

namespace {

constexpr int64_t kGradRows = 16;  // dW rows of one unit (dy's 16 columns transposed in one cache line per t)

// dW would be too narrow for the column tiles (e.g. a LoRA B [out, r]).
bool narrow_grad(int64_t N, int64_t K) { return K < 16 && N >= 16; }
size_t grad_rows_floats(int64_t T) { return scratch_lines(static_cast<size_t>(kGradRows * T)); }

// Units of 16 dW rows by column slices; slices only when there are too few row
// blocks (small N, e.g. LoRA). `dyT`: grad_rows_floats(T) per thread index.
void weight_grad_tiles(ThreadPool& pool, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                       int64_t K, float* dyT) {
  const int64_t n_nb = (N + kGradRows - 1) / kGradRows;
  const int64_t n_kc = std::min((K + 63) / 64, std::max<int64_t>(1, (4 * pool.size() + n_nb - 1) / n_nb));
  const int64_t kw = ((K + n_kc - 1) / n_kc + 15) / 16 * 16;
  const int64_t units = n_nb * n_kc;
  auto run_units = [&](int64_t u0, int64_t u1, float* rows) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = (u / n_kc) * kGradRows, nr = std::min(kGradRows, N - n0);
      const int64_t c0 = (u % n_kc) * kw, c1 = std::min(K, c0 + kw);
      if (c0 >= c1) continue;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < nr; ++r) rows[r * T + t] = dy[t * N + n0 + r];
      // dW[n0 + r, c] += sum_t dyT[r, t] x[t, c], 64-column strips of x kept in cache
      // across the row groups.
      for (int64_t s0 = c0; s0 < c1; s0 += 64)
        rows_fma(dW + n0 * K + s0, K, rows, T, 1, x + s0, K, T, std::min<int64_t>(64, c1 - s0), 0, nr);
    }
  };
  if (pool.size() == 1 || units <= 1) return run_units(0, units, dyT);
  // parallel_for's contiguous chunks, each with its thread index's rows.
  pool.run([&](int ti, int tn) {
    const int64_t chunk = (units + tn - 1) / tn, b = chunk * ti, e = std::min(units, b + chunk);
    if (b < e) run_units(b, e, dyT + static_cast<size_t>(ti) * grad_rows_floats(T));
  });
}

}  // namespace

size_t linear_backward_weight_floats(int64_t T, int64_t N, int64_t K, int threads) {
  if (T <= 0 || N <= 0 || K <= 0) return 0;
  return (narrow_grad(N, K) ? scratch_lines(static_cast<size_t>(K * N)) : 0) +
         static_cast<size_t>(threads) * grad_rows_floats(T);
}

void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                            int64_t K, ScratchFloats& scratch) {
  if (T <= 0 || N <= 0 || K <= 0) return;
  float* base = scratch.reserve(linear_backward_weight_floats(T, N, K, pool.size()));
  if (!narrow_grad(N, K)) return weight_grad_tiles(pool, dy, x, dW, T, N, K, base);
  // Narrow: dW^T = x^T dy with the wide tiles, added transposed.
  float* dWt = base;
  std::fill(dWt, dWt + K * N, 0.0f);
  weight_grad_tiles(pool, x, dy, dWt, T, K, N, base + scratch_lines(static_cast<size_t>(K * N)));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dW[n * K + k] += dWt[k * N + n];
}

void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                            int64_t K) {
  ScratchFloats scratch;
  linear_backward_weight(pool, dy, x, dW, T, N, K, scratch);
}

void linear_backward_bias(const float* dy, float* db, int64_t T, int64_t N) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) db[n] += dy[t * N + n];
}

}  // namespace loom

namespace loom {

DType transposed_weight_dtype(DType w, int64_t n_total, TransposedPrecision p) {
  if (p == TransposedPrecision::bf16) return DType::bf16;
  // bf16 products round dy to bf16 (kernels/cpu/matmul.h): the exact mode
  // widens bf16 weights to f32 instead.
  if (w == DType::bf16) return p == TransposedPrecision::f16 ? DType::f32 : DType::bf16;
  if (w == DType::f32 || w == DType::f16) return w;
  if (p == TransposedPrecision::f16) return DType::f16;
  return n_total % 32 == 0 ? DType::q8_0 : DType::f16;
}

namespace {

// Columns of W (rows of W^T) per slice: whole blocks of a quantized type (256
// covers the 32- and 256-element ones, and i8_ch's single columns); one 16-row
// panel of W^T for the float types, so that a thread's slice of an f32 weight
// that training repacks stays small.
int64_t slice_cols(DType src) {
  const int64_t bs = dtype_block_size(src);
  return bs == 1 && !dtype_is_quantized(src) ? cpu::kPanelRows : std::max<int64_t>(bs, 256) / bs * bs;
}

// How pack_transposed converts: f16 / bf16 moved as they are when they keep
// their dtype (exact), else
// dequantized to f32 rows of W^T (`wt`) and, unless they stay f32 or become
// bf16 pairs, stored as dst rows (`rows`).
struct TransposePlan {
  DType src, dst;
  bool pairs, move;
  int64_t N, K, kc;
  size_t out_row;  // bytes of a dst row of W^T (0 for pairs)
  size_t wt_floats() const { return move ? 0 : scratch_lines(static_cast<size_t>(kc * N)); }
  size_t rows_floats() const {
    return pairs || dst == DType::f32 ? 0 : scratch_lines((static_cast<size_t>(kc) * out_row + 3) / 4);
  }
  size_t thread_floats() const { return wt_floats() + rows_floats(); }
};

TransposePlan transpose_plan(DType src, int64_t N, int64_t K, TransposedPrecision precision) {
  TransposePlan t;
  t.src = src;
  t.dst = transposed_weight_dtype(src, N, precision);
  t.pairs = precision == TransposedPrecision::bf16;
  t.move = !t.pairs && src == t.dst && src != DType::f32 && dtype_block_size(src) == 1;
  t.N = N, t.K = K, t.kc = slice_cols(src);
  t.out_row = t.pairs ? 0 : dtype_row_bytes(t.dst, N);
  return t;
}

// Columns [k0, k0 + cols) of every part, transposed: wt[c * N + n] (f32), or
// for `move` the 2-byte elements into rows[c * N + n].
void transpose_slice(const TransposePlan& t, std::span<const Tensor> parts, int64_t k0, int64_t cols, float* wt,
                     uint8_t* rows) {
  const int64_t N = t.N;
  int64_t n0 = 0;
  for (const Tensor& p : parts) {
    if (t.move) {
      const auto* w = p.as<const uint16_t>();
      auto* o = reinterpret_cast<uint16_t*>(rows);
      for (int64_t n = 0; n < p.rows(); ++n)
        for (int64_t c = 0; c < cols; ++c) o[c * N + n0 + n] = w[n * t.K + k0 + c];
    } else if (t.src == DType::f32) {
      const float* w = p.as<const float>();
      for (int64_t n = 0; n < p.rows(); ++n)
        for (int64_t c = 0; c < cols; ++c) wt[c * N + n0 + n] = w[n * t.K + k0 + c];
    } else {
      float row[256];
      for (int64_t n = 0; n < p.rows(); ++n) {
        dequantize_row_cols(t.src, p.row_ptr(n), k0, row, cols);
        for (int64_t c = 0; c < cols; ++c) wt[c * N + n0 + n] = row[c];
      }
    }
    n0 += p.rows();
  }
}

// f32 rows of W^T -> dst rows (out_row bytes apart).
void store_rows(const TransposePlan& t, const float* wt, int64_t cols, uint8_t* rows) {
  for (int64_t c = 0; c < cols; ++c) {
    uint8_t* o = rows + static_cast<size_t>(c) * t.out_row;
    const float* x = wt + c * t.N;
    if (t.dst == DType::q8_0) {
      quantize_row_q8_0(x, o, t.N);
    } else {
      LOOM_ASSERT(t.dst == DType::f16);
      auto* h = reinterpret_cast<uint16_t*>(o);
      for (int64_t n = 0; n < t.N; ++n) h[n] = fp32_to_fp16(x[n]);
    }
  }
}

// The panels of W^T rows [k0, k0 + cols) (k0 a multiple of 16), from dst rows.
void pack_slice_panels(PackedWeight& packed, const TransposePlan& t, const uint8_t* rows, int64_t k0,
                       int64_t cols) {
  const size_t used = cpu::panel_bytes(t.dst, t.N);
  for (int64_t r0 = 0; r0 < cols; r0 += cpu::kPanelRows) {
    const int nr = static_cast<int>(std::min<int64_t>(cpu::kPanelRows, cols - r0));
    const uint8_t* rp[cpu::kPanelRows];
    for (int r = 0; r < nr; ++r) rp[r] = rows + static_cast<size_t>(r0 + r) * t.out_row;
    uint8_t* dst = packed.mutable_panel((k0 + r0) / cpu::kPanelRows);
    cpu::pack_panel(t.dst, rp, nr, t.N, dst);
    std::memset(dst + used, 0, packed.panel_bytes() - used);
  }
}

}  // namespace

size_t pack_transposed_floats(DType src, int64_t N, int64_t K, TransposedPrecision precision, int threads) {
  if (N <= 0 || K <= 0) return 0;
  return static_cast<size_t>(threads) * transpose_plan(src, N, K, precision).thread_floats();
}

PackedWeight pack_transposed(ThreadPool& pool, std::span<const Tensor> parts, TransposedPrecision precision,
                            const char* name, PackedWeight* recycle, ScratchFloats* scratch) {
  if (parts.empty()) fail(ErrorKind::invalid_input, "pack_transposed({}): no tensors", name);
  const DType src = parts[0].dtype;
  const int64_t K = parts[0].cols();
  int64_t N = 0;
  for (const Tensor& p : parts) {
    if (p.cols() != K || p.dtype != src)
      fail(ErrorKind::invalid_input, "pack_transposed({}): parts differ in width or dtype ({} {} vs {} {})", name,
           dtype_name(p.dtype), p.cols(), dtype_name(src), K);
    N += p.rows();
  }
  const TransposePlan t = transpose_plan(src, N, K, precision);
  PackedWeight packed =
      t.pairs ? PackedWeight::allocate(PackedLayout::bf16_pairs, DType::bf16, K, N, cpu::bf16_panel_bytes(N), recycle)
              : PackedWeight::allocate(PackedLayout::panels, t.dst, K, N, packed_panel_stride(t.dst, N), recycle);
  ScratchFloats own;
  ScratchFloats& sc = scratch ? *scratch : own;
  float* base = sc.reserve(static_cast<size_t>(pool.size()) * t.thread_floats());
  // Slices of kc columns of W, transposed and stored as whole panels of W^T;
  // parallel_for's contiguous chunks, each with its thread index's slab.
  const int64_t n_slices = (K + t.kc - 1) / t.kc;
  pool.run([&](int ti, int tn) {
    const int64_t chunk = (n_slices + tn - 1) / tn, s0 = chunk * ti, s1 = std::min(n_slices, s0 + chunk);
    float* wt = base + static_cast<size_t>(ti) * t.thread_floats();
    auto* rows = reinterpret_cast<uint8_t*>(wt + t.wt_floats());
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t k0 = s * t.kc, cols = std::min(t.kc, K - k0);
      transpose_slice(t, parts, k0, cols, wt, rows);
      if (t.pairs) {
        cpu::store_bf16_pairs(packed, k0, cols, wt, N);
        continue;
      }
      if (t.dst == DType::f32) {
        pack_slice_panels(packed, t, reinterpret_cast<const uint8_t*>(wt), k0, cols);
        continue;
      }
      if (!t.move) store_rows(t, wt, cols, rows);
      pack_slice_panels(packed, t, rows, k0, cols);
    }
  });
  return packed;
}

void linear_backward_input_packed(ThreadPool& pool, const PackedWeight& Wt, const float* dy, int64_t ldy,
                                  float* dx, int64_t T, bool accumulate, PackedBackwardScratch& scratch,
                                  Bf16Kernel kernel) {
  if (Wt.layout() == PackedLayout::bf16_pairs) {
    cpu::bf16_gemm(pool, kernel, Wt, dy, ldy, dx, T, accumulate, scratch.matmul);
    return;
  }
  if (T <= 0) return;
  const int64_t K = Wt.rows(), N = Wt.cols();
  const bool rescale = Wt.dtype() == DType::q8_0;
  std::vector<float> inv_scale(rescale ? static_cast<size_t>(T) : 0);
  const float* x = dy;
  int64_t ldx = ldy;
  if (rescale) {
    scratch.dy.resize(static_cast<size_t>(T * N));
    pool.parallel_for(T, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* src = dy + t * ldy;
        float amax = 0;
        for (int64_t n = 0; n < N; ++n) amax = std::max(amax, std::fabs(src[n]));
        int e = 0;
        if (amax > 0 && std::isfinite(amax)) std::frexp(amax, &e);
        const float s = std::ldexp(1.0f, 16 - e);
        inv_scale[static_cast<size_t>(t)] = std::ldexp(1.0f, e - 16);
        float* d = scratch.dy.data() + t * N;
        for (int64_t n = 0; n < N; ++n) d[n] = src[n] * s;
      }
    });
    x = scratch.dy.data();
    ldx = N;
  }
  if (!accumulate && !rescale) {
    matmul(pool, Wt, x, ldx, dx, K, T, scratch.matmul);
    return;
  }
  scratch.prod.resize(static_cast<size_t>(T * K));
  float* prod = scratch.prod.data();
  matmul(pool, Wt, x, ldx, prod, K, T, scratch.matmul);
  pool.parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float s = rescale ? inv_scale[static_cast<size_t>(t)] : 1.0f;
      float* o = dx + t * K;
      const float* p = prod + t * K;
      if (accumulate)
        for (int64_t k = 0; k < K; ++k) o[k] += p[k] * s;
      else
        for (int64_t k = 0; k < K; ++k) o[k] = p[k] * s;
    }
  });
}

bool bf16_direct_available(DType w) {
  return cpu::bf16_direct_type(w, nullptr) && cpu::resolve_bf16_kernel(Bf16Kernel::automatic) == Bf16Kernel::amx;
}

void linear_backward_input_bf16_direct(ThreadPool& pool, const Tensor& W, const float* dy, int64_t ldy, float* dx,
                                       int64_t T, bool accumulate, PackedBackwardScratch& scratch) {
  cpu::bf16_gemm_direct(pool, W, dy, ldy, dx, T, accumulate, scratch.matmul);
}

}  // namespace loom

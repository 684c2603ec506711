// quantize_rows: the dispatch over types and threads, and the importance-
// weighted quantizers of the 32-element formats (ggml's quantize_row_q4_0_impl
// .. q5_1_impl). Without importance those formats round to nearest
// (quantize_row_ref, kernels/ref); the k-quants are in quantize_k.cpp.

// As in quantize_search.cpp: ggml's products and sums are not fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/quantize.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/quant_blocks.h"
#include "kernels/quantize_impl.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

// 32 codes of 4 or 5 bits: qs[j] holds code j (low nibble) and j + 16 (high);
// for q5, bit 4 of code j is bit j of qh.
template <typename Block, typename Code>
void pack_codes(const Code* L, Block& b) {
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>((L[j] & 0x0F) | ((L[j + 16] & 0x0F) << 4));
  if constexpr (requires { b.qh; }) {
    uint32_t qh = 0;
    for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>((L[j] & 0x10) >> 4) << j;
    std::memcpy(b.qh, &qh, sizeof(qh));
  }
}

// The importance weights of ggml's 32-element formats: qw * sqrt(sigma2 + x^2),
// sigma2 the mean square of the whole row.
struct RowWeights {
  float sigma2;
  explicit RowWeights(const float* x, int64_t n) {
    float sum_x2 = 0;
    for (int64_t j = 0; j < n; ++j) sum_x2 += x[j] * x[j];
    sigma2 = sum_x2 / static_cast<float>(n);
  }
  void of_block(const float* xb, const float* qw, float* weights) const {
    for (int j = 0; j < 32; ++j) weights[j] = qw[j] * std::sqrt(sigma2 + xb[j] * xb[j]);
  }
};

// q4_0 / q5_0 (nmax 8 / 16): the weighted symmetric search, x ~ d (L - nmax).
template <typename Block, int kNmax>
void quantize_row_symmetric_weighted(const float* x, void* dst, int64_t n, const float* importance) {
  const RowWeights rw(x, n);
  float weights[32];
  int8_t L[32];
  for (int64_t ib = 0; ib < n / 32; ++ib) {
    const float* xb = x + 32 * ib;
    rw.of_block(xb, importance + 32 * ib, weights);
    Block b{};
    b.d = fp32_to_fp16(quant::fit_symmetric(32, kNmax, xb, weights, L));
    pack_codes(L, b);
    quant::store_block(dst, ib, b);
  }
}

// q4_1 / q5_1 (nmax 15 / 31): the weighted affine search, x ~ d L + m.
template <typename Block, int kNmax>
void quantize_row_affine_weighted(const float* x, void* dst, int64_t n, const float* importance) {
  const RowWeights rw(x, n);
  float weights[32];
  uint8_t L[32];
  for (int64_t ib = 0; ib < n / 32; ++ib) {
    const float* xb = x + 32 * ib;
    rw.of_block(xb, importance + 32 * ib, weights);
    float neg_min;
    const float d =
        quant::fit_affine(32, kNmax, xb, weights, L, &neg_min, quant::AffineGrid{-0.9f, 0.05f, 36, false});
    Block b{};
    b.d = fp32_to_fp16(d);
    b.m = fp32_to_fp16(-neg_min);
    pack_codes(L, b);
    quant::store_block(dst, ib, b);
  }
}

// One row as ggml_quantize_chunk quantizes it.
void quantize_row(DType type, const float* x, void* dst, int64_t n, const float* importance) {
  if (type == DType::iq4_nl) return quant::quantize_row_iq4_nl(x, dst, n, importance);
  if (type == DType::iq4_xs) return quant::quantize_row_iq4_xs(x, dst, n, importance);
  if (type == DType::iq3_xxs) return quant::quantize_row_iq3_xxs(x, dst, n, importance);
  if (type == DType::iq3_s) return quant::quantize_row_iq3_s(x, dst, n, importance);
  if (type == DType::iq2_xxs) return quant::quantize_row_iq2_xxs(x, dst, n, importance);
  if (type == DType::iq2_xs) return quant::quantize_row_iq2_xs(x, dst, n, importance);
  if (type == DType::iq2_s) return quant::quantize_row_iq2_s(x, dst, n, importance);
  if (type == DType::iq1_s) return quant::quantize_row_iq1_s(x, dst, n, importance);
  if (type == DType::iq1_m) return quant::quantize_row_iq1_m(x, dst, n, importance);
  if (type == DType::mxfp4)
    return quant::quantize_row_mxfp4(x, dst, n);  // (ggml takes no importance for these)
  if (type == DType::nvfp4) return quant::quantize_row_nvfp4(x, dst, n);
  if (type == DType::q1_0) return quant::quantize_row_q1_0(x, dst, n);
  if (type == DType::q2_0) return quant::quantize_row_q2_0(x, dst, n);
  if (type == DType::tq1_0) return quant::quantize_row_tq1_0(x, dst, n);
  if (type == DType::tq2_0) return quant::quantize_row_tq2_0(x, dst, n);
  if (importance) {
    switch (type) {
      case DType::q4_0:
        quantize_row_symmetric_weighted<BlockQ4_0, 8>(x, dst, n, importance);
        return;
      case DType::q5_0:
        quantize_row_symmetric_weighted<BlockQ5_0, 16>(x, dst, n, importance);
        return;
      case DType::q4_1:
        quantize_row_affine_weighted<BlockQ4_1, 15>(x, dst, n, importance);
        return;
      case DType::q5_1:
        quantize_row_affine_weighted<BlockQ5_1, 31>(x, dst, n, importance);
        return;
      case DType::q2_k:
        quant::quantize_row_q2_k_weighted(x, dst, n, importance);
        return;
      case DType::q3_k:
        quant::quantize_row_q3_k_weighted(x, dst, n, importance);
        return;
      case DType::q4_k:
        quant::quantize_row_q4_k_weighted(x, dst, n, importance);
        return;
      case DType::q5_k:
        quant::quantize_row_q5_k_weighted(x, dst, n, importance);
        return;
      case DType::q6_k:
        quant::quantize_row_q6_k_weighted(x, dst, n, importance);
        return;
      default:  // f32, f16, bf16 and q8_0: ggml ignores the importance
        break;
    }
  }
  switch (type) {
    case DType::q2_k:
      quant::quantize_row_q2_k(x, dst, n);
      return;
    case DType::q3_k:
      quant::quantize_row_q3_k(x, dst, n);
      return;
    case DType::q4_k:
      quant::quantize_row_q4_k(x, dst, n);
      return;
    case DType::q5_k:
      quant::quantize_row_q5_k(x, dst, n);
      return;
    case DType::q6_k:
      quant::quantize_row_q6_k(x, dst, n);
      return;
    default:  // the plain types; q4_0 .. q8_0 round to nearest
      quantize_row_ref(type, x, dst, n);
      return;
  }
}

}  // namespace

bool quantize_supported(DType type) {
  switch (type) {
    case DType::f32:
    case DType::f16:
    case DType::bf16:
    case DType::q4_0:
    case DType::q4_1:
    case DType::q5_0:
    case DType::q5_1:
    case DType::q8_0:
    case DType::q2_k:
    case DType::q3_k:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k:
    case DType::iq4_nl:
    case DType::iq4_xs:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq1_s:
    case DType::iq1_m:
    case DType::mxfp4:
    case DType::nvfp4:
    case DType::q1_0:
    case DType::q2_0:
    case DType::tq1_0:
    case DType::tq2_0:
      return true;
    default:
      return false;
  }
}

namespace {

// The grid searches take a NaN or an infinity where no grid entry fits (ggml's
// stop with "point not on grid"): refused up front, naming the row.
void require_finite(DType type, const float* src, int64_t nrows, int64_t n_per_row, const float* importance) {
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t j = 0; j < n_per_row; ++j)
      if (!std::isfinite(src[r * n_per_row + j]))
        fail(ErrorKind::invalid_input, "quantize to {}: row {} holds a non-finite value ({} at column {})",
             dtype_name(type), r, src[r * n_per_row + j], j);
  if (importance == nullptr) return;
  for (int64_t j = 0; j < n_per_row; ++j)
    if (!std::isfinite(importance[j]) || importance[j] < 0)
      fail(ErrorKind::invalid_input, "quantize to {}: importance {} at column {} is not a finite non-negative number",
           dtype_name(type), importance[j], j);
}

}  // namespace

bool quantize_requires_importance(DType type) {
  return type == DType::iq2_xxs || type == DType::iq2_xs || type == DType::iq1_s;
}

void quantize_rows(ThreadPool& pool, DType type, const float* src, void* dst, int64_t nrows,
                   int64_t n_per_row, const float* importance) {
  if (!quantize_supported(type))
    fail(
        ErrorKind::unsupported,
        "quantize: no quantizer for tensor type {} (supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, "
        "q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, iq3_xxs, iq3_s, iq2_xxs, iq2_xs, iq2_s, iq1_s, iq1_m, mxfp4, "
        "nvfp4, q1_0, q2_0, tq1_0, tq2_0)",
        dtype_name(type));
  const int64_t block = dtype_block_size(type);
  if (n_per_row <= 0 || n_per_row % block != 0)
    fail(ErrorKind::invalid_input,
         "quantize to {}: {} values per row is not a positive multiple of the block size {}",
         dtype_name(type), n_per_row, block);
  if (nrows < 0)
    fail(ErrorKind::invalid_input, "quantize to {}: negative row count {}", dtype_name(type), nrows);
  if (quantize_requires_importance(type) && importance == nullptr)
    fail(ErrorKind::invalid_input,
         "quantize to {}: this type needs an importance vector (an imatrix entry for the tensor); ggml's quantizer "
         "has no form without one",
         dtype_name(type));
  if (is_iq_grid(type)) require_finite(type, src, nrows, n_per_row, importance);
  const size_t row_bytes = dtype_row_bytes(type, n_per_row);
  auto* out = static_cast<uint8_t*>(dst);
  pool.parallel_for(nrows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(type, src + r * n_per_row, out + static_cast<size_t>(r) * row_bytes, n_per_row,
                   importance);
  });
}

}  // namespace loom

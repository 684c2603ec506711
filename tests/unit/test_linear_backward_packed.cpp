// Input gradients through W^T packed for the matmul kernels (pack_transposed +
// linear_backward_input_packed) against the exact tile path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/half.h"
#include "kernels/cpu/dequant.h"
#include "kernels/cpu/linear_backward.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::random_floats;
using testing::random_weights;

// max |a - b| / max |b|
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
    m = std::max(m, std::fabs(static_cast<double>(b[i])));
  }
  return d / m;
}

struct Case {
  DType type;
  int64_t N, K, T;
};

TEST(LinearBackwardPacked, MatchesExactPathForEveryDtypeAndPrecision) {
  ThreadPool pool(3);
  const Case cases[] = {{DType::f32, 45, 70, 5},   {DType::f16, 64, 96, 17},   {DType::bf16, 32, 40, 3},
                        {DType::q4_1, 96, 128, 9}, {DType::q8_0, 64, 64, 33},  {DType::q4_k, 64, 256, 4},
                        {DType::q6_k, 40, 256, 7}, {DType::q4_0, 50, 96, 6}};
  for (const Case& c : cases)
    for (TransposedPrecision prec : {TransposedPrecision::f16, TransposedPrecision::int8})
      for (float mag : {1.0f, 1e-7f}) {  // tiny gradients: q8_0 block scales must not go subnormal
        SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " N=" << c.N << " K=" << c.K << " T=" << c.T
                                          << " prec=" << static_cast<int>(prec) << " mag=" << mag);
        auto wbytes = random_weights(c.type, c.N, c.K, 11);
        const Tensor W = make_tensor(wbytes.data(), c.type, {c.N, c.K});
        const auto dy = random_floats(c.T * c.N, 5, mag);
        const auto init = random_floats(c.T * c.K, 6, mag);
        std::vector<float> want = init;
        linear_backward_input(pool, W, dy.data(), want.data(), c.T);

        const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), prec);
        ASSERT_EQ(Wt.rows(), c.K);
        ASSERT_EQ(Wt.cols(), c.N);
        PackedBackwardScratch scratch;
        std::vector<float> got = init;
        linear_backward_input_packed(pool, Wt, dy.data(), c.N, got.data(), c.T, true, scratch);
        const bool is_float = !dtype_is_quantized(c.type);
        // bf16 under int8 stays bf16, whose products round dy to bf16 (2^-9 relative).
        const bool rounds_dy = c.type == DType::bf16 && prec == TransposedPrecision::int8;
        const double tol = rounds_dy ? 4e-3 : is_float ? 1e-5 : prec == TransposedPrecision::f16 ? 2e-3 : 3e-2;
        EXPECT_LT(rel_err(got, want), tol);

        // accumulate = false overwrites: the product alone.
        std::vector<float> prod(init.size(), NAN);
        linear_backward_input_packed(pool, Wt, dy.data(), c.N, prod.data(), c.T, false, scratch);
        for (size_t i = 0; i < prod.size(); ++i) prod[i] += init[i];
        EXPECT_LT(rel_err(prod, want), tol);
      }
}

// W^T as a plain tensor of pack_transposed's dtype: dequantized, transposed,
// stored row by row (f16 / bf16 weights moved as they are).
std::vector<uint8_t> transposed_copy(const Tensor& W, DType dst) {
  const int64_t N = W.rows(), K = W.cols();
  const size_t row = dtype_row_bytes(dst, N);
  std::vector<uint8_t> out(row * static_cast<size_t>(K));
  std::vector<float> w(static_cast<size_t>(N * K)), col(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) dequantize_row(W.dtype, W.row_ptr(n), w.data() + n * K, K);
  for (int64_t k = 0; k < K; ++k) {
    uint8_t* o = out.data() + static_cast<size_t>(k) * row;
    for (int64_t n = 0; n < N; ++n) col[static_cast<size_t>(n)] = w[static_cast<size_t>(n * K + k)];
    if (dst == W.dtype && dst != DType::f32 && dtype_block_size(dst) == 1) {
      const auto* src = static_cast<const uint16_t*>(W.data);
      for (int64_t n = 0; n < N; ++n) reinterpret_cast<uint16_t*>(o)[n] = src[n * K + k];
    } else if (dst == DType::q8_0) {
      quantize_row_q8_0(col.data(), o, N);
    } else if (dst == DType::f16) {
      for (int64_t n = 0; n < N; ++n) reinterpret_cast<uint16_t*>(o)[n] = fp32_to_fp16(col[static_cast<size_t>(n)]);
    } else {
      std::memcpy(o, col.data(), static_cast<size_t>(N) * sizeof(float));
    }
  }
  return out;
}

// pack_transposed writes the panels straight from slices of W: the same bytes
// as packing a whole transposed copy, also when it recycles a weight and
// reuses a scratch that an earlier (larger) call grew.
TEST(LinearBackwardPacked, PanelsEqualPackingTheTransposedCopy) {
  ThreadPool pool(3);
  const Case cases[] = {{DType::f32, 45, 70, 0}, {DType::f32, 256, 48, 0}, {DType::f16, 64, 96, 0},
                        {DType::bf16, 32, 40, 0}, {DType::q4_1, 96, 128, 0}, {DType::q8_0, 64, 64, 0},
                        {DType::q4_k, 64, 256, 0}, {DType::q6_k, 40, 256, 0}};
  ScratchFloats scratch;
  auto big = random_weights(DType::f32, 300, 64, 3);
  const Tensor B = make_tensor(big.data(), DType::f32, {300, 64});
  for (TransposedPrecision prec : {TransposedPrecision::f16, TransposedPrecision::int8}) {
    pack_transposed(pool, std::span<const Tensor>(&B, 1), prec, "big", nullptr, &scratch);
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " N=" << c.N << " K=" << c.K
                                        << " prec=" << static_cast<int>(prec));
      auto wbytes = random_weights(c.type, c.N, c.K, 21);
      const Tensor W = make_tensor(wbytes.data(), c.type, {c.N, c.K});
      const DType dst = transposed_weight_dtype(c.type, c.N, prec);
      auto copy = transposed_copy(W, dst);
      const PackedWeight want = PackedWeight::pack(make_tensor(copy.data(), dst, {c.K, c.N}));
      PackedWeight old = pack_transposed(pool, std::span<const Tensor>(&W, 1), prec);
      const PackedWeight fresh = pack_transposed(pool, std::span<const Tensor>(&W, 1), prec);
      const PackedWeight got = pack_transposed(pool, std::span<const Tensor>(&W, 1), prec, "w", &old, &scratch);
      const size_t held = scratch.bytes();
      const PackedWeight again = pack_transposed(pool, std::span<const Tensor>(&W, 1), prec, "w", nullptr, &scratch);
      EXPECT_EQ(scratch.bytes(), held);  // grown once, then reused
      for (const PackedWeight* p : {&fresh, &got, &again}) {
        ASSERT_EQ(p->dtype(), dst);
        ASSERT_EQ(p->nbytes(), want.nbytes());
        EXPECT_EQ(std::memcmp(p->panel(0), want.panel(0), want.nbytes()), 0);
      }
    }
  }
}

TEST(LinearBackwardPacked, ConcatenatedPartsEqualTheSumOfProducts) {
  ThreadPool pool(2);
  const int64_t K = 64, T = 5, N1 = 32, N2 = 64;
  auto b1 = random_weights(DType::f32, N1, K, 1), b2 = random_weights(DType::f32, N2, K, 2);
  const Tensor parts[] = {make_tensor(b1.data(), DType::f32, {N1, K}), make_tensor(b2.data(), DType::f32, {N2, K})};
  const PackedWeight Wt = pack_transposed(pool, parts, TransposedPrecision::f16);
  const auto dy = random_floats(T * (N1 + N2), 3);
  std::vector<float> got(static_cast<size_t>(T * K)), want(static_cast<size_t>(T * K), 0.0f);
  PackedBackwardScratch scratch;
  linear_backward_input_packed(pool, Wt, dy.data(), N1 + N2, got.data(), T, false, scratch);
  std::vector<float> dy1(static_cast<size_t>(T * N1)), dy2(static_cast<size_t>(T * N2));
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(dy.begin() + t * (N1 + N2), N1, dy1.begin() + t * N1);
    std::copy_n(dy.begin() + t * (N1 + N2) + N1, N2, dy2.begin() + t * N2);
  }
  linear_backward_input(pool, parts[0], dy1.data(), want.data(), T);
  linear_backward_input(pool, parts[1], dy2.data(), want.data(), T);
  EXPECT_LT(rel_err(got, want), 1e-5);

  const Tensor bad[] = {parts[0], make_tensor(b2.data(), DType::f32, {N2 / 2, K * 2})};
  EXPECT_THROW(pack_transposed(pool, bad, TransposedPrecision::f16), Error);
}

}  // namespace
}  // namespace loom

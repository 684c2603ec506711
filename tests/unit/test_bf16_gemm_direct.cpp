// Direct bf16 input gradients (linear_backward_input_bf16_direct): W read in its
// own type and dequantized into AMX tiles on the fly. Dequantized tiles against
// dequantize_row_ref rounded to bf16, products against a double product of the
// rounded operands and against the copy path (pack_transposed ::bf16), awkward
// sizes, and bit-identical results for 1, 2 and 3 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/half.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/bf16_gemm_direct.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/ref/dequant_ref.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::random_floats;
using testing::random_weights;

constexpr DType kTypes[] = {DType::q4_0, DType::q4_1, DType::q5_0, DType::q5_1,
                            DType::q8_0, DType::f16,  DType::bf16, DType::f32};

bool have_direct() { return bf16_direct_available(DType::f32); }

float round_bf16(float x) { return bf16_to_fp32(cpu::round_to_bf16(x)); }

// max |a - b| / max |b|
double rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(a[i] - b[i]));
    m = std::max(m, std::fabs(b[i]));
  }
  return d / m;
}

std::vector<float> dequant_all(const Tensor& W) {
  std::vector<float> w(static_cast<size_t>(W.rows() * W.cols()));
  for (int64_t n = 0; n < W.rows(); ++n) dequantize_row_ref(W.dtype, W.row_ptr(n), w.data() + n * W.cols(), W.cols());
  return w;
}

// init + bf16(dy) bf16(W) in double.
std::vector<double> reference(const Tensor& W, const std::vector<float>& dy, const std::vector<float>& init,
                              int64_t T) {
  const int64_t N = W.rows(), K = W.cols();
  const std::vector<float> w = dequant_all(W);
  std::vector<double> out(init.begin(), init.end());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      const double g = round_bf16(dy[static_cast<size_t>(t * N + n)]);
      if (g == 0) continue;
      for (int64_t k = 0; k < K; ++k)
        out[static_cast<size_t>(t * K + k)] += g * round_bf16(w[static_cast<size_t>(n * K + k)]);
    }
  return out;
}

std::vector<float> run(ThreadPool& pool, const Tensor& W, const std::vector<float>& dy,
                       const std::vector<float>& init, int64_t T, bool accumulate) {
  std::vector<float> dx = init;
  PackedBackwardScratch scratch;
  linear_backward_input_bf16_direct(pool, W, dy.data(), W.rows(), dx.data(), T, accumulate, scratch);
  return dx;
}

double sum_tolerance(int64_t N) { return 1e-6 * std::max(1.0, std::sqrt(static_cast<double>(N) / 256.0)); }

TEST(Bf16GemmDirect, AvailabilityFollowsTheType) {
  EXPECT_FALSE(bf16_direct_available(DType::q4_k));
  EXPECT_FALSE(bf16_direct_available(DType::q6_k));
  for (DType t : kTypes) EXPECT_EQ(bf16_direct_available(t), bf16_direct_available(DType::f32)) << dtype_name(t);
}

TEST(Bf16GemmDirect, DequantizedTilesAreTheRoundedReferenceValues) {
  if (!have_direct()) GTEST_SKIP() << "no AMX-BF16";
  for (DType type : kTypes) {
    const bool plain = dtype_block_size(type) == 1;
    for (int64_t K : plain ? std::vector<int64_t>{37, 16, 64} : std::vector<int64_t>{32, 96}) {
      const int64_t N = 70;  // rows past N are zeros
      SCOPED_TRACE(::testing::Message() << dtype_name(type) << " K=" << K);
      auto wb = random_weights(type, N, K, 17);
      const Tensor W = make_tensor(wb.data(), type, {N, K});
      const std::vector<float> w = dequant_all(W);
      cpu::Bf16DirectWork work;
      ASSERT_TRUE(cpu::bf16_direct_type(type, &work.type));
      work.w = wb.data();
      work.w_row_bytes = W.row_bytes();
      work.N = N;
      work.K = K;
      alignas(64) uint16_t tiles[2][512];
      for (int64_t n0 = 0; n0 < N; n0 += 32)
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
          const bool two = k0 + 16 < K;
          std::memset(tiles, 0xff, sizeof(tiles));
          cpu::bf16_direct_dequant_tiles(work, n0, k0, reinterpret_cast<uint8_t*>(tiles[0]),
                                         two ? reinterpret_cast<uint8_t*>(tiles[1]) : nullptr);
          for (int i = 0; i < (two ? 2 : 1); ++i)
            for (int j = 0; j < 16; ++j)
              for (int r = 0; r < 16; ++r)
                for (int e = 0; e < 2; ++e) {
                  const int64_t n = n0 + 2 * j + e, k = k0 + 16 * i + r;
                  const uint16_t want =
                      n < N && k < K ? cpu::round_to_bf16(w[static_cast<size_t>(n * K + k)]) : uint16_t{0};
                  ASSERT_EQ(tiles[i][j * 32 + r * 2 + e], want) << "n=" << n << " k=" << k;
                }
        }
    }
  }
}

struct Case {
  DType type;
  int64_t N, K, T;
};

TEST(Bf16GemmDirect, MatchesTheDoubleProductOfRoundedOperandsAndTheCopyPath) {
  if (!have_direct()) GTEST_SKIP() << "no AMX-BF16";
  ThreadPool pool(2);
  const Case cases[] = {{DType::f32, 45, 70, 5},       {DType::q4_1, 96, 128, 17},  {DType::f16, 31, 16, 16},
                        {DType::bf16, 1, 1, 1},        {DType::q8_0, 2080, 64, 33}, {DType::q5_0, 77, 160, 9},
                        {DType::q5_1, 130, 96, 70},    {DType::q4_0, 1536, 576, 21}, {DType::f32, 49152, 24, 3},
                        {DType::q4_0, 192, 1536, 260}, {DType::f16, 2100, 40, 250}, {DType::q8_0, 49152, 576, 5}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " N=" << c.N << " K=" << c.K << " T=" << c.T);
    auto wb = random_weights(c.type, c.N, c.K, 11);
    const Tensor W = make_tensor(wb.data(), c.type, {c.N, c.K});
    const auto dy = random_floats(c.T * c.N, 5, 1e-4f);
    const auto init = random_floats(c.T * c.K, 6, 1e-3f);
    const std::vector<float> got = run(pool, W, dy, init, c.T, true);
    EXPECT_LT(rel_err(got, reference(W, dy, init, c.T)), sum_tolerance(c.N));
    // Overwriting gives the product alone; adding init to it in f32 is the
    // accumulating result, bit for bit.
    std::vector<float> prod = run(pool, W, dy, std::vector<float>(init.size(), NAN), c.T, false);
    for (size_t i = 0; i < prod.size(); ++i) prod[i] += init[i];
    EXPECT_EQ(0, std::memcmp(prod.data(), got.data(), prod.size() * sizeof(float)));
    // The copy path rounds the same operands: at most the f32 sums' grouping differs.
    const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
    std::vector<float> copy = init;
    PackedBackwardScratch scratch;
    linear_backward_input_packed(pool, Wt, dy.data(), c.N, copy.data(), c.T, true, scratch, Bf16Kernel::amx);
    EXPECT_LT(rel_err(got, std::vector<double>(copy.begin(), copy.end())), sum_tolerance(c.N));
  }
}

TEST(Bf16GemmDirect, EveryRowCountFrom1To70) {
  if (!have_direct()) GTEST_SKIP() << "no AMX-BF16";
  ThreadPool pool(3);
  for (const Case& c : {Case{DType::f32, 67, 37, 0}, Case{DType::q4_1, 64, 96, 0}}) {
    auto wb = random_weights(c.type, c.N, c.K, 3);
    const Tensor W = make_tensor(wb.data(), c.type, {c.N, c.K});
    for (int64_t T = 1; T <= 70; ++T) {
      SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " T=" << T);
      const auto dy = random_floats(T * c.N, static_cast<uint32_t>(T), 1.0f);
      const auto init = random_floats(T * c.K, 100 + static_cast<uint32_t>(T), 1.0f);
      EXPECT_LT(rel_err(run(pool, W, dy, init, T, true), reference(W, dy, init, T)), sum_tolerance(c.N));
    }
  }
}

TEST(Bf16GemmDirect, BitIdenticalForEveryThreadCount) {
  if (!have_direct()) GTEST_SKIP() << "no AMX-BF16";
  // 2100 rows: 66 steps (three chunks); 224 columns: 7 panel pairs split
  // unevenly; the loss shape (few rows, a long reduction) too.
  ThreadPool p1(1), p2(2), p3(3);
  for (const Case& c : {Case{DType::q4_1, 2100, 224, 70}, Case{DType::q4_1, 2100, 224, 300},
                        Case{DType::q8_0, 4160, 576, 64}, Case{DType::f32, 300, 70, 33}}) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " N=" << c.N << " K=" << c.K << " T=" << c.T);
    auto wb = random_weights(c.type, c.N, c.K, 9);
    const Tensor W = make_tensor(wb.data(), c.type, {c.N, c.K});
    const auto dy = random_floats(c.T * c.N, 4, 1e-3f);
    const auto init = random_floats(c.T * c.K, 5);
    for (bool acc : {true, false}) {
      const auto a = run(p1, W, dy, init, c.T, acc);
      const auto b = run(p2, W, dy, init, c.T, acc);
      const auto d = run(p3, W, dy, init, c.T, acc);
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(a.data(), d.data(), a.size() * sizeof(float)));
    }
  }
}

TEST(Bf16GemmDirect, UnsupportedTypeThrows) {
  if (!have_direct()) GTEST_SKIP() << "no AMX-BF16";
  ThreadPool pool(1);
  auto wb = random_weights(DType::q4_k, 4, 256, 1);
  const Tensor W = make_tensor(wb.data(), DType::q4_k, {4, 256});
  std::vector<float> dy(4, 1.0f), dx(256);
  PackedBackwardScratch scratch;
  EXPECT_THROW(linear_backward_input_bf16_direct(pool, W, dy.data(), 4, dx.data(), 1, false, scratch), Error);
}

}  // namespace
}  // namespace loom

// bf16 input gradients (TransposedPrecision::bf16): each kernel (AMX, AVX512-BF16,
// AVX2) against a double-precision product of the bf16-rounded operands and the
// exact path, at awkward sizes; bit-identical across thread counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/half.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/linear_backward.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::random_floats;
using testing::random_weights;

constexpr Bf16Kernel kKernels[] = {Bf16Kernel::amx, Bf16Kernel::avx512, Bf16Kernel::avx2};

const char* kernel_name(Bf16Kernel k) {
  switch (k) {
    case Bf16Kernel::amx:
      return "amx";
    case Bf16Kernel::avx512:
      return "avx512";
    case Bf16Kernel::avx2:
      return "avx2";
    default:
      return "automatic";
  }
}

// max |a - b| / max |b|
double rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(a[i] - b[i]));
    m = std::max(m, std::fabs(b[i]));
  }
  return d / m;
}

// The operand rounding: to nearest even, f32 subnormals to signed zeros.
uint16_t bf16_bits(float x) {
  const uint32_t u = float_to_bits(x);
  return (u & 0x7f800000u) == 0 ? static_cast<uint16_t>((u >> 16) & 0x8000u) : fp32_to_bf16(x);
}
float round_bf16(float x) { return bf16_to_fp32(bf16_bits(x)); }

// init + bf16(dy) bf16(W) in double, W dequantized first.
std::vector<double> reference(const Tensor& W, const std::vector<float>& dy, const std::vector<float>& init,
                              int64_t T) {
  const int64_t N = W.rows(), K = W.cols();
  std::vector<double> w(static_cast<size_t>(N * K)), out(init.begin(), init.end());
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    dequantize_row_ref(W.dtype, W.row_ptr(n), row.data(), K);
    for (int64_t k = 0; k < K; ++k)
      w[static_cast<size_t>(n * K + k)] = round_bf16(row[static_cast<size_t>(k)]);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      const double g = round_bf16(dy[static_cast<size_t>(t * N + n)]);
      if (g == 0) continue;
      for (int64_t k = 0; k < K; ++k)
        out[static_cast<size_t>(t * K + k)] += g * w[static_cast<size_t>(n * K + k)];
    }
  return out;
}

std::vector<float> run(ThreadPool& pool, const PackedWeight& Wt, const std::vector<float>& dy,
                       const std::vector<float>& init, int64_t T, bool accumulate, Bf16Kernel k) {
  std::vector<float> dx = init;
  PackedBackwardScratch scratch;
  linear_backward_input_packed(pool, Wt, dy.data(), Wt.cols(), dx.data(), T, accumulate, scratch, k);
  return dx;
}

struct Case {
  DType type;
  int64_t N, K, T;
};

// f32 sums of N terms drift from the exact sum by ~sqrt(N) roundings of 2^-24.
double sum_tolerance(int64_t N) { return 1e-6 * std::max(1.0, std::sqrt(static_cast<double>(N) / 256.0)); }

TEST(Bf16Gemm, EveryKernelMatchesTheDoubleProductOfRoundedOperands) {
  ThreadPool pool(2);
  const Case cases[] = {
      {DType::f32, 45, 70, 5},       {DType::q4_1, 96, 128, 17},   {DType::f16, 31, 16, 16},
      {DType::bf16, 1, 1, 1},        {DType::q8_0, 2080, 64, 33},  {DType::q4_k, 77, 1536, 9},
      {DType::f32, 49152, 24, 3},    {DType::q4_0, 1536, 576, 21}, {DType::q6_k, 40, 256, 70},
      {DType::q4_0, 192, 1536, 260}, {DType::f16, 2100, 40, 250},  {DType::q8_0, 49152, 576, 5}};
  for (Bf16Kernel kern : kKernels)
    if (!bf16_kernel_available(kern))
      std::printf("[ skipped ] bf16 kernel %s: not on this CPU\n", kernel_name(kern));
  for (const Case& c : cases) {
    auto wbytes = random_weights(c.type, c.N, c.K, 11);
    const Tensor W = make_tensor(wbytes.data(), c.type, {c.N, c.K});
    const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
    ASSERT_EQ(Wt.rows(), c.K);
    ASSERT_EQ(Wt.cols(), c.N);
    EXPECT_EQ(Wt.layout(), PackedLayout::bf16_pairs);
    const auto dy = random_floats(c.T * c.N, 5, 1e-4f);
    const auto init = random_floats(c.T * c.K, 6, 1e-3f);
    const std::vector<double> want = reference(W, dy, init, c.T);
    for (Bf16Kernel kern : kKernels) {
      if (!bf16_kernel_available(kern)) continue;
      SCOPED_TRACE(::testing::Message() << kernel_name(kern) << " " << dtype_name(c.type) << " N=" << c.N
                                        << " K=" << c.K << " T=" << c.T);
      const std::vector<float> got = run(pool, Wt, dy, init, c.T, true, kern);
      EXPECT_LT(rel_err(got, want), sum_tolerance(c.N));

      // Overwriting gives the product alone; adding init to it in f32 is the
      // accumulating result, bit for bit.
      std::vector<float> prod = run(pool, Wt, dy, std::vector<float>(init.size(), NAN), c.T, false, kern);
      for (size_t i = 0; i < prod.size(); ++i) prod[i] += init[i];
      EXPECT_EQ(0, std::memcmp(prod.data(), got.data(), prod.size() * sizeof(float)));
    }
  }
}

TEST(Bf16Gemm, EveryRowCountFrom1To70) {
  ThreadPool pool(3);
  const int64_t N = 67, K = 37;
  auto wbytes = random_weights(DType::f32, N, K, 3);
  const Tensor W = make_tensor(wbytes.data(), DType::f32, {N, K});
  const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
  for (Bf16Kernel kern : kKernels) {
    if (!bf16_kernel_available(kern)) continue;
    for (int64_t T = 1; T <= 70; ++T) {
      SCOPED_TRACE(::testing::Message() << kernel_name(kern) << " T=" << T);
      const auto dy = random_floats(T * N, static_cast<uint32_t>(T), 1.0f);
      const auto init = random_floats(T * K, 100 + static_cast<uint32_t>(T), 1.0f);
      EXPECT_LT(rel_err(run(pool, Wt, dy, init, T, true, kern), reference(W, dy, init, T)), sum_tolerance(N));
    }
  }
}

TEST(Bf16Gemm, CloseToTheExactPath) {
  ThreadPool pool(2);
  const Case cases[] = {{DType::q4_1, 576, 576, 13}, {DType::f32, 100, 200, 7}, {DType::q8_0, 192, 96, 40}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " N=" << c.N << " K=" << c.K << " T=" << c.T);
    auto wbytes = random_weights(c.type, c.N, c.K, 21);
    const Tensor W = make_tensor(wbytes.data(), c.type, {c.N, c.K});
    const auto dy = random_floats(c.T * c.N, 8, 1e-5f);
    std::vector<float> exact(static_cast<size_t>(c.T * c.K), 0.0f);
    linear_backward_input(pool, W, dy.data(), exact.data(), c.T);
    const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
    const auto got =
        run(pool, Wt, dy, std::vector<float>(exact.size(), 0.0f), c.T, false, Bf16Kernel::automatic);
    const double rel = rel_err(got, std::vector<double>(exact.begin(), exact.end()));
    EXPECT_LT(rel, 1e-2);  // two operands rounded to 8 significant bits
    EXPECT_GT(rel, 1e-5) << "the operands are rounded: the result cannot be exact";
  }
}

TEST(Bf16Gemm, BitIdenticalForEveryThreadCount) {
  // 66 steps of 32 (three chunks), 14 panels (7 pairs), 5 or 19 t-tiles: uneven
  // splits. With T = 300, 1 and 2 threads split rows, 3 threads split panels.
  const int64_t N = 2100, K = 224;
  auto wbytes = random_weights(DType::q4_1, N, K, 9);
  const Tensor W = make_tensor(wbytes.data(), DType::q4_1, {N, K});
  ThreadPool p1(1), p2(2), p3(3);
  const PackedWeight Wt = pack_transposed(p2, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
  const PackedWeight Wt3 = pack_transposed(p3, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
  ASSERT_EQ(0, std::memcmp(Wt.panel(0), Wt3.panel(0), Wt.nbytes())) << "packing depends on the thread count";
  for (int64_t T : {70, 300}) {
    const auto dy = random_floats(T * N, 4, 1e-3f);
    const auto init = random_floats(T * K, 5);
    for (Bf16Kernel kern : kKernels) {
      if (!bf16_kernel_available(kern)) continue;
      SCOPED_TRACE(::testing::Message() << kernel_name(kern) << " T=" << T);
      for (bool acc : {true, false}) {
        const auto a = run(p1, Wt, dy, init, T, acc, kern);
        const auto b = run(p2, Wt, dy, init, T, acc, kern);
        const auto c = run(p3, Wt, dy, init, T, acc, kern);
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)));
      }
    }
  }
  const int64_t T = 70;
  const auto dy = random_floats(T * N, 4, 1e-3f);
  const auto init = random_floats(T * K, 5);
  // automatic is the kernel resolve_bf16_kernel names.
  const Bf16Kernel chosen = cpu::resolve_bf16_kernel(Bf16Kernel::automatic);
  std::printf("[ bf16 ] automatic kernel here: %s\n", kernel_name(chosen));
  const auto a = run(p2, Wt, dy, init, T, true, Bf16Kernel::automatic);
  const auto b = run(p2, Wt, dy, init, T, true, chosen);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

TEST(Bf16Gemm, ConcatenatedPartsAndRecycling) {
  ThreadPool pool(2);
  const int64_t K = 48, T = 9, N1 = 40, N2 = 23;
  auto b1 = random_weights(DType::f16, N1, K, 1), b2 = random_weights(DType::f16, N2, K, 2);
  const Tensor parts[] = {make_tensor(b1.data(), DType::f16, {N1, K}),
                          make_tensor(b2.data(), DType::f16, {N2, K})};
  PackedWeight old = pack_transposed(pool, parts, TransposedPrecision::bf16);
  const uint8_t* mem = old.panel(0);
  const PackedWeight Wt = pack_transposed(pool, parts, TransposedPrecision::bf16, "qk", &old);
  EXPECT_EQ(Wt.panel(0), mem) << "same size: the memory is reused";
  const auto dy = random_floats(T * (N1 + N2), 3);
  const auto got = run(pool, Wt, dy, std::vector<float>(static_cast<size_t>(T * K), 0.0f), T, false,
                       Bf16Kernel::automatic);
  // The same as two separate products added.
  std::vector<float> dy1(static_cast<size_t>(T * N1)), dy2(static_cast<size_t>(T * N2));
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(dy.begin() + t * (N1 + N2), N1, dy1.begin() + t * N1);
    std::copy_n(dy.begin() + t * (N1 + N2) + N1, N2, dy2.begin() + t * N2);
  }
  std::vector<double> want = reference(parts[0], dy1, std::vector<float>(got.size(), 0.0f), T);
  const std::vector<double> want2 = reference(parts[1], dy2, std::vector<float>(got.size(), 0.0f), T);
  for (size_t i = 0; i < want.size(); ++i) want[i] += want2[i];
  EXPECT_LT(rel_err(got, want), sum_tolerance(N1 + N2));
}

TEST(Bf16Gemm, MatmulRejectsTheBf16Layout) {
  ThreadPool pool(1);
  auto wb = random_weights(DType::f32, 32, 16, 1);
  const Tensor W = make_tensor(wb.data(), DType::f32, {32, 16});
  const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
  std::vector<float> x(32), y(16);
  MatmulScratch scratch;
  EXPECT_THROW(matmul(pool, Wt, x.data(), y.data(), 1, scratch), Error);
}

TEST(Bf16Gemm, RoundingMatchesTheScalarModel) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          inf,
                          -inf,
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::denorm_min(),
                          bits_to_float(0x007fffffu) /* largest subnormal */,
                          std::numeric_limits<float>::min(),
                          1.00390625f /* tie, even */,
                          1.01171875f /* tie, odd */,
                          bits_to_float(0x7f800001u) /* signalling NaN */,
                          bits_to_float(0xffc01234u)};
  const auto r = random_floats(100, 9, 3.0f);
  x.insert(x.end(), r.begin(), r.end());
  for (int e = -150; e < 128; e += 3) x.push_back(std::ldexp(-1.337f, e));
  std::vector<uint16_t> got(x.size());
  cpu::round_to_bf16(x.data(), got.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(got[i], bf16_bits(x[i])) << "x[" << i << "] = " << x[i] << " bits " << float_to_bits(x[i]);
    EXPECT_EQ(cpu::round_to_bf16(x[i]), bf16_bits(x[i])) << "x[" << i << "] = " << x[i];
  }
  // As floats (the AVX2 bf16 activations), at every length's tail.
  for (const size_t n : {x.size(), x.size() - 3, size_t{7}}) {
    std::vector<float> as_f32(n);
    cpu::round_to_bf16_as_f32(x.data(), as_f32.data(), static_cast<int64_t>(n));
    for (size_t i = 0; i < n; ++i)
      EXPECT_EQ(float_to_bits(as_f32[i]), uint32_t{bf16_bits(x[i])} << 16)
          << "n " << n << " x[" << i << "] = " << x[i];
  }

  // The AVX2 and AVX-512 dy packers agree byte for byte (padding included), at
  // N and T that are not multiples of the tile.
  if (!bf16_kernel_available(Bf16Kernel::avx512)) GTEST_SKIP() << "no AVX512-BF16";
  const int64_t N = 77, T = 19, ld = 80, ns = cpu::bf16_steps(N);
  std::vector<float> dy = random_floats(T * ld, 12);
  std::copy(x.begin(), x.begin() + 15, dy.begin() + 40);  // the special values
  std::vector<uint8_t> a(static_cast<size_t>(2 * ns) * cpu::kBf16TileBytes, 0xcc), b(a.size(), 0x33);
  cpu::pack_dy_tiles_avx2(dy.data(), ld, N, T, 0, 2, ns, a.data());
  cpu::pack_dy_tiles_avx512(dy.data(), ld, N, T, 0, 2, ns, b.data());
  EXPECT_EQ(a, b);
  const auto* tile = reinterpret_cast<const uint16_t*>(a.data());  // tile (0, 1), row 2, column 5
  EXPECT_EQ(tile[512 + 2 * 32 + 5], bf16_bits(dy[2 * ld + 37]));
}

TEST(Bf16Gemm, ForcedKernelTheCpuLacksThrows) {
  ThreadPool pool(1);
  auto wb = random_weights(DType::f32, 32, 16, 1);
  const Tensor W = make_tensor(wb.data(), DType::f32, {32, 16});
  const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), TransposedPrecision::bf16);
  const std::vector<float> dy(32, 1.0f);
  for (Bf16Kernel kern : kKernels)
    if (!bf16_kernel_available(kern)) {
      EXPECT_THROW(run(pool, Wt, dy, std::vector<float>(16), 1, false, kern), Error);
    }
  EXPECT_TRUE(bf16_kernel_available(Bf16Kernel::avx2));
  EXPECT_TRUE(bf16_kernel_available(Bf16Kernel::automatic));
}

}  // namespace
}  // namespace loom

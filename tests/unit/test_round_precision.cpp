// bf16 / fp16 operand rounding (kernels/cpu/round_precision.h): the AVX2 body
// against the scalar definition on every kind of value, and the scalar
// definition against known roundings (ties to even, fp16 overflow and
// subnormals, bf16's flush of f32 subnormals).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/half.h"
#include "core/rng.h"
#include "cpu_backend_util.h"
#include "kernels/cpu/round_precision.h"

namespace loom {
namespace {

uint32_t bits(float f) { return float_to_bits(f); }

std::vector<float> values(size_t n) {
  CounterRng rng(7);
  std::vector<float> v;
  const float specials[] = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.0f, 65520.0f, -70000.0f, 6e-8f, 2.9e-8f, 1e-40f,
                            -1e-45f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), 0x1.008p0f, 0x1.018p0f, 3.4e38f};
  for (float s : specials) v.push_back(s);
  while (v.size() < n) {  // every exponent from 2^-140 to 2^120, random mantissas and signs
    const double e = -140 + 260 * rng.next_double();
    const double m = 1 + rng.next_double();
    v.push_back(static_cast<float>((rng.next_double() < 0.5 ? -1 : 1) * m * std::exp2(std::floor(e))));
  }
  return v;
}

TEST(RoundPrecision, VectorBodyEqualsScalar) {
  const std::vector<float> x = values(20011);  // not a multiple of 8: the tail runs too
  for (DType to : {DType::bf16, DType::f16, DType::f32}) {
    std::vector<float> y(x.size());
    round_to_precision(to, y.data(), x.data(), static_cast<int64_t>(x.size()));
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = round_to_precision_scalar(to, x[i]);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(y[i])) << dtype_name(to) << " element " << i;
      } else {
        ASSERT_EQ(bits(y[i]), bits(want)) << dtype_name(to) << " element " << i << " x " << x[i];
      }
    }
  }
}

TEST(RoundPrecision, BackendSplitsAndAliasesGiveTheSameBits) {
  test_util::CpuBackend cpu(2);
  const std::vector<float> x = values(100003);  // several chunks of the parallel split
  for (DType to : {DType::bf16, DType::f16}) {
    std::vector<float> a(x.size()), b = x;
    round_to_precision(to, a.data(), x.data(), static_cast<int64_t>(x.size()));
    cpu.backend->round_to(to, b.data(), b.data(), static_cast<int64_t>(b.size()));  // in place
    for (size_t i = 0; i < x.size(); ++i)
      if (!std::isnan(a[i])) {
        ASSERT_EQ(bits(a[i]), bits(b[i])) << dtype_name(to) << " element " << i;
      }
  }
}

TEST(RoundPrecision, KnownRoundings) {
  auto bf = [](float x) { return round_to_precision_scalar(DType::bf16, x); };
  auto hf = [](float x) { return round_to_precision_scalar(DType::f16, x); };
  EXPECT_EQ(bf(0x1.01p0f), 1.0f);          // a tie (bf16's ulp at 1 is 2^-7): to the even mantissa
  EXPECT_EQ(bf(0x1.03p0f), 0x1.04p0f);     // a tie: up to the even one
  EXPECT_EQ(bf(0x1.0101p0f), 0x1.02p0f);   // just above a tie
  EXPECT_EQ(bf(0x1.00fp0f), 1.0f);         // just below it
  EXPECT_EQ(bits(bf(1e-40f)), 0u);         // an f32 subnormal: zero, as vcvtneps2bf16
  EXPECT_EQ(bits(bf(-1e-40f)), 0x80000000u);
  EXPECT_TRUE(std::isinf(bf(3.4e38f)));    // rounds past the largest bf16
  EXPECT_EQ(hf(65519.0f), 65504.0f);
  EXPECT_TRUE(std::isinf(hf(65520.0f)));   // fp16 overflow: inf (what loss scaling watches for)
  EXPECT_EQ(hf(-70000.0f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(hf(6e-8f), 0x1p-24f);          // fp16's smallest subnormal
  EXPECT_EQ(hf(2.9e-8f), 0.0f);            // below half of it: underflow to zero
  EXPECT_EQ(hf(1.0f + 0x1p-11f), 1.0f);    // tie to even
  EXPECT_TRUE(std::isnan(hf(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace loom

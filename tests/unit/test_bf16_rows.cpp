// f32 <-> bf16 row conversion (kernels/cpu/bf16_rows.h, Backend::to_bf16 /
// from_bf16) against the scalar reference (kernels/ref/bf16_rows_ref.h), and
// the reference against known roundings.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "cpu_backend_util.h"
#include "kernels/cpu/bf16_rows.h"
#include "kernels/ref/bf16_rows_ref.h"

namespace loom {
namespace {

std::vector<float> values(size_t n) {
  CounterRng rng(11);
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 1e-40f, -1e-45f, 3.4e38f, -3.4e38f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), 0x1.008p0f, 0x1.01p0f, 0x1.03p0f, 0x1.0101p0f};
  while (v.size() < n) {
    const double e = -140 + 260 * rng.next_double();
    v.push_back(static_cast<float>((rng.next_double() < 0.5 ? -1 : 1) * (1 + rng.next_double()) *
                                   std::exp2(std::floor(e))));
  }
  return v;
}

TEST(Bf16Rows, ReferenceRounding) {
  EXPECT_EQ(ref::f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(ref::f32_to_bf16(0x1.008p0f), 0x3f80);   // below the tie (ulp 2^-7)
  EXPECT_EQ(ref::f32_to_bf16(0x1.01p0f), 0x3f80);    // tie, even stays
  EXPECT_EQ(ref::f32_to_bf16(0x1.03p0f), 0x3f82);    // tie, odd rounds up
  EXPECT_EQ(ref::f32_to_bf16(0x1.0101p0f), 0x3f81);  // above the tie
  EXPECT_EQ(ref::f32_to_bf16(-1e-40f), 0x8000);       // subnormal -> signed zero
  EXPECT_EQ(ref::f32_to_bf16(3.4e38f), 0x7f80);       // rounds up to inf
  EXPECT_TRUE(std::isnan(ref::bf16_to_f32(ref::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(ref::bf16_to_f32(0xc040), -3.0f);
}

TEST(Bf16Rows, KernelsEqualReference) {
  const std::vector<float> x = values(20011);  // not a multiple of 8 or 32: tails run too
  std::vector<uint16_t> h(x.size());
  f32_to_bf16_rows(h.data(), x.data(), static_cast<int64_t>(x.size()));
  std::vector<float> back(x.size());
  bf16_to_f32_rows(back.data(), h.data(), static_cast<int64_t>(h.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(h[i], ref::f32_to_bf16(x[i])) << "element " << i << " value " << x[i];
    const float r = ref::bf16_to_f32(h[i]);
    ASSERT_EQ(0, std::memcmp(&back[i], &r, sizeof r)) << "element " << i;
  }
}

TEST(Bf16Rows, BackendOpsEqualReferenceOnThreads) {
  test_util::CpuBackend cpu(2);
  const std::vector<float> x = values(100003);  // several chunks of the backend's split
  std::vector<uint16_t> h(x.size());
  cpu.backend->to_bf16(h.data(), x.data(), static_cast<int64_t>(x.size()));
  std::vector<float> back(x.size());
  cpu.backend->from_bf16(back.data(), h.data(), static_cast<int64_t>(h.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(h[i], ref::f32_to_bf16(x[i])) << "element " << i;
    const float r = ref::bf16_to_f32(h[i]);
    ASSERT_EQ(0, std::memcmp(&back[i], &r, sizeof r)) << "element " << i;
  }
}

}  // namespace
}  // namespace loom

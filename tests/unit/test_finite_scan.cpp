// scan_finite (core/finite_scan.h) against the plain loop it replaced.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/finite_scan.h"

namespace loom {
namespace {

FiniteScan reference_scan(const std::vector<float>& v) {
  FiniteScan s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      s.first_non_finite = static_cast<int64_t>(i);
      s.max_abs = 0;
      return s;
    }
    s.max_abs = std::max(s.max_abs, std::fabs(v[i]));
  }
  return s;
}

TEST(FiniteScan, MaxAbsEqualsThePlainLoopBitForBit) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int n : {0, 1, 7, 8, 31, 1000, 4099}) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = nd(rng);
    if (n > 3) {
      v[1] = -0.0f;
      v[2] = std::numeric_limits<float>::denorm_min();
      v[3] = -std::numeric_limits<float>::max();  // the largest magnitude, negative
    }
    const FiniteScan got = scan_finite(v.data(), n), want = reference_scan(v);
    SCOPED_TRACE(n);
    EXPECT_EQ(got.first_non_finite, -1);
    EXPECT_EQ(std::bit_cast<uint32_t>(got.max_abs), std::bit_cast<uint32_t>(want.max_abs));
  }
}

TEST(FiniteScan, FindsTheFirstNanOrInf) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, -nan, inf, -inf}) {
    for (int64_t at : {0, 5, 63, 999}) {
      std::vector<float> v(1000, 0.5f);
      v[static_cast<size_t>(at)] = bad;
      if (at + 7 < 1000) v[static_cast<size_t>(at) + 7] = nan;  // a later one does not count
      SCOPED_TRACE(::testing::Message() << bad << " at " << at);
      EXPECT_EQ(scan_finite(v.data(), 1000).first_non_finite, at);
    }
  }
}

}  // namespace
}  // namespace loom

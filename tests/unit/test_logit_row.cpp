// kernels/cpu/logit_row.h: the greedy argmax, log-sum-exp and top-k of a row
// of logits against std::max_element, a long-double sum and a stable sort.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/logit_row.h"

namespace loom {
namespace {

// argmax_first against std::max_element (the first index of the largest) on
// rows of every length up to 80 (the vector loop and the tail), ties inside a
// lane, across lanes and in the tail, -inf rows and NaN (never the largest).
TEST(LogitRow, ArgmaxFirstIsMaxElementsAnswer) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> level(-3, 3);
  for (int n = 1; n <= 80; ++n)
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& v : x) v = static_cast<float>(level(rng));  // few values: many ties
      if (trial % 7 == 0) x[static_cast<size_t>(trial) % x.size()] = -INFINITY;
      if (trial % 11 == 0) x.assign(x.size(), -INFINITY);
      const auto want = std::max_element(x.begin(), x.end()) - x.begin();
      ASSERT_EQ(argmax_first(x.data(), n), want) << "n=" << n << " trial=" << trial;
    }
  // NaN is skipped wherever it is (std::max_element's answer would depend on its place).
  std::vector<float> x(37, 0.0f);
  x[20] = 2.0f;
  x[35] = 2.0f;
  for (size_t at : {size_t{0}, size_t{5}, size_t{20}, size_t{36}}) {
    std::vector<float> y = x;
    y[at] = NAN;
    EXPECT_EQ(argmax_first(y.data(), 37), at == 20 ? 35 : 20) << "NaN at " << at;
  }
  // A large vocabulary with the maximum in the last vector and in the tail.
  std::vector<float> v(49157, 0.5f);
  v[49150] = 1.0f;
  EXPECT_EQ(argmax_first(v.data(), 49157), 49150);
  v[49156] = 2.0f;
  EXPECT_EQ(argmax_first(v.data(), 49157), 49156);
}

// Against the sum in long double of exp(x - max) over the finite values:
// within 1e-6 relative to the answer's magnitude (simd::exp_ps is a few ulp in
// float; the sum is in double), on lengths around the 8-lane boundary and a
// vocabulary-sized row, with -inf entries (masked tokens) and NaN skipped.
TEST(LogitRow, LogSumExpMatchesALongDoubleSum) {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  for (int64_t n : {1, 7, 8, 9, 31, 64, 1000, 49152}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = dist(rng);
    if (n > 3) x[2] = -INFINITY;
    if (n > 5) x[4] = NAN;
    float mx = -INFINITY;
    for (float v : x)
      if (!std::isnan(v)) mx = std::max(mx, v);
    long double sum = 0;
    for (float v : x)
      if (!std::isnan(v)) sum += std::exp(static_cast<long double>(v) - mx);
    const double want = static_cast<double>(mx + std::log(sum));
    EXPECT_NEAR(logsumexp(x.data(), n), want, 1e-6 * std::max(1.0, std::fabs(want))) << "n=" << n;
  }
  const std::vector<float> masked(20, -INFINITY);
  EXPECT_EQ(logsumexp(masked.data(), 20), -INFINITY);
  const float one[] = {3.5f};
  EXPECT_DOUBLE_EQ(logsumexp(one, 1), 3.5);
}

// The first k of a stable sort by descending value (NaN last), for every k on
// rows with many ties, -inf and NaN, and on a vocabulary-sized row.
TEST(LogitRow, TopKIsAStableDescendingSortsPrefix) {
  std::mt19937 rng(13);
  std::uniform_int_distribution<int> level(-4, 4);
  auto reference = [](const std::vector<float>& x) {
    std::vector<int32_t> idx(x.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
      if (std::isnan(x[a]) || std::isnan(x[b])) return !std::isnan(x[a]) && std::isnan(x[b]);
      return x[a] > x[b];
    });
    return idx;
  };
  for (int n = 1; n <= 45; ++n)
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& v : x) v = static_cast<float>(level(rng));
      if (trial % 5 == 1) x[static_cast<size_t>(trial) % x.size()] = NAN;
      if (trial % 5 == 2) x[static_cast<size_t>(trial * 3) % x.size()] = -INFINITY;
      if (trial % 9 == 3) x.assign(x.size(), NAN);
      const std::vector<int32_t> want = reference(x);
      for (int k = 0; k <= n; ++k) {
        std::vector<int32_t> got(static_cast<size_t>(k));
        top_k(x.data(), n, k, got.data());
        ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin()))
            << "n=" << n << " trial=" << trial << " k=" << k;
      }
    }
  // A NaN among the first k kept, then -inf values that outrank it.
  std::vector<float> m(20, -INFINITY);
  m[0] = NAN;
  m[1] = 0.0f;
  std::vector<int32_t> two(2);
  top_k(m.data(), 20, 2, two.data());
  EXPECT_EQ(two, (std::vector<int32_t>{1, 2}));
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> v(49152);
  for (float& e : v) e = dist(rng);
  const std::vector<int32_t> want = reference(v);
  std::vector<int32_t> got(20);
  top_k(v.data(), 49152, 20, got.data());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()));
}

}  // namespace
}  // namespace loom

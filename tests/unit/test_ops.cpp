// Fast row-wise operators against their scalar double-precision references.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/ref/ops_ref.h"
#include "ops_test_util.h"

namespace loom {
namespace {

using test_util::random_vec;

void expect_close(const std::vector<float>& a, const std::vector<float>& b, float rtol, float atol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_NEAR(a[i], b[i], atol + rtol * std::fabs(b[i])) << "at " << i;
}

TEST(Ops, RmsNormMatchesReference) {
  for (int64_t n : {1, 7, 64, 577}) {
    const int64_t T = 3;
    auto x = random_vec(static_cast<size_t>(T * n), 1, 3.0f), w = random_vec(static_cast<size_t>(n), 2);
    std::vector<float> a(x.size()), b(x.size());
    rmsnorm(a.data(), x.data(), w.data(), T, n, 1e-5f);
    ref::rmsnorm(b.data(), x.data(), w.data(), T, n, 1e-5f);
    expect_close(a, b, 1e-5f, 1e-6f);
  }
}

TEST(Ops, SwiGluMatchesReference) {
  for (int64_t n : {1, 9, 1537}) {
    auto g = random_vec(static_cast<size_t>(n), 3, 6.0f), u = random_vec(static_cast<size_t>(n), 4);
    g[0] = -90.f;  // exp overflow region must stay finite
    std::vector<float> a(g.size()), b(g.size());
    swiglu(a.data(), g.data(), u.data(), n);
    ref::swiglu(b.data(), g.data(), u.data(), n);
    expect_close(a, b, 1e-5f, 1e-6f);
  }
}

TEST(Ops, RopeMatchesReferenceBothLayouts) {
  for (bool inter : {true, false}) {
    RopeTable rope;
    rope.head_dim = 16;
    rope.interleaved = inter;
    for (int i = 0; i < 8; ++i) rope.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / 16)));
    const int64_t T = 5, H = 3;
    auto x = random_vec(static_cast<size_t>(T * H * 16), 5);
    std::vector<int32_t> pos = {0, 1, 17, 300, 8191};
    auto a = x, b = x;
    rope_apply(rope, a.data(), T, H, pos.data());
    ref::rope_apply(rope, b.data(), T, H, pos.data());
    expect_close(a, b, 1e-5f, 1e-5f);
  }
}

TEST(Ops, AttentionMatchesReferenceWithGqaAndPacking) {
  ThreadPool pool(2);
  AttentionShape s{6, 2, 20, 2 * 20 + 3};  // awkward head_dim and padded kv stride
  const int64_t T = 13, ctx = 40;
  auto q = random_vec(static_cast<size_t>(T * 6 * 20), 6, 2.0f);
  auto k = random_vec(static_cast<size_t>(ctx * s.kv_stride), 7, 2.0f);
  auto v = random_vec(static_cast<size_t>(ctx * s.kv_stride), 8);
  std::vector<int32_t> pos(T), start(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[static_cast<size_t>(t)] = static_cast<int32_t>(20 + t);
    start[static_cast<size_t>(t)] = t < 6 ? 0 : 26;  // second packed sample begins at position 26
  }
  std::vector<float> a(q.size()), b(q.size());
  attention(pool, s, q.data(), k.data(), v.data(), a.data(), T, pos.data(), start.data());
  ref::attention(s, q.data(), k.data(), v.data(), b.data(), T, pos.data(), start.data());
  expect_close(a, b, 1e-4f, 1e-5f);
}

}  // namespace
}  // namespace loom

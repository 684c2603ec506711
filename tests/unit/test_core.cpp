#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "core/thread_pool.h"

#include <immintrin.h>

namespace loom {

TEST(Half, Fp16RoundTripMatchesF16C) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-70000.f, 70000.f);
  for (int i = 0; i < 200000; ++i) {
    float x = dist(rng);
    if (i % 3 == 0) x *= 1e-6f;  // subnormal range of fp16
    const uint16_t h = fp32_to_fp16(x);
    EXPECT_EQ(h, _cvtss_sh(x, 0)) << x;
    const float back = fp16_to_fp32(h);
    const float hw = _cvtsh_ss(h);
    EXPECT_EQ(float_to_bits(back), float_to_bits(hw)) << h;
  }
}

TEST(Half, Bf16RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_fp32(0x3f80), 1.0f);
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x3f808000)), 0x3f80);  // tie -> even
  EXPECT_EQ(fp32_to_bf16(bits_to_float(0x3f818000)), 0x3f82);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(NAN))));
}

TEST(DType, RowBytesAndNames) {
  EXPECT_EQ(dtype_row_bytes(DType::q4_1, 576), 18u * 20u);
  EXPECT_EQ(dtype_row_bytes(DType::q6_k, 512), 2u * 210u);
  EXPECT_EQ(dtype_from_name("Q4_K"), DType::q4_k);
  EXPECT_FALSE(dtype_traits_of_id(16).has_value());  // IQ2_XXS: unsupported
}

TEST(ThreadPool, ParallelForCoversRangeExactlyOnce) {
  for (int nt : {1, 2, 3, 5}) {
    ThreadPool pool(nt);
    for (int64_t n : {0, 1, 7, 64, 1001}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      for (int rep = 0; rep < 50; ++rep)
        pool.parallel_for(n, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
        });
      for (auto& h : hits) EXPECT_EQ(h.load(), 50);
    }
  }
}

TEST(ThreadPool, RunGivesEachThreadItsIndex) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> seen(4);
  pool.run([&](int ti, int tn) {
    EXPECT_EQ(tn, 4);
    seen[static_cast<size_t>(ti)]++;
  });
  for (auto& s : seen) EXPECT_EQ(s.load(), 1);
}

}  // namespace loom

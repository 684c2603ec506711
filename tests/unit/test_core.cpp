#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "core/tensor.h"
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
  EXPECT_EQ(dtype_traits_of_id(39)->type, DType::mxfp4);
  EXPECT_EQ(dtype_row_bytes(DType::mxfp4, 64), 2u * 17u);
  EXPECT_EQ(dtype_traits_of_id(40)->type, DType::nvfp4);
  EXPECT_EQ(dtype_row_bytes(DType::nvfp4, 128), 2u * 36u);
  EXPECT_EQ(dtype_traits_of_id(41)->type, DType::q1_0);
  EXPECT_EQ(dtype_row_bytes(DType::q1_0, 256), 2u * 18u);
  EXPECT_EQ(dtype_traits_of_id(42)->type, DType::q2_0);
  EXPECT_EQ(dtype_row_bytes(DType::q2_0, 256), 4u * 18u);
  EXPECT_EQ(dtype_from_name("Q1_0"), DType::q1_0);
  EXPECT_EQ(dtype_traits_of_id(34)->type, DType::tq1_0);
  EXPECT_EQ(dtype_row_bytes(DType::tq1_0, 512), 2u * 54u);
  EXPECT_EQ(dtype_row_bytes(DType::tq2_0, 512), 2u * 66u);
  EXPECT_EQ(dtype_traits_of_id(19)->type, DType::iq1_s);
  EXPECT_EQ(dtype_row_bytes(DType::iq1_m, 512), 2u * 56u);
  EXPECT_EQ(dtype_traits_of_id(21)->type, DType::iq3_s);
  EXPECT_EQ(dtype_row_bytes(DType::iq2_xxs, 512), 2u * 66u);
}

// Zero-length dims are legal in safetensors files; a zero last dim once divided by zero
// (found by fuzz_safetensors).
TEST(Tensor, ZeroLengthDimsHaveRowsAndNoBytes) {
  const Tensor empty_rows = make_tensor(nullptr, DType::f32, {3, 0});
  EXPECT_EQ(empty_rows.rows(), 3);
  EXPECT_EQ(empty_rows.cols(), 0);
  EXPECT_EQ(empty_rows.nbytes(), 0u);
  const Tensor no_rows = make_tensor(nullptr, DType::bf16, {0, 4});
  EXPECT_EQ(no_rows.rows(), 0);
  EXPECT_EQ(no_rows.nbytes(), 0u);
  const Tensor cube = make_tensor(nullptr, DType::f16, {2, 3, 5});
  EXPECT_EQ(cube.rows(), 6);
  EXPECT_EQ(cube.nbytes(), 60u);
  EXPECT_EQ(make_tensor(nullptr, DType::f32, {}).rows(), 1);
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

TEST(ThreadPool, RunCallsEachIndexOnce) {
  for (int nt : {2, 4, 7}) {
    ThreadPool pool(nt);
    std::vector<std::atomic<int>> seen(static_cast<size_t>(nt));
    for (int rep = 0; rep < 200; ++rep)
      pool.run([&](int ti, int tn) {
        EXPECT_EQ(tn, nt);
        seen[static_cast<size_t>(ti)]++;
      });
    for (auto& s : seen) EXPECT_EQ(s.load(), 200);
  }
}

// Workers that went to sleep (longer than the spin) are woken by the next run;
// a pool destroyed at once, or while its workers sleep, joins them.
TEST(ThreadPool, WakesSleepingWorkersAndStops) {
  { ThreadPool fresh(3); }
  ThreadPool pool(3);
  for (int rep = 0; rep < 5; ++rep) {
    std::atomic<int> sum{0};
    pool.run([&](int ti, int) { sum += ti + 1; });
    EXPECT_EQ(sum.load(), 6);
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
}

// Far more threads than CPUs (64 on a 2-core machine): every run still calls
// each index exactly once and results add up; threads that arrive late find
// their indices taken and must not run them again. The bound is generous (a
// spinning pool took minutes here); it guards against hangs, not speed.
TEST(ThreadPool, OversubscribedPoolCompletesCorrectly) {
  const auto t0 = std::chrono::steady_clock::now();
  ThreadPool pool(64);
  constexpr int64_t kN = 10000;
  std::vector<int64_t> data(kN);
  for (int64_t i = 0; i < kN; ++i) data[static_cast<size_t>(i)] = i;
  std::vector<std::atomic<int>> hits(64);
  for (int rep = 0; rep < 300; ++rep) {
    std::vector<int64_t> partial(64, 0);
    pool.run([&](int ti, int tn) {
      hits[static_cast<size_t>(ti)]++;
      for (int64_t i = ti; i < kN; i += tn) partial[static_cast<size_t>(ti)] += data[static_cast<size_t>(i)];
    });
    int64_t total = 0;
    for (int64_t p : partial) total += p;
    ASSERT_EQ(total, kN * (kN - 1) / 2) << "run " << rep;
    std::atomic<int64_t> covered{0};
    pool.parallel_for(kN, [&](int64_t b, int64_t e) { covered += e - b; }, 16);
    ASSERT_EQ(covered.load(), kN);
  }
  for (auto& h : hits) EXPECT_EQ(h.load(), 300);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
}

// Several pools used at once from different threads (serve's scheduler and a
// training run in one test binary, say) stay independent.
TEST(ThreadPool, ConcurrentPoolsStayIndependent) {
  std::vector<std::thread> users;
  std::atomic<int> bad{0};
  for (int u = 0; u < 3; ++u)
    users.emplace_back([&] {
      ThreadPool pool(3);
      for (int rep = 0; rep < 300; ++rep) {
        std::atomic<int> mask{0};
        pool.run([&](int ti, int) { mask |= 1 << ti; });
        if (mask.load() != 7) ++bad;
      }
    });
  for (auto& t : users) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace loom

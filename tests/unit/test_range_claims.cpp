// RangeClaims (core/range_claims.h): every index claimed exactly once, a
// worker's own part first and in order, then the others' tails.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "core/range_claims.h"

namespace loom {
namespace {

TEST(RangeClaims, OneWorkerTakesItsPartInOrderThenTheOthersTailsFromTheBack) {
  RangeClaims rc;
  rc.reset(20, 2, 4);  // parts [0, 10) and [10, 20)
  std::vector<std::pair<int64_t, int64_t>> got;
  for (int64_t b, e; rc.next(1, &b, &e);) got.emplace_back(b, e);
  const std::vector<std::pair<int64_t, int64_t>> want = {{10, 14}, {14, 18}, {18, 20},
                                                         {6, 10},  {2, 6},   {0, 2}};
  EXPECT_EQ(got, want);
  int64_t b = -1, e = -1;
  EXPECT_FALSE(rc.next(0, &b, &e));
}

TEST(RangeClaims, EvenWorkersKeepTheStaticSplit) {
  RangeClaims rc;
  rc.reset(10, 3, 2);  // parts [0, 3), [3, 6), [6, 10)
  const std::vector<std::pair<int64_t, int64_t>> want[3] = {
      {{0, 2}, {2, 3}}, {{3, 5}, {5, 6}}, {{6, 8}, {8, 10}}};
  for (int round = 0; round < 2; ++round)
    for (int w = 0; w < 3; ++w) {
      int64_t b = -1, e = -1;
      ASSERT_TRUE(rc.next(w, &b, &e));
      EXPECT_EQ(std::make_pair(b, e), want[w][round]) << "worker " << w << " claim " << round;
    }
}

TEST(RangeClaims, EmptyRangeAndMoreWorkersThanIndices) {
  RangeClaims rc;
  int64_t b = -1, e = -1;
  rc.reset(0, 4, 3);
  for (int w = 0; w < 4; ++w) EXPECT_FALSE(rc.next(w, &b, &e));
  rc.reset(2, 5, 3);  // three parts are empty: their workers steal
  std::vector<int> seen(2, 0);
  for (int w = 0; w < 5; ++w)
    while (rc.next(w, &b, &e))
      for (int64_t i = b; i < e; ++i) ++seen[static_cast<size_t>(i)];
  EXPECT_EQ(seen, std::vector<int>({1, 1}));
}

// Threads racing for the same parts (one of them slowed) still cover [0, n)
// exactly once, over reuse of one RangeClaims for many ops.
TEST(RangeClaims, RacingThreadsClaimEveryIndexExactlyOnce) {
  constexpr int kThreads = 4;
  constexpr int64_t kN = 5000;
  RangeClaims rc;
  for (int op = 0; op < 20; ++op) {
    rc.reset(kN - op, kThreads, 1 + op % 7);
    std::vector<std::atomic<int>> seen(kN);
    std::vector<std::thread> threads;
    for (int w = 0; w < kThreads; ++w)
      threads.emplace_back([&, w] {
        for (int64_t b, e; rc.next(w, &b, &e);) {
          if (w == 0) std::this_thread::yield();  // a slow worker: others take its tail
          for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
        }
      });
    for (std::thread& t : threads) t.join();
    for (int64_t i = 0; i < kN; ++i)
      ASSERT_EQ(seen[static_cast<size_t>(i)].load(), i < kN - op ? 1 : 0) << "op " << op << " index " << i;
  }
}

}  // namespace
}  // namespace loom

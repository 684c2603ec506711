// GradientReducer (src/dist/grad_reducer.h) over an in-process group of N ranks
// (thread_communicator.h): plain sums on every rank with buckets handed over
// during the backward, the bucket plan, deterministic rank-order sums bit for
// bit, top-k with error feedback against a model of it, PowerSGD on rank-1
// gradients, and the wire-byte statistics.
//
// The fake communicator sums all-reduces in descending rank order (N-1 first),
// so a rank-order (0..N-1) check tells the deterministic path from a plain
// all-reduce bit for bit.
#include <fmt/format.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "thread_communicator.h"

namespace loom {
namespace {

using test_util::run_ranks;
using test_util::ThreadCommunicator;
using test_util::ThreadGroup;

using Grads = std::vector<float>;

// Uniform mantissas in [-1, 1) scaled by 2^-4 .. 2^4: sums of these round, and
// differently in different orders.
Grads random_grads(size_t n, uint64_t seed) {
  CounterRng rng(seed);
  Grads g(n);
  for (float& v : g) {
    const double m = 2.0 * rng.next_double() - 1.0;
    const int e = static_cast<int>(rng.next_u64() % 9) - 4;
    v = static_cast<float>(std::ldexp(m, e));
  }
  return g;
}

// k/64 with |k| <= 64: sums of a few of these are exact in float in any order.
Grads dyadic_grads(size_t n, uint64_t seed) {
  CounterRng rng(seed);
  Grads g(n);
  for (float& v : g) v = static_cast<float>(static_cast<int>(rng.next_u64() % 129) - 64) / 64.0f;
  return g;
}

// The gradient arena of a full fine-tune: `head` floats no layer covers (the
// embedding), the layers back to back, `tail` floats (final norm, output).
struct Arena {
  size_t size = 0;
  std::vector<std::pair<size_t, size_t>> layers;
  std::vector<GradMatrix> matrices;
};

Arena layered_arena(size_t head, const std::vector<size_t>& layer_sizes, size_t tail) {
  Arena a;
  size_t at = head;
  for (size_t n : layer_sizes) {
    a.layers.push_back({at, at + n});
    at += n;
  }
  a.size = at + tail;
  return a;
}

// inputs[step][rank]
using Inputs = std::vector<std::vector<Grads>>;

Inputs random_inputs(const Arena& a, int n_ranks, int steps, uint64_t seed) {
  Inputs in(static_cast<size_t>(steps));
  for (int s = 0; s < steps; ++s)
    for (int r = 0; r < n_ranks; ++r) in[s].push_back(random_grads(a.size, seed * 1000 + s * 10 + r));
  return in;
}

struct RunResult {
  std::vector<std::vector<Grads>> out;            // [step][rank]: the arena after finish()
  std::vector<std::vector<GradSyncStats>> stats;  // [step][rank]
  size_t buckets = 0;
};

// Each step as the backward goes: the arena poisoned with NaN (a bucket reduced
// before its gradients are written poisons the result), begin_step, the
// non-layer ranges after the first layer written (output, final norm: the
// backward's first gradients), the layers last first, each followed by
// layer_done, the head (embedding: the last gradient) written, finish().
RunResult run_steps(ThreadGroup& group, const Arena& a, const GradSyncOptions& opt, const Inputs& in) {
  const auto N = static_cast<size_t>(group.size());
  RunResult res;
  res.out.assign(in.size(), std::vector<Grads>(N));
  res.stats.assign(in.size(), std::vector<GradSyncStats>(N));
  const size_t head_end = a.layers.empty() ? a.size : a.layers.front().first;
  std::vector<bool> in_layer(a.size, false);
  for (const auto& [lo, hi] : a.layers)
    for (size_t i = lo; i < hi; ++i) in_layer[i] = true;
  std::vector<size_t> buckets(N);
  run_ranks(group, [&](ThreadCommunicator& comm) {
    const auto r = static_cast<size_t>(comm.rank());
    Grads arena(a.size);
    GradientReducer red(comm, arena, a.layers, a.matrices, opt);
    buckets[r] = red.bucket_count();
    for (size_t s = 0; s < in.size(); ++s) {
      const Grads& g = in[s][r];
      std::fill(arena.begin(), arena.end(), std::numeric_limits<float>::quiet_NaN());
      red.begin_step();
      for (size_t i = head_end; i < a.size; ++i)
        if (!in_layer[i]) arena[i] = g[i];
      for (auto l = static_cast<int64_t>(a.layers.size()) - 1; l >= 0; --l) {
        const auto [lo, hi] = a.layers[static_cast<size_t>(l)];
        std::copy(g.begin() + static_cast<std::ptrdiff_t>(lo), g.begin() + static_cast<std::ptrdiff_t>(hi),
                  arena.begin() + static_cast<std::ptrdiff_t>(lo));
        red.layer_done(l);
      }
      std::copy(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(head_end), arena.begin());
      res.stats[s][r] = red.finish();
      res.out[s][r] = arena;
    }
  });
  for (size_t r = 1; r < N; ++r) EXPECT_EQ(buckets[r], buckets[0]) << "rank " << r;
  res.buckets = buckets[0];
  return res;
}

// |out - sum_r g_r| <= rel * sum_r |g_r| for every entry (the reference in
// double; the float sum of N terms is off by at most (N-1) 2^-24 sum |g_r|).
void expect_sum(const Grads& out, const std::vector<Grads>& in, double rel, const std::string& what) {
  size_t bad = 0, first = 0;
  double first_ref = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    double ref = 0, mag = 0;
    for (const Grads& g : in) {
      ref += g[i];
      mag += std::fabs(g[i]);
    }
    if (!(std::fabs(out[i] - ref) <= rel * mag)) {
      if (bad++ == 0) first = i, first_ref = ref;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << out.size() << " entries off; first [" << first
                     << "] = " << out[first] << ", sum " << first_ref;
}

// The sum in rank order in float: ((g0 + g1) + g2) ...
Grads rank_order_sum(const std::vector<Grads>& in) {
  Grads s = in[0];
  for (size_t r = 1; r < in.size(); ++r)
    for (size_t i = 0; i < s.size(); ++i) s[i] += in[r][i];
  return s;
}

size_t count_bit_differences(const Grads& a, const Grads& b) {
  size_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return d;
}

void expect_same_on_every_rank(const std::vector<Grads>& out, const std::string& what) {
  for (size_t r = 1; r < out.size(); ++r)
    EXPECT_EQ(count_bit_differences(out[r], out[0]), 0u) << what << ": rank " << r << " differs from rank 0";
}

// 2 (N-1)/N B, as the reducer rounds it (per bucket, toward zero).
int64_t allreduce_wire(int n, size_t bytes) {
  return static_cast<int64_t>(2.0 * (n - 1) / n * static_cast<double>(bytes));
}

// --- plain mode ------------------------------------------------------------------------------------------

TEST(GradReducer, PlainSumOnEveryRank) {
  // embedding 700 | six layers | final norm + output 530
  const Arena a = layered_arena(700, {120, 90, 150, 110, 130, 100}, 530);
  struct Case {
    size_t cap_floats, buckets;
  };
  // cap 250: layers {4,5} {3} {1,2} {0}, head 250+250+200, tail 250+250+30 -> 10;
  // cap 64: every layer alone, head 11 and tail 9 chunks -> 26; 4 MiB: one bucket each -> 3.
  const Case cases[] = {{250, 10}, {64, 26}, {size_t{1} << 20, 3}};
  for (int N : {2, 3, 4})
    for (bool overlap : {true, false})
      for (const Case& c : cases) {
        const std::string what = fmt::format("N={} overlap={} cap={} floats", N, overlap, c.cap_floats);
        SCOPED_TRACE(what);
        GradSyncOptions opt;
        opt.bucket_bytes = c.cap_floats * sizeof(float);
        opt.overlap = overlap;
        const Inputs in = random_inputs(a, N, 2, 1 + N);
        ThreadGroup group(N);
        const RunResult run = run_steps(group, a, opt, in);
        EXPECT_EQ(run.buckets, c.buckets);
        for (size_t s = 0; s < in.size(); ++s) {
          for (int r = 0; r < N; ++r) {
            expect_sum(run.out[s][r], in[s], 1e-6, fmt::format("step {} rank {}", s, r));
            EXPECT_EQ(run.stats[s][r].buckets, static_cast<int64_t>(c.buckets));
          }
          expect_same_on_every_rank(run.out[s], fmt::format("step {}", s));
        }
      }
}

// With overlap a bucket's all-reduce starts as soon as its last layer is done,
// before finish(); without, nothing starts before finish().
TEST(GradReducer, OverlapStartsABucketDuringTheBackward) {
  const Arena a = layered_arena(0, {100, 100, 100, 100}, 0);
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "overlap" : "no overlap");
    ThreadGroup group(2);
    GradSyncOptions opt;
    opt.bucket_bytes = 200 * sizeof(float);  // buckets {2,3} {0,1}
    opt.overlap = overlap;
    const Inputs in = random_inputs(a, 2, 1, 7);
    std::vector<Grads> out(2);
    run_ranks(group, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      Grads arena = in[0][static_cast<size_t>(r)];
      GradientReducer red(comm, arena, a.layers, a.matrices, opt);
      red.begin_step();
      red.layer_done(3);
      red.layer_done(2);
      if (overlap) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (group.op_count(r) == 0 && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const auto log = group.op_log(r);
        EXPECT_EQ(log.size(), 1u) << "rank " << r << ": the top bucket was not handed over";
        if (!log.empty()) {
          EXPECT_EQ(log[0].bytes, 200 * sizeof(float));
        }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        EXPECT_EQ(group.op_count(r), 0u) << "rank " << r << ": a bucket started without overlap";
      }
      red.layer_done(1);
      red.layer_done(0);
      red.finish();
      out[static_cast<size_t>(r)] = arena;
    });
    for (int r = 0; r < 2; ++r) expect_sum(out[r], in[0], 1e-6, fmt::format("rank {}", r));
  }
}

// --- bucket planning -------------------------------------------------------------------------------------

size_t planned_buckets(const Arena& a, size_t cap_floats) {
  auto comm = make_single_process_communicator();
  Grads arena(a.size);
  GradSyncOptions opt;
  opt.bucket_bytes = cap_floats * sizeof(float);
  return GradientReducer(*comm, arena, a.layers, a.matrices, opt).bucket_count();
}

TEST(GradReducer, BucketPlan) {
  const Arena four = layered_arena(0, {100, 100, 100, 100}, 0);
  EXPECT_EQ(planned_buckets(four, 250), 2u);  // {2,3} {0,1}
  EXPECT_EQ(planned_buckets(four, 200), 2u);  // the cap is inclusive
  EXPECT_EQ(planned_buckets(four, 199), 4u);
  EXPECT_EQ(planned_buckets(four, 300), 2u);  // {1,2,3} {0}
  EXPECT_EQ(planned_buckets(four, 400), 1u);
  EXPECT_EQ(planned_buckets(four, 1), 4u);  // a layer over the cap stays whole
  // Gaps split by the cap: head 600 -> 250 250 100, tail 130 -> 130.
  EXPECT_EQ(planned_buckets(layered_arena(600, {100, 100, 100, 100}, 130), 250), 6u);
  EXPECT_EQ(planned_buckets(layered_arena(500, {100, 100, 100, 100}, 500), 250), 2u + 2u + 2u);
  // Layers that do not touch are never merged; the hole between them is a gap bucket.
  Arena holes;
  holes.size = 400;
  holes.layers = {{0, 100}, {110, 210}, {210, 310}};
  EXPECT_EQ(planned_buckets(holes, 1000), 3u + 1u + 1u);  // layers alone, [100,110), [310,400)
  // No layers (a LoRA arena with nothing per layer): the arena in chunks of the cap.
  Arena flat;
  flat.size = 1000;
  EXPECT_EQ(planned_buckets(flat, 300), 4u);
}

// The buckets go out last layer first: the all-reduces each rank starts, in
// order, are the merged top layers, the bottom layer, then the gaps in address order.
TEST(GradReducer, BucketsGoOutLastLayerFirst) {
  const Arena a = layered_arena(600, {100, 100, 100, 100}, 130);
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "overlap" : "no overlap");
    GradSyncOptions opt;
    opt.bucket_bytes = 300 * sizeof(float);  // {1,2,3} {0} | head 300 300 | tail 130
    opt.overlap = overlap;
    ThreadGroup group(2);
    const RunResult run = run_steps(group, a, opt, random_inputs(a, 2, 1, 3));
    for (int r = 0; r < 2; ++r) {
      std::vector<size_t> floats;
      for (const auto& op : group.op_log(r)) {
        EXPECT_EQ(op.kind, "allreduce_sum_f32");
        EXPECT_TRUE(op.nonblocking);
        floats.push_back(op.bytes / sizeof(float));
      }
      EXPECT_EQ(floats, (std::vector<size_t>{300, 100, 300, 300, 130})) << "rank " << r;
      expect_sum(run.out[0][r], random_inputs(a, 2, 1, 3)[0], 1e-6, "sum");
    }
  }
}

// --- deterministic mode ----------------------------------------------------------------------------------

TEST(GradReducer, DeterministicIsTheRankOrderSumBitForBit) {
  const Arena a = layered_arena(300, {200, 150, 250}, 170);
  for (int N : {2, 3, 4})
    for (bool overlap : {true, false}) {
      SCOPED_TRACE(fmt::format("N={} overlap={}", N, overlap));
      const Inputs in = random_inputs(a, N, 2, 40 + N);
      GradSyncOptions opt;
      opt.bucket_bytes = 256 * sizeof(float);
      opt.overlap = overlap;
      opt.deterministic = true;
      ThreadGroup group(N);
      const RunResult run = run_steps(group, a, opt, in);
      for (size_t s = 0; s < in.size(); ++s) {
        const Grads ref = rank_order_sum(in[s]);
        if (N > 2) {
          // The data can tell the orders apart: the fake's all-reduce (N-1 first) differs somewhere.
          std::vector<Grads> reversed(in[s].rbegin(), in[s].rend());
          EXPECT_GT(count_bit_differences(rank_order_sum(reversed), ref), 0u);
        }
        for (int r = 0; r < N; ++r)
          EXPECT_EQ(count_bit_differences(run.out[s][r], ref), 0u) << "step " << s << " rank " << r;
      }
    }
}

// --- top-k -----------------------------------------------------------------------------------------------

struct Span {
  size_t offset, size;
};

// Top-k with error feedback as the header states it, per rank and bucket in
// float: v = residual + g; the k = ceil(ratio n) entries of largest |v| are
// sent (ties: lower index first) and leave the residual, which keeps the rest;
// the result is the sum over ranks, in rank order, of what was sent.
struct TopKModel {
  std::vector<Grads> residual;  // per rank
  TopKModel(int n_ranks, size_t size) : residual(static_cast<size_t>(n_ranks), Grads(size, 0.0f)) {}

  Grads step(const std::vector<Grads>& g, const std::vector<Span>& buckets, double ratio) {
    Grads out(g[0].size(), 0.0f);
    for (const Span& b : buckets) {
      const auto k = static_cast<size_t>(std::ceil(ratio * static_cast<double>(b.size)));
      for (size_t r = 0; r < g.size(); ++r) {
        Grads& v = residual[r];
        for (size_t i = b.offset; i < b.offset + b.size; ++i) v[i] += g[r][i];
        std::vector<size_t> idx(b.size);
        std::iota(idx.begin(), idx.end(), b.offset);
        std::stable_sort(idx.begin(), idx.end(),
                         [&](size_t x, size_t y) { return std::fabs(v[x]) > std::fabs(v[y]); });
        for (size_t j = 0; j < k; ++j) {
          out[idx[j]] += v[idx[j]];
          v[idx[j]] = 0;
        }
      }
    }
    return out;
  }
};

// head 37 | layers 95 101 64 | tail 250, cap 100 floats: every layer alone,
// the tail in 100 100 50. ceil(0.1 n) differs from floor and from rounding for most.
const Arena& topk_arena() {
  static const Arena a = layered_arena(37, {95, 101, 64}, 250);
  return a;
}
const std::vector<Span> kTopkBuckets = {{233, 64},  {132, 101}, {37, 95}, {0, 37},
                                        {297, 100}, {397, 100}, {497, 50}};

TEST(GradReducerTopK, RatioOneIsTheExactSum) {
  const Arena& a = topk_arena();
  const int N = 3;
  GradSyncOptions opt;
  opt.bucket_bytes = 100 * sizeof(float);
  opt.compression = GradCompression::topk;
  opt.topk_ratio = 1.0;
  Inputs in = random_inputs(a, N, 1, 11);
  in.push_back(in[0]);  // the same gradients again: nothing was owed, the same sum
  ThreadGroup group(N);
  const RunResult run = run_steps(group, a, opt, in);
  ASSERT_EQ(run.buckets, kTopkBuckets.size());
  const Grads ref = rank_order_sum(in[0]);  // 0 + g0 + g1 + g2 in rank order: these very bits
  for (size_t s = 0; s < 2; ++s)
    for (int r = 0; r < N; ++r) {
      expect_sum(run.out[s][r], in[s], 1e-6, fmt::format("step {} rank {}", s, r));
      EXPECT_EQ(count_bit_differences(run.out[s][r], ref), 0u) << "step " << s << " rank " << r;
      // All n entries as (index, value) pairs: (N-1) n 8 bytes.
      EXPECT_EQ(run.stats[s][r].wire_bytes, int64_t{N - 1} * static_cast<int64_t>(a.size) * 8);
    }
}

// Identical gradients on both ranks: the result is 2 g exactly at the k largest |g| of each bucket, 0
// elsewhere.
TEST(GradReducerTopK, SendsTheLargestMagnitudes) {
  const Arena& a = topk_arena();
  GradSyncOptions opt;
  opt.bucket_bytes = 100 * sizeof(float);
  opt.compression = GradCompression::topk;
  opt.topk_ratio = 0.1;
  const Grads g = random_grads(a.size, 99);
  ThreadGroup group(2);
  const RunResult run = run_steps(group, a, opt, {{g, g}});
  for (const Span& b : kTopkBuckets) {
    const auto k = static_cast<size_t>(std::ceil(0.1 * static_cast<double>(b.size)));
    std::vector<float> mags;
    for (size_t i = b.offset; i < b.offset + b.size; ++i) mags.push_back(std::fabs(g[i]));
    std::sort(mags.begin(), mags.end(), std::greater<float>());
    ASSERT_GT(mags[k - 1], mags[k]) << "test data: a tie at the k-th magnitude";
    for (int r = 0; r < 2; ++r)
      for (size_t i = b.offset; i < b.offset + b.size; ++i) {
        const bool top = std::fabs(g[i]) >= mags[k - 1];
        EXPECT_EQ(run.out[0][r][i], top ? 2 * g[i] : 0.0f) << "bucket at " << b.offset << " entry " << i;
      }
  }
}

// Two tensors in one bucket, the second 1000 times smaller: each still sends
// its own ceil(ratio n) largest entries (a bucket-wide threshold would pick
// only the first tensor's).
TEST(GradReducerTopK, SelectsWithinEachTensor) {
  Arena a = layered_arena(0, {200}, 0);
  a.matrices = {{0, 10, 10}, {100, 1, 100}};  // a 10 x 10 matrix and a vector of 100
  GradSyncOptions opt;
  opt.compression = GradCompression::topk;
  opt.topk_ratio = 0.2;
  Grads g = random_grads(a.size, 5);
  for (size_t i = 100; i < 200; ++i) g[i] *= 1e-3f;
  ThreadGroup group(2);
  const RunResult run = run_steps(group, a, opt, {{g, g}});
  for (const auto& [lo, hi] : {std::pair<size_t, size_t>{0, 100}, {100, 200}}) {
    std::vector<float> mags;
    for (size_t i = lo; i < hi; ++i) mags.push_back(std::fabs(g[i]));
    std::sort(mags.begin(), mags.end(), std::greater<float>());
    size_t sent = 0;
    for (size_t i = lo; i < hi; ++i) {
      const bool top = std::fabs(g[i]) >= mags[19];
      EXPECT_EQ(run.out[0][0][i], top ? 2 * g[i] : 0.0f) << "entry " << i;
      sent += run.out[0][0][i] != 0.0f;
    }
    EXPECT_EQ(sent, 20u) << "tensor at " << lo;
  }
  EXPECT_EQ(run.stats[0][0].wire_bytes, int64_t{40} * 8);  // (N-1) * (20 + 20) pairs of 8 bytes
}

// Ratio 0.1 over three steps, against TopKModel bit for bit (the result is
// exact arithmetic on the same floats in the same order, so no tolerance);
// each rank sends exactly ceil(0.1 n) pairs per bucket.
TEST(GradReducerTopK, ErrorFeedbackMatchesTheModel) {
  const Arena& a = topk_arena();
  for (int N : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("N={}", N));
    GradSyncOptions opt;
    opt.bucket_bytes = 100 * sizeof(float);
    opt.compression = GradCompression::topk;
    opt.topk_ratio = 0.1;
    const Inputs in = random_inputs(a, N, 3, 60 + N);
    ThreadGroup group(N);
    const RunResult run = run_steps(group, a, opt, in);
    ASSERT_EQ(run.buckets, kTopkBuckets.size());
    TopKModel model(N, a.size);
    int64_t k_sum = 0, uncompressed = 0;
    for (const Span& b : kTopkBuckets) {
      k_sum += static_cast<int64_t>(std::ceil(0.1 * static_cast<double>(b.size)));
      uncompressed += allreduce_wire(N, b.size * sizeof(float));
    }
    EXPECT_EQ(k_sum, 7 + 11 + 10 + 4 + 10 + 10 + 5);
    for (size_t s = 0; s < in.size(); ++s) {
      const Grads ref = model.step(in[s], kTopkBuckets, 0.1);
      for (int r = 0; r < N; ++r) {
        EXPECT_EQ(count_bit_differences(run.out[s][r], ref), 0u) << "step " << s << " rank " << r;
        EXPECT_EQ(run.stats[s][r].wire_bytes, int64_t{N - 1} * k_sum * 8) << "step " << s;
        EXPECT_EQ(run.stats[s][r].uncompressed_wire_bytes, uncompressed) << "step " << s;
      }
    }
    // Each all-gather carries ceil(0.1 n) (index, value) pairs of 8 bytes, buckets in hand-over order.
    for (int r = 0; r < N; ++r) {
      const auto log = group.op_log(r);
      ASSERT_EQ(log.size(), in.size() * kTopkBuckets.size());
      for (size_t i = 0; i < log.size(); ++i) {
        const Span& b = kTopkBuckets[i % kTopkBuckets.size()];
        EXPECT_EQ(log[i].kind, "allgather");
        EXPECT_EQ(log[i].bytes, static_cast<size_t>(std::ceil(0.1 * static_cast<double>(b.size))) * 8)
            << "rank " << r << " collective " << i;
      }
    }
  }
}

// Conservation without reading the residual: after S steps of gradients, steps
// of zero gradients drain it (each sends the k largest of what is owed and
// zeroes them exactly; a bucket of n entries is empty after ceil(n/k) steps),
// which one more zero step confirms by returning exactly zero. Then every
// input was delivered once: the sum of all results equals the sum of all inputs,
// up to the rounding of v = residual + g and of the rank sums (2e-6 of the sum
// of magnitudes, a few float ulps). Before the drain the results fall well short.
TEST(GradReducerTopK, ErrorFeedbackConservesTheGradient) {
  const Arena& a = topk_arena();
  const int N = 3, S = 4;
  size_t drain = 0;
  for (const Span& b : kTopkBuckets) {
    const auto k = static_cast<size_t>(std::ceil(0.1 * static_cast<double>(b.size)));
    drain = std::max(drain, (b.size + k - 1) / k);
  }
  Inputs in = random_inputs(a, N, S, 77);
  for (size_t d = 0; d <= drain; ++d) in.push_back(std::vector<Grads>(N, Grads(a.size, 0.0f)));
  GradSyncOptions opt;
  opt.bucket_bytes = 100 * sizeof(float);
  opt.compression = GradCompression::topk;
  opt.topk_ratio = 0.1;
  ThreadGroup group(N);
  const RunResult run = run_steps(group, a, opt, in);
  for (int r = 0; r < N; ++r) {
    const Grads& last = run.out.back()[r];
    EXPECT_EQ(std::count(last.begin(), last.end(), 0.0f), static_cast<std::ptrdiff_t>(a.size))
        << "rank " << r << ": the residual was not drained";
    size_t bad = 0, short_before_drain = 0;
    for (size_t i = 0; i < a.size; ++i) {
      double want = 0, mag = 0, got = 0, got_before = 0;
      for (int s = 0; s < S; ++s)
        for (int q = 0; q < N; ++q) want += in[s][q][i], mag += std::fabs(in[s][q][i]);
      for (size_t s = 0; s < in.size(); ++s) got += run.out[s][r][i];
      for (int s = 0; s < S; ++s) got_before += run.out[s][r][i];
      bad += !(std::fabs(got - want) <= 2e-6 * mag);
      short_before_drain += std::fabs(got_before - want) > 1e-3 * mag;
    }
    EXPECT_EQ(bad, 0u) << "rank " << r << ": entries whose delivered total is not their input total";
    EXPECT_GT(short_before_drain, a.size / 2) << "rank " << r << ": the drain steps delivered nothing owed";
  }
}

// --- PowerSGD --------------------------------------------------------------------------------------------

// head: a vector of 20 | layer 0: A [64, 48], a vector of 48, a 3x5 matrix | tail: B [40, 32], a vector
// of 10.
struct PsgdArena {
  Arena a;
  GradMatrix A{20, 64, 48}, B{3155, 40, 32}, small{3140, 3, 5};
  PsgdArena() {
    a.size = 4445;
    a.layers = {{20, 3155}};
    a.matrices = {A, small, B};
  }
  std::vector<Span> plain() const { return {{0, 20}, {3092, 48}, {3140, 15}, {4435, 10}}; }
};

// Rank r's gradient: A = u a_r^T, B = w b_r^T (u, w shared by the ranks: the
// sums are rank 1), everything else dyadic (its sums are exact).
std::vector<Grads> rank_one_grads(const PsgdArena& p, int N, uint64_t seed) {
  std::vector<Grads> g;
  const Grads u = random_grads(64, seed), w = random_grads(40, seed + 1);
  for (int r = 0; r < N; ++r) {
    Grads x = dyadic_grads(p.a.size, seed + 10 + r);
    const Grads ar = random_grads(48, seed + 100 + r), br = random_grads(32, seed + 200 + r);
    for (int64_t i = 0; i < 64; ++i)
      for (int64_t j = 0; j < 48; ++j) x[p.A.offset + i * 48 + j] = u[i] * ar[j];
    for (int64_t i = 0; i < 40; ++i)
      for (int64_t j = 0; j < 32; ++j) x[p.B.offset + i * 32 + j] = w[i] * br[j];
    g.push_back(std::move(x));
  }
  return g;
}

// max |out - ref| over the matrix <= rel * max |ref|, ref the double sum.
void expect_matrix_sum(const Grads& out, const std::vector<Grads>& in, const GradMatrix& m, double rel,
                       const std::string& what) {
  double max_ref = 0, max_err = 0;
  for (int64_t i = 0; i < m.rows * m.cols; ++i) {
    double ref = 0;
    for (const Grads& g : in) ref += g[m.offset + i];
    max_ref = std::max(max_ref, std::fabs(ref));
    max_err = std::max(max_err, std::fabs(out[m.offset + i] - ref));
  }
  EXPECT_LE(max_err, rel * max_ref) << what << ": max error " << max_err << ", max |sum| " << max_ref;
}

// A rank-1 sum is reproduced to 1e-5 of its largest entry from the first step
// on (P = (sum M) Q spans u), and again on a second step with the same
// gradients: the per-rank residuals M_r - (1/N) P Q^T then sum to zero (a
// residual of M_r - P Q^T would add -(N-1) sum M). With dist.rank 2 and 4 the
// columns of P beyond the first are rounding noise along u: orthonormalized in
// one Gram-Schmidt pass they were not orthogonal to it, and the result was off
// by up to ~100% of the sum (fixed in grad_reducer.cpp: two passes). What is
// not compressed (the vectors, the 3x5 matrix, whose r (3+5) 2 > 15) arrives
// as the exact sum.
TEST(GradReducerPowerSgd, RankOneSumsAndUncompressedEntries) {
  const PsgdArena p;
  for (int N : {2, 3})
    for (int rank : {1, 2, 4})
      for (bool det : {false, true}) {
        SCOPED_TRACE(fmt::format("N={} dist.rank={} deterministic={}", N, rank, det));
        GradSyncOptions opt;
        opt.compression = GradCompression::powersgd;
        opt.powersgd_rank = rank;
        opt.deterministic = det;
        opt.seed = 5;
        const std::vector<Grads> g = rank_one_grads(p, N, 300 + N);
        const Inputs in = {g, g, g};
        ThreadGroup group(N);
        const RunResult run = run_steps(group, p.a, opt, in);
        ASSERT_EQ(run.buckets, 3u);  // layer 0, head, tail
        for (size_t s = 0; s < in.size(); ++s) {
          for (int r = 0; r < N; ++r) {
            const std::string what = fmt::format("step {} rank {}", s, r);
            expect_matrix_sum(run.out[s][r], g, p.A, 1e-5, what + " A");
            expect_matrix_sum(run.out[s][r], g, p.B, 1e-5, what + " B");
            for (const Span& sp : p.plain())
              for (size_t i = sp.offset; i < sp.offset + sp.size; ++i) {
                float want = 0;
                for (const Grads& x : g) want += x[i];
                ASSERT_EQ(run.out[s][r][i], want) << what << " uncompressed entry " << i;
              }
          }
          expect_same_on_every_rank(run.out[s], fmt::format("step {}", s));
        }
      }
}

// The warm start: step 2 starts from step 1's Q. Step 1's gradient is the same
// rank-1 a b^T on every rank (reproduced, so the residuals are ~0), hence its
// Q is a multiple of b; with dist.rank 1 step 2 then gives p p^T S for a
// full-rank S = sum_r G_r, p = S b / |S b|: the projection onto the direction
// the warm-started Q picks, not the one a fresh random Q would (1e-4 of max |S|).
TEST(GradReducerPowerSgd, WarmStartedQ) {
  const PsgdArena p;
  const int N = 2;
  const Grads first = rank_one_grads(p, 1, 500)[0];
  Inputs in = {{first, first}, {random_grads(p.a.size, 501), random_grads(p.a.size, 502)}};
  GradSyncOptions opt;
  opt.compression = GradCompression::powersgd;
  opt.powersgd_rank = 1;
  ThreadGroup group(N);
  const RunResult run = run_steps(group, p.a, opt, in);
  for (const GradMatrix& m : {p.A, p.B}) {
    const auto rows = static_cast<size_t>(m.rows), cols = static_cast<size_t>(m.cols);
    // b: the row of step 1's matrix with the largest entry (every row is a multiple of b).
    size_t best = 0;
    for (size_t i = 0; i < rows * cols; ++i)
      if (std::fabs(first[m.offset + i]) > std::fabs(first[m.offset + best])) best = i;
    const size_t brow = best / cols;
    std::vector<double> S(rows * cols, 0.0), sb(rows, 0.0);
    for (const Grads& g : in[1])
      for (size_t i = 0; i < rows * cols; ++i) S[i] += g[m.offset + i];
    double norm = 0, max_s = 0;
    for (size_t i = 0; i < rows; ++i) {
      for (size_t j = 0; j < cols; ++j) sb[i] += S[i * cols + j] * first[m.offset + brow * cols + j];
      norm += sb[i] * sb[i];
    }
    for (double& x : sb) x /= std::sqrt(norm);
    for (double x : S) max_s = std::max(max_s, std::fabs(x));
    for (int r = 0; r < N; ++r) {
      double max_err = 0;
      for (size_t j = 0; j < cols; ++j) {
        double pts = 0;  // (p^T S)_j
        for (size_t i = 0; i < rows; ++i) pts += sb[i] * S[i * cols + j];
        for (size_t i = 0; i < rows; ++i)
          max_err = std::max(max_err, std::fabs(run.out[1][r][m.offset + i * cols + j] - sb[i] * pts));
      }
      EXPECT_LE(max_err, 1e-4 * max_s) << "matrix at " << m.offset << " rank " << r << ", max |S| " << max_s;
    }
  }
}

// Wire bytes: per bucket the P message (rows r per compressed matrix, plus the
// uncompressed entries) and the Q message (cols r), each an all-reduce, or with
// dist.deterministic an all-gather; uncompressed_wire_bytes the plain all-reduce
// of every bucket.
TEST(GradReducerPowerSgd, WireBytes) {
  const PsgdArena p;
  const int N = 4, r = 2;
  for (bool det : {false, true}) {
    SCOPED_TRACE(det ? "deterministic" : "all-reduce");
    GradSyncOptions opt;
    opt.compression = GradCompression::powersgd;
    opt.powersgd_rank = r;
    opt.deterministic = det;
    ThreadGroup group(N);
    const RunResult run = run_steps(group, p.a, opt, {rank_one_grads(p, N, 9)});
    // One message of `floats`: an all-reduce, or each rank's copy all-gathered.
    auto wire = [&](size_t floats) {
      return det ? int64_t{N - 1} * int64_t(floats * 4) : allreduce_wire(N, floats * 4);
    };
    const int64_t layer = wire(64 * r + 48 + 15) + wire(48 * r);
    const int64_t head = wire(20);
    const int64_t tail = wire(40 * r + 10) + wire(32 * r);
    const int64_t plain =
        allreduce_wire(N, 3135 * 4) + allreduce_wire(N, 20 * 4) + allreduce_wire(N, 1290 * 4);
    for (int q = 0; q < N; ++q) {
      EXPECT_EQ(run.stats[0][q].wire_bytes, layer + head + tail);
      EXPECT_EQ(run.stats[0][q].uncompressed_wire_bytes, plain);
      EXPECT_LT(run.stats[0][q].wire_bytes * 3, run.stats[0][q].uncompressed_wire_bytes);
      std::vector<size_t> floats;
      for (const auto& op : group.op_log(q)) {
        EXPECT_EQ(op.kind, det ? "allgather" : "allreduce_sum_f32");
        floats.push_back(op.bytes / 4);
      }
      // Layer bucket P (+ its vector and the 3x5 matrix), Q; head; tail P (+ its vector), Q.
      EXPECT_EQ(floats, (std::vector<size_t>{64 * r + 63, 48 * r, 20, 40 * r + 10, 32 * r})) << "rank " << q;
    }
  }
}

// --- statistics ------------------------------------------------------------------------------------------

// Plain all-reduce: 2 (N-1)/N of the arena's bytes, compressed or not the same.
// head 288 | 4 layers of 96 | tail 96, cap 192 floats: 5 buckets, 768 floats.
TEST(GradReducer, PlainWireBytes) {
  const Arena a = layered_arena(288, {96, 96, 96, 96}, 96);
  const int64_t want[] = {0, 0, 3072, 4096, 4608};  // 2 (N-1)/N 768 * 4
  for (int N : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("N={}", N));
    GradSyncOptions opt;
    opt.bucket_bytes = 192 * sizeof(float);
    ThreadGroup group(N);
    const RunResult run = run_steps(group, a, opt, random_inputs(a, N, 2, 5));
    for (const auto& step : run.stats)
      for (const GradSyncStats& st : step) {
        EXPECT_EQ(st.wire_bytes, want[N]);
        EXPECT_EQ(st.uncompressed_wire_bytes, want[N]);
        EXPECT_EQ(st.buckets, 5);
        EXPECT_GE(st.wait_seconds, 0);
        EXPECT_GE(st.comm_seconds, 0);
      }
  }
}

// Deterministic mode all-gathers every bucket: (N-1) B on the wire (the
// header's all-gather formula), against 2 (N-1)/N B for the plain all-reduce.
TEST(GradReducer, DeterministicWireBytes) {
  const Arena a = layered_arena(288, {96, 96, 96, 96}, 96);
  for (int N : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("N={}", N));
    GradSyncOptions opt;
    opt.bucket_bytes = 192 * sizeof(float);
    opt.deterministic = true;
    ThreadGroup group(N);
    const RunResult run = run_steps(group, a, opt, random_inputs(a, N, 1, 5));
    for (const GradSyncStats& st : run.stats[0]) {
      EXPECT_EQ(st.wire_bytes, int64_t{N - 1} * 768 * 4);
      EXPECT_EQ(st.uncompressed_wire_bytes, allreduce_wire(N, 768 * 4));
    }
  }
}

// One process: finish() leaves the arena as it is and reports nothing.
TEST(GradReducer, SingleProcessIsTheIdentity) {
  auto comm = make_single_process_communicator();
  const Arena a = layered_arena(10, {20, 20}, 10);
  Grads g = random_grads(a.size, 1);
  const Grads before = g;
  GradientReducer red(*comm, g, a.layers, a.matrices, GradSyncOptions{});
  red.begin_step();
  red.layer_done(1);
  red.layer_done(0);
  const GradSyncStats st = red.finish();
  EXPECT_EQ(count_bit_differences(g, before), 0u);
  EXPECT_EQ(st.wire_bytes, 0);
  EXPECT_EQ(st.buckets, 0);
}

// The fake communicator itself: the blocking collectives, and a mismatch across ranks is caught.
TEST(ThreadCommunicator, BlockingCollectives) {
  ThreadGroup group(3);
  run_ranks(group, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    std::vector<double> d = {1.0 * r, 2.0};
    comm.allreduce_sum(std::span<double>(d));
    EXPECT_EQ(d, (std::vector<double>{3.0, 6.0}));
    std::vector<int64_t> m = {r, -r};
    comm.allreduce_max(std::span<int64_t>(m));
    EXPECT_EQ(m, (std::vector<int64_t>{2, 0}));
    int b = r == 1 ? 42 : 0;
    comm.broadcast(&b, sizeof b, 1);
    EXPECT_EQ(b, 42);
    comm.barrier();
    // Rank r sends r+1 bytes of value r.
    const std::vector<size_t> counts = {1, 2, 3};
    std::vector<uint8_t> mine(static_cast<size_t>(r + 1), static_cast<uint8_t>(r)), all(6, 9);
    comm.allgatherv(mine.data(), all.data(), counts);
    EXPECT_EQ(all, (std::vector<uint8_t>{0, 1, 1, 2, 2, 2}));
    std::vector<uint8_t> at_root(6, 9);
    comm.gatherv(mine.data(), r == 2 ? at_root.data() : nullptr, counts, 2);
    EXPECT_EQ(at_root, r == 2 ? (std::vector<uint8_t>{0, 1, 1, 2, 2, 2}) : std::vector<uint8_t>(6, 9));
  });
}

TEST(ThreadCommunicator, MismatchedCollectivesFail) {
  ThreadGroup group(2);
  testing::TestPartResultArray failures;
  {
    testing::ScopedFakeTestPartResultReporter reporter(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ALL_THREADS, &failures);
    run_ranks(group, [&](ThreadCommunicator& comm) {
      std::vector<float> x(comm.rank() == 0 ? 4 : 5, 1.0f);
      comm.allreduce_sum(std::span<float>(x));
    });
  }
  EXPECT_TRUE(group.aborted());
  bool named = false;
  for (int i = 0; i < failures.size(); ++i)
    named |= std::string(failures.GetTestPartResult(i).message()).find("allreduce_sum_f32 of") !=
             std::string::npos;
  EXPECT_TRUE(named) << "no failure names the mismatch";
}

}  // namespace
}  // namespace loom

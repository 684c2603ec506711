// The server's per-row LoRA kernel (kernels/cpu/lora_rows.h) against its scalar
// reference bit for bit: jobs over one x combined (q/k/v, gate/up), row tiles
// and runs of one adapter, ranks with and without tails, past the transposed
// path's rank, adapters that leave a target out, rows without an adapter.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cpu_backend_util.h"
#include "kernels/backend.h"
#include "kernels/ref/lora_rows_ref.h"
#include "ops_test_util.h"

namespace loom {
namespace {

using test_util::random_vec;

// One adaptation point: targets of widths `outs` over x [T, in], adapters with
// a rank each (0 for a target: that adapter leaves it out), a row -> adapter map.
struct Point {
  int64_t in = 0, T = 0;
  std::vector<int64_t> outs;
  std::vector<std::vector<int64_t>> ranks;  // [adapter][job]
  std::vector<int> row_adapter;             // [T], -1: none
  std::vector<int32_t> rows;                // listed rows (adapter's rows adjacent)

  std::vector<float> x;
  std::vector<std::vector<float>> a, b;  // [adapter * jobs + job]
  std::vector<LoraFactor> f;
  std::vector<std::vector<const LoraFactor*>> per_row;  // [job][listed row]
  std::vector<std::vector<float>> y0;                   // [job] initial y

  int64_t jobs() const { return static_cast<int64_t>(outs.size()); }
  int64_t max_rank() const {
    int64_t r = 1;
    for (const auto& rs : ranks)
      for (int64_t v : rs) r = std::max(r, v);
    return r;
  }

  void build(uint32_t seed) {
    x = random_vec(static_cast<size_t>(T * in), seed++);
    const auto J = static_cast<size_t>(jobs());
    f.resize(ranks.size() * J);
    for (size_t ad = 0; ad < ranks.size(); ++ad)
      for (size_t j = 0; j < J; ++j) {
        const int64_t r = ranks[ad][j];
        a.push_back(random_vec(static_cast<size_t>(r * in), seed++, 0.3f));
        b.push_back(random_vec(static_cast<size_t>(outs[j] * r), seed++, 0.3f));
        f[ad * J + j] = {a.back().data(), b.back().data(), r, in, outs[j], 0.25f * static_cast<float>(ad + 1)};
      }
    per_row.assign(J, {});
    for (size_t j = 0; j < J; ++j) {
      for (int32_t row : rows) {
        const int ad = row_adapter[static_cast<size_t>(row)];
        const bool present = ad >= 0 && ranks[static_cast<size_t>(ad)][j] > 0;
        per_row[j].push_back(present ? &f[static_cast<size_t>(ad) * J + j] : nullptr);
      }
      y0.push_back(random_vec(static_cast<size_t>(T * outs[j]), seed++));
    }
  }

  std::vector<LoraRowsJob> make_jobs(std::vector<std::vector<float>>& y) const {
    std::vector<LoraRowsJob> out;
    for (size_t j = 0; j < static_cast<size_t>(jobs()); ++j)
      out.push_back({x.data(), in, y[j].data(), outs[j], outs[j], per_row[j].data()});
    return out;
  }
  // y after the kernel, jobs [j0, j1) in one call.
  std::vector<std::vector<float>> kernel(int threads, int64_t j0, int64_t j1) const {
    test_util::CpuBackend cpu(threads);
    std::vector<std::vector<float>> y = y0;
    const std::vector<LoraRowsJob> all = make_jobs(y);
    std::vector<float> u(static_cast<size_t>(jobs() * T * max_rank()));
    cpu.backend->lora_rows(*cpu.backend->make_workspace(),
                           std::span<const LoraRowsJob>(all).subspan(static_cast<size_t>(j0),
                                                                    static_cast<size_t>(j1 - j0)),
                           rows, max_rank(), u.data(), T);
    return y;
  }
  std::vector<std::vector<float>> reference() const {
    std::vector<std::vector<float>> y = y0;
    ref::lora_rows(make_jobs(y), rows);
    return y;
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Rows 0..T-1 listed by adapter (as BatchForward sorts them): runs of `run`
// rows per adapter in turn, every `gap`-th row without one.
void assign_rows(Point& p, const std::vector<int>& run_lengths) {
  p.row_adapter.assign(static_cast<size_t>(p.T), -1);
  int64_t t = 0;
  for (size_t i = 0; i < run_lengths.size() && t < p.T; ++i) {
    const int ad = static_cast<int>(i % p.ranks.size());
    for (int n = 0; n < run_lengths[i] && t < p.T; ++n) p.row_adapter[static_cast<size_t>(t++)] = ad;
    if (t < p.T) ++t;  // one row without an adapter between runs
  }
  p.rows.clear();
  for (size_t ad = 0; ad < p.ranks.size(); ++ad)
    for (int64_t r = 0; r < p.T; ++r)
      if (p.row_adapter[static_cast<size_t>(r)] == static_cast<int>(ad)) p.rows.push_back(static_cast<int32_t>(r));
}

std::vector<Point> points() {
  std::vector<Point> ps;
  // q/k/v: x width with a tail (45), ranks 3, 13 (k left out), 8 and 70 (past
  // the transposed path), runs of 1..9 rows.
  Point qkv;
  qkv.in = 45;
  qkv.T = 40;
  qkv.outs = {70, 24, 24};
  qkv.ranks = {{3, 3, 3}, {13, 0, 13}, {8, 8, 8}, {70, 70, 70}};
  assign_rows(qkv, {9, 1, 2, 3, 5, 1, 4, 6, 1});
  ps.push_back(qkv);
  // gate/up: no tail (64), a 16-row run and longer (split into runs of 16).
  Point gu;
  gu.in = 64;
  gu.T = 45;
  gu.outs = {130, 130};
  gu.ranks = {{16, 16}, {5, 9}};
  assign_rows(gu, {20, 2, 17, 1});
  ps.push_back(gu);
  // down: one job.
  Point down;
  down.in = 100;
  down.T = 12;
  down.outs = {33};
  down.ranks = {{4}, {12}};
  assign_rows(down, {4, 3, 2});
  ps.push_back(down);
  return ps;
}

TEST(LoraRows, EqualsScalarReferenceBitForBit) {
  std::vector<Point> ps = points();
  for (size_t i = 0; i < ps.size(); ++i) {
    Point& p = ps[i];
    p.build(100 + static_cast<uint32_t>(i) * 50);
    const auto want = p.reference();
    for (int threads : {1, 2}) {
      const auto got = p.kernel(threads, 0, p.jobs());
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_TRUE(same_bits(got[j], want[j])) << "point " << i << " job " << j << " threads " << threads;
        EXPECT_FALSE(same_bits(got[j], p.y0[j])) << "point " << i << " job " << j << ": nothing added";
      }
    }
  }
}

// Combining the targets of one x into one product changes no bit: each job
// alone in its own call, and each listed row alone, give the same y.
TEST(LoraRows, CombinedJobsEqualEachJobAloneAndEachRowAlone) {
  std::vector<Point> ps = points();
  for (size_t i = 0; i < 2; ++i) {
    Point& p = ps[i];
    p.build(300 + static_cast<uint32_t>(i) * 50);
    const auto together = p.kernel(2, 0, p.jobs());
    for (int64_t j = 0; j < p.jobs(); ++j) {
      const auto alone = p.kernel(1, j, j + 1);
      EXPECT_TRUE(same_bits(alone[static_cast<size_t>(j)], together[static_cast<size_t>(j)]))
          << "point " << i << " job " << j;
    }
    Point one = p;
    const int32_t row = p.rows[p.rows.size() / 2];
    one.rows = {row};
    one.per_row.clear();
    one.a.clear();
    one.b.clear();
    one.y0.clear();
    one.build(300 + static_cast<uint32_t>(i) * 50);
    const auto solo = one.kernel(1, 0, one.jobs());
    for (size_t j = 0; j < solo.size(); ++j) {
      const auto w = static_cast<size_t>(p.outs[j]);
      EXPECT_EQ(std::memcmp(solo[j].data() + row * w, together[j].data() + row * w, w * sizeof(float)), 0)
          << "point " << i << " job " << j << " row " << row;
    }
  }
}

}  // namespace
}  // namespace loom

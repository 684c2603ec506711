// The server's per-row LoRA kernel (kernels/cpu/lora_rows.h) against its scalar
// reference bit for bit: jobs over one x combined (q/k/v, gate/up), row tiles
// and runs of one adapter, ranks with and without tails, past the transposed
// path's rank, adapters that leave a target out, rows without an adapter; and
// factors kept in 4 bits, int8 or bf16 against the f32 kernel on their values.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/half.h"
#include "cpu_backend_util.h"
#include "kernels/backend.h"
#include "kernels/int_quant.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"
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
  std::vector<std::vector<int>> bits;       // [adapter][job]: 4, 8, 16 (bf16) or 32; empty: all f32
  std::vector<int> row_adapter;             // [T], -1: none
  std::vector<int32_t> rows;                // listed rows (adapter's rows adjacent)

  std::vector<float> x;
  std::vector<std::vector<float>> a, b;  // [adapter * jobs + job]
  std::vector<PackedInt4> packed;        // the 4-bit factors' A and B
  std::vector<std::vector<uint16_t>> halves;  // the bf16 factors' A and B
  std::vector<std::vector<uint8_t>> bytes8;   // the int8 factors' A and B (kernels/lora_i8.h)
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

  // `unpacked`: the 4-bit factors as f32 factors of their dequantized values
  // (the same seed gives the same values either way).
  void build(uint32_t seed, bool unpacked = false) {
    x = random_vec(static_cast<size_t>(T * in), seed++);
    const auto J = static_cast<size_t>(jobs());
    f.resize(ranks.size() * J);
    packed.reserve(2 * ranks.size() * J);  // the factors point into these
    halves.reserve(2 * ranks.size() * J);
    bytes8.reserve(2 * ranks.size() * J);
    for (size_t ad = 0; ad < ranks.size(); ++ad)
      for (size_t j = 0; j < J; ++j) {
        const int64_t r = ranks[ad][j];
        a.push_back(random_vec(static_cast<size_t>(r * in), seed++, 0.3f));
        b.push_back(random_vec(static_cast<size_t>(outs[j] * r), seed++, 0.3f));
        LoraFactor& fj = f[ad * J + j];
        fj.a = a.back().data();
        fj.b = b.back().data();
        fj.rank = r;
        fj.in = in;
        fj.out = outs[j];
        fj.scale = 0.25f * static_cast<float>(ad + 1);
        if (r > 0 && !bits.empty() && bits[ad][j] == 4) pack(fj, unpacked);
        if (r > 0 && !bits.empty() && bits[ad][j] == 16) pack_bf16(fj, unpacked);
        if (r > 0 && !bits.empty() && bits[ad][j] == 8) pack_int8(fj, unpacked);
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

  // A at fitting_int4_group(in, 128), B per row of r (the server's layout).
  void pack(LoraFactor& fj, bool unpacked) {
    const int64_t r = fj.rank;
    const PackedInt4& qa = packed.emplace_back(pack_int4_rows(fj.a, r, in, fitting_int4_group(in, 128)));
    const PackedInt4& qb = packed.emplace_back(pack_int4_rows(fj.b, fj.out, r, fitting_int4_group(r, 128)));
    if (unpacked) {
      unpack_int4_rows(qa.codes.data(), qa.scales.data(), r, in, qa.group, const_cast<float*>(fj.a));
      unpack_int4_rows(qb.codes.data(), qb.scales.data(), fj.out, r, qb.group, const_cast<float*>(fj.b));
      return;
    }
    fj.a = fj.b = nullptr;
    fj.a4 = {qa.codes.data(), qa.scales.data(), qa.group};
    fj.b4 = {qb.codes.data(), qb.scales.data(), qb.group};
  }

  // A and B rounded to bf16 (unpacked: kept as f32 factors of those values;
  // else B in lora_b16.h's transposed column blocks, as the server keeps it).
  void pack_bf16(LoraFactor& fj, bool unpacked) {
    float* ab[2] = {const_cast<float*>(fj.a), const_cast<float*>(fj.b)};
    const int64_t n[2] = {fj.rank * in, fj.out * fj.rank};
    for (int i = 0; i < 2; ++i)
      for (int64_t e = 0; e < n[i]; ++e) ab[i][e] = bf16_to_fp32(fp32_to_bf16(ab[i][e]));
    if (unpacked) return;
    std::vector<uint16_t>& a16 = halves.emplace_back(static_cast<size_t>(n[0]));
    for (int64_t e = 0; e < n[0]; ++e) a16[static_cast<size_t>(e)] = fp32_to_bf16(fj.a[e]);
    std::vector<uint16_t>& b16 = halves.emplace_back(static_cast<size_t>(lora_b16_elements(fj.out, fj.rank)));
    pack_lora_b16(fj.b, fj.out, fj.rank, b16.data());
    fj.a = fj.b = nullptr;
    fj.a16 = a16.data();
    fj.b16 = b16.data();
  }

  // A and B in int8 (unpacked: kept as f32 factors of their values).
  void pack_int8(LoraFactor& fj, bool unpacked) {
    std::vector<uint8_t>& a8 = bytes8.emplace_back(lora_a8_bytes(fj.rank, in));
    std::vector<uint8_t>& b8 = bytes8.emplace_back(lora_b8_bytes(fj.out, fj.rank));
    pack_lora_a8(fj.a, fj.rank, in, a8.data());
    pack_lora_b8(fj.b, fj.out, fj.rank, b8.data());
    if (unpacked) {
      unpack_lora_a8(a8.data(), fj.rank, in, const_cast<float*>(fj.a));
      unpack_lora_b8(b8.data(), fj.out, fj.rank, const_cast<float*>(fj.b));
      return;
    }
    fj.a = fj.b = nullptr;
    fj.a8 = a8.data();
    fj.b8 = b8.data();
  }

  std::vector<LoraRowsJob> make_jobs(std::vector<std::vector<float>>& y, bool stream = false) const {
    std::vector<LoraRowsJob> out;
    for (size_t j = 0; j < static_cast<size_t>(jobs()); ++j)
      out.push_back({x.data(), in, y[j].data(), outs[j], outs[j], per_row[j].data(), stream});
    return out;
  }
  // y after the kernel, jobs [j0, j1) in one call; `stream`: the factors
  // prefetched ahead (LoraRowsJob::stream_factors), which changes no bit.
  std::vector<std::vector<float>> kernel(int threads, int64_t j0, int64_t j1, bool stream = false) const {
    test_util::CpuBackend cpu(threads);
    std::vector<std::vector<float>> y = y0;
    const std::vector<LoraRowsJob> all = make_jobs(y, stream);
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
    for (auto [threads, stream] :
         {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}, std::pair{2, true}}) {
      const auto got = p.kernel(threads, 0, p.jobs(), stream);
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_TRUE(same_bits(got[j], want[j]))
            << "point " << i << " job " << j << " threads " << threads << " stream " << stream;
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

// Adapters some of whose factors are kept in 4 bits (A at SmolLM2's widths:
// 576 in groups of 96, 1536 in groups of 128; widths whose only group is the
// whole row, with and without a tail of 8; B per row), mixed with f32 factors
// within one adapter and one tile, with f32 adapters and with rows without one;
// ranks 8, 16, 10, 6 and past the transposed path (192: B rows of two groups;
// 520: past the stack buffer); runs of 1..16 rows, so both second-pass paths
// run. The kernel gives exactly what it gives on the dequantized values in f32,
// and what the scalar reference gives.
std::vector<Point> int4_points() {
  std::vector<Point> ps;
  Point qkv;
  qkv.in = 576;
  qkv.T = 160;
  qkv.outs = {576, 192, 192};
  qkv.ranks = {{8, 8, 8}, {16, 0, 16}, {10, 10, 10}, {16, 16, 16}, {192, 192, 192}};
  qkv.bits = {{4, 4, 4}, {4, 4, 4}, {4, 32, 4}, {32, 32, 32}, {4, 4, 4}};
  assign_rows(qkv, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16});
  ps.push_back(qkv);
  Point down;
  down.in = 1536;
  down.T = 48;
  down.outs = {576};
  down.ranks = {{8}, {16}, {12}, {520}};
  down.bits = {{4}, {32}, {4}, {4}};
  assign_rows(down, {1, 16, 3, 4, 2, 7, 5, 1});
  ps.push_back(down);
  Point tail;  // in 100: one group of 100 per row, a tail of 4 past the chunks of 8
  tail.in = 100;
  tail.T = 30;
  tail.outs = {33, 40};
  tail.ranks = {{6, 6}, {10, 4}};
  tail.bits = {{4, 4}, {4, 32}};
  assign_rows(tail, {4, 1, 6, 2, 5});
  ps.push_back(tail);
  Point whole;  // in 176: one group of 176 per row (no multiple of 32 divides it)
  whole.in = 176;
  whole.T = 20;
  whole.outs = {70};
  whole.ranks = {{8}, {14}};
  whole.bits = {{4}, {4}};
  assign_rows(whole, {5, 2, 3, 1});
  ps.push_back(whole);
  return ps;
}

TEST(LoraRows, FourBitFactorsEqualTheirDequantizedValuesBitForBit) {
  ASSERT_EQ(fitting_int4_group(576, 128), 96);
  ASSERT_EQ(fitting_int4_group(1536, 128), 128);
  ASSERT_EQ(fitting_int4_group(100, 128), 100);
  ASSERT_EQ(fitting_int4_group(176, 128), 176);
  ASSERT_EQ(fitting_int4_group(192, 128), 96);
  std::vector<Point> ps = int4_points();
  for (size_t i = 0; i < ps.size(); ++i) {
    Point p = ps[i], twin = ps[i];
    const auto seed = 500 + static_cast<uint32_t>(i) * 50;
    p.build(seed);
    twin.build(seed, /*unpacked=*/true);
    ASSERT_FALSE(p.packed.empty());
    const auto want = twin.kernel(1, 0, twin.jobs());
    const auto ref = p.reference();
    for (auto [threads, stream] :
         {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}, std::pair{2, true}}) {
      const auto got = p.kernel(threads, 0, p.jobs(), stream);
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_TRUE(same_bits(got[j], want[j]))
            << "point " << i << " job " << j << " threads " << threads << " stream " << stream;
        EXPECT_TRUE(same_bits(got[j], ref[j]))
            << "point " << i << " job " << j << " threads " << threads << " stream " << stream;
        EXPECT_FALSE(same_bits(got[j], p.y0[j])) << "point " << i << " job " << j << ": nothing added";
      }
    }
  }
}

// Factors kept in bf16 (serve --lora-bits 16), mixed with 4-bit and f32 ones
// within an adapter and a tile: the kernel gives exactly what it gives on the
// widened values in f32 and what the scalar reference gives, for segments of
// 1..16 rows (decode: one row per adapter; prefill: long runs) and ranks 8,
// 16 and 64 (the transposed path's limit), and past it.
TEST(LoraRows, Bf16FactorsEqualTheirWidenedValuesBitForBit) {
  std::vector<Point> ps = int4_points();
  for (Point& p : ps)
    for (auto& bs : p.bits)
      for (int& b : bs) b = b == 4 ? 16 : b;
  Point mixed;  // SmolLM2's q/k/v widths, one adapter of each kind, ranks 8, 16, 64
  mixed.in = 576;
  mixed.T = 96;
  mixed.outs = {576, 192, 192};
  mixed.ranks = {{8, 8, 8}, {16, 16, 16}, {64, 64, 64}, {8, 0, 8}, {16, 16, 16}};
  mixed.bits = {{16, 16, 16}, {16, 4, 32}, {16, 16, 16}, {16, 32, 16}, {4, 4, 4}};
  assign_rows(mixed, {1, 1, 1, 1, 1, 16, 2, 3, 9, 1, 1, 12, 1, 1});
  ps.push_back(mixed);
  for (size_t i = 0; i < ps.size(); ++i) {
    Point p = ps[i], twin = ps[i];
    const auto seed = 1500 + static_cast<uint32_t>(i) * 50;
    p.build(seed);
    twin.build(seed, /*unpacked=*/true);
    ASSERT_FALSE(p.halves.empty());
    const auto want = twin.kernel(1, 0, twin.jobs());
    const auto ref = p.reference();
    for (auto [threads, stream] :
         {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}, std::pair{2, true}}) {
      const auto got = p.kernel(threads, 0, p.jobs(), stream);
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_TRUE(same_bits(got[j], want[j]))
            << "point " << i << " job " << j << " threads " << threads << " stream " << stream;
        EXPECT_TRUE(same_bits(got[j], ref[j]))
            << "point " << i << " job " << j << " threads " << threads << " stream " << stream;
        EXPECT_FALSE(same_bits(got[j], p.y0[j])) << "point " << i << " job " << j << ": nothing added";
      }
    }
  }
}

// Factors kept in int8 (serve --lora-bits 8), alone and mixed with bf16, 4-bit
// and f32 ones within an adapter and a tile: the kernel gives exactly what the
// scalar reference gives (sums over the codes, the scales outside them), for
// segments of 1..16 rows, ranks with tails, 8, 16, 64 and past the transposed
// path's limit, widths with partial blocks; and what the f32 kernel gives on
// their values (unpack_lora_a8 / unpack_lora_b8) up to rounding.
TEST(LoraRows, Int8FactorsEqualTheReferenceBitForBit) {
  std::vector<Point> ps = int4_points();
  for (Point& p : ps)
    for (auto& bs : p.bits)
      for (int& b : bs) b = b == 4 ? 8 : b;
  for (Point p : points()) {  // every factor int8: tails of x (45), ranks 3, 13, 70
    p.bits.assign(p.ranks.size(), std::vector<int>(p.outs.size(), 8));
    ps.push_back(p);
  }
  Point mixed;  // SmolLM2's q/k/v widths, one adapter of each kind, ranks 8, 16, 64
  mixed.in = 576;
  mixed.T = 96;
  mixed.outs = {576, 192, 200};
  mixed.ranks = {{8, 8, 8}, {16, 16, 16}, {64, 64, 64}, {8, 0, 8}, {16, 16, 16}};
  mixed.bits = {{8, 8, 8}, {8, 4, 32}, {8, 8, 8}, {8, 16, 8}, {16, 8, 4}};
  assign_rows(mixed, {1, 1, 1, 1, 1, 16, 2, 3, 9, 1, 1, 12, 1, 1});
  ps.push_back(mixed);
  for (size_t i = 0; i < ps.size(); ++i) {
    Point p = ps[i], twin = ps[i];
    const auto seed = 2500 + static_cast<uint32_t>(i) * 50;
    p.build(seed);
    twin.build(seed, /*unpacked=*/true);
    ASSERT_FALSE(p.bytes8.empty());
    const auto values = twin.kernel(1, 0, twin.jobs());
    const auto ref = p.reference();
    for (auto [threads, stream] :
         {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}, std::pair{2, true}}) {
      const auto got = p.kernel(threads, 0, p.jobs(), stream);
      for (size_t j = 0; j < ref.size(); ++j) {
        EXPECT_TRUE(same_bits(got[j], ref[j]))
            << "point " << i << " job " << j << " threads " << threads << " stream " << stream;
        EXPECT_FALSE(same_bits(got[j], p.y0[j])) << "point " << i << " job " << j << ": nothing added";
        // Rounding only: f32 sums of up to 576 products of O(1) terms (ranks to 70) differ by ~1e-5.
        for (size_t e = 0; e < got[j].size(); ++e)
          ASSERT_NEAR(got[j][e], values[j][e], 1e-4f * (1 + std::fabs(values[j][e])))
              << "point " << i << " job " << j << " element " << e;
      }
    }
  }
}

// The int8 layout keeps each value within half its scale (max|x| / 127.5 of
// A's row, of 64 columns of one rank of B), zeros exact, and an all-zero
// row or block all zeros.
TEST(LoraRows, Int8FactorsHoldTheirValuesToHalfAStep) {
  const int64_t r = 8, in = 576, out = 196;  // 196: the last block padded to 8 columns
  std::vector<float> a = random_vec(static_cast<size_t>(r * in), 31, 0.3f);
  std::vector<float> b = random_vec(static_cast<size_t>(out * r), 32, 0.3f);
  for (int64_t i = 0; i < in; ++i) a[static_cast<size_t>(3 * in + i)] = 0.0f;   // a zero row of A
  for (int64_t n = 64; n < 128; ++n) b[static_cast<size_t>(n * r + 5)] = 0.0f;  // a zero rank row of block 1
  b[static_cast<size_t>(130 * r + 2)] = 4.0f;                                   // an outlier in block 2
  std::vector<uint8_t> a8(lora_a8_bytes(r, in)), b8(lora_b8_bytes(out, r));
  ASSERT_EQ(b8.size(), static_cast<size_t>(4 * r * 4 + 200 * r));  // 4 blocks' scales, 200 padded columns
  pack_lora_a8(a.data(), r, in, a8.data());
  pack_lora_b8(b.data(), out, r, b8.data());
  std::vector<float> a1(a.size()), b1(b.size());
  unpack_lora_a8(a8.data(), r, in, a1.data());
  unpack_lora_b8(b8.data(), out, r, b1.data());
  for (int64_t j = 0; j < r; ++j) {
    float amax = 0;
    for (int64_t i = 0; i < in; ++i) amax = std::max(amax, std::fabs(a[static_cast<size_t>(j * in + i)]));
    for (int64_t i = 0; i < in; ++i) {
      const size_t e = static_cast<size_t>(j * in + i);
      ASSERT_LE(std::fabs(a1[e] - a[e]), amax / 127.5f / 2 * 1.0001f) << "A " << j << "," << i;
      if (a[e] == 0.0f) {
        ASSERT_EQ(a1[e], 0.0f);
      }
    }
  }
  for (int64_t q = 0; q < 4; ++q)
    for (int64_t j = 0; j < r; ++j) {
      float bmax = 0;
      for (int64_t n = 64 * q; n < std::min<int64_t>(out, 64 * q + 64); ++n)
        bmax = std::max(bmax, std::fabs(b[static_cast<size_t>(n * r + j)]));
      for (int64_t n = 64 * q; n < std::min<int64_t>(out, 64 * q + 64); ++n) {
        const size_t e = static_cast<size_t>(n * r + j);
        ASSERT_LE(std::fabs(b1[e] - b[e]), bmax / 127.5f / 2 * 1.0001f) << "B " << n << "," << j;
        if (b[e] == 0.0f) {
          ASSERT_EQ(b1[e], 0.0f);
        }
      }
    }
  // The outlier costs only its own block's rank row its resolution: block 0's
  // values of rank 2 keep steps well under the outlier's (4 / 127.5).
  EXPECT_LT(std::fabs(b1[static_cast<size_t>(10 * r + 2)] - b[static_cast<size_t>(10 * r + 2)]),
            4.0f / 127.5f / 4);
}

// Two 4-bit adapters differ only in their codes (a / b null in both): each
// row still gets its own adapter's product, not its neighbour's.
TEST(LoraRows, FourBitAdaptersAreToldApartByTheirCodes) {
  Point p;
  p.in = 64;
  p.T = 12;
  p.outs = {64};
  p.ranks = {{8}, {8}};
  p.bits = {{4}, {4}};
  assign_rows(p, {5, 5});
  Point twin = p;
  p.build(900);
  twin.build(900, /*unpacked=*/true);
  for (Point* q : {&p, &twin}) q->f[1].scale = q->f[0].scale;
  ASSERT_TRUE(p.f[0].a == nullptr && p.f[1].a == nullptr);
  EXPECT_TRUE(same_bits(p.kernel(1, 0, 1)[0], twin.kernel(1, 0, 1)[0]));
  EXPECT_TRUE(same_bits(p.kernel(1, 0, 1)[0], p.reference()[0]));
}

}  // namespace
}  // namespace loom

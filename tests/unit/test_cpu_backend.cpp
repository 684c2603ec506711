// The Backend op table's CPU implementation: the ops written for the seam
// (RoPE from a cos/sin table, column-blocked SwiGLU, per-row LoRA, the paged
// K/V store, add, AdamW update, memory) against scalar references and against
// the kernels they replace bit for bit; devices this build lacks are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/half.h"
#include "core/thread_pool.h"
#include "expect_error.h"
#include "kernels/backend.h"
#include "cpu_backend_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/ref/ops_ref.h"
#include "ops_test_util.h"

namespace loom {
namespace {

using test_util::random_vec;
using Cpu = test_util::CpuBackend;

TEST(Device, NamesParseAndPrint) {
  EXPECT_EQ(parse_device("cpu"), kCpu);
  EXPECT_EQ(device_name(*parse_device("cuda")), "cuda:0");
  EXPECT_EQ(device_name(*parse_device("cuda:3")), "cuda:3");
  EXPECT_EQ(device_name(*parse_device("npu:1")), "npu:1");
  for (const char* bad : {"", "gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:1", "cuda:1x"})
    EXPECT_FALSE(parse_device(bad)) << bad;
}

TEST(CpuBackend, DevicesThisBuildLacksAreRefused) {
  ThreadPool pool(1);
  test_util::expect_error([&] { make_backend(*parse_device("cuda:1"), pool); }, ErrorKind::unsupported,
                          {"cuda:1", "built without CUDA"});
  test_util::expect_error([&] { make_backend(*parse_device("npu"), pool); }, ErrorKind::unsupported,
                          {"npu:0", "without an NPU backend"});
  EXPECT_EQ(make_backend(kCpu, pool)->device(), kCpu);
}

TEST(CpuBackend, AllocIsZeroedTaggedAndAligned) {
  Cpu cpu(1);
  for (size_t bytes : {size_t{4}, size_t{1000}, size_t{3} << 20}) {  // heap and mapped paths
    DeviceBuffer b = cpu.backend->alloc(bytes);
    ASSERT_EQ(b.bytes(), bytes);
    EXPECT_EQ(b.device(), kCpu);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
    const auto* p = static_cast<const uint8_t*>(b.data());
    for (size_t i = 0; i < bytes; i += 997) ASSERT_EQ(p[i], 0) << bytes << " at " << i;
    DeviceBuffer moved = std::move(b);
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(moved.bytes(), bytes);
  }
  EXPECT_TRUE(cpu.backend->alloc(0).empty());
}

// The table-driven RoPE is rope_rotate's arithmetic: forward (+1) and inverse (-1) bit for bit.
TEST(CpuBackend, RopeFromTableEqualsRopeRotate) {
  Cpu cpu(2);
  for (bool interleaved : {true, false}) {
    RopeTable rope;
    rope.head_dim = 16;
    rope.interleaved = interleaved;
    for (int i = 0; i < 8; ++i) rope.inv_freq.push_back(std::pow(10000.0f, -static_cast<float>(i) / 8));
    const int64_t T = 5, heads = 3;
    const std::vector<int32_t> pos = {0, 7, 100, 4095, 131071};
    std::vector<float> cs(static_cast<size_t>(T * rope.head_dim));
    cpu.backend->rope_table(rope, pos.data(), T, cs.data());
    for (bool inverse : {false, true}) {
      auto x = random_vec(static_cast<size_t>(T * heads * rope.head_dim), 3, 2.0f), y = x;
      cpu.backend->rope(rope, cs.data(), x.data(), T, heads, inverse);
      rope_rotate(rope, y.data(), T, heads, pos.data(), inverse ? -1.0f : 1.0f);
      ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << interleaved << inverse;
    }
  }
}

// Column blocks of 256: the same bits as one flat swiglu call when rows are
// multiples of 8 wide, and each row the same whatever the row count.
TEST(CpuBackend, SwigluRowsAreBatchInvariant) {
  Cpu cpu(2);
  for (int64_t F : {8, 256, 1536, 1000, 37}) {
    const int64_t T = 3;
    auto g = random_vec(static_cast<size_t>(T * F), 4, 3.0f), u = random_vec(g.size(), 5);
    std::vector<float> h(g.size()), flat(g.size()), one(static_cast<size_t>(F));
    cpu.backend->swiglu(h.data(), g.data(), u.data(), T, F);
    swiglu(flat.data(), g.data(), u.data(), T * F);
    if (F % 8 == 0) {
      EXPECT_EQ(h, flat) << F;
    }
    cpu.backend->swiglu(one.data(), g.data() + 2 * F, u.data() + 2 * F, 1, F);
    EXPECT_EQ(std::memcmp(one.data(), h.data() + 2 * F, one.size() * sizeof(float)), 0) << F;
    std::vector<float> r(g.size());
    ref::swiglu(r.data(), g.data(), u.data(), T * F);
    for (size_t i = 0; i < r.size(); ++i) ASSERT_NEAR(h[i], r[i], 1e-5f + 1e-5f * std::fabs(r[i])) << F;
  }
}

TEST(CpuBackend, AddAliasesEitherInput) {
  Cpu cpu(1);
  auto a = random_vec(37, 6), b = random_vec(37, 7);
  std::vector<float> sum(37), left = a, right = b;
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = a[i] + b[i];
  cpu.backend->add(left.data(), left.data(), b.data(), 37);
  cpu.backend->add(right.data(), a.data(), right.data(), 37);
  std::vector<float> out(37);
  cpu.backend->add(out.data(), a.data(), b.data(), 37);
  EXPECT_EQ(left, sum);
  EXPECT_EQ(right, sum);
  EXPECT_EQ(out, sum);
}

// Per-row LoRA against y += scale * B (A x) in double: rows with different
// adapters, a row with none, ranks not a multiple of 4, widths not of 8.
TEST(CpuBackend, LoraRowsMatchesReferenceAndIsRowIndependent) {
  const int64_t T = 5, in = 19, out = 70;
  struct Factor {
    int64_t rank;
    float scale;
    std::vector<float> a, b;
  };
  std::vector<Factor> f = {{3, 0.5f, random_vec(3 * in, 8), random_vec(out * 3, 9)},
                           {8, 2.0f, random_vec(8 * in, 10), random_vec(out * 8, 11)}};
  const int row_factor[T] = {0, 1, -1, 1, 0};
  auto x = random_vec(static_cast<size_t>(T * in), 12);
  auto y0 = random_vec(static_cast<size_t>(T * out), 13);
  std::vector<LoraFactor> lf;
  for (const Factor& fa : f) lf.push_back({fa.a.data(), fa.b.data(), fa.rank, in, out, fa.scale, {}, {}});
  std::vector<int32_t> rows;
  std::vector<const LoraFactor*> per_row;
  for (int32_t t = 0; t < T; ++t)
    if (row_factor[t] >= 0) {
      rows.push_back(t);
      per_row.push_back(&lf[static_cast<size_t>(row_factor[t])]);
    }
  auto run = [&](int threads, std::span<const int32_t> rs, std::span<const LoraFactor* const> fs) {
    Cpu cpu(threads);
    std::vector<float> y = y0, u(static_cast<size_t>(T * 8));
    const LoraRowsJob job{x.data(), in, y.data(), out, out, fs.data()};
    cpu.backend->lora_rows(*cpu.backend->make_workspace(), {&job, 1}, rs, 8, u.data(), T);
    return y;
  };
  const std::vector<float> y = run(2, rows, per_row);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < out; ++n) {
      double want = y0[static_cast<size_t>(t * out + n)];
      if (row_factor[t] >= 0) {
        const Factor& fa = f[static_cast<size_t>(row_factor[t])];
        for (int64_t j = 0; j < fa.rank; ++j) {
          double ax = 0;
          for (int64_t k = 0; k < in; ++k)
            ax += static_cast<double>(fa.a[static_cast<size_t>(j * in + k)]) * x[static_cast<size_t>(t * in + k)];
          want += fa.scale * ax * fa.b[static_cast<size_t>(n * fa.rank + j)];
        }
      }
      ASSERT_NEAR(y[static_cast<size_t>(t * out + n)], want, 1e-4 * (1 + std::fabs(want))) << t << "," << n;
    }
  // One row alone, on one thread, gives the same bits as inside the batch.
  const int32_t only[] = {3};
  const LoraFactor* only_f[] = {&lf[1]};
  const std::vector<float> alone = run(1, only, only_f);
  EXPECT_EQ(std::memcmp(alone.data() + 3 * out, y.data() + 3 * out, out * sizeof(float)), 0);
}

TEST(CpuBackend, PagedStoreWritesEachSlotAsF32OrHalf) {
  Cpu cpu(2);
  const AttentionShape s{4, 2, 8, 16};  // 2 kv heads of 8: rows of 16
  const int64_t bs = 4, n_blocks = 3, T = 3;
  const std::vector<int64_t> slots = {5, 0, 11};  // block 1 slot 1, block 0 slot 0, block 2 slot 3
  auto k = random_vec(static_cast<size_t>(T * 16), 14), v = random_vec(k.size(), 15);
  for (DType dt : {DType::f32, DType::f16}) {
    const size_t elem = dt == DType::f16 ? 2 : 4, n = static_cast<size_t>(n_blocks * 2 * bs * 8);
    std::vector<uint8_t> ks(n * elem), vs(n * elem);
    cpu.backend->paged_store(s, ks.data(), vs.data(), dt, bs, k.data(), v.data(), slots.data(), T);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < 2; ++g)
        for (int64_t d = 0; d < 8; ++d) {
          const int64_t slot = slots[static_cast<size_t>(t)];
          const size_t at = static_cast<size_t>(((slot / bs * 2 + g) * bs + slot % bs) * 8 + d);
          const float want_k = k[static_cast<size_t>(t * 16 + g * 8 + d)];
          const float want_v = v[static_cast<size_t>(t * 16 + g * 8 + d)];
          if (dt == DType::f32) {
            EXPECT_EQ(reinterpret_cast<const float*>(ks.data())[at], want_k);
            EXPECT_EQ(reinterpret_cast<const float*>(vs.data())[at], want_v);
          } else {
            EXPECT_EQ(reinterpret_cast<const uint16_t*>(ks.data())[at], fp32_to_fp16(want_k));
            EXPECT_EQ(reinterpret_cast<const uint16_t*>(vs.data())[at], fp32_to_fp16(want_v));
          }
        }
  }
}

// torch.optim.AdamW's fp32 update, element by element.
TEST(CpuBackend, AdamwUpdateMatchesTheFormula) {
  Cpu cpu(1);
  const size_t n = 33;
  auto p = random_vec(n, 16), g = random_vec(n, 17), m = random_vec(n, 18, 0.1f), v = random_vec(n, 19, 0.1f);
  for (auto& x : v) x = std::fabs(x);
  const AdamWUpdate u{0.999f, 1e-3f, 0.1f, 0.999f, 0.001f, 0.3f, 1e-8f};
  std::vector<float> p2 = p, m2 = m, v2 = v;
  cpu.backend->adamw_update(u, p2.data(), g.data(), m2.data(), v2.data(), n);
  for (size_t i = 0; i < n; ++i) {
    const float pk = p[i] * u.keep;
    const float mi = m[i] + u.w1 * (g[i] - m[i]);
    const float vi = v[i] * u.b2 + u.w2 * (g[i] * g[i]);
    EXPECT_EQ(m2[i], mi);
    EXPECT_EQ(v2[i], vi);
    EXPECT_EQ(p2[i], pk - u.step_size * (mi / (std::sqrt(vi) / u.bc2_sqrt + u.eps)));
  }
  double ss = 0;
  for (float x : g) ss += static_cast<double>(x) * x;
  EXPECT_EQ(cpu.backend->sum_squares(g.data(), n), ss);
}

}  // namespace
}  // namespace loom

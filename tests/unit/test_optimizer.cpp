// AdamW, gradient clipping and LR schedules against torch.optim.AdamW,
// clip_grad_norm_ and transformers' schedulers (scripts/fixtures/make_optimizer_fixtures.py).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "cpu_backend_util.h"
#include "train/optimizer.h"

namespace loom {
namespace {

using Cpu = test_util::CpuBackend;

const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/optimizer/";

std::vector<float> read_f32(const std::string& path) {
  const std::string b = read_text_file(path);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

void expect_close(std::span<const float> got, const float* want, size_t n, double rel, const std::string& what) {
  for (size_t i = 0; i < n; ++i) {
    const double tol = rel * std::max(1.0, std::fabs(static_cast<double>(want[i])));
    ASSERT_NEAR(got[i], want[i], tol) << what << " element " << i;
  }
}

TEST(LrSchedule, MatchesTransformers) {
  const auto meta = nlohmann::json::parse(read_text_file(kDir + "adamw.json"));
  int checked = 0;
  for (const auto& s : meta["schedules"]) {
    LrSchedule sch{lr_schedule_from_name(s["kind"].get<std::string>()), s["warmup"].get<int64_t>(),
                   s["total"].get<int64_t>()};
    const auto& vals = s["values"];
    for (size_t step = 0; step < vals.size(); ++step, ++checked)
      EXPECT_NEAR(sch.multiplier(static_cast<int64_t>(step)), vals[step].get<double>(), 1e-12)
          << s["kind"] << " warmup " << s["warmup"] << " total " << s["total"] << " step " << step;
  }
  EXPECT_GT(checked, 100);
  EXPECT_THROW(lr_schedule_from_name("cosine_with_restarts"), Error);
}

TEST(AdamW, MatchesTorchTwentySteps) {
  Cpu cpu;
  const auto meta = nlohmann::json::parse(read_text_file(kDir + "adamw.json"));
  const std::vector<float> blob = read_f32(kDir + "adamw.bin");
  std::vector<ParamGroup> groups;
  size_t n = 0;
  for (const auto& g : meta["groups"]) {
    ParamGroup pg;
    pg.name = g["name"];
    pg.offset = n;
    pg.size = g["size"];
    pg.lr = g["lr"];
    pg.weight_decay = g["weight_decay"];
    n += pg.size;
    groups.push_back(pg);
  }
  const int steps = meta["steps"];
  ASSERT_EQ(blob.size(), n * (1 + 2 * static_cast<size_t>(steps) + 2));
  AdamWConfig cfg{meta["beta1"], meta["beta2"], meta["eps"], meta["max_grad_norm"]};
  AdamW opt(*cpu.backend, cfg, groups, n, LrSchedule{LrScheduleKind::cosine, meta["warmup"], steps});
  std::vector<float> params(blob.begin(), blob.begin() + static_cast<ptrdiff_t>(n));
  int clipped = 0;
  for (int s = 0; s < steps; ++s) {
    const float* g = blob.data() + n * (1 + 2 * static_cast<size_t>(s));
    std::vector<float> grads(g, g + n);
    for (size_t k = 0; k < groups.size(); ++k)
      EXPECT_NEAR(opt.current_lr(k), meta["lrs"][s][k].get<double>(), 1e-12 + 1e-9 * groups[k].lr);
    const StepStats st = opt.step(params, grads);
    EXPECT_NEAR(st.grad_norm, meta["grad_norms"][s].get<double>(), 1e-6 * st.grad_norm) << "step " << s;
    clipped += st.clip_scale < 1.0;
    expect_close(params, g + n, n, 1e-6, "params after step " + std::to_string(s + 1));
  }
  EXPECT_GT(clipped, 5);
  EXPECT_LT(clipped, steps);  // some steps are below the threshold
  EXPECT_EQ(opt.step_count(), steps);
  const float* m = blob.data() + n * (1 + 2 * static_cast<size_t>(steps));
  expect_close(opt.exp_avg(), m, n, 1e-6, "exp_avg");
  expect_close(opt.exp_avg_sq(), m + n, n, 1e-6, "exp_avg_sq");
}

TEST(AdamW, UngroupedParamsUntouchedAndNoDecayFlag) {
  Cpu cpu;
  std::vector<ParamGroup> groups = {{"a", 0, 3, 0.1, 0.5, true, false}, {"norm", 5, 2, 0.1, 0.5, false, false}};
  AdamW opt(*cpu.backend, {}, groups, 7);
  std::vector<float> p = {1, 1, 1, 7, 7, 1, 1}, g(7, 0.0f);
  opt.step(p, g);  // zero gradients: only weight decay moves anything
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * 0.5f);
  EXPECT_EQ(p[3], 7.0f);
  EXPECT_EQ(p[5], 1.0f);
}

TEST(AdamW, LoraPlusScalesOnlyB) {
  std::vector<ParamGroup> groups = {{"A", 0, 2, 1e-4, 0, true, false}, {"B", 2, 2, 1e-4, 0, true, true}};
  const auto out = apply_lora_plus(groups, 16);
  EXPECT_DOUBLE_EQ(out[0].lr, 1e-4);
  EXPECT_DOUBLE_EQ(out[1].lr, 16e-4);
}

TEST(AdamW, RejectsBadGroups) {
  Cpu cpu;
  EXPECT_THROW(AdamW(*cpu.backend, {}, {{"x", 5, 4, 1e-3}}, 8), Error);
  EXPECT_THROW(AdamW(*cpu.backend, {}, {{"x", 0, 4, 1e-3}, {"y", 3, 2, 1e-3}}, 8), Error);
  EXPECT_THROW(AdamW(*cpu.backend, {}, {{"x", 0, 4, -1.0}}, 8), Error);
}

TEST(AdamW, ClipReturnsPreClipNorm) {
  std::vector<float> g = {3, 4};
  double scale = 0;
  EXPECT_DOUBLE_EQ(clip_grad_global_norm(g, 1.0, &scale), 5.0);
  EXPECT_NEAR(g[0], 0.6f, 1e-6);
  EXPECT_NEAR(scale, 0.2, 1e-6);
  std::vector<float> small = {0.3f, 0.4f};
  clip_grad_global_norm(small, 1.0, &scale);
  EXPECT_EQ(small[0], 0.3f);
  EXPECT_EQ(scale, 1.0);
}

TEST(AdamW, SaveLoadRoundTripAndCorruption) {
  Cpu cpu;
  const auto dir = std::filesystem::temp_directory_path() / ("loom_opt_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "opt.bin").string();
  const size_t n = 37;
  CounterRng rng(7);
  std::vector<float> p(n), g(n);
  AdamW a(*cpu.backend, {}, {{"all", 0, n, 1e-2, 0.01}}, n);
  for (int s = 0; s < 3; ++s) {
    for (size_t i = 0; i < n; ++i) g[i] = static_cast<float>(rng.next_u64() % 1000) / 500.0f - 1.0f;
    a.step(p, g);
  }
  a.save(path);
  AdamW b(*cpu.backend, {}, {{"all", 0, n, 1e-2, 0.01}}, n);
  b.load(path);
  EXPECT_EQ(b.step_count(), 3);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(a.exp_avg()[i], b.exp_avg()[i]);
    EXPECT_EQ(a.exp_avg_sq()[i], b.exp_avg_sq()[i]);
  }
  AdamW wrong_size(*cpu.backend, {}, {}, n + 1);
  EXPECT_THROW(wrong_size.load(path), Error);
  std::string bytes = read_text_file(path);
  bytes[40] ^= 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  try {
    b.load(path);
    ADD_FAILURE() << "corrupted file loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), 20);
  EXPECT_THROW(b.load(path), Error);
  std::filesystem::remove_all(dir);
}

// ---- top-k's lazy moments (AdamWLazyUpdate): every entry arriving every step
// is adamw_update's bits; sparse arrivals follow a double-precision reference.

AdamWUpdate lazy_test_scalars(int64_t t) {
  const double b1 = 0.9, b2 = 0.999, lr = 1e-2, wd = 0.1;
  AdamWUpdate u{};
  u.keep = static_cast<float>(1.0 - lr * wd);
  u.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, t)));
  u.w1 = static_cast<float>(1.0 - b1);
  u.b2 = static_cast<float>(b2);
  u.w2 = static_cast<float>(1.0 - b2);
  u.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, t)));
  u.eps = 1e-8f;
  return u;
}

TEST(AdamWLazy, EveryEntryArrivingIsAdamWBitForBit) {
  Cpu cpu;
  constexpr size_t n = 257;
  CounterRng rng(7);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), gap(n, 0.0f);
  for (float& x : p) x = static_cast<float>(rng.next_double() - 0.5);
  std::vector<float> p2 = p, m2 = m, v2 = v, g(n);
  for (int64_t t = 1; t <= 20; ++t) {
    for (float& x : g) x = static_cast<float>(rng.next_double() - 0.5) + 1e-3f;  // never exactly zero
    const AdamWUpdate u = lazy_test_scalars(t);
    cpu.backend->adamw_update(u, p.data(), g.data(), m.data(), v.data(), n);
    cpu.backend->adamw_lazy_update({u, 0.9, 0.999}, p2.data(), g.data(), m2.data(), v2.data(), gap.data(), n);
  }
  EXPECT_EQ(0, std::memcmp(p.data(), p2.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(m.data(), m2.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(v.data(), v2.data(), n * 4));
  for (float x : gap) ASSERT_EQ(x, 0.0f);
}

// Sparse arrivals (about 1 entry in 4 a step, sums of what waited) against the
// rule in double: within 2e-6 of each value (m: of 1e-2, its scale here) after 40 steps.
TEST(AdamWLazy, SparseArrivalsMatchDoubleReference) {
  Cpu cpu;
  constexpr size_t n = 300;
  const double b1 = 0.9, b2 = 0.999, lr = 1e-2, wd = 0.1, eps = 1e-8;
  CounterRng rng(11);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), gap(n, 0.0f), g(n);
  std::vector<double> rp(n), rm(n, 0.0), rv(n, 0.0), rgap(n, 0.0);
  for (size_t i = 0; i < n; ++i) rp[i] = p[i] = static_cast<float>(rng.next_double() - 0.5);
  int arrivals_after_a_gap = 0;
  for (int64_t t = 1; t <= 40; ++t) {
    for (float& x : g) x = rng.next_double() < 0.25 ? static_cast<float>(rng.next_double() - 0.5) + 1e-3f : 0.0f;
    cpu.backend->adamw_lazy_update({lazy_test_scalars(t), b1, b2}, p.data(), g.data(), m.data(), v.data(), gap.data(),
                                   n);
    for (size_t i = 0; i < n; ++i) {
      rp[i] *= 1.0 - lr * wd;
      if (g[i] == 0.0f) {
        rgap[i] += 1;
        continue;
      }
      const double a = rgap[i] + 1, ga = g[i] / a;
      arrivals_after_a_gap += a > 1;
      rm[i] = std::pow(b1, a) * rm[i] + (1 - std::pow(b1, a)) * ga;
      rv[i] = std::pow(b2, a) * rv[i] + (1 - std::pow(b2, a)) * ga * ga;
      rp[i] -= lr / (1 - std::pow(b1, t)) * rm[i] / (std::sqrt(rv[i] / (1 - std::pow(b2, t))) + eps);
      rgap[i] = 0;
    }
  }
  EXPECT_GT(arrivals_after_a_gap, 1000);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(gap[i], rgap[i]) << i;
    ASSERT_NEAR(p[i], rp[i], 2e-6 * std::max(1.0, std::fabs(rp[i]))) << "p " << i;
    ASSERT_NEAR(m[i], rm[i], 2e-6 * std::max(1e-2, std::fabs(rm[i]))) << "m " << i;
    ASSERT_NEAR(v[i], rv[i], 2e-6 * std::max(1e-6, std::fabs(rv[i]))) << "v " << i;
  }
}

// A steady gradient c sent only every few steps (as top-k's error feedback
// sends an entry's a steps at once: a c) leaves the moments where dense AdamW
// leaves them after the same steps; the parameter does not move in between.
TEST(AdamWLazy, SteadyGradientSentInBurstsGivesDenseMoments) {
  Cpu cpu;
  const std::vector<ParamGroup> groups = {{"x", 0, 2, 1e-2, 0.0, true, false}};
  AdamWConfig cfg;
  cfg.max_grad_norm = 0;
  AdamW dense(*cpu.backend, cfg, groups, 2);
  cfg.sparse_gradients = true;
  AdamW lazy(*cpu.backend, cfg, groups, 2);
  lazy.set_sparse_gradients(true);
  const float c[2] = {0.3f, -0.02f};
  std::vector<float> pd = {1, 1}, pl = {1, 1}, waited = {0, 0};
  const std::set<int> sends = {1, 4, 5, 9, 16};  // entry 0 at these steps; entry 1 every step
  for (int t = 1; t <= 16; ++t) {
    std::vector<float> gd = {c[0], c[1]}, gl = {0, c[1]};
    waited[0] += c[0];
    if (sends.count(t)) gl[0] = waited[0], waited[0] = 0;
    const float before = pl[0];
    dense.step(pd, gd);
    lazy.step(pl, gl);
    if (!sends.count(t)) ASSERT_EQ(pl[0], before) << "step " << t;
    if (sends.count(t)) {
      EXPECT_NEAR(lazy.exp_avg()[0], dense.exp_avg()[0], 1e-6 * std::fabs(dense.exp_avg()[0])) << "step " << t;
      EXPECT_NEAR(lazy.exp_avg_sq()[0], dense.exp_avg_sq()[0], 1e-5 * dense.exp_avg_sq()[0]) << "step " << t;
    }
  }
  EXPECT_EQ(pl[1], pd[1]);  // the entry sent every step: plain AdamW
  ASSERT_EQ(lazy.state_parts().size(), 3u);
  EXPECT_STREQ(lazy.state_parts()[2].file, "adam_gap.f32");
  EXPECT_TRUE(lazy.state_parts()[2].zero_if_absent);
  cfg.max_grad_norm = 1;
  EXPECT_THROW(AdamW(*cpu.backend, cfg, groups, 2, {}, OptimizerKind::adamw8bit), Error);
}

}  // namespace
}  // namespace loom

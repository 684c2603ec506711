// loom's loss scaler against torch.amp.GradScaler's decisions on a recorded
// stream of gradients (scripts/fixtures/make_grad_scaler_fixture.py): each
// step's gradient is scaled, held in fp16, unscaled, checked; skipped or not,
// the scale and growth tracker after the update must be GradScaler's.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/half.h"
#include "core/mapped_file.h"
#include "expect_error.h"
#include "train/loss_scaler.h"

namespace loom {
namespace {

const std::string kFixture = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/grad_scaler/grad_scaler.json";

float json_float(const nlohmann::json& v) {
  return v.is_null() ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(v.get<double>());
}

TEST(LossScaler, ReplaysGradScalerDecisions) {
  const auto fx = nlohmann::json::parse(read_text_file(kFixture));
  int runs = 0, skipped = 0, grown = 0;
  for (const auto& run : fx["runs"]) {
    LossScalerOptions o;
    o.init_scale = run["init_scale"].get<double>();
    o.growth_factor = run["growth_factor"].get<double>();
    o.backoff_factor = run["backoff_factor"].get<double>();
    o.growth_interval = run["growth_interval"].get<int64_t>();
    LossScaler s(o);
    const std::string name = run["name"].get<std::string>();
    int64_t i = 0;
    for (const auto& st : run["steps"]) {
      const float before = s.scale();
      bool found_inf = false;
      std::vector<float> g;
      for (const auto& v : st["grad"]) {
        // The scaled gradient as an fp16 product holds it, then unscaled (trainer.cpp does the same).
        const float held = fp16_to_fp32(fp32_to_fp16(json_float(v) * s.scale()));
        g.push_back(held * s.inv_scale());
        found_inf = found_inf || !std::isfinite(g.back());
      }
      EXPECT_EQ(found_inf, st["skipped"].get<bool>()) << name << " step " << i;
      for (size_t k = 0; k < g.size(); ++k) {
        if (st["unscaled"][k].is_null()) {
          EXPECT_FALSE(std::isfinite(g[k])) << name << " step " << i << " element " << k;
        } else {
          EXPECT_EQ(g[k], json_float(st["unscaled"][k])) << name << " step " << i << " element " << k;
        }
      }
      s.update(found_inf);
      EXPECT_EQ(s.scale(), json_float(st["scale_after"])) << name << " step " << i;
      EXPECT_EQ(s.growth_tracker(), st["growth_tracker_after"].get<int64_t>()) << name << " step " << i;
      skipped += found_inf;
      grown += s.scale() > before;
      ++i;
    }
    ++runs;
  }
  EXPECT_EQ(runs, 2);
  EXPECT_GE(skipped, 10);  // the stream does exercise both rules
  EXPECT_GE(grown, 10);
}

TEST(LossScaler, DefaultsAreGradScalers) {
  LossScaler s;
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(s.inv_scale(), 1.0f / 65536.0f);
  for (int i = 0; i < 1999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(s.growth_tracker(), 1999);
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0f);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.update(false);
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(s.growth_tracker(), 0);
}

TEST(LossScaler, GrowthStopsBeforeInfinity) {
  LossScalerOptions o;
  o.init_scale = 0x1p127;
  o.growth_interval = 1;
  LossScaler s(o);
  s.update(false);  // 2^128 is not a float: GradScaler keeps the scale
  EXPECT_EQ(s.scale(), 0x1p127f);
  EXPECT_EQ(s.growth_tracker(), 0);
}

TEST(LossScaler, StateRoundTripsAndBadValuesAreRefused) {
  LossScaler s;
  s.update(true);
  s.update(false);
  LossScaler r;
  r.restore(s.state());
  EXPECT_EQ(r.scale(), 32768.0f);
  EXPECT_EQ(r.growth_tracker(), 1);
  using test_util::expect_error;
  expect_error([&] { r.restore({std::numeric_limits<float>::infinity(), 0}); }, ErrorKind::invalid_input,
               {"loss scaler state", "inf"});
  expect_error([&] { r.restore({1024.0f, 2000}); }, ErrorKind::invalid_input, {"growth tracker 2000"});
  expect_error([] { LossScaler bad({.init_scale = 0}); }, ErrorKind::invalid_input, {"init_scale"});
  expect_error([] { LossScaler bad({.growth_factor = 1.0}); }, ErrorKind::invalid_input, {"growth_factor"});
  expect_error([] { LossScaler bad({.backoff_factor = 1.0}); }, ErrorKind::invalid_input, {"backoff_factor"});
  expect_error([] { LossScaler bad({.growth_interval = 0}); }, ErrorKind::invalid_input, {"growth_interval"});
}

}  // namespace
}  // namespace loom

// Hardware-aware scheduling (serve/step_cost.h): the cost curves and the
// prefill budget they give, the cache file, and the serving engine keeping
// each step within the target on the tiny llama.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/cpu_features.h"
#include "core/trace.h"
#include "expect_error.h"
#include "model_test_util.h"
#include "serve/scheduler.h"
#include "serve/step_cost.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

const std::string kModel = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/tiny-llama.f32.gguf";

CostCurve curve(std::vector<int64_t> n, std::vector<double> ms) { return CostCurve{std::move(n), std::move(ms)}; }

// A machine where a step costs 2 ms, plus 1 ms per decode row and 0.5 ms per
// prefill token, and 1 ms per 1,000 attended positions.
StepCost linear_cost() {
  StepCost c;
  c.decode = curve({1, 64}, {3, 66});
  c.prefill = curve({1, 1024}, {2.5, 514});
  c.attend_ms_per_kpos = 1;
  return c;
}

TEST(StepCost, CurveInterpolatesAndExtends) {
  const CostCurve c = curve({1, 4, 16}, {2, 5, 11});
  EXPECT_DOUBLE_EQ(c.at(0), 0);
  EXPECT_DOUBLE_EQ(c.at(0.5), 1);   // from (0, 0) to the first point
  EXPECT_DOUBLE_EQ(c.at(1), 2);
  EXPECT_DOUBLE_EQ(c.at(2), 3);     // between 1 and 4
  EXPECT_DOUBLE_EQ(c.at(10), 8);    // between 4 and 16
  EXPECT_DOUBLE_EQ(c.at(32), 19);   // the last slope (0.5 ms a row) beyond 16
}

TEST(StepCost, PredictAddsTheMarginalPrefillAndAttention) {
  const StepCost c = linear_cost();
  EXPECT_NEAR(c.predict_ms(0, 0, 0), 0, 1e-12);
  EXPECT_NEAR(c.predict_ms(8, 0, 0), 10, 1e-9);
  // 8 decode rows, 100 prefill tokens (0.5 ms each on top), 4,000 positions read.
  EXPECT_NEAR(c.predict_ms(8, 100, 4000), 10 + 50 + 4, 1e-9);
}

TEST(StepCost, PrefillBudgetKeepsTheTarget) {
  const StepCost c = linear_cost();
  // No decode rows, no cached context: 2 + 0.5 p + p (p + 1) / 2000 <= 50.
  StepLoad idle;
  const int64_t p = prefill_budget(c, idle, 50, 1000, 16);
  EXPECT_LE(c.predict_ms(0, p, static_cast<double>(p) * (p + 1) / 2), 50);
  EXPECT_GT(c.predict_ms(0, p + 1, static_cast<double>(p + 1) * (p + 2) / 2), 50);
  // 16 decode rows at 1,000 positions: 18 + 16 = 34 ms before any prefill, of 50.
  const StepLoad busy{.decode_rows = 16, .decode_attended = 16000, .prefill_past = 200};
  const int64_t q = prefill_budget(c, busy, 50, 1000, 16);
  EXPECT_GT(q, 16);
  EXPECT_LT(q, p);
  const auto pairs = [&](int64_t n) { return 16000 + static_cast<double>(n) * 200 + static_cast<double>(n) * (n + 1) / 2; };
  EXPECT_LE(c.predict_ms(16, q, pairs(q)), 50);
  EXPECT_GT(c.predict_ms(16, q + 1, pairs(q + 1)), 50);
}

TEST(StepCost, PrefillBudgetLimits) {
  const StepCost c = linear_cost();
  EXPECT_EQ(prefill_budget(c, StepLoad{}, 1e9, 300, 16), 300);  // the cap
  EXPECT_EQ(prefill_budget(c, StepLoad{}, 50, 0, 16), 0);
  // Decode alone is over the target: prompts still get the minimum chunk.
  const StepLoad overloaded{.decode_rows = 64, .decode_attended = 64000};
  EXPECT_EQ(prefill_budget(c, overloaded, 50, 300, 16), 16);
  EXPECT_EQ(prefill_budget(c, overloaded, 50, 10, 16), 10);
}

TEST(StepCost, CorrectionFollowsTheActualTimes) {
  StepCostCorrection c;
  EXPECT_DOUBLE_EQ(c.scale(), 1);
  c.observe(0.5, 100);  // predicted under 1 ms: not counted
  EXPECT_DOUBLE_EQ(c.scale(), 1);
  c.observe(10, 20);  // one slow step moves it a tenth of the way
  EXPECT_NEAR(c.scale(), 1.1, 1e-12);
  for (int i = 0; i < 60; ++i) c.observe(10, 20);
  EXPECT_NEAR(c.scale(), 2, 0.01);
  for (int i = 0; i < 200; ++i) c.observe(10, 1000);  // the ratio is capped at 5
  EXPECT_NEAR(c.scale(), 5, 1e-6);
  // The budget then keeps the target for steps that take 2x the prediction.
  const StepCost cost = linear_cost();
  const int64_t p = prefill_budget(cost, StepLoad{}, 50.0 / 2, 1000, 16);
  EXPECT_LT(p, prefill_budget(cost, StepLoad{}, 50, 1000, 16));
}

TEST(StepCost, ShapeCountsRowsAndAttention) {
  StepShape s;
  s.add(1, 100);  // a decode row reading 100 cached positions and itself
  s.add(10, 50);  // a prefill chunk: 10 rows behind 50 positions, causal among themselves
  EXPECT_EQ(s.decode_rows, 1);
  EXPECT_EQ(s.prefill_tokens, 10);
  EXPECT_DOUBLE_EQ(s.attended, 101 + 500 + 55);
}

TEST(StepCost, JsonRoundTripAndErrors) {
  StepCost c = linear_cost();
  c.key.cpu = "cpu";
  c.key.model = "m:1:2";
  c.key.threads = 3;
  c.key.kv_dtype = "f16";
  c.seconds = 1.5;
  const std::string text = step_cost_to_json(c);
  const StepCost back = step_cost_from_json(text, "f.json");
  EXPECT_EQ(back.key, c.key);
  EXPECT_EQ(back.decode.n, c.decode.n);
  EXPECT_EQ(back.prefill.ms, c.prefill.ms);
  EXPECT_DOUBLE_EQ(back.attend_ms_per_kpos, 1);

  test_util::expect_error([&] { step_cost_from_json("{", "f.json"); }, ErrorKind::invalid_input, {"f.json: not JSON"});
  test_util::expect_error([&] { step_cost_from_json(R"({"loom_step_cost": 1e999})", "f.json"); },
                          ErrorKind::invalid_input, {"f.json: not JSON", "overflow"});
  auto j = nlohmann::json::parse(text);
  j["loom_step_cost"] = 99;
  test_util::expect_error([&] { step_cost_from_json(j.dump(), "f.json"); }, ErrorKind::invalid_input, {"not a loom step-cost file"});
  j = nlohmann::json::parse(text);
  j["decode_ms"] = nlohmann::json::array({nlohmann::json::array({4, 3.0}), nlohmann::json::array({2, 5.0})});
  test_util::expect_error([&] { step_cost_from_json(j.dump(), "f.json"); }, ErrorKind::invalid_input, {"sizes increasing"});
  j = nlohmann::json::parse(text);
  j["attend_ms_per_kpos"] = -1;
  test_util::expect_error([&] { step_cost_from_json(j.dump(), "f.json"); }, ErrorKind::invalid_input, {"attend_ms_per_kpos"});
  j = nlohmann::json::parse(text);
  j["key"].erase("model");
  test_util::expect_error([&] { step_cost_from_json(j.dump(), "f.json"); }, ErrorKind::invalid_input, {"\"model\""});
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("loom_step_cost_test_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

ServeOptions tiny_options(const fs::path& cache) {
  ServeOptions o;
  o.model_path = kModel;
  o.model_name = "base";
  o.threads = 2;
  o.max_seqs = 8;
  o.max_batch_tokens = 64;
  o.max_model_len = 256;
  o.step_cost_dir = cache.string();
  return o;
}

std::vector<int32_t> run(ServingEngine& e, std::vector<int32_t> prompt, int64_t max_tokens) {
  return test::serve_greedy_ids(e, "base", std::move(prompt), max_tokens);
}

std::vector<int32_t> long_prompt() {
  std::vector<int32_t> p;
  for (int i = 0; i < 100; ++i) p.push_back(3 + (i * 37) % 200);
  return p;
}

TEST(StepCost, MeasuredOnceThenReadFromTheCache) {
  TempDir tmp;
  ServeOptions o = tiny_options(tmp.path);
  o.itl_target_ms = 50;
  std::string path;
  {
    ServingEngine e(o);
    ASSERT_NE(e.step_cost(), nullptr);
    EXPECT_TRUE(e.step_cost()->measured);
    path = e.step_cost()->path;
    ASSERT_TRUE(fs::exists(path));
    const StepCost& c = e.step_cost()->cost;
    EXPECT_EQ(c.prefill.n.front(), 1);
    EXPECT_GT(c.decode.ms.front(), 0);
    EXPECT_FALSE(run(e, long_prompt(), 8).empty());  // the scratch sequences left the cache usable
  }
  {
    ServingEngine e(o);
    EXPECT_FALSE(e.step_cost()->measured);
    EXPECT_EQ(e.step_cost()->path, path);
  }
  std::ofstream(path) << "{ damaged";
  {
    ServingEngine e(o);
    EXPECT_TRUE(e.step_cost()->measured);  // measured over, and cached again
  }
  EXPECT_NO_THROW(step_cost_from_json([&] {
    std::stringstream ss;
    ss << std::ifstream(path).rdbuf();
    return ss.str();
  }(), path));
  o.remeasure_step_cost = true;
  ServingEngine e(o);
  EXPECT_TRUE(e.step_cost()->measured);
}

// With a cached cost of 1 ms per prefill token and a 20 ms target, no step
// prefills more than 20 tokens; the output is the fixed budget's.
TEST(StepCost, StepsKeepTheTargetAndTheOutput) {
  TempDir tmp;
  ServeOptions fixed = tiny_options(tmp.path);
  std::vector<int32_t> expected;
  {
    ServingEngine e(fixed);
    EXPECT_EQ(e.step_cost(), nullptr);
    expected = run(e, long_prompt(), 12);
  }
  ServeOptions o = fixed;
  o.itl_target_ms = 20;
  o.correct_step_cost = false;  // the tiny model's steps take far less than the cost below
  StepCost c;
  c.key = step_cost_key(o, 2, /*kv_positions=*/1 << 20);
  c.decode = curve({1, 8}, {1, 8});
  c.prefill = curve({1, 64}, {1, 64});
  c.attend_ms_per_kpos = 0;
  std::ofstream(step_cost_cache_path(tmp.path.string(), c.key)) << step_cost_to_json(c);

  Tracer tracer;
  o.tracer = &tracer;
  ServingEngine e(o);
  ASSERT_NE(e.step_cost(), nullptr);
  EXPECT_FALSE(e.step_cost()->measured);
  tracer.start();
  EXPECT_EQ(run(e, long_prompt(), 12), expected);
  tracer.stop();
  std::stringstream out;
  tracer.write_chrome_json(out, "{}");
  const auto trace = nlohmann::json::parse(out.str());
  int64_t steps = 0, prefilled = 0;
  for (const auto& ev : trace["traceEvents"]) {
    if (ev.value("name", "") != "serve_step" || !ev.contains("args")) continue;
    const auto p = ev["args"].value("prefill_tokens", 0.0);
    EXPECT_LE(p, 20);
    prefilled += static_cast<int64_t>(p);
    ++steps;
  }
  EXPECT_EQ(prefilled, 100);
  EXPECT_GE(steps, 5 + 11);  // 100 prompt tokens in chunks of at most 20, then 11 decode steps
}

TEST(StepCost, TargetMustBeFiniteAndNotNegative) {
  TempDir tmp;
  ServeOptions o = tiny_options(tmp.path);
  for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(), -1.0}) {
    o.itl_target_ms = bad;
    test_util::expect_error([&] { ServingEngine e(o); }, ErrorKind::invalid_input, {"--itl-target-ms"});
  }
}

}  // namespace
}  // namespace loom

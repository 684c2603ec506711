// TrainMetrics (the loom_train_ series and the live page's history): the values
// after a tiny-model run equal the run's own result, counters count what is
// new, eval figures are NaN until measured, the history stays bounded and
// ends at the newest step, and readers may render while the trainer writes.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <cstring>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/prometheus.h"
#include "temp_dir.h"
#include "train/train_metrics.h"
#include "train/trainer.h"

namespace loom {
namespace {

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

// `name{labels}` -> value, for every sample line of the exposition.
std::map<std::string, double> samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    const std::string v = line.substr(sp + 1);
    out[line.substr(0, sp)] = v == "NaN" ? std::nan("") : v == "+Inf" ? INFINITY : std::stod(v);
  }
  return out;
}

double value(const std::map<std::string, double>& s, const std::string& key) {
  const auto it = s.find(key);
  EXPECT_NE(it, s.end()) << key << " is not exported";
  return it == s.end() ? std::nan("") : it->second;
}

StepReport step_report(int64_t step, double loss, int64_t input_tokens) {
  StepReport r;
  r.step = step;
  r.loss = loss;
  r.lr = 1e-3;
  r.grad_norm = 0.5;
  r.target_tokens = 10;
  r.input_tokens = input_tokens;
  r.step_seconds = 0.02;
  return r;
}

TEST(TrainMetrics, EverySeriesShowsFromTheStartEvalAsNaN) {
  MetricsRegistry reg;
  TrainMetrics m(reg);
  const auto s = samples(m.render());
  for (const char* name :
       {"loom_train_step", "loom_train_total_steps", "loom_train_loss", "loom_train_learning_rate",
        "loom_train_grad_norm", "loom_train_tokens_total", "loom_train_target_tokens_total",
        "loom_train_tokens_per_second", "loom_train_step_seconds_count", "loom_train_skipped_steps_total",
        "loom_train_checkpoints_total", "loom_train_checkpoint_seconds_count",
        "loom_train_last_checkpoint_time_seconds", "loom_train_memory_rss_bytes", "loom_train_memory_limit_bytes",
        "loom_train_memory_alarm_level", "loom_train_progress_ratio", "loom_train_eta_seconds",
        "loom_train_start_time_seconds"})
    EXPECT_TRUE(s.count(name)) << name;
  EXPECT_TRUE(std::isnan(value(s, "loom_train_eval_loss")));
  EXPECT_TRUE(std::isnan(value(s, "loom_train_eval_token_accuracy")));
  EXPECT_EQ(value(s, "loom_train_step_seconds_count"), 0);
}

TEST(TrainMetrics, StepsEvalsCheckpointsAndMemory) {
  MetricsRegistry reg;
  TrainMetrics m(reg);
  m.on_start("tiny.gguf", "lora", 4, 0);
  m.on_step(step_report(1, 2.5, 100), 4, 1000, 3.0);
  m.on_step(step_report(2, 2.25, 200), 4, 1100, 2.0);
  m.on_eval(2, 2.4, 0.375);
  m.on_skipped_step();
  m.on_checkpoint(0.3);
  m.on_memory({{{"weights", 1000}, {"activations", 2000}}, 5000, 10000, 1});
  auto s = samples(m.render());
  EXPECT_EQ(value(s, "loom_train_info{model=\"tiny.gguf\",method=\"lora\"}"), 1);
  EXPECT_EQ(value(s, "loom_train_step"), 2);
  EXPECT_EQ(value(s, "loom_train_total_steps"), 4);
  EXPECT_EQ(value(s, "loom_train_loss"), 2.25);
  EXPECT_EQ(value(s, "loom_train_learning_rate"), 1e-3);
  EXPECT_EQ(value(s, "loom_train_grad_norm"), 0.5);
  EXPECT_EQ(value(s, "loom_train_tokens_total"), 200);  // the running total, not the sum of totals
  EXPECT_EQ(value(s, "loom_train_target_tokens_total"), 20);
  EXPECT_EQ(value(s, "loom_train_tokens_per_second"), 1100);
  EXPECT_EQ(value(s, "loom_train_step_seconds_count"), 2);
  EXPECT_EQ(value(s, "loom_train_step_seconds_bucket{le=\"0.025\"}"), 2);
  EXPECT_EQ(value(s, "loom_train_step_seconds_bucket{le=\"0.01\"}"), 0);
  EXPECT_EQ(value(s, "loom_train_eval_loss"), 2.4);
  EXPECT_EQ(value(s, "loom_train_eval_token_accuracy"), 0.375);
  EXPECT_EQ(value(s, "loom_train_skipped_steps_total"), 1);
  EXPECT_EQ(value(s, "loom_train_checkpoints_total"), 1);
  EXPECT_EQ(value(s, "loom_train_checkpoint_seconds_sum"), 0.3);
  EXPECT_GT(value(s, "loom_train_last_checkpoint_time_seconds"), 1.6e9);
  EXPECT_EQ(value(s, "loom_train_memory_bytes{arena=\"weights\"}"), 1000);
  EXPECT_EQ(value(s, "loom_train_memory_bytes{arena=\"activations\"}"), 2000);
  EXPECT_EQ(value(s, "loom_train_memory_rss_bytes"), 5000);
  EXPECT_EQ(value(s, "loom_train_memory_limit_bytes"), 10000);
  EXPECT_EQ(value(s, "loom_train_memory_alarm_level"), 1);
  EXPECT_EQ(value(s, "loom_train_progress_ratio"), 0.5);
  EXPECT_EQ(value(s, "loom_train_eta_seconds"), 2);
  m.on_finish();
  s = samples(m.render());
  EXPECT_EQ(value(s, "loom_train_progress_ratio"), 1);
  EXPECT_EQ(value(s, "loom_train_eta_seconds"), 0);

  const auto j = nlohmann::json::parse(m.curves_json());
  EXPECT_EQ(j["model"], "tiny.gguf");
  EXPECT_EQ(j["done"], true);
  EXPECT_EQ(j["step"], 2);
  EXPECT_EQ(j["train"]["step"], nlohmann::json({1, 2}));
  EXPECT_EQ(j["train"]["loss"], nlohmann::json({2.5, 2.25}));
  EXPECT_EQ(j["eval"]["step"], nlohmann::json({2}));
  EXPECT_EQ(j["eval"]["token_accuracy"], nlohmann::json({0.375}));
}

TEST(TrainMetrics, NonFiniteValuesAreNullInTheJson) {
  MetricsRegistry reg;
  TrainMetrics m(reg);
  m.on_step(step_report(1, std::nan(""), 10), 2, 0, INFINITY);
  m.on_eval(1, 3.0, std::nullopt);
  const auto j = nlohmann::json::parse(m.curves_json());
  EXPECT_TRUE(j["train"]["loss"][0].is_null());
  EXPECT_TRUE(j["eval"]["token_accuracy"][0].is_null());
  EXPECT_TRUE(j["eta_s"].is_null());
  EXPECT_TRUE(std::isnan(value(samples(m.render()), "loom_train_eta_seconds")));
}

// 10,000 steps keep at most kMaxPoints, in order, from step 1 to the newest.
TEST(TrainMetrics, HistoryIsBoundedAndEndsAtTheNewestStep) {
  MetricsRegistry reg;
  TrainMetrics m(reg);
  constexpr int64_t kSteps = 10001;
  for (int64_t i = 1; i <= kSteps; ++i) m.on_step(step_report(i, 1.0 / static_cast<double>(i), i), kSteps, 1, 1);
  const auto h = m.train_history();
  ASSERT_LE(h.size(), TrainMetrics::kMaxPoints + 1);
  EXPECT_GT(h.size(), TrainMetrics::kMaxPoints / 4);
  EXPECT_EQ(h.front().step, 1);
  EXPECT_EQ(h.back().step, kSteps);
  EXPECT_EQ(h.back().loss, 1.0 / kSteps);
  for (size_t i = 1; i < h.size(); ++i) ASSERT_LT(h[i - 1].step, h[i].step) << "at " << i;
}

TEST(TrainMetrics, ReadersRenderWhileTheTrainerWrites) {
  MetricsRegistry reg;
  TrainMetrics m(reg);
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    while (!stop) {
      const auto j = nlohmann::json::parse(m.curves_json());
      ASSERT_EQ(j["train"]["step"].size(), j["train"]["loss"].size());
      ASSERT_NE(m.render().find("loom_train_step "), std::string::npos);
    }
  });
  for (int64_t i = 1; i <= 5000; ++i) {
    m.on_step(step_report(i, 1, i * 10), 5000, 1, 1);
    if (i % 100 == 0) m.on_eval(i, 1, 0.5);
  }
  stop = true;
  reader.join();
  EXPECT_EQ(value(samples(m.render()), "loom_train_tokens_total"), 50000);
}

void collect_exprs(const nlohmann::json& j, std::vector<std::string>& out) {
  if (j.is_object()) {
    for (const auto& [k, v] : j.items()) {
      if (k == "expr" && v.is_string()) out.push_back(v.get<std::string>());
      collect_exprs(v, out);
    }
  } else if (j.is_array()) {
    for (const auto& v : j) collect_exprs(v, out);
  }
}

// deploy/grafana/loom-train.json is valid JSON and every loom_train_ name its
// queries use is a series TrainMetrics exports (histograms by their
// _bucket/_sum/_count samples); every exported family is on some panel.
TEST(TrainMetrics, GrafanaDashboardQueriesExportedSeries) {
  std::ifstream in(src("deploy/grafana/loom-train.json"));
  ASSERT_TRUE(in) << "deploy/grafana/loom-train.json";
  const nlohmann::json dash = nlohmann::json::parse(in);
  std::vector<std::string> exprs;
  collect_exprs(dash["panels"], exprs);
  ASSERT_GE(exprs.size(), 15u);
  MetricsRegistry reg;
  TrainMetrics m(reg);
  m.on_start("m.gguf", "lora", 2, 0);
  m.on_memory({{{"weights", 1}}, 1, 1, 0});  // the arena series appear with the first report
  const std::string text = m.render();
  std::set<std::string> exported, families, used;
  for (const auto& [key, v] : samples(text)) exported.insert(key.substr(0, key.find('{')));
  const std::regex type_line(R"(# TYPE (\S+) )");
  for (std::sregex_iterator it(text.begin(), text.end(), type_line), end; it != end; ++it)
    families.insert((*it)[1]);
  const std::regex name(R"(loom_train_[a-zA-Z0-9_]+)");
  for (const std::string& e : exprs) {
    for (std::sregex_iterator it(e.begin(), e.end(), name), end; it != end; ++it) {
      EXPECT_TRUE(exported.count(it->str())) << it->str() << " in '" << e << "' is not exported";
      std::string fam = it->str();
      for (const char* suffix : {"_bucket", "_sum", "_count"})
        if (fam.ends_with(suffix) && families.count(fam.substr(0, fam.size() - std::strlen(suffix))))
          fam = fam.substr(0, fam.size() - std::strlen(suffix));
      used.insert(fam);
    }
  }
  for (const std::string& f : families) {
    if (f == "loom_train_start_time_seconds" || f == "loom_train_target_tokens_total") continue;
    EXPECT_TRUE(used.count(f)) << f << " is on no panel of the dashboard";
  }
}

// The trainer keeps the series: after a tiny-model run they hold the run's own figures.
TEST(TrainMetrics, TrainerRunLeavesTheRunsValues) {
  test_util::TempDir tmp("train_metrics_test");
  const std::string yaml = fmt::format(
      "model: {}\ndata:\n  train: {}\n  eval: {}\n  seq_len: 48\nlora:\n  r: 4\n  dropout: 0\n"
      "optim:\n  lr: 1e-2\nschedule:\n  kind: linear\n  warmup_steps: 1\n"
      "batch_size: 2\ngrad_accum: 2\nsteps: 3\neval_interval: 2\neval_at_start: true\noutput_dir: {}\nseed: 3\n"
      "threads: 2\n",
      src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
      src("tests/fixtures/train_data/eval.jsonl"), (tmp.path / "out").string());
  const TrainConfig c = parse_train_config(yaml, "metrics.yaml");
  MetricsRegistry reg;
  TrainMetrics m(reg);
  std::vector<StepReport> reports;
  TrainHooks h;
  h.after_optimizer_step = [&](Trainer& t, const StepReport& r) {
    reports.push_back(r);
    // Updated before the hook runs: a scrape during the step sees this step.
    const auto s = samples(m.render());
    EXPECT_EQ(value(s, "loom_train_step"), r.step);
    EXPECT_EQ(value(s, "loom_train_loss"), r.loss);
  };
  TrainRuntime rt;
  rt.metrics = &m;
  const TrainResult res = run_training(c, nullptr, h, rt);
  ASSERT_EQ(reports.size(), 3u);
  const auto s = samples(m.render());
  EXPECT_EQ(value(s, "loom_train_info{model=\"tiny-llama.f32.gguf\",method=\"lora\"}"), 1);
  EXPECT_EQ(value(s, "loom_train_step"), 3);
  EXPECT_EQ(value(s, "loom_train_total_steps"), 3);
  EXPECT_EQ(value(s, "loom_train_loss"), res.step_losses.back());
  EXPECT_EQ(value(s, "loom_train_learning_rate"), reports.back().lr);
  EXPECT_EQ(value(s, "loom_train_grad_norm"), reports.back().grad_norm);
  EXPECT_EQ(value(s, "loom_train_eval_loss"), *res.final_eval_loss);
  EXPECT_EQ(value(s, "loom_train_tokens_total"), reports.back().input_tokens);
  EXPECT_EQ(value(s, "loom_train_target_tokens_total"), res.trained_tokens);
  EXPECT_EQ(value(s, "loom_train_step_seconds_count"), 3);
  EXPECT_GT(value(s, "loom_train_tokens_per_second"), 0);
  EXPECT_EQ(value(s, "loom_train_progress_ratio"), 1);
  EXPECT_EQ(value(s, "loom_train_eta_seconds"), 0);
  EXPECT_EQ(value(s, "loom_train_skipped_steps_total"), 0);

  const auto j = nlohmann::json::parse(m.curves_json());
  EXPECT_EQ(j["done"], true);
  EXPECT_EQ(j["train"]["step"], nlohmann::json({1, 2, 3}));
  EXPECT_EQ(j["train"]["loss"], nlohmann::json(res.step_losses));
  EXPECT_EQ(j["eval"]["step"], nlohmann::json({0, 2, 3}));
  EXPECT_EQ(j["eval"]["loss"], nlohmann::json(res.eval_losses));
}

}  // namespace
}  // namespace loom

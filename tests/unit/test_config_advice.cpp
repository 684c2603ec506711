// Advice before training (train/config_advice.h): each rule fires on the
// setting the guide warns about, names the key, and stays quiet on a fine
// value; the Trainer logs the warnings at the start of a run, and
// Trainer::check (`loom train --check`) reports without writing anything.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "expect_error.h"
#include "temp_dir.h"
#include "train/config_advice.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

ModelConfig model_with_eps(double eps) {
  ModelConfig m;
  m.rms_eps = eps;
  return m;
}

// The keys advise_config warns about, in order.
std::vector<std::string> keys(const std::vector<ConfigWarning>& ws) {
  std::vector<std::string> out;
  for (const ConfigWarning& w : ws) out.push_back(w.key);
  return out;
}

std::vector<std::string> advise(const TrainConfig& c, double rms_eps = 1e-5) {
  return keys(advise_config(c, model_with_eps(rms_eps)));
}

// The one warning for `key`; fails the test when there is not exactly one.
ConfigWarning only(const std::vector<ConfigWarning>& ws, const std::string& key) {
  EXPECT_EQ(keys(ws), std::vector<std::string>{key});
  return ws.empty() ? ConfigWarning{} : ws.front();
}

void expect_has(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << text << "\n  missing: " << needle;
}

TEST(ConfigAdvice, DefaultsAndTypicalModelsGetNoWarning) {
  const TrainConfig c;  // LoRA r 8, lr 2e-4, clipping 1.0, eps 1e-8, fp32
  EXPECT_TRUE(advise(c).empty());
  TrainConfig fp16 = c;
  fp16.precision = TrainPrecision::fp16;
  EXPECT_TRUE(advise(fp16, 1e-6).empty());  // Qwen2's eps, subnormal in fp16 but held within 3%
  EXPECT_TRUE(advise(fp16, 1e-5).empty());  // Llama's, SmolLM2's
}

TEST(ConfigAdvice, LoraRankBelowEight) {
  TrainConfig c;
  c.lora.r = 4;
  const ConfigWarning w = only(advise_config(c, model_with_eps(1e-5)), "lora.r");
  EXPECT_EQ(w.value, 4);
  expect_has(w.message, "lora.r 4 is below 8");
  expect_has(w.message, "start at lora.r: 8");
  c.lora.r = 8;
  EXPECT_TRUE(advise(c).empty());
  c.lora.r = 4;
  c.method = TrainMethod::full;  // no adapters: the rank means nothing
  c.lr = 3e-5;
  EXPECT_TRUE(advise(c).empty());
}

TEST(ConfigAdvice, LoraLearningRateAboveOneInAThousand) {
  TrainConfig c;
  c.lr = 2e-3;  // the main job's
  const ConfigWarning w = only(advise_config(c, model_with_eps(1e-5)), "optim.lr");
  EXPECT_EQ(w.value, 2e-3);
  expect_has(w.message, "optim.lr 0.002 is above 1e-3");
  expect_has(w.message, "1e-4 to 2e-4");
  expect_has(w.message, "try optim.lr: 2e-4");
  for (double fine : {1e-4, 2e-4, 1e-3}) {
    c.lr = fine;
    EXPECT_TRUE(advise(c).empty()) << fine;
  }
  c.mlp_lr = 5e-3;  // the MLP adapters' own rate
  const ConfigWarning m = only(advise_config(c, model_with_eps(1e-5)), "optim.mlp_lr");
  expect_has(m.message, "optim.mlp_lr 0.005 is above 1e-3");
  expect_has(m.message, "try optim.mlp_lr: 2e-4");
}

TEST(ConfigAdvice, FullFineTuningLearningRateAboveOneInTenThousand) {
  TrainConfig c;
  c.method = TrainMethod::full;
  c.lr = 2e-4;  // fine for LoRA, high for every weight
  const ConfigWarning w = only(advise_config(c, model_with_eps(1e-5)), "optim.lr");
  expect_has(w.message, "optim.lr 0.0002 is above 1e-4");
  expect_has(w.message, "try optim.lr: 3e-5");
  for (double fine : {3e-5, 1e-4}) {
    c.lr = fine;
    EXPECT_TRUE(advise(c).empty()) << fine;
  }
}

TEST(ConfigAdvice, ClippingOff) {
  TrainConfig c;
  for (double off : {0.0, -1.0}) {
    c.adam.max_grad_norm = off;
    const ConfigWarning w = only(advise_config(c, model_with_eps(1e-5)), "optim.max_grad_norm");
    expect_has(w.message, "turns gradient clipping off");
    expect_has(w.message, "use optim.max_grad_norm: 1.0");
  }
  for (double on : {0.3, 1.0, 5.0}) {
    c.adam.max_grad_norm = on;
    EXPECT_TRUE(advise(c).empty()) << on;
  }
}

// loom adds AdamW's eps in f32: 1e-8 is fine under fp16; below fp16's
// gradient resolution at the initial loss scale (2^-24 / 2^16) it is not.
TEST(ConfigAdvice, AdamEpsBelowFp16GradientResolution) {
  TrainConfig c;
  c.precision = TrainPrecision::fp16;
  c.adam.eps = 1e-13;
  const ConfigWarning w = only(advise_config(c, model_with_eps(1e-5)), "optim.eps");
  expect_has(w.message, "optim.eps 1e-13 is below the smallest gradient fp16 products hold");
  expect_has(w.message, "use optim.eps: 1e-6");
  for (double fine : {1e-12, 1e-8, 1e-6}) {
    c.adam.eps = fine;
    EXPECT_TRUE(advise(c).empty()) << fine;
  }
  c.adam.eps = 1e-13;
  for (TrainPrecision p : {TrainPrecision::fp32, TrainPrecision::bf16}) {  // no fp16 gradients
    c.precision = p;
    EXPECT_TRUE(advise(c).empty()) << train_precision_name(p);
  }
}

TEST(ConfigAdvice, NormEpsThatFp16CannotHold) {
  TrainConfig c;
  c.precision = TrainPrecision::fp16;
  ConfigWarning w = only(advise_config(c, model_with_eps(1e-10)), "model");
  EXPECT_EQ(w.value, 1e-10);
  expect_has(w.message, "rms_norm_eps) 1e-10 is below fp16's smallest subnormal 5.96e-8 and is 0 in fp16");
  expect_has(w.message, "rms_norm_eps 1e-6 or 1e-5, or precision: bf16");
  w = only(advise_config(c, model_with_eps(4e-8)), "model");  // rounds up to 2^-24
  expect_has(w.message, "is 5.96e-08 in fp16");
  for (double fine : {6e-8, 1e-6, 1e-5}) EXPECT_TRUE(advise(c, fine).empty()) << fine;
  c.precision = TrainPrecision::bf16;  // f32's exponent range
  EXPECT_TRUE(advise(c, 1e-10).empty());
  c.precision = TrainPrecision::fp32;
  EXPECT_TRUE(advise(c, 1e-10).empty());
  // A full fine-tune written as f16 meets fp16 where it runs.
  c.method = TrainMethod::full;
  c.lr = 3e-5;
  c.output_dtype = safetensors::StDType::f16;
  w = only(advise_config(c, model_with_eps(1e-10)), "model");
  expect_has(w.message, "(output_dtype: f16)");
  expect_has(w.message, "or output_dtype: bf16");
  c.output_dtype = safetensors::StDType::bf16;
  EXPECT_TRUE(advise(c, 1e-10).empty());
}

TEST(ConfigAdvice, SeqLenTruncatingMoreThanOneSampleInTen) {
  TrainConfig c;
  c.seq_len = 64;
  DataStats s;
  s.samples = 9;
  s.dropped = 1;  // read, then dropped: counts as read
  s.truncated = 2;
  const std::vector<ConfigWarning> ws = advise_data(c, s);
  ASSERT_EQ(keys(ws), std::vector<std::string>{"data.seq_len"});
  EXPECT_EQ(ws[0].value, 64);
  expect_has(ws[0].message, "data.seq_len 64 cuts 2 of the 10 samples read (20%, more than 10%)");
  expect_has(ws[0].message, "raise data.seq_len");
  s.truncated = 1;  // 10%: a few long outliers
  EXPECT_TRUE(advise_data(c, s).empty());
  s.truncated = 0;
  EXPECT_TRUE(advise_data(c, s).empty());
}

// The README's main job (LoRA r 16, lr 2e-3 for 180 steps of a narrow task):
// its learning rate is 10x the usual top and the rule says so; nothing else fires.
TEST(ConfigAdvice, MainJobIsWarnedAboutItsLearningRateOnly) {
  const TrainConfig c = load_train_config(src("configs/main_job.yaml"));
  EXPECT_EQ(advise(c, 1e-5), std::vector<std::string>{"optim.lr"});
}

// ---- in the Trainer ----------------------------------------------------------

struct TinyRun {
  test_util::TempDir tmp;
  explicit TinyRun(const std::string& tag) : tmp("config_advice_" + tag) {}
  std::string path(const std::string& rel) const { return (tmp.path / rel).string(); }
  // r 4 and lr 1e-2: two warnings; seq_len 12 cuts the two long samples of text.jsonl.
  TrainConfig config(const std::vector<std::string>& sets = {}) const {
    return parse_train_config(
        fmt::format(
            "model: {}\ndata:\n  train: {}\n  seq_len: 12\n  cache_dir: {}\nlora:\n  r: 4\n  dropout: 0\n"
            "optim:\n  lr: 1e-2\nbatch_size: 2\ngrad_accum: 2\nsteps: 2\noutput_dir: {}\n"
            "metrics_file: {}\nlog_file: {}\nseed: 1\nthreads: 2\n",
            src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
            path("cache"), path("out/adapter"), path("metrics.jsonl"), path("logs/log.jsonl")),
        "advice.yaml", sets);
  }
  std::vector<json> records(const std::string& action) const {
    std::vector<json> out;
    std::ifstream f(path("logs/log.jsonl"));
    for (std::string line; std::getline(f, line);) {
      json j = json::parse(line);
      if (j["event"]["action"] == action) out.push_back(j);
    }
    return out;
  }
};

std::vector<std::string> advice_keys(const std::vector<json>& records) {
  std::vector<std::string> out;
  for (const json& j : records)
    if (j["loom"].contains("advice")) out.push_back(j["loom"]["advice"]["key"]);
  return out;
}

TEST(ConfigAdvice, EveryRunLogsTheWarningsAtStart) {
  TinyRun run("run");
  const TrainResult r = run_training(run.config(), nullptr);
  EXPECT_EQ(r.steps, 2);
  const std::vector<json> recs = run.records("config");
  EXPECT_EQ(advice_keys(recs), (std::vector<std::string>{"lora.r", "optim.lr", "data.seq_len"}));
  for (const json& j : recs) {
    EXPECT_EQ(j["log.level"], "warn");
    expect_has(j["message"], "advice.yaml: ");
  }
  // Once: not again at the evaluation or the end.
  TinyRun quiet("quiet");
  run_training(quiet.config({"lora.r=8", "optim.lr=2e-4", "data.seq_len=64"}), nullptr);
  EXPECT_TRUE(advice_keys(quiet.records("config")).empty());
}

TEST(ConfigAdvice, CheckReportsAndWritesNothing) {
  TinyRun run("check");
  char* text = nullptr;
  size_t size = 0;
  std::FILE* out = open_memstream(&text, &size);
  const CheckReport r = run_check(run.config(), out);
  std::fclose(out);
  const std::string printed(text, size);
  std::free(text);
  EXPECT_EQ(keys(r.warnings), (std::vector<std::string>{"lora.r", "optim.lr", "data.seq_len"}));
  EXPECT_GT(r.memory.total, 0);
  EXPECT_EQ(r.tokens.rows, 4);  // grad_accum 2 x batch_size 2
  EXPECT_EQ(r.tokens.slots, 48);
  EXPECT_GT(r.tokens.tokens, 0);
  EXPECT_LE(r.tokens.tokens, 48);
  EXPECT_GT(r.tokens.targets, 0);
  EXPECT_LE(r.tokens.targets, r.tokens.tokens);
  EXPECT_EQ(r.data.truncated, 2);
  EXPECT_EQ(r.total_steps, 2);
  expect_has(printed, "memory: needs about");
  expect_has(printed, "tokens per step: 4 rows (2 x 2) x 12 = 48 slots");
  expect_has(printed, "2 truncated");
  expect_has(printed, "warning: advice.yaml: lora.r 4 is below 8");
  expect_has(printed, "check: advice.yaml can start (2 steps); 3 warnings");
  for (const char* p : {"out", "cache", "metrics.jsonl", "logs"})
    EXPECT_FALSE(fs::exists(run.tmp.path / p)) << p << " was written";
}

// After a run: its token cache is read, a cache for other settings is not
// written, and its output, checkpoints and metrics file stay as they are.
TEST(ConfigAdvice, CheckLeavesAnEarlierRunAsItIs) {
  TinyRun run("check_after");
  run_training(run.config({"checkpoint_interval=1"}), nullptr);
  const auto listing = [&] {
    std::vector<std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(run.tmp.path))
      out.push_back(
          fmt::format("{} {}", e.path().string(), e.is_regular_file() ? fs::file_size(e.path()) : 0));
    std::sort(out.begin(), out.end());
    return out;
  };
  const std::vector<std::string> before = listing();
  EXPECT_EQ(run_check(run.config({"checkpoint_interval=1", "overwrite=true"}), nullptr).data.truncated, 2);
  EXPECT_EQ(run_check(run.config({"data.seq_len=32", "overwrite=true"}), nullptr).data.truncated, 0);
  EXPECT_EQ(listing(), before);
}

TEST(ConfigAdvice, CheckFailsAsTheRunWould) {
  TinyRun run("check_bad");
  test_util::expect_error([&] { run_check(run.config({"model=" + run.path("none.gguf")}), nullptr); },
                          ErrorKind::not_found, {"none.gguf"});
  test_util::expect_error([&] { run_check(run.config({"memory_limit=1MiB"}), nullptr); },
                          ErrorKind::invalid_input, {"memory_limit"});
  fs::create_directories(run.tmp.path / "out" / "adapter");
  std::ofstream(run.tmp.path / "out" / "adapter" / "notes.txt") << "mine";
  test_util::expect_error([&] { run_check(run.config(), nullptr); }, ErrorKind::invalid_input,
                          {"output_dir", "--overwrite"});
  EXPECT_TRUE(fs::exists(run.tmp.path / "out" / "adapter" / "notes.txt"));
}

}  // namespace
}  // namespace loom

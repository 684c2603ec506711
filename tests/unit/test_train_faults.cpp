// Fault handling in the Trainer on the tiny llama fixture, driven by
// LOOM_FAILPOINTS specs: a non-finite step is not applied (parameters,
// moments and step count unchanged) and names the first bad tensor; a run
// with skipped steps still ends; max_bad_steps then stop is a diverged error;
// rollback goes back to the last checkpoint with a lower learning rate, at
// most max_rollbacks times; any error that ends a run is a log record with
// the step and the checkpoint to resume from.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/failpoints.h"
#include "core/thread_pool.h"
#include "temp_dir.h"
#include "train/checkpoint.h"
#include "train/faults.h"
#include "train/lora_params.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

struct FaultRun {
  test_util::TempDir tmp;
  explicit FaultRun(const std::string& tag) : tmp("train_faults_" + tag) {}
  std::string log() const { return (tmp.path / "log.jsonl").string(); }
  // 8 steps of one micro-batch of 2 rows, constant learning rate, no dropout.
  TrainConfig config(const std::string& extra = "", const std::vector<std::string>& sets = {}) const {
    return parse_train_config(
        fmt::format("model: {}\ndata:\n  train: {}\n  seq_len: 32\nlora:\n  r: 4\n  dropout: 0\n"
                    "optim:\n  lr: 1e-2\nschedule:\n  kind: constant\nbatch_size: 2\nsteps: 8\n"
                    "output_dir: {}\nlog_file: {}\nseed: 1\nthreads: 2\n{}",
                    src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
                    (tmp.path / "out").string(), log(), extra),
        "faults.yaml", sets);
  }
  // The log_file's records with event.action `action`.
  std::vector<json> records(const std::string& action) const {
    std::vector<json> out;
    std::ifstream f(log());
    for (std::string line; std::getline(f, line);) {
      json j = json::parse(line);
      if (j["event"]["action"] == action) out.push_back(j);
    }
    return out;
  }
};

TrainRuntime with(const Failpoints& fp) {
  TrainRuntime rt;
  rt.failpoints = &fp;
  return rt;
}

// run_training's error, which must be of `kind` and already reported.
Error run_error(const TrainConfig& c, const Failpoints& fp, ErrorKind kind, TrainHooks hooks = {}) {
  try {
    run_training(c, nullptr, std::move(hooks), with(fp));
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_TRUE(e.reported()) << "the error record was not written";
    return e;
  }
  ADD_FAILURE() << "run_training did not throw";
  return Error(ErrorKind::internal, "");
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(FirstNonFinite, FindsTheFirstBadElement) {
  std::vector<float> a(10000, 1.0f);
  a[7] = std::numeric_limits<float>::max();
  a[8] = std::numeric_limits<float>::denorm_min();
  a[9] = -0.0f;
  EXPECT_FALSE(first_non_finite(a));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> b = a;
    b[9000] = bad;
    b[5000] = bad;
    EXPECT_EQ(first_non_finite(b), 5000u);
  }
  EXPECT_FALSE(first_non_finite(std::span<const float>()));
}

TEST(FirstNonFinite, SplitOverThreadsStillTheFirst) {
  ThreadPool pool(2);
  std::vector<float> a((size_t{1} << 21) + 3, 0.5f);
  EXPECT_FALSE(first_non_finite(a, &pool));
  a[a.size() - 1] = std::numeric_limits<float>::infinity();  // the second thread's chunk
  EXPECT_EQ(first_non_finite(a, &pool), a.size() - 1);
  a[10] = std::numeric_limits<float>::quiet_NaN();  // also one in the first chunk
  EXPECT_EQ(first_non_finite(a, &pool), 10u);
}

TEST(TrainFaults, TensorAtNamesEveryLoraMatrixAndFullWeight) {
  FaultRun run("names");
  Trainer t(run.config(), nullptr);
  t.setup();
  const LoraModel layout(t.model().config(), t.config().lora);  // the same layout the trainer laid out
  const auto r = static_cast<size_t>(t.config().lora.r);
  for (int64_t l = 0; l < layout.n_layers(); ++l)
    for (LoraTarget tg : kAllLoraTargets) {
      const LoraSlot& s = layout.slot(l, tg);
      if (!s.active) continue;
      const std::string a = LoraModel::peft_name(l, tg, true), b = LoraModel::peft_name(l, tg, false);
      const std::string short_a = t.params().tensor_at(s.a_offset);
      EXPECT_TRUE(short_a.starts_with(fmt::format("layers.{}.", l))) << short_a;
      EXPECT_TRUE(short_a.ends_with(".lora_A")) << short_a;
      EXPECT_TRUE(has(a, short_a)) << a << " vs " << short_a;
      EXPECT_EQ(t.params().tensor_at(s.a_offset + r * static_cast<size_t>(s.in) - 1), short_a);
      EXPECT_TRUE(has(b, t.params().tensor_at(s.b_offset))) << b;
      EXPECT_TRUE(t.params().tensor_at(s.b_offset).ends_with(".lora_B"));
    }
  EXPECT_EQ(t.params().tensor_at(static_cast<size_t>(t.params().count())), "");

  FaultRun full_run("names_full");
  Trainer f(full_run.config("method: full\n"), nullptr);
  f.setup();
  const auto n = static_cast<size_t>(f.params().count());
  EXPECT_EQ(f.params().tensor_at(0), "model.embed_tokens.weight");
  const std::string last = f.params().tensor_at(n - 1);
  EXPECT_TRUE(last == "model.norm.weight" || last == "lm_head.weight") << last;
  EXPECT_TRUE(f.params().tensor_at(n / 2).starts_with("model.layers.")) << f.params().tensor_at(n / 2);
  EXPECT_EQ(f.params().tensor_at(n), "");
}

// nan_grad at attempt 3: that step is not applied at all (parameters, moments
// and step count as before), its rows are consumed, it names the tensor; the
// next attempt runs step 3 again and the run makes its 8 updates.
TEST(TrainFaults, NanGradSkipsExactlyThatStepAndNamesTheTensor) {
  FaultRun run("nan_grad");
  const Failpoints fp = Failpoints::parse("nan_grad@step=3");
  Trainer t(run.config(), nullptr, {}, with(fp));
  t.setup();
  EXPECT_FALSE(t.train_step().skipped);
  EXPECT_FALSE(t.train_step().skipped);
  const std::vector<float> params(t.params().params().begin(), t.params().params().end());
  const std::vector<float> m(t.optimizer().exp_avg().begin(), t.optimizer().exp_avg().end());
  const std::vector<float> v(t.optimizer().exp_avg_sq().begin(), t.optimizer().exp_avg_sq().end());
  const DataCursor before = t.loader().cursor();
  const StepReport r = t.train_step();
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(t.steps_done(), 2);
  EXPECT_EQ(t.optimizer().step_count(), 2);
  EXPECT_TRUE(std::equal(params.begin(), params.end(), t.params().params().begin()));
  EXPECT_TRUE(std::equal(m.begin(), m.end(), t.optimizer().exp_avg().begin()));
  EXPECT_TRUE(std::equal(v.begin(), v.end(), t.optimizer().exp_avg_sq().begin()));
  EXPECT_NE(t.loader().cursor(), before);  // the data is consumed
  EXPECT_EQ(t.result().step_losses.size(), 2u);
  EXPECT_EQ(t.faults().skipped_steps, 1);
  EXPECT_EQ(t.faults().bad_in_a_row, 1);

  const std::vector<json> skipped = run.records("skipped_step");
  ASSERT_EQ(skipped.size(), 1u);
  const std::string tensor = t.params().tensor_at(static_cast<size_t>(t.params().count()) / 2);
  ASSERT_FALSE(tensor.empty());
  EXPECT_EQ(skipped[0]["log.level"], "warn");
  EXPECT_EQ(skipped[0]["loom"]["step"], 3);
  EXPECT_EQ(skipped[0]["loom"]["reason"], "gradient");
  EXPECT_EQ(skipped[0]["loom"]["tensor"], tensor);
  EXPECT_EQ(skipped[0]["loom"]["arena_offset"], t.params().count() / 2);
  EXPECT_TRUE(has(skipped[0]["message"], "step 3: non-finite gradient (nan in " + tensor)) << skipped[0]["message"];

  int attempts = 3;
  while (t.steps_done() < t.total_steps()) {
    EXPECT_FALSE(t.train_step().skipped);
    ++attempts;
  }
  EXPECT_EQ(attempts, 9);  // 8 updates + the skipped one
  EXPECT_EQ(t.faults().bad_in_a_row, 0);
  const TrainResult res = t.finish();
  EXPECT_EQ(res.steps, 8);
  EXPECT_EQ(res.step_losses.size(), 8u);
  for (double l : res.step_losses) EXPECT_TRUE(std::isfinite(l));
}

TEST(TrainFaults, NanLossAndInfGradAreSkippedToo) {
  FaultRun run("nan_loss");
  const Failpoints fp = Failpoints::parse("nan_loss@step=2,inf_grad@step=5");
  std::vector<StepReport> applied;
  TrainHooks h;
  h.after_optimizer_step = [&](Trainer&, const StepReport& r) { applied.push_back(r); };
  const TrainResult res = run_training(run.config(), nullptr, h, with(fp));
  EXPECT_EQ(res.steps, 8);
  EXPECT_EQ(applied.size(), 8u);  // the hook sees applied steps only
  const std::vector<json> skipped = run.records("skipped_step");
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_EQ(skipped[0]["loom"]["reason"], "loss");
  EXPECT_EQ(skipped[0]["loom"]["tensor"], "loss");
  EXPECT_EQ(skipped[0]["loom"]["step"], 2);
  EXPECT_EQ(skipped[1]["loom"]["reason"], "gradient");
  EXPECT_EQ(skipped[1]["loom"]["step"], 4);  // attempt 5 ran step 4 (attempt 2 was skipped)
  EXPECT_TRUE(has(skipped[1]["message"], "(inf in ")) << skipped[1]["message"];
  EXPECT_EQ(skipped[1]["loom"]["skipped_steps"], 2);
}

// A real divergence, not an injected one: a huge learning rate with clipping
// off overflows within a few steps; on_divergence: stop ends the run.
TEST(TrainFaults, RealOverflowIsCaughtAndStops) {
  FaultRun run("overflow");
  const Failpoints none;
  TrainConfig c = run.config("optim.max_grad_norm: 0\non_divergence: stop\nmax_bad_steps: 1\n", {"steps=30"});
  c.lr = 1e30;  // beyond what the config accepts: the overflow must come from the numbers themselves
  const Error e = run_error(c, none, ErrorKind::diverged);
  EXPECT_TRUE(has(e.what(), "training diverged at step")) << e.what();
  EXPECT_EQ(run.records("skipped_step").size(), 1u);
}

TEST(TrainFaults, MaxBadStepsThenStopIsADivergedError) {
  FaultRun run("stop");
  const Failpoints fp = Failpoints::parse("nan_grad@step=3..");
  const Error e = run_error(run.config("on_divergence: stop\nmax_bad_steps: 3\n"), fp, ErrorKind::diverged);
  const std::string what = e.what();
  EXPECT_TRUE(has(what, "training diverged at step 3: 3 steps in a row")) << what;
  EXPECT_TRUE(has(what, "on_divergence: stop")) << what;
  EXPECT_TRUE(has(what, "lower optim.lr")) << what;
  EXPECT_EQ(error_exit_code(e.kind()), 4);
  EXPECT_EQ(run.records("skipped_step").size(), 3u);
  const std::vector<json> err = run.records("diverged");
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0]["log.level"], "error");
  EXPECT_EQ(err[0]["error"]["type"], "diverged");
  EXPECT_EQ(err[0]["loom"]["step"], 3);
  EXPECT_EQ(err[0]["loom"]["exit_code"], 4);
  EXPECT_TRUE(err[0]["loom"]["checkpoint"].is_null());
  EXPECT_TRUE(has(err[0]["message"], "no checkpoint to resume from")) << err[0]["message"];
}

TEST(TrainFaults, RollbackWithoutACheckpointStops) {
  FaultRun run("no_ckpt");
  const Failpoints fp = Failpoints::parse("nan_grad@step=2..3");
  const Error e = run_error(run.config("max_bad_steps: 2\n"), fp, ErrorKind::diverged);
  EXPECT_TRUE(has(e.what(), "no checkpoint in")) << e.what();
}

// Checkpoints every 2 steps; attempts 5 and 6 (both step 5) are bad: back to
// step 4 at half the learning rate. Step 5 then sees the same parameters and
// rows as the clean run (the same loss), and updates at half its lr.
TEST(TrainFaults, RollbackLowersTheLearningRateAndGoesOn) {
  FaultRun clean_run("clean"), run("rollback");
  const std::string extra = "checkpoint_interval: 2\nmax_bad_steps: 2\nrollback_lr_factor: 0.5\n";
  std::vector<double> clean_lr, lr;
  TrainHooks hc, h;
  hc.after_optimizer_step = [&](Trainer&, const StepReport& r) { clean_lr.push_back(r.lr); };
  const Failpoints none;
  const TrainResult clean = run_training(clean_run.config(extra), nullptr, hc, with(none));
  const Failpoints fp = Failpoints::parse("nan_grad@step=5..6");
  FaultState after{};
  h.after_optimizer_step = [&](Trainer& t, const StepReport& r) {
    lr.push_back(r.lr);
    after = t.faults();
  };
  const TrainResult res = run_training(run.config(extra), nullptr, h, with(fp));
  EXPECT_EQ(res.steps, 8);
  EXPECT_EQ(after.rollbacks, 1);
  EXPECT_EQ(after.lr_scale, 0.5);
  EXPECT_EQ(after.skipped_steps, 2);
  EXPECT_EQ(after.bad_in_a_row, 0);
  ASSERT_EQ(res.step_losses.size(), 8u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(res.step_losses[i], clean.step_losses[i]) << "step " << i + 1;
  EXPECT_NE(res.step_losses[5], clean.step_losses[5]);
  // The hook saw steps 1-4 at the clean run's lr, then 5-8 (after the rollback) at half.
  ASSERT_EQ(lr.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(lr[i], clean_lr[i] * (i < 4 ? 1.0 : 0.5)) << "step " << i + 1;
  const std::vector<json> rb = run.records("rollback");
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_EQ(rb[0]["loom"]["step"], 5);
  EXPECT_EQ(rb[0]["loom"]["checkpoint"]["step"], 4);
  EXPECT_EQ(rb[0]["loom"]["lr_scale"], 0.5);
  EXPECT_EQ(rb[0]["loom"]["rollbacks"], 1);
  EXPECT_TRUE(has(rb[0]["message"], "step-00000004")) << rb[0]["message"];
}

TEST(TrainFaults, MaxRollbacksThenStop) {
  FaultRun run("max_rollbacks");
  const Failpoints fp = Failpoints::parse("nan_grad@step=3..");
  const Error e = run_error(
      run.config("checkpoint_interval: 2\nmax_bad_steps: 2\nmax_rollbacks: 2\nrollback_lr_factor: 0.25\n"), fp,
      ErrorKind::diverged);
  EXPECT_TRUE(has(e.what(), "no rollback left (max_rollbacks 2)")) << e.what();
  EXPECT_TRUE(has(e.what(), "lr scale 0.0625")) << e.what();
  const std::vector<json> rb = run.records("rollback");
  ASSERT_EQ(rb.size(), 2u);
  EXPECT_EQ(rb[0]["loom"]["lr_scale"], 0.25);
  EXPECT_EQ(rb[1]["loom"]["lr_scale"], 0.0625);
  EXPECT_EQ(run.records("skipped_step").size(), 6u);
  const std::vector<json> err = run.records("diverged");
  ASSERT_EQ(err.size(), 1u);
  EXPECT_TRUE(has(err[0]["loom"]["checkpoint"].get<std::string>(), "step-00000002")) << err[0];
  EXPECT_TRUE(has(err[0]["message"], "--resume")) << err[0]["message"];
}

TEST(TrainFaults, ThrowDuringAStepIsAnErrorRecordWithTheStepAndCheckpoint) {
  FaultRun run("throw");
  const Failpoints fp = Failpoints::parse("throw@step=4");
  const Error e = run_error(run.config("checkpoint_interval: 2\n"), fp, ErrorKind::internal);
  EXPECT_EQ(error_exit_code(e.kind()), 70);
  const std::vector<json> err = run.records("error");
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0]["log.level"], "error");
  EXPECT_EQ(err[0]["error"]["type"], "internal");
  EXPECT_EQ(err[0]["loom"]["step"], 4);
  EXPECT_EQ(err[0]["loom"]["steps_done"], 3);
  EXPECT_EQ(err[0]["loom"]["exit_code"], 70);
  const std::string ck = err[0]["loom"]["checkpoint"];
  EXPECT_EQ(fs::path(ck).filename(), "step-00000002");
  const std::string msg = err[0]["message"];
  EXPECT_TRUE(has(msg, "training failed during step 4: failpoint 'throw@step=4' fired at step 4")) << msg;
  EXPECT_TRUE(has(msg, "resume from " + ck + " with: loom train faults.yaml --resume")) << msg;
  EXPECT_EQ(err[0]["error"]["message"], msg);
}

TEST(TrainFaults, IoErrorIsAnIoErrorRecord) {
  FaultRun run("io");
  const Failpoints fp = Failpoints::parse("io_error@step=2");
  const Error e = run_error(run.config(), fp, ErrorKind::io);
  EXPECT_EQ(error_exit_code(e.kind()), 3);
  const std::vector<json> err = run.records("error");
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0]["error"]["type"], "io");
  EXPECT_TRUE(has(err[0]["message"], "no checkpoint to resume from")) << err[0]["message"];
}

TEST(TrainFaults, SetupErrorIsRecordedToo) {
  FaultRun run("setup");
  TrainConfig c = run.config();
  c.model = (run.tmp.path / "missing.gguf").string();
  const Failpoints none;
  const Error e = run_error(c, none, ErrorKind::not_found);
  const std::vector<json> err = run.records("error");
  ASSERT_EQ(err.size(), 1u);
  EXPECT_TRUE(has(err[0]["message"], "missing.gguf")) << err[0]["message"];
  EXPECT_EQ(err[0]["error"]["type"], "not_found");
}

}  // namespace
}  // namespace loom

// `precision` in the Trainer: fp16's loss scaler in the step loop (an overflow
// skips the step and halves the scale without being a fault; the scale and
// growth tracker go into checkpoints and come back on resume), the eps
// warning, and full fine-tuning's refusal of bf16/fp16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/failpoints.h"
#include "temp_dir.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace loom {
namespace {

using nlohmann::json;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

struct PrecisionRun {
  test_util::TempDir tmp;
  explicit PrecisionRun(const std::string& tag) : tmp("train_precision_" + tag) {}
  std::string log() const { return (tmp.path / "log.jsonl").string(); }
  TrainConfig config(const std::vector<std::string>& sets) const {
    return parse_train_config(
        fmt::format("model: {}\ndata:\n  train: {}\n  seq_len: 32\nlora:\n  r: 4\n  dropout: 0\n"
                    "optim:\n  lr: 1e-2\nschedule:\n  kind: constant\nbatch_size: 2\nsteps: 8\n"
                    "output_dir: {}\nlog_file: {}\nseed: 1\nthreads: 2\nmax_bad_steps: 2\n"
                    "on_divergence: stop\n",
                    src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
                    (tmp.path / "out").string(), log()),
        "precision.yaml", sets);
  }
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

// Three overflowing attempts in a row with max_bad_steps 2 and on_divergence
// stop: as faults they would end the run; as loss-scale skips they only halve
// the scale three times.
TEST(TrainPrecision, Fp16OverflowIsALossScaleSkipNotAFault) {
  PrecisionRun run("skip");
  const Failpoints fp = Failpoints::parse("inf_grad@step=3..5");
  Trainer t(run.config({"precision=fp16"}), nullptr, {}, with(fp));
  t.setup();
  ASSERT_NE(t.loss_scaler(), nullptr);
  EXPECT_EQ(t.loss_scaler()->scale(), 65536.0f);
  int skipped = 0;
  while (t.steps_done() < t.total_steps()) skipped += t.train_step().skipped;
  EXPECT_EQ(skipped, 3);
  EXPECT_EQ(t.faults().skipped_steps, 0);
  EXPECT_EQ(t.faults().bad_in_a_row, 0);
  EXPECT_EQ(t.loss_scaler()->scale(), 8192.0f);
  EXPECT_EQ(t.loss_scaler()->growth_tracker(), 6);  // the applied steps after the last skip
  const std::vector<json> r = run.records("loss_scale");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0]["loom"]["previous_loss_scale"], 65536.0);
  EXPECT_EQ(r[2]["loom"]["loss_scale"], 8192.0);
  EXPECT_TRUE(run.records("skipped_step").empty());
  for (double l : t.result().step_losses) EXPECT_TRUE(std::isfinite(l));
  // A non-finite loss stays a fault in fp16 too.
  PrecisionRun run2("loss");
  const Failpoints fp2 = Failpoints::parse("nan_loss@step=2");
  Trainer t2(run2.config({"precision=fp16"}), nullptr, {}, with(fp2));
  t2.setup();
  while (t2.steps_done() < t2.total_steps()) t2.train_step();
  EXPECT_EQ(t2.faults().skipped_steps, 1);
  EXPECT_EQ(t2.loss_scaler()->scale(), 65536.0f);
}

TEST(TrainPrecision, Fp16ScalerStateResumesExactly) {
  PrecisionRun run("resume");
  const Failpoints fp = Failpoints::parse("inf_grad@step=2");
  std::vector<float> want;
  LossScalerState at_checkpoint;
  std::string path;
  {
    Trainer t(run.config({"precision=fp16"}), nullptr, {}, with(fp));
    t.setup();
    while (t.steps_done() < 4) t.train_step();
    t.write_checkpoint("test");
    path = t.last_checkpoint();
    at_checkpoint = t.loss_scaler()->state();
    while (t.steps_done() < t.total_steps()) t.train_step();
    want.assign(t.params().params().begin(), t.params().params().end());
  }
  EXPECT_EQ(at_checkpoint.scale, 32768.0f);
  EXPECT_EQ(at_checkpoint.growth_tracker, 3);
  const CheckpointState st = read_checkpoint_state(path);
  ASSERT_TRUE(st.loss_scaler.has_value());
  EXPECT_EQ(st.loss_scaler->scale, 32768.0f);
  EXPECT_EQ(st.loss_scaler->growth_tracker, 3);
  const Failpoints none;
  TrainRuntime rt = with(none);
  rt.resume = path;
  Trainer t(run.config({"precision=fp16"}), nullptr, {}, rt);
  t.setup();
  EXPECT_EQ(t.loss_scaler()->scale(), 32768.0f);
  EXPECT_EQ(t.loss_scaler()->growth_tracker(), 3);
  while (t.steps_done() < t.total_steps()) t.train_step();
  const std::vector<float> got(t.params().params().begin(), t.params().params().end());
  EXPECT_EQ(got, want);
}

// fp16 is compared at its last step before a loss-scale skip, if it had one: a
// skipped step retries on the next batch, so the losses from it on are of other
// batches (with the AVX2 kernels, step 8's gradients overflowed the initial 2^16
// scale here, and its loss was the next batch's, 2.49 against fp32's 3.14).
TEST(TrainPrecision, Bf16AndFp16TrainCloseToFp32) {
  std::vector<std::vector<double>> losses;
  int64_t fp16_first_skip = 9;  // the step skipped first; 9: none
  for (const char* p : {"fp32", "bf16", "fp16"}) {
    PrecisionRun run(p);
    const TrainResult r = run_training(run.config({std::string("precision=") + p}), nullptr);
    ASSERT_EQ(r.step_losses.size(), 8u);
    losses.emplace_back(r.step_losses.begin(), r.step_losses.end());
    EXPECT_LT(r.step_losses.back(), r.step_losses.front()) << p;
    if (std::string(p) == "fp16")
      for (const json& j : run.records("loss_scale"))
        fp16_first_skip = std::min<int64_t>(fp16_first_skip, j["loom"]["step"].get<int64_t>());
  }
  const std::vector<double>&fp32 = losses[0], &bf16 = losses[1], &fp16 = losses[2];
  EXPECT_NEAR(bf16.back(), fp32.back(), 0.02 * fp32.back());
  EXPECT_NE(bf16.back(), fp32.back());  // the rounding is applied in the run
  ASSERT_GE(fp16_first_skip, 6) << "fp16 skipped a step too early for a comparison";
  const size_t at = static_cast<size_t>(fp16_first_skip - 2);  // the last step before the skip (or step 8)
  EXPECT_NEAR(fp16[at], fp32[at], 0.005 * fp32[at]) << "step " << at + 1;
}

TEST(TrainPrecision, Fp16WarnsWhenEpsIsBelowTheGradientsResolution) {
  PrecisionRun tiny("eps");
  Trainer t(tiny.config({"precision=fp16", "optim.eps=1e-13"}), nullptr);
  t.setup();
  bool warned = false;
  for (const json& j : tiny.records("config"))
    warned = warned || (j["message"].get<std::string>().find("optim.eps 1e-13") != std::string::npos &&
                        j["message"].get<std::string>().find("use optim.eps: 1e-6") != std::string::npos);
  EXPECT_TRUE(warned);
  PrecisionRun fine("eps_ok");
  Trainer t2(fine.config({"precision=fp16"}), nullptr);  // loom's default 1e-8 is fine: AdamW adds it in f32
  t2.setup();
  for (const json& j : fine.records("config"))
    EXPECT_EQ(j["message"].get<std::string>().find("optim.eps"), std::string::npos) << j["message"];
}

TEST(TrainPrecision, FullFineTuningRefusesBf16AndFp16) {
  PrecisionRun run("full");
  for (const char* p : {"bf16", "fp16"}) {
    try {
      Trainer t(run.config({"method=full", std::string("precision=") + p}), nullptr);
      t.setup();
      ADD_FAILURE() << p << ": setup did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::unsupported);
      EXPECT_NE(std::string(e.what()).find(std::string("precision: ") + p + " with method: full"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace loom

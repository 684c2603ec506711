// The Trainer's hooks on the tiny llama fixture: called in order with the
// run's own values; after_backward sees the step's accumulated gradients
// before the update (and what it changes reaches the optimizer); the token
// count hook sets the loss normalisation; the data cursor is where the next
// step starts.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "expect_error.h"
#include "temp_dir.h"
#include "model/lora.h"
#include "model/peft_adapter.h"
#include "train/lora_params.h"
#include "train/train_step.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

// One folder per test of this file.
struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("trainer_hooks_test") {}
};

// 3 steps of 2 micro-batches, evaluations at 0, 2 and the end.
TrainConfig hooks_config(const TempDir& tmp, const std::vector<std::string>& sets = {}) {
  const std::string yaml = fmt::format(
      "model: {}\ndata:\n  train: {}\n  eval: {}\n  seq_len: 48\nlora:\n  r: 4\n  dropout: 0\n"
      "optim:\n  lr: 1e-2\n  mlp_lr: 5e-3\n  lora_plus_ratio: 4\nschedule:\n  kind: linear\n  warmup_steps: 1\n"
      "batch_size: 2\ngrad_accum: 2\nsteps: 3\neval_interval: 2\neval_at_start: true\noutput_dir: {}\nseed: 3\n"
      "threads: 2\n",
      src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
      src("tests/fixtures/train_data/eval.jsonl"), (tmp.path / "out").string());
  return parse_train_config(yaml, "hooks.yaml", sets);
}

TEST(TrainerHooks, CalledInOrderWithTheRunsValues) {
  TempDir tmp;
  const TrainConfig c = hooks_config(tmp);
  std::vector<std::string> events;
  std::vector<StepReport> reports;
  std::vector<double> evals;
  std::vector<int64_t> local_counts;
  TrainHooks h;
  h.loss_tokens = [&](Trainer& t, int64_t local) {
    events.push_back(fmt::format("tokens {}", t.steps_done()));
    local_counts.push_back(local);
    return local;
  };
  h.after_backward = [&](Trainer& t, std::span<float> grads) {
    events.push_back(fmt::format("backward {}", t.steps_done()));
    EXPECT_EQ(grads.size(), static_cast<size_t>(t.params().count()));
    EXPECT_EQ(grads.data(), t.params().grads().data());
  };
  h.after_optimizer_step = [&](Trainer& t, const StepReport& r) {
    events.push_back(fmt::format("step {}", r.step));
    EXPECT_EQ(t.steps_done(), r.step);
    EXPECT_EQ(t.optimizer().step_count(), r.step);
    // The cursor is where the next step starts: 2 micro-batches per step from the start.
    DataLoader again(t.data().train, t.data().pad_id, c.batch_size, /*shuffle=*/true, c.seed);
    for (int64_t i = 0; i < 2 * r.step; ++i) again.next();
    EXPECT_EQ(t.loader().cursor(), again.cursor());
    reports.push_back(r);
  };
  std::vector<double> accuracies;
  h.at_evaluation = [&](Trainer& t, const EvalReport& e) {
    events.push_back(fmt::format("eval {}", e.step));
    EXPECT_EQ(e.step, t.steps_done());
    EXPECT_GT(e.tokens, 0);
    evals.push_back(e.loss);
    accuracies.push_back(e.accuracy);
  };
  const TrainResult r = run_training(c, nullptr, h);

  const std::vector<std::string> want = {"eval 0",     "tokens 0", "backward 0", "step 1",     "tokens 1",
                                         "backward 1", "step 2",   "eval 2",     "tokens 2",   "backward 2",
                                         "step 3",     "eval 3"};
  EXPECT_EQ(events, want);
  EXPECT_EQ(evals, r.eval_losses);  // exactly the losses the result reports
  ASSERT_EQ(r.eval_losses.size(), 3u);
  EXPECT_EQ(evals.back(), *r.final_eval_loss);
  EXPECT_EQ(accuracies, r.eval_accuracies);
  for (double a : accuracies) {
    EXPECT_GE(a, 0.0);
    EXPECT_LE(a, 1.0);
  }
  ASSERT_EQ(reports.size(), 3u);
  int64_t tokens = 0;
  for (size_t i = 0; i < reports.size(); ++i) {
    EXPECT_EQ(reports[i].step, static_cast<int64_t>(i) + 1);
    EXPECT_EQ(reports[i].loss, r.step_losses[i]);
    EXPECT_EQ(reports[i].target_tokens, local_counts[i]);
    EXPECT_EQ(reports[i].loss_tokens, local_counts[i]);
    EXPECT_GT(reports[i].grad_norm, 0);
    EXPECT_GT(reports[i].input_tokens, 0);
    tokens += reports[i].target_tokens;
  }
  EXPECT_EQ(tokens, r.trained_tokens);
  // Linear schedule with one warm-up step: lr 0 for the first update, then the peak, then down.
  EXPECT_EQ(reports[0].lr, 0.0);
  EXPECT_DOUBLE_EQ(reports[1].lr, 1e-2);
  EXPECT_DOUBLE_EQ(reports[2].lr, 0.5e-2);
}

// after_backward gets the gradients of the whole step (both micro-batches,
// scaled by 1 / the step's target tokens) before the update, and the update
// AdamW makes from exactly those gradients is the one the parameters got.
TEST(TrainerHooks, AfterBackwardSeesTheAccumulatedGradientsBeforeTheStep) {
  TempDir tmp;
  // A constant schedule: the first update has its full learning rate.
  const TrainConfig c =
      hooks_config(tmp, {"steps=1", "eval_at_start=false", "schedule.kind=constant", "schedule.warmup_steps=0"});
  std::vector<float> seen_grads, params_before, want_grads;
  TrainHooks h;
  h.after_backward = [&](Trainer& t, std::span<float> grads) {
    seen_grads.assign(grads.begin(), grads.end());
    params_before.assign(t.params().params().begin(), t.params().params().end());
    // The same step computed here: same adapter init, same batches.
    LoraModel lora(t.model().config(), c.lora);
    TrainSession s(t.model().config(), t.model().weights(), lora, t.backend(), c.backward);
    DataLoader loader(t.data().train, t.data().pad_id, c.batch_size, /*shuffle=*/true, c.seed);
    const Batch b1 = loader.next(), b2 = loader.next();
    const float scale = 1.0f / static_cast<float>(b1.target_tokens + b2.target_tokens);
    lora.zero_grads();
    s.forward_backward(b1, scale, 0);
    s.forward_backward(b2, scale, 0);
    want_grads.assign(lora.grads(), lora.grads() + lora.param_count());
    EXPECT_EQ(std::vector<float>(lora.params(), lora.params() + lora.param_count()), params_before);
  };
  h.after_optimizer_step = [&](Trainer& t, const StepReport&) {
    AdamW fresh(t.backend(), t.optimizer().config(), t.optimizer().groups(), params_before.size(), t.optimizer().schedule());
    std::vector<float> p = params_before, g = seen_grads;
    fresh.step(p, g);
    const std::span<float> now = t.params().params();
    EXPECT_EQ(p, std::vector<float>(now.begin(), now.end()));
  };
  run_training(c, nullptr, h);
  ASSERT_FALSE(seen_grads.empty());
  EXPECT_EQ(seen_grads, want_grads);
  EXPECT_TRUE(std::any_of(seen_grads.begin(), seen_grads.end(), [](float v) { return v != 0; }));
}

// Where the all-reduce will go: what after_backward writes is what the
// optimizer uses. Zero gradients (and no weight decay) leave the adapters as
// initialized, so the written B matrices stay zero.
TEST(TrainerHooks, GradientsChangedInAfterBackwardReachTheOptimizer) {
  TempDir tmp;
  const TrainConfig c = hooks_config(tmp, {"eval_at_start=false"});
  std::vector<float> initial;
  bool same = true;
  TrainHooks h;
  h.after_backward = [&](Trainer& t, std::span<float> grads) {
    if (initial.empty()) initial.assign(t.params().params().begin(), t.params().params().end());
    std::fill(grads.begin(), grads.end(), 0.0f);
  };
  h.after_optimizer_step = [&](Trainer& t, const StepReport& r) {
    EXPECT_EQ(r.grad_norm, 0.0);
    same = same && std::equal(initial.begin(), initial.end(), t.params().params().begin());
  };
  const TrainResult r = run_training(c, nullptr, h);
  EXPECT_TRUE(same);
  ASSERT_EQ(r.eval_losses.size(), 2u);
  EXPECT_EQ(r.eval_losses[0], r.eval_losses[1]);  // B = 0: the base model's loss every time
}

// A token count of twice the local one (as if a second rank held as many
// tokens) halves every gradient exactly; the reported loss stays the local mean.
TEST(TrainerHooks, DoubledTokenCountHalvesTheGradients) {
  TempDir tmp;
  const auto first_step = [&](bool doubled) {
    std::vector<float> grads;
    StepReport report;
    TrainHooks h;
    if (doubled) h.loss_tokens = [](Trainer&, int64_t local) { return 2 * local; };
    h.after_backward = [&](Trainer& t, std::span<float> g) {
      if (t.steps_done() == 0) grads.assign(g.begin(), g.end());
    };
    h.after_optimizer_step = [&](Trainer&, const StepReport& r) {
      if (r.step == 1) report = r;
    };
    run_training(hooks_config(tmp, {"steps=2", "eval_at_start=false"}), nullptr, h);
    return std::pair{grads, report};
  };
  const auto [g1, r1] = first_step(false);
  const auto [g2, r2] = first_step(true);
  ASSERT_EQ(g1.size(), g2.size());
  size_t nonzero = 0;
  for (size_t i = 0; i < g1.size(); ++i) {
    ASSERT_EQ(g2[i], 0.5f * g1[i]) << "at " << i;
    nonzero += g1[i] != 0;
  }
  EXPECT_GT(nonzero, g1.size() / 4);
  EXPECT_EQ(r2.grad_norm, 0.5 * r1.grad_norm);
  EXPECT_EQ(r2.loss, r1.loss);
  EXPECT_EQ(r2.target_tokens, r1.target_tokens);
  EXPECT_EQ(r2.loss_tokens, 2 * r1.loss_tokens);
}

TEST(TrainerHooks, BadTokenCountIsAnError) {
  TempDir tmp;
  TrainHooks h;
  h.loss_tokens = [](Trainer&, int64_t) { return int64_t{0}; };
  test_util::expect_error([&] { run_training(hooks_config(tmp), nullptr, h); }, ErrorKind::invalid_input,
                          {"TrainHooks::loss_tokens returned 0", "must be >= 1"});
}

// Full fine-tuning runs through the same steps and hooks: the gradient arena
// holds every weight, and evaluations reach at_evaluation.
TEST(TrainerHooks, FullFineTuningThroughTheSameHooks) {
  TempDir tmp;
  TrainConfig c = hooks_config(tmp, {"method=full", "optim.lr=1e-3", "steps=2"});
  c.mlp_lr.reset();  // LoRA-only options
  c.lora_plus_ratio.reset();
  size_t grad_size = 0;
  int steps = 0;
  std::vector<double> evals;
  TrainHooks h;
  h.after_backward = [&](Trainer&, std::span<float> g) { grad_size = g.size(); };
  h.after_optimizer_step = [&](Trainer&, const StepReport&) { ++steps; };
  h.at_evaluation = [&](Trainer&, const EvalReport& e) { evals.push_back(e.loss); };
  const TrainResult r = run_training(c, nullptr, h);
  EXPECT_EQ(static_cast<int64_t>(grad_size), r.trainable_params);
  EXPECT_EQ(r.trainable_params, r.total_params);
  EXPECT_EQ(steps, 2);
  EXPECT_EQ(evals, r.eval_losses);
  EXPECT_EQ(evals.size(), 2u);  // step 0 and the end
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// TrainRuntime::checkpoint_adapters: after each checkpoint its adapter is written whole to
// checkpoint_dir/latest-adapter (kept past pruning) and handed to after_adapter_written, then the output
// folder at the end; the last checkpoint's adapter (step 3 = the end) is the output's, byte for byte.
TEST(TrainerHooks, AdapterWrittenAtCheckpointsAndAtTheEnd) {
  TempDir tmp;
  const TrainConfig c = hooks_config(tmp, {"checkpoint_interval=1", "keep_checkpoints=1"});
  std::vector<AdapterWritten> written;
  std::vector<std::string> adapter_bytes;
  TrainHooks h;
  h.after_adapter_written = [&](Trainer&, const AdapterWritten& a) {
    written.push_back(a);
    adapter_bytes.push_back(file_bytes(fs::path(a.path) / "adapter_model.safetensors"));
  };
  TrainRuntime rt;
  rt.checkpoint_adapters = true;
  run_training(c, nullptr, h, rt);
  const fs::path out = fs::absolute(tmp.path / "out");
  const fs::path latest = out / "checkpoints" / "latest-adapter";
  ASSERT_EQ(written.size(), 4u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(written[static_cast<size_t>(i)].path, latest.string());
    EXPECT_EQ(written[static_cast<size_t>(i)].step, i + 1);
    EXPECT_FALSE(written[static_cast<size_t>(i)].final);
  }
  EXPECT_EQ(written[3].path, out.string());
  EXPECT_EQ(written[3].step, 3);
  EXPECT_TRUE(written[3].final);
  EXPECT_NE(adapter_bytes[0], adapter_bytes[1]) << "each checkpoint's adapter is that step's";
  EXPECT_EQ(adapter_bytes[2], adapter_bytes[3]);
  EXPECT_EQ(file_bytes(latest / "adapter_model.safetensors"), file_bytes(out / "adapter_model.safetensors"));
  EXPECT_NO_THROW(peft::read_adapter(latest.string()));
  EXPECT_TRUE(fs::exists(out / "checkpoints" / "step-00000003"));
  EXPECT_FALSE(fs::exists(out / "checkpoints" / "step-00000001")) << "pruned (keep_checkpoints 1)";

  // Without checkpoint_adapters: only the output, and no latest-adapter folder.
  written.clear();
  run_training(hooks_config(tmp, {"checkpoint_interval=1", "output_dir=" + (tmp.path / "out2").string()}), nullptr,
               h);
  ASSERT_EQ(written.size(), 1u);
  EXPECT_TRUE(written[0].final);
  EXPECT_FALSE(fs::exists(tmp.path / "out2" / "checkpoints" / "latest-adapter"));
}

// Full fine-tuning writes no adapter: checkpoint_adapters is refused, and the hook is never called.
TEST(TrainerHooks, CheckpointAdaptersNeedLora) {
  TempDir tmp;
  TrainConfig c = hooks_config(tmp, {"method=full", "optim.lr=1e-3", "steps=1"});
  c.mlp_lr.reset();
  c.lora_plus_ratio.reset();
  TrainRuntime rt;
  rt.checkpoint_adapters = true;
  EXPECT_THROW(run_training(c, nullptr, {}, rt), Error);
  int calls = 0;
  TrainHooks h;
  h.after_adapter_written = [&](Trainer&, const AdapterWritten&) { ++calls; };
  run_training(c, nullptr, h);
  EXPECT_EQ(calls, 0);
}

}  // namespace
}  // namespace loom

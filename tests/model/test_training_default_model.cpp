// Training on the default model (SmolLM2-135M-Instruct Q4_1): the fast backward
// (W^T packed for the matmul kernels) against the exact tile path, and a short
// end-to-end `loom train` run that must lower the eval loss.
#include <gtest/gtest.h>

#include "kernels/backend.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/rng.h"
#include "model/model.h"
#include "train/train_step.h"
#include "train/trainer.h"

namespace loom {
namespace {

const std::string kRoot = std::string(LOOM_SOURCE_DIR) + "/";
const std::string kModel = kRoot + "models/SmolLM2-135M-Instruct.Q4_1.gguf";

bool have_model() { return std::ifstream(kModel).good(); }

// One packed row of `T` tokens: two samples, positions restarting at the second.
Batch make_batch(int64_t T, int64_t vocab) {
  Batch b;
  b.rows = 1;
  b.seq_len = T;
  CounterRng rng(7);
  const int64_t split = T / 3;
  for (int64_t t = 0; t < T; ++t) {
    b.tokens.push_back(static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(vocab)));
    const bool first = t < split;
    b.positions.push_back(static_cast<int32_t>(first ? t : t - split));
    b.seq_start.push_back(static_cast<int32_t>(first ? 0 : split));
  }
  for (int64_t t = 0; t < T; ++t) {
    const bool last_of_sample = t == split - 1 || t == T - 1;
    b.targets.push_back(last_of_sample ? -100 : b.tokens[static_cast<size_t>(t + 1)]);
    b.target_tokens += last_of_sample ? 0 : 1;
  }
  return b;
}

TEST(TrainDefaultModel, FastBackwardMatchesExact) {
  if (!have_model()) GTEST_SKIP() << kModel << " is missing: run scripts/fetch_model (scripts/test does)";
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = Model::load(kModel, {.tokenizer = false, .pack = true, .backend = &backend});
  const ModelConfig& mc = model->config();
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  LoraModel lora(mc, lc);
  // Non-zero B so that every adapter passes gradient to its input (B = 0 at init).
  CounterRng rng(3);
  for (int64_t l = 0; l < mc.n_layers; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      Tensor B = lora.b(l, t);
      for (int64_t i = 0; i < B.numel(); ++i) B.as<float>()[i] = static_cast<float>(rng.next_double() - 0.5) * 0.02f;
    }
  const Batch batch = make_batch(96, mc.vocab_size);
  const float scale = 1.0f / static_cast<float>(batch.target_tokens);

  TrainSession exact(mc, model->weights(), lora, backend, BackwardMode::exact);
  lora.zero_grads();
  const double loss_exact = exact.forward_backward(batch, scale).loss_sum;
  const std::vector<float> g_exact(lora.grads(), lora.grads() + lora.param_count());

  for (BackwardMode mode : {BackwardMode::f16, BackwardMode::int8, BackwardMode::bf16}) {
    TrainSession fast(mc, model->weights(), lora, backend, mode);
    lora.zero_grads();
    const double loss_fast = fast.forward_backward(batch, scale).loss_sum;
    EXPECT_EQ(loss_exact, loss_fast) << "the forward is the same code in every mode";
    double diff = 0, norm = 0, dot = 0, norm_fast = 0;
    for (int64_t i = 0; i < lora.param_count(); ++i) {
      const double e = g_exact[static_cast<size_t>(i)], f = lora.grads()[i];
      diff += (f - e) * (f - e);
      norm += e * e;
      norm_fast += f * f;
      dot += e * f;
    }
    const double rel = std::sqrt(diff / norm), cosine = dot / std::sqrt(norm * norm_fast);
    std::printf("[ backward %s ] SmolLM2 Q4_1, %lld LoRA gradients: |g - g_exact| / |g_exact| = %.2e, cosine %.8f\n",
                backward_mode_name(mode), static_cast<long long>(lora.param_count()), rel, cosine);
    if (mode == BackwardMode::f16) {
      EXPECT_LT(rel, 2e-3);  // weights rounded to 11 bits, products in f32
    } else if (mode == BackwardMode::bf16) {
      // Weights and dy rounded to 8 significant bits (2^-9 relative, 8x f16's
      // 2^-12, on both operands), sums in f32: one product is ~2e-3 off
      // (tests/unit/test_bf16_gemm.cpp), 30 layers of backward compound that to
      // ~1.1e-2 here (f16: 7e-4). The direction barely moves.
      EXPECT_LT(rel, 2e-2);
      EXPECT_GT(cosine, 0.9999);
    } else {
      EXPECT_LT(rel, 0.1);  // q8_0 weights and gradients
      EXPECT_GT(cosine, 0.998);
    }
  }
}

TEST(TrainDefaultModel, ShortRunLowersEvalLoss) {
  if (!have_model()) GTEST_SKIP() << kModel << " is missing: run scripts/fetch_model (scripts/test does)";
  const auto out = std::filesystem::temp_directory_path() / "loom_test_short_run";
  std::filesystem::remove_all(out);
  // The main job's task, shortened: 12 steps of 4 rows x 104 tokens on 2 threads.
  const std::vector<std::string> overrides = {
      "model=" + kModel,
      "data.train=" + kRoot + "data/main_job/train.jsonl",
      "data.eval=" + kRoot + "data/main_job/eval.jsonl",
      "steps=12",
      "schedule.warmup_steps=2",
      "eval_at_start=true",
      "output_dir=" + out.string(),
  };
  TrainConfig c = load_train_config(kRoot + "configs/main_job.yaml", overrides);
  const TrainResult res = run_training(c, nullptr);
  ASSERT_EQ(res.eval_losses.size(), 2u) << "one evaluation before training and one after";
  std::printf("[ short run ] 12 steps: eval loss %.4f -> %.4f, %.0f tokens/s\n", res.eval_losses[0],
              res.eval_losses[1], res.tokens_per_s);
  EXPECT_LT(res.eval_losses[1], 0.8 * res.eval_losses[0]);
  EXPECT_TRUE(std::filesystem::exists(out / "adapter_model.safetensors"));
  std::filesystem::remove_all(out);
}

}  // namespace
}  // namespace loom

// optim.kind adamw8bit against adamw over 200 steps: the run must end within 1%
// of AdamW's loss (the tiny Llama fixture, so that CI's two cores do it in
// seconds; docs/training.md, "8-bit AdamW", has the same on the default model).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <fmt/format.h>

#include "core/rng.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
const std::string kRoot = std::string(LOOM_SOURCE_DIR) + "/";

struct Runs {
  fs::path dir = fs::temp_directory_path() / fmt::format("loom_adam8bit_{}", ::getpid());
  Runs() {
    fs::create_directories(dir);
    // 400 short sentences from a few word lists (seeded): enough that 200 steps do not memorize them.
    static const char* const kWho[] = {"the cat", "a dog", "my friend", "the teacher", "our team", "a bird"};
    static const char* const kDid[] = {"sat on", "looked at", "walked to", "painted", "found", "carried"};
    static const char* const kWhat[] = {"the mat", "a red box", "the old house", "two green apples", "the river"};
    CounterRng rng(17);
    const auto pick = [&](auto& list) { return list[rng.next_u64() % std::size(list)]; };
    std::ofstream f(dir / "train.jsonl");
    for (int i = 0; i < 400; ++i)
      f << fmt::format("{{\"text\": \"{} {} {} on day {}, then {} {} {}.\"}}\n", pick(kWho), pick(kDid),
                       pick(kWhat), rng.next_u64() % 31, pick(kWho), pick(kDid), pick(kWhat));
  }
  ~Runs() { fs::remove_all(dir); }

  TrainResult train(const std::string& method_yaml, const char* kind) const {
    const std::string out = (dir / fmt::format("out-{}", kind)).string();
    const std::string yaml = fmt::format(
        "model: {}tests/fixtures/model/tiny-llama.f32.gguf\n"
        "data:\n  train: {}\n  seq_len: 32\n  pack: true\n  eval_fraction: 0.1\n"
        "optim:\n  lr: 1e-3\n  weight_decay: 0.01\n  kind: {}\n"
        "schedule:\n  kind: cosine\n  warmup_steps: 10\n"
        "batch_size: 4\nsteps: 200\neval_interval: 200\nlog_interval: 50\n"
        "output_dir: {}\noverwrite: true\nseed: 3\nthreads: 2\n{}",
        kRoot, (dir / "train.jsonl").string(), kind, out, method_yaml);
    return run_training(parse_train_config(yaml, "adam8bit.yaml"), nullptr);
  }
};

double mean_of_last(const std::vector<double>& v, size_t n) {
  return std::accumulate(v.end() - static_cast<ptrdiff_t>(n), v.end(), 0.0) / static_cast<double>(n);
}

void expect_within_one_percent(const std::string& method_yaml) {
  const Runs r;
  const TrainResult f32 = r.train(method_yaml, "adamw"), q8 = r.train(method_yaml, "adamw8bit");
  ASSERT_EQ(f32.step_losses.size(), 200u);
  ASSERT_EQ(q8.step_losses.size(), 200u);
  // The runs learned (the comparison means something) and are not the same run.
  EXPECT_LT(mean_of_last(f32.step_losses, 20), 0.6 * f32.step_losses.front());
  EXPECT_NE(f32.step_losses, q8.step_losses);
  const double a = mean_of_last(f32.step_losses, 20), b = mean_of_last(q8.step_losses, 20);
  EXPECT_LT(std::fabs(b - a), 0.01 * a) << "mean loss of the last 20 steps: adamw " << a << ", adamw8bit " << b;
  ASSERT_TRUE(f32.final_eval_loss && q8.final_eval_loss);
  EXPECT_LT(std::fabs(*q8.final_eval_loss - *f32.final_eval_loss), 0.01 * *f32.final_eval_loss)
      << "eval loss: adamw " << *f32.final_eval_loss << ", adamw8bit " << *q8.final_eval_loss;
  std::printf("[ adamw8bit ] %s: last-20 mean loss adamw %.5f, adamw8bit %.5f (%+.3f%%); eval %.5f vs %.5f\n",
              method_yaml.starts_with("method: full") ? "full" : "lora", a, b, 100.0 * (b - a) / a, *f32.final_eval_loss,
              *q8.final_eval_loss);
}

// Full fine-tuning: the matrices and the embedding (>= 4096 elements) have 8-bit moments, the norms f32.
TEST(Adam8bitTraining, FullFineTuneEndsWithinOnePercentOfAdamW) { expect_within_one_percent("method: full\n"); }

// LoRA r=64: A [64, 64] and the wide B have 8-bit moments, k/v's narrow B f32.
TEST(Adam8bitTraining, LoraEndsWithinOnePercentOfAdamW) { expect_within_one_percent("lora:\n  r: 64\n  alpha: 64\n"); }

}  // namespace
}  // namespace loom

// Evaluation's token accuracy and loss on the tiny llama fixture against
// Hugging Face transformers: the committed logits of each reference prompt
// (tests/fixtures/model/ref, computed by torch) give, for chosen targets, the
// loss and which targets are the argmax; TrainSession::forward_loss (the
// evaluation path, base model: LoRA B = 0) must agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "model/lora.h"
#include "model/model.h"
#include "train/data.h"
#include "train/train_step.h"

namespace loom {
namespace {

const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/";

std::vector<float> read_f32(const std::string& path, size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> v(n);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  EXPECT_TRUE(in.good()) << path;
  return v;
}

// One prompt as a single-row batch whose targets the test chooses.
Batch one_row(const std::vector<int32_t>& ids, const std::vector<int32_t>& targets) {
  Batch b;
  b.rows = 1;
  b.seq_len = static_cast<int64_t>(ids.size());
  b.tokens = ids;
  b.targets = targets;
  for (size_t t = 0; t < ids.size(); ++t) {
    b.positions.push_back(static_cast<int32_t>(t));
    b.seq_start.push_back(0);
    b.target_tokens += targets[t] != kIgnoreLabel;
  }
  return b;
}

TEST(EvalAccuracy, MatchesTransformersLogitsOnTheTinyModel) {
  std::ifstream in(kDir + "manifest.json");
  ASSERT_TRUE(in) << kDir << "manifest.json";
  const nlohmann::json ref = nlohmann::json::parse(in).at("references").at("tiny-llama");
  const int64_t V = ref.at("vocab_size");
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  auto model = Model::load(kDir + "tiny-llama.f32.gguf", {.tokenizer = false, .pack = true, .backend = backend.get()});
  LoraConfig lc;
  lc.r = 4;
  LoraModel lora(model->config(), lc);  // B = 0: the base model
  TrainSession session(model->config(), model->weights(), lora, *backend);

  int64_t total = 0, total_correct = 0;
  for (const auto& p : ref.at("prompts")) {
    const std::vector<int32_t> ids = p.at("ids");
    const auto T = static_cast<int64_t>(ids.size());
    const std::vector<float> logits = read_f32(kDir + p.at("logits").at("file").get<std::string>(), T * V);
    // Targets: the reference's argmax at every other position, another token at
    // the rest, the last position ignored, and one ignored position that would be right.
    std::vector<int32_t> targets(ids.size(), kIgnoreLabel);
    int64_t want_correct = 0, want_tokens = 0;
    double want_loss = 0;
    for (int64_t t = 0; t + 1 < T; ++t) {
      const float* z = logits.data() + t * V;
      const auto top = static_cast<int32_t>(std::max_element(z, z + V) - z);  // first largest, as torch.argmax
      std::vector<float> sorted(z, z + V);
      std::nth_element(sorted.begin(), sorted.begin() + 1, sorted.end(), std::greater<>());
      ASSERT_GT(sorted[0] - sorted[1], 1e-2f) << "a near-tie at position " << t << " would make the test fragile";
      if (t == 1) continue;  // ignored (its target would be the argmax)
      const bool right = t % 2 == 0;
      targets[static_cast<size_t>(t)] = right ? top : static_cast<int32_t>((top + 1 + t) % V);
      double mx = z[0], sum = 0;
      for (int64_t c = 0; c < V; ++c) mx = std::max<double>(mx, z[c]);
      for (int64_t c = 0; c < V; ++c) sum += std::exp(z[c] - mx);
      want_loss += mx + std::log(sum) - z[targets[static_cast<size_t>(t)]];
      want_correct += right;
      ++want_tokens;
    }
    const LossResult r = session.forward_loss(one_row(ids, targets));
    EXPECT_EQ(r.n_tokens, want_tokens);
    EXPECT_EQ(r.n_correct, want_correct) << "prompt of " << T << " tokens";
    EXPECT_NEAR(r.loss_sum, want_loss, 1e-3 * want_loss);
    // The training step does not count (it need not).
    EXPECT_EQ(session.forward_backward(one_row(ids, targets), 0.0f).n_correct, 0);
    total += want_tokens;
    total_correct += want_correct;
  }
  EXPECT_GT(total, 10);
  EXPECT_GT(total_correct, 5);
}

}  // namespace
}  // namespace loom

// Full fine-tuning in pipeline stages (train/full_params.h, train/full_pp.h):
// a stage's f32 arena holds only the tensors the stage holds, in the whole
// model's order, so the stages' arenas one after another are the whole
// model's arena (untied); the stages run one after another in one process
// give the whole model's gradients bit for bit; with a tied embedding the
// first and the last stage each hold a copy, whose gradients add up to the
// whole model's (within rounding: another order of the same sums).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/pipeline_stage.h"
#include "random_llama_util.h"
#include "temp_dir.h"
#include "train/full_params.h"
#include "train/train_step.h"

namespace loom {
namespace {

constexpr int64_t kLayers = 5, kVocab = 320;

// A model (whole or one stage's) whose weights a FullParams arena holds, and its session.
struct FullModel {
  std::unique_ptr<FullParams> full;
  std::unique_ptr<Model> model;
  std::unique_ptr<TrainSession> session;
};

struct Fixture {
  explicit Fixture(bool tied) : dir("full_pp"), pool(2), backend(make_backend(kCpu, pool)) {
    test_util::write_random_llama(dir.str(), kLayers, tied);
  }
  FullModel load(std::optional<PipelineStage> stage) {
    FullModel m;
    auto take = [&](ModelWeights& w, const ModelConfig& c) {
      m.full = std::make_unique<FullParams>(w, c, pool);
    };
    m.model = Model::load(
        dir.str(),
        {.tokenizer = false, .pack = true, .backend = backend.get(), .before_pack = take, .stage = stage});
    m.session = std::make_unique<TrainSession>(m.model->config(), m.model->weights(), *m.full, *backend,
                                               BackwardMode::exact);
    return m;
  }
  test_util::TempDir dir;
  ThreadPool pool;
  std::unique_ptr<Backend> backend;
};

Batch make_batch(uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b;
  b.rows = 2;
  b.seq_len = 16;
  for (int64_t r = 0; r < b.rows; ++r)
    for (int32_t t = 0; t < b.seq_len; ++t) {
      b.tokens.push_back(static_cast<int32_t>(rng() % kVocab));
      const bool target = t + 1 < b.seq_len && t % 4 != 0;
      b.targets.push_back(target ? static_cast<int32_t>(rng() % kVocab) : kIgnoreLabel);
      b.positions.push_back(t);
      b.seq_start.push_back(0);
      b.target_tokens += target ? 1 : 0;
    }
  return b;
}

std::vector<float> arena(const float* p, const FullParams& f) { return {p, p + f.param_count()}; }

// Two micro-batches through `stages` stage models one after another (1F1B's
// order does not change a stage's sums); returns the stages.
std::vector<FullModel> run_stages(Fixture& f, int stages, double* loss) {
  std::vector<FullModel> ms;
  for (int s = 0; s < stages; ++s) ms.push_back(f.load(PipelineStage{s, stages}));
  for (uint32_t i = 0; i < 2; ++i) {
    const Batch b = make_batch(i + 1);
    const float* x = nullptr;
    LossResult r;
    for (FullModel& m : ms) x = m.session->forward_stage(b, 0.01f, i, x, &r);
    *loss += r.loss_sum;
    const float* dy = nullptr;
    for (int s = stages - 1; s >= 0; --s) dy = ms[static_cast<size_t>(s)].session->backward_stage(dy);
  }
  return ms;
}

TEST(FullPipeline, StagesHoldTheirTensorsAndGiveTheWholeGradients) {
  Fixture f(/*tied=*/false);
  FullModel whole = f.load(std::nullopt);
  double ref_loss = 0;
  for (uint32_t i = 0; i < 2; ++i)
    ref_loss += whole.session->forward_backward(make_batch(i + 1), 0.01f, i).loss_sum;
  const std::vector<float> ref_params = arena(whole.full->params(), *whole.full);
  const std::vector<float> ref_grads = arena(whole.full->grads(), *whole.full);
  for (int stages : {2, 3}) {
    double loss = 0;
    std::vector<FullModel> ms = run_stages(f, stages, &loss);
    EXPECT_EQ(loss, ref_loss) << stages << " stages";
    std::vector<float> params, grads;
    for (int s = 0; s < stages; ++s) {
      FullParams& p = *ms[static_cast<size_t>(s)].full;
      EXPECT_TRUE(p.tied_copy_grads().empty());
      const LayerSpan span = pipeline_stage_layers(kLayers, {s, stages});
      for (int64_t l = 0; l < kLayers; ++l) {  // other stages' layers: empty runs, no gradients
        const auto [b, e] = p.layer_ranges()[static_cast<size_t>(l)];
        EXPECT_EQ(b == e, l < span.first || l >= span.last) << "stage " << s << " layer " << l;
        EXPECT_EQ(p.layer_grads(l).wq == nullptr, b == e);
      }
      const std::vector<float> a = arena(p.params(), p), g = arena(p.grads(), p);
      params.insert(params.end(), a.begin(), a.end());
      grads.insert(grads.end(), g.begin(), g.end());
    }
    EXPECT_EQ(ms[1].full->tensor_at(0), stages == 2 ? "model.layers.2.input_layernorm.weight"
                                                    : "model.layers.1.input_layernorm.weight");
    EXPECT_EQ(params, ref_params) << stages << " stages: the arenas one after another are the whole one";
    ASSERT_EQ(grads.size(), ref_grads.size());
    size_t differ = 0;
    for (size_t i = 0; i < grads.size(); ++i) differ += grads[i] != ref_grads[i];
    EXPECT_EQ(differ, 0u) << stages << " stages";
  }
}

TEST(FullPipeline, TiedEmbeddingCopiesSumToTheWholeGradient) {
  Fixture f(/*tied=*/true);
  FullModel whole = f.load(std::nullopt);
  ASSERT_TRUE(whole.full->tied());
  double ref_loss = 0;
  for (uint32_t i = 0; i < 2; ++i)
    ref_loss += whole.session->forward_backward(make_batch(i + 1), 0.01f, i).loss_sum;
  const float* ref = whole.full->token_embd_grad();  // the whole arena's first run
  double loss = 0;
  std::vector<FullModel> ms = run_stages(f, 2, &loss);
  EXPECT_EQ(loss, ref_loss);
  const std::span<float> first = ms[0].full->tied_copy_grads(), last = ms[1].full->tied_copy_grads();
  ASSERT_EQ(first.size(), static_cast<size_t>(kVocab * 64));
  ASSERT_EQ(last.size(), first.size());
  EXPECT_EQ(ms[1].full->tensor_at(ms[1].full->param_count() - 1), "model.embed_tokens.weight");
  // Both stages start from the same values.
  EXPECT_EQ(std::vector<float>(ms[0].model->weights().token_embd.as<float>(),
                               ms[0].model->weights().token_embd.as<float>() + first.size()),
            std::vector<float>(ms[1].model->weights().output.as<float>(),
                               ms[1].model->weights().output.as<float>() + first.size()));
  double worst = 0, largest = 0;
  for (size_t i = 0; i < first.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(first[i]) + last[i] - ref[i]));
    largest = std::max(largest, std::abs(static_cast<double>(ref[i])));
  }
  EXPECT_GT(largest, 0.0);
  EXPECT_LE(worst, 1e-6 * largest);
  // The embedding-only part (the first stage's) is not the whole gradient: the head's part matters.
  double head = 0;
  for (float x : last) head = std::max(head, std::abs(static_cast<double>(x)));
  EXPECT_GT(head, 1e-3 * largest);
}

}  // namespace
}  // namespace loom

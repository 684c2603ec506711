// Pipeline parallel's cut of a model (model/pipeline_stage.h) and its stage
// sessions: a stage holds and prepares only its own layers (the first also the
// embedding, the last the head), and the stages run one after another in one
// process (TrainSession::forward_stage / backward_stage) give the loss and the
// LoRA gradients of the whole model bit for bit, also with gradient
// checkpointing (segments split by a stage boundary or not) and bf16 saved
// activations; bf16 checkpoints of segments that a stage boundary splits stay
// within the bf16 error. A stage's activation arena is its layers' share.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "expect_error.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "model/pipeline_stage.h"
#include "random_llama_util.h"
#include "temp_dir.h"
#include "train/lora_params.h"
#include "train/train_step.h"

namespace loom {
namespace {

constexpr int64_t kLayers = 5;

struct Fixture {
  Fixture() : dir("pp_stage"), pool(2), backend(make_backend(kCpu, pool)) {
    test_util::write_random_llama(dir.str(), kLayers);
  }
  std::unique_ptr<Model> load(std::optional<PipelineStage> stage) {
    return Model::load(dir.str(),
                       {.tokenizer = false, .pack = true, .backend = backend.get(), .stage = stage});
  }
  test_util::TempDir dir;
  ThreadPool pool;
  std::unique_ptr<Backend> backend;
};

Batch make_batch(uint32_t seed) { return test_util::random_packed_batch(seed); }

TEST(PipelineStage, LayerSpans) {
  const LayerSpan a = pipeline_stage_layers(30, {0, 3}), b = pipeline_stage_layers(30, {2, 3});
  EXPECT_EQ(a.first, 0);
  EXPECT_EQ(a.last, 10);
  EXPECT_EQ(b.first, 20);
  EXPECT_EQ(b.last, 30);
  const LayerSpan c = pipeline_stage_layers(5, {1, 2});  // 5 = 2 + 3
  EXPECT_EQ(c.first, 2);
  EXPECT_EQ(c.last, 5);
  test_util::expect_error(
      [] {
        pipeline_stage_layers(2, {0, 3});
      },
      ErrorKind::invalid_input, {"3 stages", "2 layers"});
}

// Each stage holds and prepares only its layers; together they hold the whole model once.
TEST(PipelineStage, HoldsOnlyItsWeights) {
  Fixture f;
  const auto whole = f.load(std::nullopt);
  size_t bytes = 0;
  for (int s = 0; s < 3; ++s) {
    const auto m = f.load(PipelineStage{s, 3});
    const ModelWeights& w = m->weights();
    const LayerSpan span = pipeline_stage_layers(kLayers, {s, 3});
    EXPECT_EQ(m->config().n_layers, kLayers);  // the config stays the whole model's
    ASSERT_EQ(w.prepared.size(), static_cast<size_t>(kLayers));
    for (int64_t l = 0; l < kLayers; ++l) {
      const bool mine = span.first <= l && l < span.last;
      EXPECT_EQ(w.layers[static_cast<size_t>(l)].held(), mine) << "stage " << s << " layer " << l;
      EXPECT_EQ(w.prepared[static_cast<size_t>(l)].w_up != nullptr, mine) << "stage " << s << " layer " << l;
    }
    EXPECT_EQ(w.token_embd.data != nullptr, s == 0);
    EXPECT_EQ(w.output.data != nullptr, s == 2);
    EXPECT_EQ(w.output_prepared != nullptr, s == 2);
    EXPECT_EQ(w.output_norm != nullptr, s == 2);
    bytes += m->weight_bytes();
  }
  EXPECT_EQ(bytes, whole->weight_bytes());
  test_util::expect_error(
      [&] {
        f.load(PipelineStage{0, 6});
      },
      ErrorKind::invalid_input, {f.dir.str(), "6 pipeline stages", "5 layers"});
}

struct Outcome {
  double loss = 0;
  std::vector<float> grads;
  std::vector<size_t> activation_bytes;  // each session's
};

LoraModel make_lora(const ModelConfig& c, double dropout) {
  LoraConfig lc;
  lc.r = 4;
  lc.dropout = dropout;
  lc.seed = 3;
  LoraModel lora(c, lc);
  std::mt19937 rng(9);  // B != 0 so that every A gets a gradient too
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (int64_t i = 0; i < lora.param_count(); ++i) lora.params()[i] += normal(rng);
  return lora;
}

using Acts = TrainSession::ActivationOptions;

// Two micro-batches (gradients accumulated) through the whole model.
Outcome whole_model(Fixture& f, double dropout, BackwardMode mode, const std::vector<Batch>& batches,
                    Acts acts = {}) {
  const auto m = f.load(std::nullopt);
  LoraModel lora = make_lora(m->config(), dropout);
  TrainSession s(m->config(), m->weights(), lora, *f.backend, mode);
  s.set_activation_options(acts);
  Outcome out;
  for (size_t i = 0; i < batches.size(); ++i) out.loss += s.forward_backward(batches[i], 0.01f, i).loss_sum;
  out.grads.assign(lora.grads(), lora.grads() + lora.param_count());
  out.activation_bytes = {s.activation_bytes()};
  return out;
}

// The same through `stages` stage models, each with its own adapters (same
// initialization), one stage after another; the gradients summed over the stages.
Outcome staged(Fixture& f, int stages, double dropout, BackwardMode mode, const std::vector<Batch>& batches,
               Acts acts = {}) {
  std::vector<std::unique_ptr<Model>> models;
  std::vector<LoraModel> loras;
  std::vector<std::unique_ptr<TrainSession>> sessions;
  for (int s = 0; s < stages; ++s) {
    models.push_back(f.load(PipelineStage{s, stages}));
    loras.push_back(make_lora(models.back()->config(), dropout));
  }
  for (int s = 0; s < stages; ++s) {
    sessions.push_back(std::make_unique<TrainSession>(models[s]->config(), models[s]->weights(), loras[s],
                                                      *f.backend, mode));
    sessions.back()->set_activation_options(acts);
  }
  Outcome out;
  for (size_t i = 0; i < batches.size(); ++i) {
    const float* x = nullptr;
    LossResult r;
    for (int s = 0; s < stages; ++s)
      x = sessions[static_cast<size_t>(s)]->forward_stage(batches[i], 0.01f, i, x, &r);
    out.loss += r.loss_sum;
    const float* dy = nullptr;
    for (int s = stages - 1; s >= 0; --s) dy = sessions[static_cast<size_t>(s)]->backward_stage(dy);
  }
  out.grads.assign(static_cast<size_t>(loras[0].param_count()), 0.0f);
  for (LoraModel& l : loras)
    for (size_t i = 0; i < out.grads.size(); ++i) out.grads[i] += l.grads()[i];
  for (const auto& s : sessions) out.activation_bytes.push_back(s->activation_bytes());
  return out;
}

TEST(PipelineStage, StagesGiveTheWholeModelsGradients) {
  Fixture f;
  const std::vector<Batch> batches = {make_batch(1), make_batch(2)};
  for (BackwardMode mode : {BackwardMode::f16, BackwardMode::exact})
    for (double dropout : {0.0, 0.1}) {
      const Outcome ref = whole_model(f, dropout, mode, batches);
      for (int stages : {2, 3}) {
        const Outcome got = staged(f, stages, dropout, mode, batches);
        EXPECT_EQ(got.loss, ref.loss) << stages << " stages, dropout " << dropout;
        ASSERT_EQ(got.grads.size(), ref.grads.size());
        size_t differ = 0;
        for (size_t i = 0; i < ref.grads.size(); ++i) differ += got.grads[i] != ref.grads[i];
        EXPECT_EQ(differ, 0u) << stages << " stages, dropout " << dropout << ", backward "
                              << backward_mode_name(mode);
      }
    }
}

// Gradient checkpointing every 2 layers of 5 (segments [0, 1), [1, 3), [3, 5))
// and every 3 ([0, 2), [2, 5)), in 2 stages ([0, 2), [2, 5)) and 3 ([0, 1),
// [1, 3), [3, 5)); f32 or bf16 saved activations.
TEST(PipelineStage, CheckpointingAndBf16Activations) {
  Fixture f;
  const std::vector<Batch> batches = {make_batch(3), make_batch(4)};
  for (const Acts acts : {Acts{0, true}, Acts{2, false}, Acts{3, false}, Acts{2, true}, Acts{3, true}}) {
    const Outcome ref = whole_model(f, 0.1, BackwardMode::f16, batches, acts);
    for (int stages : {2, 3}) {
      const std::string what = std::to_string(stages) + " stages, checkpoint_every " +
                               std::to_string(acts.checkpoint_every) + (acts.bf16 ? ", bf16" : ", f32");
      const Outcome got = staged(f, stages, 0.1, BackwardMode::f16, batches, acts);
      // bf16 checkpoints: one process recomputes a segment from its bf16 input; a
      // stage that starts inside the segment recomputes its part from its f32 input.
      bool splits = false;
      for (int s = 1; s < stages; ++s) {
        const int64_t start = pipeline_stage_layers(kLayers, {s, stages}).first, N = acts.checkpoint_every;
        splits = splits || (N > 0 && (kLayers - start) % N != 0);
      }
      ASSERT_EQ(got.grads.size(), ref.grads.size());
      if (acts.bf16 && splits) {
        double largest = 0, diff = 0;
        for (size_t i = 0; i < ref.grads.size(); ++i) {
          largest = std::max(largest, std::fabs(static_cast<double>(ref.grads[i])));
          diff = std::max(diff, std::fabs(static_cast<double>(got.grads[i]) - ref.grads[i]));
        }
        EXPECT_LT(diff, 2e-2 * largest) << what;
        EXPECT_GT(diff, 0.0) << what << ": a split bf16 segment is expected to round differently";
        continue;
      }
      EXPECT_EQ(got.loss, ref.loss) << what;
      size_t differ = 0;
      for (size_t i = 0; i < ref.grads.size(); ++i) differ += got.grads[i] != ref.grads[i];
      EXPECT_EQ(differ, 0u) << what;
    }
  }
}

// A stage lays out activations for its own layers only: the stages' arenas
// together are about one whole model's (each adds its output and rope table).
TEST(PipelineStage, ActivationsSplitOverTheStages) {
  Fixture f;
  const std::vector<Batch> batches = {make_batch(5)};
  const Outcome ref = whole_model(f, 0.1, BackwardMode::f16, batches);
  const Outcome got = staged(f, 3, 0.1, BackwardMode::f16, batches);
  size_t sum = 0;
  for (size_t b : got.activation_bytes) {
    EXPECT_LT(b, ref.activation_bytes[0] * 3 / 5);  // at most 2 of 5 layers and the head
    sum += b;
  }
  EXPECT_LT(sum, ref.activation_bytes[0] * 11 / 10);
}

}  // namespace
}  // namespace loom

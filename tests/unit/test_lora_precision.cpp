// Training's LoRA at precision bf16 / fp16 (rounded operands, f32 sums) and
// the fused q/k/v, gate/up A products (train_step_lora.cpp):
//  - fused and unfused give bit-identical gradients at every precision;
//  - bf16 / fp16 gradients stay within their precision's tolerance of the fp32
//    ones (which LoraGrad.* checks against PEFT and finite differences), and
//    are not fp32's (the rounding is applied);
//  - fp16 gradients overflow to inf where a loss scale is too large (what the
//    loss scaler watches for), fp32 ones do not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "peft_fixture_util.h"
#include "train/data.h"
#include "train/lora_params.h"
#include "train/train_step.h"

namespace loom {
namespace {

std::string fixture(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel; }

struct Fixture {
  ThreadPool pool{2};
  std::unique_ptr<Backend> backend = make_backend(kCpu, pool);
  std::unique_ptr<Model> model;
  Batch batch;
  Fixture() {
    model = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = true, .backend = backend.get()});
    std::ifstream f(fixture("peft/tiny-llama/batch.json"));
    const auto meta = nlohmann::json::parse(f);
    batch = test_util::batch_from_hf(meta["input_ids"].get<std::vector<std::vector<int32_t>>>(),
                                     meta["labels"].get<std::vector<std::vector<int32_t>>>());
  }
};

// Every target, r 4; B random (PEFT's zero B would make dA zero).
LoraModel make_lora(const ModelConfig& c, double dropout) {
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  lc.dropout = dropout;
  lc.seed = 5;
  const std::vector<std::string> all = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  lc.set_targets(all);
  LoraModel lora(c, lc);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 0.05f);
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      Tensor b = lora.b(l, t);
      for (int64_t i = 0; i < b.numel(); ++i) b.as<float>()[i] = d(rng);
    }
  return lora;
}

std::vector<float> grads(Fixture& s, LoraModel& lora, TrainPrecision p, bool fused, float grad_scale, double* loss) {
  TrainSession session(s.model->config(), s.model->weights(), lora, *s.backend);
  session.set_precision(p);
  session.set_fused_lora(fused);
  lora.zero_grads();
  const LossResult r = session.forward_backward(s.batch, grad_scale, 2);
  if (loss) *loss = r.loss_sum / static_cast<double>(r.n_tokens);
  // A second micro-batch accumulates (dA's chains start from the accumulated value).
  session.forward_backward(s.batch, grad_scale, 3);
  return {lora.grads(), lora.grads() + lora.param_count()};
}

float scale_of(const Fixture& s) { return 1.0f / static_cast<float>(s.batch.target_tokens); }

TEST(LoraPrecision, FusedEqualsUnfusedBitForBit) {
  Fixture s;
  for (double dropout : {0.0, 0.1})
    for (TrainPrecision p : {TrainPrecision::fp32, TrainPrecision::bf16, TrainPrecision::fp16}) {
      LoraModel lora = make_lora(s.model->config(), dropout);
      double l1 = 0, l2 = 0;
      const std::vector<float> a = grads(s, lora, p, true, scale_of(s), &l1);
      const std::vector<float> b = grads(s, lora, p, false, scale_of(s), &l2);
      EXPECT_EQ(l1, l2) << train_precision_name(p) << " dropout " << dropout;
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << train_precision_name(p) << " dropout " << dropout;
    }
}

// max|g - g_fp32| / max|g_fp32| over the whole arena, and per (layer, target, A|B).
double rel_error(const std::vector<float>& g, const std::vector<float>& ref) {
  double err = 0, mx = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(g[i]) - ref[i]));
    mx = std::max(mx, std::fabs(static_cast<double>(ref[i])));
  }
  return err / mx;
}

TEST(LoraPrecision, GradientsWithinTheirPrecisionOfFp32) {
  Fixture s;
  // Stated tolerances (max abs error over the arena's max): bf16 keeps 8
  // significant bits per operand (2^-9 relative rounding), fp16 11 (2^-12);
  // errors add over the chained products of a 2-layer model.
  const struct {
    TrainPrecision p;
    double tol, min_err;
  } cases[] = {{TrainPrecision::bf16, 3e-2, 1e-5}, {TrainPrecision::fp16, 4e-3, 1e-7}};
  for (double dropout : {0.0, 0.1}) {
    LoraModel lora = make_lora(s.model->config(), dropout);
    double l32 = 0;
    const std::vector<float> ref = grads(s, lora, TrainPrecision::fp32, true, scale_of(s), &l32);
    for (const auto& c : cases) {
      double loss = 0;
      const std::vector<float> g = grads(s, lora, c.p, true, scale_of(s), &loss);
      const double e = rel_error(g, ref);
      std::printf("%s dropout %.1f: LoRA gradient max|d|/max|fp32| %.2e, loss %.7f vs fp32 %.7f\n",
                  train_precision_name(c.p), dropout, e, loss, l32);
      EXPECT_LE(e, c.tol) << train_precision_name(c.p);
      EXPECT_GE(e, c.min_err) << train_precision_name(c.p) << ": no rounding happened";
      EXPECT_LE(std::fabs(loss - l32), c.tol * l32) << train_precision_name(c.p);
    }
  }
}

TEST(LoraPrecision, Fp16GradientsOverflowWhereFp32DoNot) {
  Fixture s;
  LoraModel lora = make_lora(s.model->config(), 0.0);
  const float huge = scale_of(s) * 0x1p40f;  // a loss scale far beyond fp16's range
  auto finite = [](const std::vector<float>& g) {
    return std::all_of(g.begin(), g.end(), [](float x) { return std::isfinite(x); });
  };
  EXPECT_TRUE(finite(grads(s, lora, TrainPrecision::fp32, true, huge, nullptr)));
  EXPECT_TRUE(finite(grads(s, lora, TrainPrecision::bf16, true, huge, nullptr)));  // bf16 has f32's range
  EXPECT_FALSE(finite(grads(s, lora, TrainPrecision::fp16, true, huge, nullptr)));
  EXPECT_TRUE(finite(grads(s, lora, TrainPrecision::fp16, true, scale_of(s) * 0x1p10f, nullptr)));
}

}  // namespace
}  // namespace loom

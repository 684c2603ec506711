// Quantization-aware training (train/qat.h) and training a pruned model
// (sparsity_mask, the merge keeping zeros): the LoRA gradients under QAT are
// the straight-through estimator's chain rule, checked against full
// fine-tuning's weight gradient at the fake-quantized merged weights.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "kernels/int_quant.h"
#include "model/adapter_merge.h"
#include "model/model.h"
#include "peft_fixture_util.h"
#include "train/full_params.h"
#include "train/lora_params.h"
#include "train/qat.h"
#include "train/train_config.h"
#include "train/train_step.h"

namespace loom {
namespace {

using test_util::batch_from_hf;

std::string fixture(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel; }

Batch tiny_batch() {
  std::ifstream bf(fixture("peft/tiny-llama/batch.json"));
  const auto meta = nlohmann::json::parse(bf);
  return batch_from_hf(meta["input_ids"].get<std::vector<std::vector<int32_t>>>(),
                       meta["labels"].get<std::vector<std::vector<int32_t>>>());
}

double rel_err(const std::vector<double>& got, const float* want) {
  double d = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d = std::max(d, std::fabs(got[i] - want[i]));
    m = std::max(m, std::fabs(static_cast<double>(want[i])));
  }
  return d / m;
}

// STE: dL/d(W + s B A) is taken as dL/dM at M = fq(W + s B A), so
// dB = s dL/dM A^T and dA = s B^T dL/dM, with dL/dM what full fine-tuning
// computes for a model whose weights are M.
TEST(Qat, LoraGradientsAreTheStraightThroughChainRule) {
  ThreadPool pool(2);
  auto be = make_backend(kCpu, pool);
  for (const bool symmetric : {true, false}) {
    SCOPED_TRACE(symmetric ? "sym" : "asym");
    auto model = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = true, .backend = be.get()});
    const ModelConfig& mc = model->config();
    LoraConfig lc;
    lc.r = 4;
    lc.alpha = 8;
    LoraModel lora(mc, lc);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 0.05f);
    for (int64_t l = 0; l < mc.n_layers; ++l)
      for (LoraTarget t : kAllLoraTargets) {
        Tensor B = lora.b(l, t);
        for (int64_t i = 0; i < B.numel(); ++i) B.as<float>()[i] = nd(rng);
      }
    IntQuantSpec spec;
    spec.bits = 4;
    spec.symmetric = symmetric;
    spec.group = 0;  // the tiny widths (64, 176) take no group of 32
    QatWeights qat(model->mutable_weights(), spec, /*lora=*/true);
    qat.refresh(model->mutable_weights(), pool, &lora);
    prepare_weights(model->mutable_weights(), *be);
    TrainSession session(mc, model->weights(), lora, *be, BackwardMode::exact);
    session.set_adapters_merged(true);
    const Batch batch = tiny_batch();
    const float scale = 1.0f / static_cast<float>(batch.target_tokens);
    lora.zero_grads();
    const LossResult lr = session.forward_backward(batch, scale);

    // The reference: full fine-tuning of the model whose matrices are M.
    std::unique_ptr<FullParams> full;
    auto ref = Model::load(fixture("model/tiny-llama"),
                           {.tokenizer = false, .pack = true, .backend = be.get(),
                            .before_pack = [&](ModelWeights& w, const ModelConfig& c) {
                              for (int64_t l = 0; l < c.n_layers; ++l)
                                for (LoraTarget t : kAllLoraTargets)
                                  target_matrix(w.layers[static_cast<size_t>(l)], t) =
                                      target_matrix(model->weights().layers[static_cast<size_t>(l)], t);
                              full = std::make_unique<FullParams>(w, c, pool);
                            }});
    TrainSession fs(mc, ref->weights(), *full, *be, BackwardMode::exact);
    full->zero_grads();
    const LossResult fr = fs.forward_backward(batch, scale);
    EXPECT_NEAR(lr.loss_sum, fr.loss_sum, 1e-5 * std::fabs(fr.loss_sum));

    const double s = lc.scale();
    const int64_t r = lc.r;
    double worst = 0;
    for (int64_t l = 0; l < mc.n_layers; ++l) {
      const LayerGrads& G = full->layer_grads(l);
      const float* dW[] = {G.wq, G.wk, G.wv, G.wo, G.w_gate, G.w_up, G.w_down};
      for (LoraTarget t : kAllLoraTargets) {
        const Tensor A = lora.a(l, t), B = lora.b(l, t);
        const int64_t in = A.dim(1), out = B.dim(0);
        const float* g = dW[static_cast<int>(t)];
        std::vector<double> dA(static_cast<size_t>(r * in), 0.0), dB(static_cast<size_t>(out * r), 0.0);
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i) {
            const double gi = g[o * in + i];
            for (int64_t k = 0; k < r; ++k) {
              dB[static_cast<size_t>(o * r + k)] += s * gi * A.as<const float>()[k * in + i];
              dA[static_cast<size_t>(k * in + i)] += s * B.as<const float>()[o * r + k] * gi;
            }
          }
        const double ea = rel_err(dA, lora.grad_a(l, t).as<const float>());
        const double eb = rel_err(dB, lora.grad_b(l, t).as<const float>());
        EXPECT_LT(ea, 1e-4) << "layer " << l << " " << lora_target_peft_name(t) << " dA";
        EXPECT_LT(eb, 1e-4) << "layer " << l << " " << lora_target_peft_name(t) << " dB";
        worst = std::max({worst, ea, eb});
      }
    }
    std::printf("QAT LoRA gradients against the STE chain rule: worst max|d|/max|ref| %.2e\n", worst);
  }
}

// The forward under QAT multiplies exactly what the quantized export holds:
// fq of the merge loom merge computes.
TEST(Qat, ForwardWeightsAreTheQuantizedMerge) {
  ThreadPool pool(2);
  auto model = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = false});
  const ModelConfig& mc = model->config();
  LoraConfig lc;
  lc.r = 2;
  LoraModel lora(mc, lc);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  const Tensor B = lora.b(1, LoraTarget::up);
  for (int64_t i = 0; i < B.numel(); ++i) B.as<float>()[i] = nd(rng);
  const Tensor W0 = target_matrix(model->weights().layers[1], LoraTarget::up);
  std::vector<float> merged(W0.as<const float>(), W0.as<const float>() + W0.numel());
  IntQuantSpec spec;
  spec.bits = 8;
  spec.symmetric = false;
  QatWeights qat(model->mutable_weights(), spec, /*lora=*/true);
  qat.refresh(model->mutable_weights(), pool, &lora);
  merge_lora_rows(merged.data(), B.as<const float>(), lora.a(1, LoraTarget::up).as<const float>(), W0.rows(), lc.r,
                  W0.cols(), lc.scale());
  std::vector<float> want(merged.size());
  int_fake_quantize(merged.data(), W0.rows(), W0.cols(), spec, want.data());
  const Tensor W = target_matrix(model->weights().layers[1], LoraTarget::up);
  ASSERT_EQ(W.dtype, DType::f32);
  EXPECT_EQ(std::vector<float>(W.as<const float>(), W.as<const float>() + W.numel()), want);
  // An unadapted-by-B matrix (B zero) is fq(W) alone.
  qat.restore_latent(model->mutable_weights());
  EXPECT_EQ(target_matrix(model->weights().layers[1], LoraTarget::up).as<const float>()[0], W0.as<const float>()[0]);
}

// The one-pass fake quantization equals quantize-then-dequantize bit for bit.
TEST(Qat, FakeQuantizeEqualsQuantizeThenDequantize) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 0.03f);
  const int64_t rows = 6, cols = 192;
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (float& v : w) v = nd(rng);
  w[7] = 0.8f;  // an outlier
  for (int bits : {4, 8})
    for (bool sym : {true, false})
      for (int64_t group : {int64_t{-1}, int64_t{0}, int64_t{32}, int64_t{96}}) {
        IntQuantSpec spec;
        spec.bits = bits;
        spec.symmetric = sym;
        spec.group = group;
        const IntQuantParams p = choose_int_quant_params(w.data(), rows, cols, spec);
        const std::vector<int8_t> q = int_quantize(w.data(), rows, cols, spec, p);
        const std::vector<float> want = int_dequantize(q.data(), rows, cols, spec, p);
        std::vector<float> got(w.size());
        int_fake_quantize(w.data(), rows, cols, spec, got.data());
        EXPECT_EQ(got, want) << "bits " << bits << " sym " << sym << " group " << group;
      }
}

TEST(Qat, ConfigKeys) {
  const std::string base = "model: m.gguf\ndata: {train: t.jsonl}\noutput_dir: o\nsteps: 1\n";
  const TrainConfig c =
      parse_train_config(base + "qat: {bits: 4, group_size: 64, scheme: asym, start_step: 7}\n", "c.yaml");
  EXPECT_EQ(c.qat.start_step, 7);
  EXPECT_EQ(c.qat.bits, 4);
  EXPECT_EQ(c.qat.group_size, 64);
  EXPECT_FALSE(c.qat.symmetric);
  EXPECT_EQ(c.lora.dropout, 0.0);  // QAT sets PEFT's default dropout to 0, with a warning
  EXPECT_FALSE(c.warnings.empty());
  for (const char* bad : {"qat: {bits: 3}\n", "qat: {bits: 4, group_size: 48}\n", "qat: {scheme: nf4}\n",
                          "sparsity_mask: maybe\n"})
    EXPECT_THROW(parse_train_config(base + bad, "c.yaml"), Error) << bad;
  EXPECT_EQ(parse_train_config(base + "sparsity_mask: on\n", "c.yaml").sparsity_mask, TrainConfig::SparsityMask::on);
}

TEST(SparsityMask, FullFineTuningKeepsTheZeros) {
  ThreadPool pool(1);
  auto model = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = false});
  ModelWeights& w = model->mutable_weights();
  FullParams full(w, model->config(), pool);
  float* wq = w.layers[0].wq.as<float>();
  float* down = w.layers[1].w_down.as<float>();
  wq[3] = wq[7] = down[100] = 0.0f;
  float* norm = const_cast<float*>(w.layers[0].attn_norm);
  norm[0] = 0.0f;  // norms are not masked
  EXPECT_EQ(full.keep_zeros(), 3);
  for (int64_t i = 0; i < full.param_count(); ++i) full.grads()[i] = 1.0f;
  full.mask_grads();
  const LayerGrads& g0 = full.layer_grads(0);
  EXPECT_EQ(g0.wq[3], 0.0f);
  EXPECT_EQ(g0.wq[7], 0.0f);
  EXPECT_EQ(g0.wq[4], 1.0f);
  EXPECT_EQ(full.layer_grads(1).w_down[100], 0.0f);
  EXPECT_EQ(g0.attn_norm[0], 1.0f);
  for (int64_t i = 0; i < full.param_count(); ++i) full.params()[i] += 0.5f;
  full.mask_params();
  EXPECT_EQ(wq[3], 0.0f);
  EXPECT_EQ(down[100], 0.0f);
  EXPECT_NE(wq[4], 0.0f);
  EXPECT_EQ(norm[0], 0.5f);
}

TEST(SparsityMask, MergingIntoAPrunedModelKeepsItsZeros) {
  auto model = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = false});
  ModelConfig c = model->config();
  ModelWeights& w = model->mutable_weights();
  peft::AdapterTensors a;
  a.config.r = 1;
  a.config.lora_alpha = 1;
  a.config.layers_to_transform = {0};  // layer 0 only (without it an adapter must cover every layer)
  peft::LoraPair p;
  p.in = c.hidden;
  p.out = c.q_dim();
  p.a.assign(static_cast<size_t>(p.in), 0.5f);
  p.b.assign(static_cast<size_t>(p.out), 0.5f);
  a.pairs[{0, LoraTarget::q}] = p;
  std::vector<float> zeroed(w.layers[0].wq.as<const float>(), w.layers[0].wq.as<const float>() + w.layers[0].wq.numel());
  zeroed[0] = zeroed[5] = 0.0f;
  for (const bool pruned : {false, true}) {
    w.layers[0].wq.data = zeroed.data();
    w.layers[0].wq.dtype = DType::f32;
    c.unstructured_pruning = pruned ? "wanda 50% per row" : "";
    merge_adapter(w, c, a, false);  // re-points wq at a merged copy
    const float* m = w.layers[0].wq.as<const float>();
    EXPECT_EQ(m[0] == 0.0f && m[5] == 0.0f, pruned);
    EXPECT_NE(m[1], zeroed[1]);  // the adapter did act elsewhere
  }
}

}  // namespace
}  // namespace loom

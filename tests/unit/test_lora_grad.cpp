// LoRA model and the training forward/backward of the whole decoder: gradients
// against PyTorch + PEFT goldens (scripts/fixtures/make_peft_fixtures.py) and
// against finite differences of loom's own loss.
#include <gtest/gtest.h>

#include "kernels/backend.h"

#include "peft_fixture_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "train/data.h"
#include "train/lora_params.h"
#include "train/train_step.h"

namespace loom {
namespace {

using test_util::batch_from_hf;
using test_util::read_f32;

std::string fixture(const std::string& rel) {
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel;
}

std::unique_ptr<Model> load_tiny(const std::string& name, Backend& backend) {
  return Model::load(fixture("model/" + name), {.tokenizer = false, .pack = true, .backend = &backend});
}


struct PeftCase {
  nlohmann::json meta;
  Batch batch;
  std::unique_ptr<safetensors::File> adapter, grads;
};

PeftCase load_peft(const std::string& name) {
  PeftCase c;
  std::ifstream f(fixture("peft/" + name + "/batch.json"));
  c.meta = nlohmann::json::parse(f);
  c.batch = batch_from_hf(c.meta["input_ids"].get<std::vector<std::vector<int32_t>>>(),
                          c.meta["labels"].get<std::vector<std::vector<int32_t>>>());
  c.adapter = safetensors::File::open(fixture("peft/" + name + "/adapter.safetensors"));
  c.grads = safetensors::File::open(fixture("peft/" + name + "/grads.safetensors"));
  return c;
}


void set_adapter(LoraModel& lora, const safetensors::File& f) {
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (int t = 0; t < kLoraTargetCount; ++t) {
      const auto tg = static_cast<LoraTarget>(t);
      for (bool is_a : {true, false}) {
        Tensor dst = is_a ? lora.a(l, tg) : lora.b(l, tg);
        const auto v = read_f32(f, LoraModel::peft_name(l, tg, is_a), dst.numel());
        std::memcpy(dst.data, v.data(), v.size() * sizeof(float));
      }
    }
}

double max_abs(const float* p, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(p[i])));
  return m;
}

void check_against_peft(const std::string& name) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = load_tiny(name, backend);
  PeftCase pc = load_peft(name);
  LoraConfig lc;
  lc.r = pc.meta["r"].get<int64_t>();
  lc.alpha = pc.meta["alpha"].get<double>();
  lc.set_targets(pc.meta["target_modules"].get<std::vector<std::string>>());
  LoraModel lora(model->config(), lc);
  set_adapter(lora, *pc.adapter);
  TrainSession session(model->config(), model->weights(), lora, backend);
  lora.zero_grads();
  const LossResult res =
      session.forward_backward(pc.batch, 1.0f / static_cast<float>(pc.batch.target_tokens));
  ASSERT_EQ(res.n_tokens, pc.batch.target_tokens);
  const double loss = res.loss_sum / static_cast<double>(res.n_tokens), ref = pc.meta["loss"].get<double>();
  EXPECT_LE(std::fabs(loss - ref), 1e-5 * std::fabs(ref)) << name << ": loss " << loss << " vs PEFT " << ref;
  double worst = 0;
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (int t = 0; t < kLoraTargetCount; ++t)
      for (bool is_a : {true, false}) {
        const auto tg = static_cast<LoraTarget>(t);
        const Tensor g = is_a ? lora.grad_a(l, tg) : lora.grad_b(l, tg);
        const std::string n = LoraModel::peft_name(l, tg, is_a);
        const auto want = read_f32(*pc.grads, n, g.numel());
        double err = 0;
        for (int64_t i = 0; i < g.numel(); ++i)
          err =
              std::max(err, std::fabs(static_cast<double>(g.as<float>()[i]) - want[static_cast<size_t>(i)]));
        const double scale = max_abs(want.data(), g.numel());
        ASSERT_GT(scale, 0) << n << ": the golden gradient is zero, the check would be empty";
        EXPECT_LE(err / scale, 1e-4) << name << " " << n;
        worst = std::max(worst, err / scale);
      }
  std::printf("%s: loss %.9g vs PEFT %.9g (rel %.2e); worst LoRA gradient max|d|/max|ref| %.2e\n",
              name.c_str(), loss, ref, std::fabs(loss - ref) / ref, worst);
}

TEST(LoraGrad, MatchesPeftTinyLlama) { check_against_peft("tiny-llama"); }
TEST(LoraGrad, MatchesPeftTinyQwen2) { check_against_peft("tiny-qwen2"); }

// The same model from GGUF (llama q/k rows permuted for interleaved RoPE): with the
// PEFT adapter permuted into the model's row order, loss and gradients (permuted
// back) match the PEFT golden as well.
TEST(LoraGrad, MatchesPeftFromGgufWithPermutedQk) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = load_tiny("tiny-llama.f32.gguf", backend);
  ASSERT_TRUE(lora_needs_qk_permutation(model->config()));
  PeftCase pc = load_peft("tiny-llama");
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  LoraModel lora(model->config(), lc);
  set_adapter(lora, *pc.adapter);
  lora_permute_qk_rows(lora, lora.params(), model->config(), true);
  TrainSession session(model->config(), model->weights(), lora, backend);
  lora.zero_grads();
  const LossResult res =
      session.forward_backward(pc.batch, 1.0f / static_cast<float>(pc.batch.target_tokens));
  const double loss = res.loss_sum / static_cast<double>(res.n_tokens), ref = pc.meta["loss"].get<double>();
  EXPECT_LE(std::fabs(loss - ref), 1e-5 * ref);
  lora_permute_qk_rows(lora, lora.grads(), model->config(), false);
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget tg : {LoraTarget::q, LoraTarget::k, LoraTarget::v})
      for (bool is_a : {true, false}) {
        const Tensor g = is_a ? lora.grad_a(l, tg) : lora.grad_b(l, tg);
        const auto want = read_f32(*pc.grads, LoraModel::peft_name(l, tg, is_a), g.numel());
        double err = 0;
        for (int64_t i = 0; i < g.numel(); ++i)
          err =
              std::max(err, std::fabs(static_cast<double>(g.as<float>()[i]) - want[static_cast<size_t>(i)]));
        EXPECT_LE(err / max_abs(want.data(), g.numel()), 1e-4) << LoraModel::peft_name(l, tg, is_a);
      }
  // Permuting there and back is the identity.
  std::vector<float> before(lora.params(), lora.params() + lora.param_count());
  lora_permute_qk_rows(lora, lora.params(), model->config(), false);
  EXPECT_NE(before, std::vector<float>(lora.params(), lora.params() + lora.param_count()));
  lora_permute_qk_rows(lora, lora.params(), model->config(), true);
  EXPECT_EQ(before, std::vector<float>(lora.params(), lora.params() + lora.param_count()));
}

// Mean loss with dropout masks of `step` (grad_scale 0 adds nothing to the gradients).
double mean_loss(TrainSession& s, const Batch& b, uint64_t step) {
  const LossResult r = s.forward_backward(b, 0.0f, step);
  return r.loss_sum / static_cast<double>(r.n_tokens);
}

// Central differences of loom's own f32 loss against its analytic gradient, for
// a few elements of every A and B. eps = 1e-2 keeps the f32 rounding noise of the
// loss (~1e-6) small against the difference; the tolerance covers O(eps^2) terms.
void check_fd(const std::string& name, double dropout) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = load_tiny(name, backend);
  PeftCase pc = load_peft(name);
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  lc.dropout = dropout;
  lc.seed = 7;
  LoraModel lora(model->config(), lc);
  set_adapter(lora, *pc.adapter);
  TrainSession session(model->config(), model->weights(), lora, backend);
  const uint64_t step = 3;
  lora.zero_grads();
  session.forward_backward(pc.batch, 1.0f / static_cast<float>(pc.batch.target_tokens), step);
  std::vector<float> grad(lora.grads(), lora.grads() + lora.param_count());
  const double gmax = max_abs(grad.data(), lora.param_count());
  ASSERT_GT(gmax, 0);
  float* p = lora.params();
  const double eps = 1e-2;
  int checked = 0;
  double worst = 0;
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (int t = 0; t < kLoraTargetCount; ++t)
      for (bool is_a : {true, false}) {
        const LoraSlot& s = lora.slot(l, static_cast<LoraTarget>(t));
        const size_t off = is_a ? s.a_offset : s.b_offset;
        const int64_t n = is_a ? lc.r * s.in : s.out * lc.r;
        // The largest-gradient element and two others at awkward strides.
        int64_t imax = 0;
        for (int64_t i = 0; i < n; ++i)
          if (std::fabs(grad[off + i]) > std::fabs(grad[off + imax])) imax = i;
        for (int64_t i : {imax, (n * 5) / 7, n - 3}) {
          const float keep = p[off + i];
          p[off + i] = keep + static_cast<float>(eps);
          const double lp = mean_loss(session, pc.batch, step);
          p[off + i] = keep - static_cast<float>(eps);
          const double lm = mean_loss(session, pc.batch, step);
          p[off + i] = keep;
          const double fd = (lp - lm) / (2 * eps), g = grad[off + i];
          const double err = std::fabs(fd - g) / (std::fabs(g) + 0.02 * gmax);
          EXPECT_LE(err, 2e-2) << name << " " << LoraModel::peft_name(l, static_cast<LoraTarget>(t), is_a)
                               << "[" << i << "]: finite difference " << fd << " vs analytic " << g;
          worst = std::max(worst, err);
          ++checked;
        }
      }
  std::printf("%s dropout %.2f: %d finite differences, worst relative error %.2e (max |g| %.3g)\n",
              name.c_str(), dropout, checked, worst, gmax);
}

TEST(LoraGrad, FiniteDifferencesTinyLlama) { check_fd("tiny-llama", 0.0); }
TEST(LoraGrad, FiniteDifferencesWithDropout) { check_fd("tiny-qwen2", 0.25); }

// Micro-batches with grad_scale = 1 / (all target tokens) sum to the full batch's gradient.
TEST(LoraGrad, AccumulationOverMicroBatchesIsExact) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = load_tiny("tiny-llama", backend);
  PeftCase pc = load_peft("tiny-llama");
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  LoraModel lora(model->config(), lc);
  set_adapter(lora, *pc.adapter);
  TrainSession session(model->config(), model->weights(), lora, backend);
  const float scale = 1.0f / static_cast<float>(pc.batch.target_tokens);
  lora.zero_grads();
  const LossResult full = session.forward_backward(pc.batch, scale);
  const std::vector<float> g_full(lora.grads(), lora.grads() + lora.param_count());
  lora.zero_grads();
  double loss_sum = 0;
  for (int64_t r = 0; r < pc.batch.rows; ++r) {
    Batch one;
    one.rows = 1;
    one.seq_len = pc.batch.seq_len;
    const auto b = static_cast<size_t>(r * one.seq_len), e = b + static_cast<size_t>(one.seq_len);
    one.tokens.assign(pc.batch.tokens.begin() + b, pc.batch.tokens.begin() + e);
    one.targets.assign(pc.batch.targets.begin() + b, pc.batch.targets.begin() + e);
    one.positions.assign(pc.batch.positions.begin() + b, pc.batch.positions.begin() + e);
    one.seq_start.assign(pc.batch.seq_start.begin() + b, pc.batch.seq_start.begin() + e);
    loss_sum += session.forward_backward(one, scale).loss_sum;
  }
  EXPECT_NEAR(loss_sum, full.loss_sum, 1e-5 * full.loss_sum);
  const double gmax = max_abs(g_full.data(), lora.param_count());
  for (int64_t i = 0; i < lora.param_count(); ++i)
    ASSERT_NEAR(lora.grads()[i], g_full[static_cast<size_t>(i)], 1e-5 * gmax) << i;
}

// Packing two samples in one row must equal running them as separate rows.
TEST(LoraGrad, PackedRowEqualsSeparateRows) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = load_tiny("tiny-qwen2", backend);
  PeftCase pc = load_peft("tiny-qwen2");
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  LoraModel lora(model->config(), lc);
  set_adapter(lora, *pc.adapter);
  TrainSession session(model->config(), model->weights(), lora, backend);
  Batch packed;
  packed.rows = 1;
  packed.seq_len = pc.batch.rows * pc.batch.seq_len;
  packed.tokens = pc.batch.tokens;
  packed.targets = pc.batch.targets;
  packed.positions = pc.batch.positions;
  for (int64_t i = 0; i < packed.seq_len; ++i)
    packed.seq_start.push_back(static_cast<int32_t>((i / pc.batch.seq_len) * pc.batch.seq_len));
  lora.zero_grads();
  const LossResult a = session.forward_backward(pc.batch, 0.01f);
  const std::vector<float> ga(lora.grads(), lora.grads() + lora.param_count());
  lora.zero_grads();
  const LossResult b = session.forward_backward(packed, 0.01f);
  EXPECT_NEAR(a.loss_sum, b.loss_sum, 1e-5 * a.loss_sum);
  const double gmax = max_abs(ga.data(), lora.param_count());
  for (int64_t i = 0; i < lora.param_count(); ++i)
    ASSERT_NEAR(lora.grads()[i], ga[static_cast<size_t>(i)], 1e-5 * gmax) << i;
}

// Frozen quantized base weights: the same LoRA gradients as with f32 copies of
// the same (dequantized) weights, up to the q8 activation rounding of the forward
// matmuls; and results that do not depend on the thread count. The random tiny
// model is very sensitive to that rounding: inference logits of q8_0 vs its f32
// copy already differ by up to 0.8 (of 15.7), so LoRA gradients differ by ~10%;
// the bound is loose, but a wrong or missing term gives ~100%.
TEST(LoraGrad, QuantizedBaseAndThreadCountInvariance) {
  PeftCase pc = load_peft("tiny-llama");
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  lc.seed = 5;
  auto run = [&](const std::string& file, int threads, bool dequantize) {
    ThreadPool pool(threads);
    auto backend_owner = make_backend(kCpu, pool);
    Backend& backend = *backend_owner;
    auto model = Model::load(fixture("model/" + file),
                             {.tokenizer = false, .pack = true, .backend = &backend, .dequantize = dequantize});
    LoraModel lora(model->config(), lc);
    for (int64_t i = 0; i < lora.param_count(); ++i)  // B nonzero so every gradient flows
      lora.params()[i] += 0.05f * static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
    TrainSession session(model->config(), model->weights(), lora, backend);
    lora.zero_grads();
    const LossResult r =
        session.forward_backward(pc.batch, 1.0f / static_cast<float>(pc.batch.target_tokens));
    std::vector<float> g(lora.grads(), lora.grads() + lora.param_count());
    g.push_back(static_cast<float>(r.loss_sum / static_cast<double>(r.n_tokens)));
    return g;
  };
  const auto f32 = run("tiny-llama.f32.gguf", 2, false);
  EXPECT_EQ(f32, run("tiny-llama.f32.gguf", 1, false));
  EXPECT_EQ(f32, run("tiny-llama.f32.gguf", 3, false));
  for (const char* q : {"tiny-llama.q8_0.gguf", "tiny-llama.q4_0.gguf", "tiny-llama.q4_1.gguf"}) {
    const auto g = run(q, 2, false), ref = run(q, 2, true);
    EXPECT_EQ(g, run(q, 3, false)) << q;
    const double gmax = max_abs(ref.data(), static_cast<int64_t>(ref.size()) - 1);
    EXPECT_NEAR(g.back(), ref.back(), 3e-3 * ref.back()) << q;
    double err = 0;
    for (size_t i = 0; i + 1 < g.size(); ++i)
      err = std::max(err, std::fabs(static_cast<double>(g[i]) - ref[i]));
    EXPECT_LE(err / gmax, 0.25) << q;
    std::printf("%s: loss %.6g vs dequantized %.6g (f32 model %.6g), LoRA gradients max|d|/max|g| %.2e\n", q,
                g.back(), ref.back(), f32.back(), err / gmax);
  }
}

TEST(LoraModel, LayoutInitAndNames) {
  ModelConfig c;
  c.hidden = 64;
  c.intermediate = 176;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  LoraConfig lc;
  lc.r = 5;
  lc.alpha = 10;
  const std::vector<std::string> names = {"q_proj", "v", "down_proj"};
  lc.set_targets(names);
  lc.seed = 11;
  LoraModel m(c, lc);
  EXPECT_FLOAT_EQ(m.scale(), 2.0f);
  // q: 5*64 + 64*5; v: 5*64 + 32*5; down: 5*176 + 64*5, per layer.
  EXPECT_EQ(m.param_count(), 3 * (640 + 480 + 1200));
  EXPECT_FALSE(m.slot(1, LoraTarget::k).active);
  EXPECT_TRUE(m.slot(2, LoraTarget::down).active);
  const Tensor a = m.a(2, LoraTarget::down), b = m.b(2, LoraTarget::down);
  EXPECT_EQ(a.dim(0), 5);
  EXPECT_EQ(a.dim(1), 176);
  EXPECT_EQ(b.dim(0), 64);
  EXPECT_EQ(b.dim(1), 5);
  const double bound = 1.0 / std::sqrt(176.0);
  double mx = 0;
  for (int64_t i = 0; i < a.numel(); ++i) mx = std::max(mx, std::fabs(static_cast<double>(a.as<float>()[i])));
  EXPECT_LE(mx, bound);
  EXPECT_GT(mx, 0.9 * bound);
  EXPECT_EQ(max_abs(b.as<float>(), b.numel()), 0.0);
  LoraModel same(c, lc);
  EXPECT_EQ(std::memcmp(same.params(), m.params(), sizeof(float) * static_cast<size_t>(m.param_count())), 0);
  lc.seed = 12;
  LoraModel other(c, lc);
  EXPECT_NE(std::memcmp(other.params(), m.params(), sizeof(float) * static_cast<size_t>(m.param_count())), 0);
  EXPECT_EQ(LoraModel::peft_name(3, LoraTarget::gate, false),
            "base_model.model.model.layers.3.mlp.gate_proj.lora_B.weight");
  EXPECT_EQ(LoraModel::peft_name(0, LoraTarget::o, true),
            "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight");
  lc.use_rslora = true;
  EXPECT_NEAR(lc.scale(), 10 / std::sqrt(5.0), 1e-12);
  m.grads()[7] = 1;
  m.zero_grads();
  EXPECT_EQ(max_abs(m.grads(), m.param_count()), 0.0);
}

TEST(LoraModel, BadConfigsThrow) {
  LoraConfig lc;
  const std::vector<std::string> bad = {"q_proj", "lm_head"};
  EXPECT_THROW(lc.set_targets(bad), Error);
  EXPECT_THROW(lc.set_targets(std::vector<std::string>{}), Error);
  lc = {};
  lc.r = 0;
  EXPECT_THROW(lc.validate(), Error);
  lc = {};
  lc.dropout = 1.0;
  EXPECT_THROW(lc.validate(), Error);
  lc = {};
  lc.targets.fill(false);
  EXPECT_THROW(lc.validate(), Error);
}

TEST(LoraGrad, MalformedBatchThrows) {
  ThreadPool pool(1);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = load_tiny("tiny-llama", backend);
  LoraModel lora(model->config(), LoraConfig{});
  TrainSession session(model->config(), model->weights(), lora, backend);
  PeftCase pc = load_peft("tiny-llama");
  Batch b = pc.batch;
  b.tokens[3] = 100000;
  EXPECT_THROW(session.forward_backward(b, 1.0f), Error);
  b = pc.batch;
  b.seq_start[2] = 5;  // after the token itself
  EXPECT_THROW(session.forward_backward(b, 1.0f), Error);
  b = pc.batch;
  b.targets.pop_back();
  EXPECT_THROW(session.forward_loss(b), Error);
}

}  // namespace
}  // namespace loom

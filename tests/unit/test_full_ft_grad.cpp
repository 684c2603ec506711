// Full fine-tuning gradients (FullParams + TrainSession) of every parameter of
// the tiny llama (untied, Llama-3 RoPE scaling) and qwen2 (tied, qkv biases)
// against PyTorch in float64 (scripts/fixtures/make_full_ft_fixtures.py).
#include <gtest/gtest.h>

#include "kernels/backend.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/model.h"
#include "peft_fixture_util.h"
#include "train/full_params.h"
#include "train/train_step.h"

namespace loom {
namespace {
using test_util::batch_from_hf;
using test_util::read_f32;

std::string fixture(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel; }

// max |a - ref| / max |ref| over n floats.
double rel_err(const float* a, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - ref[i]));
    m = std::max(m, std::fabs(static_cast<double>(ref[i])));
  }
  return d / m;
}

void check_model(const std::string& name, BackwardMode mode) {
  SCOPED_TRACE(name + " backward " + backward_mode_name(mode));
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  std::unique_ptr<FullParams> full;
  auto model = Model::load(fixture("model/" + name),
                           {.tokenizer = false,
                            .pack = true,
                            .backend = &backend,
                            .before_pack = [&](ModelWeights& w, const ModelConfig& c) {
                              full = std::make_unique<FullParams>(w, c, pool);
                            }});
  ASSERT_TRUE(full);
  const ModelConfig& mc = model->config();
  std::ifstream bf(fixture("peft/" + name + "/batch.json"));
  const auto meta = nlohmann::json::parse(bf);
  const Batch batch = batch_from_hf(meta["input_ids"].get<std::vector<std::vector<int32_t>>>(),
                                    meta["labels"].get<std::vector<std::vector<int32_t>>>());
  std::ifstream lf(fixture("full_ft/" + name + "/loss.json"));
  const auto ref = nlohmann::json::parse(lf);
  auto grads = safetensors::File::open(fixture("full_ft/" + name + "/grads.safetensors"));
  EXPECT_EQ(full->tied(), ref["tied"].get<bool>());

  TrainSession session(mc, model->weights(), *full, backend, mode);
  full->zero_grads();
  const LossResult res = session.forward_backward(batch, 1.0f / static_cast<float>(batch.target_tokens));
  const double loss = res.loss_sum / static_cast<double>(res.n_tokens), want = ref["loss"].get<double>();
  EXPECT_LE(std::fabs(loss - want), 1e-5 * std::fabs(want));

  double worst = 0;
  int n_checked = 0;
  auto check = [&](const float* g, const std::string& hf, int64_t numel) {
    ASSERT_NE(g, nullptr) << hf;
    const std::vector<float> r = read_f32(*grads, hf, numel);
    const double e = rel_err(g, r);
    EXPECT_LT(e, 1e-4) << hf;
    worst = std::max(worst, e);
    ++n_checked;
  };
  const int64_t H = mc.hidden;
  check(full->token_embd_grad(), "model.embed_tokens.weight", mc.vocab_size * H);
  if (!full->tied()) check(full->output_grad(), "lm_head.weight", mc.vocab_size * H);
  check(full->output_norm_grad(), "model.norm.weight", H);
  for (int64_t l = 0; l < mc.n_layers; ++l) {
    const LayerGrads& G = full->layer_grads(l);
    const LayerWeights& L = model->weights().layers[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    check(G.attn_norm, p + "input_layernorm.weight", H);
    check(G.ffn_norm, p + "post_attention_layernorm.weight", H);
    check(G.wq, p + "self_attn.q_proj.weight", L.wq.numel());
    check(G.wk, p + "self_attn.k_proj.weight", L.wk.numel());
    check(G.wv, p + "self_attn.v_proj.weight", L.wv.numel());
    check(G.wo, p + "self_attn.o_proj.weight", L.wo.numel());
    check(G.w_gate, p + "mlp.gate_proj.weight", L.w_gate.numel());
    check(G.w_up, p + "mlp.up_proj.weight", L.w_up.numel());
    check(G.w_down, p + "mlp.down_proj.weight", L.w_down.numel());
    if (L.bq) {
      check(G.bq, p + "self_attn.q_proj.bias", L.wq.rows());
      check(G.bk, p + "self_attn.k_proj.bias", L.wk.rows());
      check(G.bv, p + "self_attn.v_proj.bias", L.wv.rows());
    }
  }
  EXPECT_EQ(static_cast<size_t>(n_checked), grads->tensors().size()) << "every PyTorch gradient compared";
  std::printf("%s (backward %s): loss %.8f vs PyTorch %.8f; %d gradient tensors, worst max|d|/max|ref| %.2e\n",
              name.c_str(), backward_mode_name(mode), loss, want, n_checked, worst);
}

TEST(FullFineTuneGrad, TinyLlamaMatchesPyTorch) {
  check_model("tiny-llama", BackwardMode::exact);
  check_model("tiny-llama", BackwardMode::f16);
}
TEST(FullFineTuneGrad, TinyQwen2TiedWithBiasesMatchesPyTorch) {
  check_model("tiny-qwen2", BackwardMode::exact);
  check_model("tiny-qwen2", BackwardMode::f16);
}

// Groups cover the arena once: norms and biases without decay, the rest with it.
TEST(FullFineTuneGrad, ParamGroupsSplitDecay) {
  ThreadPool pool(1);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  std::unique_ptr<FullParams> full;
  auto model = Model::load(fixture("model/tiny-qwen2"),
                           {.tokenizer = false, .pack = true, .backend = &backend,
                            .before_pack = [&](ModelWeights& w, const ModelConfig& c) {
                              full = std::make_unique<FullParams>(w, c, pool);
                            }});
  const auto groups = full->param_groups(1e-3, 0.1);
  size_t covered = 0, no_decay = 0;
  for (const ParamGroup& g : groups) {
    EXPECT_EQ(g.offset, covered);
    covered += g.size;
    if (!g.decay) no_decay += g.size;
  }
  EXPECT_EQ(covered, static_cast<size_t>(full->param_count()));
  const ModelConfig& c = model->config();
  // 2 norms per layer + final norm + q/k/v biases per layer.
  EXPECT_EQ(no_decay, static_cast<size_t>(c.n_layers * (2 * c.hidden + c.q_dim() + 2 * c.kv_dim()) + c.hidden));
}

}  // namespace
}  // namespace loom

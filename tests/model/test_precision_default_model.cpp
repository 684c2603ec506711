// precision bf16 / fp16 on the default model (SmolLM2-135M-Instruct Q4_1, and
// the same weights in f16): the LoRA gradients of one batch against fp32's
// (backward f16 in all three),
// and fused against unfused q/k/v,
// gate/up A products (bit-identical).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <span>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "model/model.h"
#include "train/train_step.h"

namespace loom {
namespace {

const std::string kModel = std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
// The same weights in f16 (scripts/make_gguf_variants): its products take f32
// activations, so the forward is smooth in the LoRA operands (see below). (A
// bf16 file would not do: bf16 products round their activations to bf16.)
const std::string kF16 = std::string(LOOM_SOURCE_DIR) + "/models/variants/SmolLM2-135M-Instruct.F16.gguf";

struct PrecisionCase {
  TrainPrecision p;
  float loss_scale;
  double tol;
  double min_cosine;
};

Batch one_row(int64_t T, int64_t vocab) {
  Batch b;
  b.rows = 1;
  b.seq_len = T;
  CounterRng rng(11);
  for (int64_t t = 0; t < T; ++t) {
    b.tokens.push_back(static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(vocab)));
    b.positions.push_back(static_cast<int32_t>(t));
    b.seq_start.push_back(0);
  }
  for (int64_t t = 0; t < T; ++t) b.targets.push_back(t + 1 < T ? b.tokens[static_cast<size_t>(t + 1)] : -100);
  b.target_tokens = T - 1;
  return b;
}

// The LoRA gradients of one 128-token row at each case's precision against
// fp32's, on two rows (random tokens, README text); returns the relative errors.
std::vector<double> gradient_errors(const std::string& path, std::span<const PrecisionCase> cases) {
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  auto model = Model::load(path, {.tokenizer = true, .pack = true, .backend = backend.get()});
  std::vector<double> errors;
  const ModelConfig& mc = model->config();
  LoraConfig lc;
  lc.r = 8;
  lc.alpha = 16;
  const std::vector<std::string> all = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  lc.set_targets(all);
  LoraModel lora(mc, lc);
  CounterRng rng(3);  // non-zero B: every adapter passes gradient to A and its input
  for (int64_t l = 0; l < mc.n_layers; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      Tensor B = lora.b(l, t);
      for (int64_t i = 0; i < B.numel(); ++i) B.as<float>()[i] = static_cast<float>(rng.next_double() - 0.5) * 0.02f;
    }
  // Two rows: random tokens (far from the model's data: its loss is very
  // sensitive to any rounding) and 128 tokens of English prose (README.md).
  Batch text = one_row(128, mc.vocab_size);
  {
    std::ifstream f(std::string(LOOM_SOURCE_DIR) + "/README.md");
    const std::string readme((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const std::vector<int32_t> ids = model->tokenizer().encode(readme, false, false);
    EXPECT_GE(ids.size(), 129u);
    if (ids.size() < 129u) return errors;
    for (size_t t = 0; t < 128; ++t) {
      text.tokens[t] = ids[t];
      text.targets[t] = t + 1 < 128 ? ids[t + 1] : -100;
    }
  }
  for (const auto& [name, batch] : {std::pair<const char*, Batch>{"random tokens", one_row(128, mc.vocab_size)},
                                    {"README text", text}}) {
  const float scale = 1.0f / static_cast<float>(batch.target_tokens);
  // loss_scale: as the Trainer runs fp16 (GradScaler's initial 2^16), unscaled after.
  auto run = [&](TrainPrecision p, bool fused, double& loss, float loss_scale = 1.0f) {
    TrainSession s(mc, model->weights(), lora, *backend, BackwardMode::f16);
    s.set_precision(p);
    s.set_fused_lora(fused);
    lora.zero_grads();
    loss = s.forward_backward(batch, scale * loss_scale).loss_sum / static_cast<double>(batch.target_tokens);
    std::vector<float> g(lora.grads(), lora.grads() + lora.param_count());
    for (float& x : g) x *= 1.0f / loss_scale;
    return g;
  };
  double l32 = 0, l_unfused = 0;
  const std::vector<float> g32 = run(TrainPrecision::fp32, true, l32);
  const std::vector<float> g32u = run(TrainPrecision::fp32, false, l_unfused);
  EXPECT_EQ(l32, l_unfused);
  EXPECT_EQ(std::memcmp(g32.data(), g32u.data(), g32.size() * sizeof(float)), 0) << "fused != unfused";
  // Stated tolerances (|g - g_fp32| / |g_fp32|, L2), from the measured figures
  // (docs/training.md) with headroom: bf16 operands keep 8 significant bits
  // (2^-9 relative each), fp16 11 (2^-12); sums over the batch's tokens cancel
  // (dA = sum_t du_t x_t), which multiplies the relative error. On this model
  // fp16's gradient error is not the 8x below bf16's that its bits suggest
  // (the tiny model shows 20x), and it does not change with the loss scale:
  // not explained yet (docs/training.md). The base's backward is f16 (dy not
  // rounded) in all runs, so its rounding does not amplify the differences.
  for (const auto& [p, first_scale, tol, min_cosine] : cases) {
    double loss = 0;
    // As GradScaler would: halve the scale until the gradients are finite.
    float loss_scale = first_scale;
    std::vector<float> g = run(p, true, loss, loss_scale);
    while (!std::all_of(g.begin(), g.end(), [](float x) { return std::isfinite(x); }) && loss_scale > 1.0f)
      g = run(p, true, loss, loss_scale *= 0.5f);
    double diff = 0, norm = 0, dot = 0, norm_p = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      diff += (static_cast<double>(g[i]) - g32[i]) * (static_cast<double>(g[i]) - g32[i]);
      norm += static_cast<double>(g32[i]) * g32[i];
      norm_p += static_cast<double>(g[i]) * g[i];
      dot += static_cast<double>(g[i]) * g32[i];
    }
    const double rel = std::sqrt(diff / norm), cosine = dot / std::sqrt(norm * norm_p);
    errors.push_back(rel);
    std::printf("[ precision %s, loss scale %g ] %s, 128 tokens of %s, %lld LoRA gradients: |g - g_fp32| / "
                "|g_fp32| = %.2e, cosine %.8f; loss %.6f (fp32 %.6f)\n",
                train_precision_name(p), loss_scale, path.c_str() + path.rfind('/') + 1, name, static_cast<long long>(g.size()), rel, cosine, loss, l32);
    EXPECT_LT(rel, tol) << train_precision_name(p);
    EXPECT_GT(cosine, min_cosine) << train_precision_name(p);
    EXPECT_GT(rel, 0) << train_precision_name(p);
    EXPECT_LT(std::fabs(loss - l32), 1e-2 * l32) << train_precision_name(p);
  }
  }
  return errors;
}

// On the Q4_1 model the base products quantize their activations to 8 bits
// (q8_1), which makes the forward piecewise constant: any change of a LoRA
// operand flips some activation codes downstream, and those flips, not the
// operands' own rounding, dominate the difference (it grows like the square
// root of the perturbation: bf16's is sqrt(8) = 2.8x fp16's on random tokens,
// and rounding A alone to fp16 already gives 7e-2). Hence the loose tolerances
// here; the f16 base below shows the precisions' own error.
TEST(PrecisionDefaultModel, GradientErrorAgainstFp32) {
  if (!std::ifstream(kModel).good()) GTEST_SKIP() << kModel << " is missing: run scripts/fetch_model";
  const PrecisionCase cases[] = {{TrainPrecision::bf16, 1.0f, 0.2, 0.99},     // measured 1.3e-1 / 9.5e-2, cosine >= 0.9950
                                 {TrainPrecision::fp16, 65536.0f, 0.15, 0.995},  // measured 4.5e-2 / 8.2e-2, cosine >= 0.9965
                                 {TrainPrecision::fp16, 1.0f, 0.15, 0.995}};
  gradient_errors(kModel, cases);
}

// The same weights in f16: no activation quantization in the base, so the
// error is the precisions' own: bf16 ~3e-3, fp16 ~3.5e-4 (8x less, its 3 more
// bits), fp16 at loss scale 1 a little worse (small gradients fall into fp16's
// subnormals: what loss scaling is for).
TEST(PrecisionDefaultModel, GradientErrorAgainstFp32OnAnF16Base) {
  if (!std::ifstream(kF16).good()) GTEST_SKIP() << kF16 << " absent (scripts/make_gguf_variants)";
  const PrecisionCase cases[] = {{TrainPrecision::bf16, 1.0f, 6e-3, 0.99998},       // measured 3.0e-3 / 3.1e-3 (f16 base)
                                 {TrainPrecision::fp16, 65536.0f, 8e-4, 0.9999998},  // measured 3.2e-4 / 3.7e-4
                                 {TrainPrecision::fp16, 1.0f, 1e-3, 0.9999995}};     // measured 3.2e-4 / 4.8e-4
  const std::vector<double> e = gradient_errors(kF16, cases);
  ASSERT_EQ(e.size(), 6u);
  for (size_t row = 0; row < 2; ++row) EXPECT_LT(4 * e[row * 3 + 1], e[row * 3]) << "fp16 not 4x closer than bf16";
}

}  // namespace
}  // namespace loom

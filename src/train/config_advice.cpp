// The rules of config_advice.h. Each one is a short function returning its
// warning, if any; thresholds are set from the fine-tuning guide's
// troubleshooting list and loom's own arithmetic (comments say which).
#include "train/config_advice.h"

#include <cmath>
#include <optional>

#include "core/error.h"
#include "core/half.h"
#include "train/loss_scaler.h"

namespace loom {

namespace {

using Advice = std::optional<ConfigWarning>;

// fp16's smallest subnormal, 2^-24 = 5.96e-8: below it fp16 holds nothing but 0 and 2^-24.
const double kFp16SmallestSubnormal = std::ldexp(1.0, -24);

// The guide: "start at 8". Below it the adapter's update has too few
// directions for most tasks; the loss plateaus high and replies stay generic.
Advice lora_rank(const TrainConfig& c) {
  if (c.method != TrainMethod::lora || c.lora.r >= kAdviceMinLoraRank) return std::nullopt;
  return ConfigWarning{
      "lora.r", static_cast<double>(c.lora.r),
      fmt::format("lora.r {} is below {}: so few directions rarely hold a new task (the loss "
                  "stops falling early); start at lora.r: {} and raise it if the loss plateaus",
                  c.lora.r, kAdviceMinLoraRank, kAdviceMinLoraRank)};
}

// The guide's usual learning rates are 1e-4 to 2e-4 for LoRA and about 3e-5
// for full fine-tuning. Short runs on narrow tasks often go higher on
// purpose, so the warning starts well above them: 5x the top of LoRA's range
// (1e-3) and ~3x full fine-tuning's (1e-4), where steps large enough to undo
// the base model's knowledge (or diverge) are common.
Advice learning_rate(const TrainConfig& c, const char* key, double lr) {
  const bool lora = c.method == TrainMethod::lora;
  if (lr <= (lora ? kAdviceMaxLoraLr : kAdviceMaxFullLr)) return std::nullopt;
  return ConfigWarning{
      key, lr,
      fmt::format("{} {:.3g} is above {}: a learning rate this high is a common cause of a "
                  "fine-tune whose output is meaningless (or of a loss that diverges); try {}: {}",
                  key, lr,
                  lora ? "1e-3 (5x the top of LoRA's usual 1e-4 to 2e-4)"
                       : "1e-4 (~3x full fine-tuning's usual 3e-5)",
                  key, lora ? "2e-4" : "3e-5")};
}

// Clipping bounds the step a single bad batch can take; without it one
// outlier gradient can throw the weights far off. The guide recommends 1.0
// (also loom's default and transformers' Trainer's).
Advice clipping(const TrainConfig& c) {
  if (c.adam.max_grad_norm > 0) return std::nullopt;
  return ConfigWarning{
      "optim.max_grad_norm", c.adam.max_grad_norm,
      fmt::format("optim.max_grad_norm {:.3g} turns gradient clipping off: one outlier batch can "
                  "then throw the weights far off; use optim.max_grad_norm: 1.0",
                  c.adam.max_grad_norm)};
}

// The guide's fp16 NaNs come from eps = 1e-8 held in fp16, where it is 0
// (sqrt(v) + eps = 0). loom's AdamW adds eps in f32, where 1e-8 is exact, so
// that failure cannot happen here and 1e-8 does not warn. What fp16 bounds in
// loom is the gradient: the products hold it times the loss scale, so the
// smallest non-zero gradient they carry is 2^-24 / scale (9.1e-13 at the
// initial 2^16). An eps below that no longer damps the step of gradients at
// fp16's resolution: m / (sqrt(v) + eps) is then about the full learning rate
// for rounding noise.
Advice adam_eps_fp16(const TrainConfig& c) {
  if (c.precision != TrainPrecision::fp16) return std::nullopt;
  const double scale = LossScalerOptions{}.init_scale;
  const double smallest = kFp16SmallestSubnormal / scale;
  if (c.adam.eps >= smallest) return std::nullopt;
  return ConfigWarning{
      "optim.eps", c.adam.eps,
      fmt::format("optim.eps {:.3g} is below the smallest gradient fp16 products hold at the "
                  "initial loss scale {} ({:.3g} = 2^-24 / scale): AdamW's step m / (sqrt(v) + "
                  "eps) is then about the full learning rate for any gradient at fp16's "
                  "resolution, rounding noise included; use optim.eps: 1e-6 (or at least {:.3g})",
                  c.adam.eps, scale, smallest, smallest)};
}

// An RMSNorm eps below fp16's smallest subnormal (2^-24 = 5.96e-8) is 0 in
// fp16 (below 2^-25) or 2^-24 (up to 2x off): a norm computed in fp16 then
// divides by sqrt(mean(x^2)) alone, inf on an all-zero row. Between 2^-24 and
// fp16's smallest normal (6.1e-5) eps is subnormal but held within 3% for the
// usual 1e-6 (Qwen2) and 1e-5 (Llama, SmolLM2); warning there would fire on
// nearly every model for no effect. loom's own norms add eps in f32, so only a
// run that meets fp16 is asked about: precision fp16, or a full fine-tune
// written as f16 (output_dtype), which runtimes may run with fp16 norms.
Advice norm_eps_fp16(const TrainConfig& c, const ModelConfig& m) {
  const bool f16_output = c.method == TrainMethod::full && c.output_dtype == safetensors::StDType::f16;
  if ((c.precision != TrainPrecision::fp16 && !f16_output) || m.rms_eps >= kFp16SmallestSubnormal)
    return std::nullopt;
  const float held = fp16_to_fp32(fp32_to_fp16(static_cast<float>(m.rms_eps)));
  return ConfigWarning{
      "model", m.rms_eps,
      fmt::format("model: its RMSNorm eps (rms_norm_eps) {:.3g} is below fp16's smallest "
                  "subnormal 5.96e-8 and is {:.3g} in fp16 ({}): loom's norms add it in f32, so "
                  "this run is not affected, but where the model runs with fp16 norms they divide "
                  "by zero on an all-zero row; use a model with rms_norm_eps 1e-6 or 1e-5, or {}: "
                  "bf16 (f32's range)",
                  m.rms_eps, held, f16_output ? "output_dtype: f16" : "precision: fp16",
                  f16_output ? "output_dtype" : "precision")};
}

// A sample longer than data.seq_len loses its end, with its end-of-turn
// token: a few long outliers cost little, but when more than one sample in
// ten is cut a noticeable part of the data teaches replies that never end.
Advice truncation(const TrainConfig& c, const DataStats& s) {
  const int64_t read = s.samples + s.dropped;
  if (read == 0) return std::nullopt;
  const double share = static_cast<double>(s.truncated) / static_cast<double>(read);
  if (share <= kAdviceMaxTruncatedShare) return std::nullopt;
  return ConfigWarning{
      "data.seq_len", static_cast<double>(c.seq_len),
      fmt::format("data.seq_len {} cuts {} of the {} samples read ({:.0f}%, more than {:.0f}%): "
                  "their ends, end-of-turn tokens included, are never learnt; raise data.seq_len "
                  "(at most the model's context) or shorten the samples",
                  c.seq_len, s.truncated, read, 100 * share, 100 * kAdviceMaxTruncatedShare)};
}

}  // namespace

std::vector<ConfigWarning> advise_config(const TrainConfig& c, const ModelConfig& model) {
  std::vector<ConfigWarning> out;
  const auto add = [&](Advice a) {
    if (a) out.push_back(std::move(*a));
  };
  add(lora_rank(c));
  add(learning_rate(c, "optim.lr", c.lr));
  if (c.mlp_lr) add(learning_rate(c, "optim.mlp_lr", *c.mlp_lr));
  add(clipping(c));
  add(adam_eps_fp16(c));
  add(norm_eps_fp16(c, model));
  return out;
}

std::vector<ConfigWarning> advise_data(const TrainConfig& c, const DataStats& train) {
  std::vector<ConfigWarning> out;
  if (Advice a = truncation(c, train)) out.push_back(std::move(*a));
  return out;
}

}  // namespace loom

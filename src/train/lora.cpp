// LoRA configuration, arena layout and PEFT-compatible initialization.
#include "train/lora.h"

#include "train/peft_adapter.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace loom {
namespace {

constexpr const char* kPeftNames[kLoraTargetCount] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"};
constexpr const char* kShortNames[kLoraTargetCount] = {"q", "k", "v", "o", "gate", "up", "down"};

// (in, out) of a target's base linear layer.
std::pair<int64_t, int64_t> target_shape(const ModelConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::q:
      return {c.hidden, c.q_dim()};
    case LoraTarget::k:
    case LoraTarget::v:
      return {c.hidden, c.kv_dim()};
    case LoraTarget::o:
      return {c.q_dim(), c.hidden};
    case LoraTarget::gate:
    case LoraTarget::up:
      return {c.hidden, c.intermediate};
    case LoraTarget::down:
      return {c.intermediate, c.hidden};
  }
  LOOM_ASSERT(false);
  return {0, 0};
}

}  // namespace

const char* lora_target_peft_name(LoraTarget t) { return kPeftNames[static_cast<int>(t)]; }

std::optional<LoraTarget> lora_target_from_name(std::string_view name) {
  for (int i = 0; i < kLoraTargetCount; ++i)
    if (name == kPeftNames[i] || name == kShortNames[i]) return static_cast<LoraTarget>(i);
  return std::nullopt;
}

double LoraConfig::scale() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

void LoraConfig::set_targets(std::span<const std::string> names) {
  if (names.empty()) fail(ErrorKind::invalid_input, "lora target_modules: the list is empty");
  targets.fill(false);
  for (const std::string& n : names) {
    const auto t = lora_target_from_name(n);
    if (!t)
      fail(ErrorKind::invalid_input,
           "lora target_modules: unknown module '{}' (expected q, k, v, o, gate, up, down or their *_proj "
           "names)",
           n);
    targets[static_cast<size_t>(*t)] = true;
  }
}

void LoraConfig::validate() const {
  if (r < 1) fail(ErrorKind::invalid_input, "lora r: must be >= 1, got {}", r);
  if (!(alpha > 0)) fail(ErrorKind::invalid_input, "lora alpha: must be > 0, got {}", alpha);
  if (!(dropout >= 0 && dropout < 1))
    fail(ErrorKind::invalid_input, "lora dropout: must be in [0, 1), got {}", dropout);
  bool any = false;
  for (bool b : targets) any = any || b;
  if (!any) fail(ErrorKind::invalid_input, "lora target_modules: no module selected");
}

LoraModel::LoraModel(const ModelConfig& model, const LoraConfig& config)
    : config_(config), scale_(static_cast<float>(config.scale())), n_layers_(model.n_layers) {
  config_.validate();
  const int64_t r = config_.r;
  slots_.resize(static_cast<size_t>(n_layers_ * kLoraTargetCount));
  size_t total = 0;
  for (int64_t l = 0; l < n_layers_; ++l)
    for (int t = 0; t < kLoraTargetCount; ++t) {
      if (!config_.targets[static_cast<size_t>(t)]) continue;
      LoraSlot& s = slots_[static_cast<size_t>(l * kLoraTargetCount + t)];
      std::tie(s.in, s.out) = target_shape(model, static_cast<LoraTarget>(t));
      s.active = true;
      s.a_offset = total;
      total += static_cast<size_t>(r * s.in);
      s.b_offset = total;
      total += static_cast<size_t>(s.out * r);
    }
  params_.assign(total, 0.0f);
  grads_.assign(total, 0.0f);
  // PEFT: kaiming_uniform_(A, a=sqrt(5)) => U(-1/sqrt(in), 1/sqrt(in)); B = 0.
  // One counter stream per slot, so adding a target does not change the others.
  for (size_t i = 0; i < slots_.size(); ++i) {
    const LoraSlot& s = slots_[i];
    if (!s.active) continue;
    CounterRng rng(config_.seed ^ splitmix64(0x4c6f5241ull + i));
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.in));
    float* a = params_.data() + s.a_offset;
    for (int64_t j = 0; j < r * s.in; ++j) a[j] = static_cast<float>((2 * rng.next_double() - 1) * bound);
  }
}

void LoraModel::zero_grads() { std::memset(grads_.data(), 0, grads_.size() * sizeof(float)); }

const LoraSlot& LoraModel::slot(int64_t layer, LoraTarget t) const {
  LOOM_ASSERT(layer >= 0 && layer < n_layers_);
  return slots_[static_cast<size_t>(layer * kLoraTargetCount + static_cast<int64_t>(t))];
}

Tensor LoraModel::view(std::vector<float>& arena, int64_t layer, LoraTarget t, bool is_a) {
  const LoraSlot& s = slot(layer, t);
  LOOM_ASSERT(s.active);
  if (is_a) return make_tensor(arena.data() + s.a_offset, DType::f32, {config_.r, s.in});
  return make_tensor(arena.data() + s.b_offset, DType::f32, {s.out, config_.r});
}

void lora_permute_qk_rows(Tensor B, int64_t n_heads, int64_t head_dim, bool hf_to_model) {
  LOOM_ASSERT(B.dtype == DType::f32 && B.ndim == 2 && B.dim(0) == n_heads * head_dim && head_dim % 2 == 0);
  const int64_t r = B.dim(1), half = head_dim / 2;
  std::vector<float> head(static_cast<size_t>(head_dim * r));
  for (int64_t h = 0; h < n_heads; ++h) {
    float* rows = B.as<float>() + h * head_dim * r;
    std::memcpy(head.data(), rows, head.size() * sizeof(float));
    for (int64_t j = 0; j < half; ++j)
      for (int64_t s = 0; s < 2; ++s) {
        const int64_t hf = s * half + j, model = 2 * j + s;
        const int64_t dst = hf_to_model ? model : hf, src = hf_to_model ? hf : model;
        std::memcpy(rows + dst * r, head.data() + src * r, static_cast<size_t>(r) * sizeof(float));
      }
  }
}

void lora_permute_qk_rows(LoraModel& lora, float* arena, const ModelConfig& model, bool hf_to_model) {
  LOOM_ASSERT(arena == lora.params() || arena == lora.grads());
  if (!lora_needs_qk_permutation(model)) return;
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : {LoraTarget::q, LoraTarget::k}) {
      const LoraSlot& s = lora.slot(l, t);
      if (!s.active) continue;
      const Tensor B = make_tensor(arena + s.b_offset, DType::f32, {s.out, lora.config().r});
      lora_permute_qk_rows(B, t == LoraTarget::q ? model.n_heads : model.n_kv_heads, model.head_dim,
                           hf_to_model);
    }
}

std::string LoraModel::peft_name(int64_t layer, LoraTarget t, bool is_a) {
  return peft::tensor_name(static_cast<int>(layer), t, /*lora_b=*/!is_a);
}

}  // namespace loom

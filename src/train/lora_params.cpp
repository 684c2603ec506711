// LoRA arena layout and PEFT-compatible initialization.
#include "train/lora_params.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"
#include "model/peft_adapter.h"

namespace loom {

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
      s.in = lora_target_in(model, static_cast<LoraTarget>(t));
      s.out = lora_target_out(model, static_cast<LoraTarget>(t));
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

std::string LoraModel::tensor_at(size_t offset) const {
  const auto r = static_cast<size_t>(config_.r);
  for (int64_t l = 0; l < n_layers_; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot& s = slot(l, t);
      if (!s.active) continue;
      const bool in_a = offset >= s.a_offset && offset - s.a_offset < r * static_cast<size_t>(s.in);
      const bool in_b = offset >= s.b_offset && offset - s.b_offset < static_cast<size_t>(s.out) * r;
      if (!in_a && !in_b) continue;
      std::string name = peft_name(l, t, in_a);
      constexpr std::string_view kPrefix = "base_model.model.model.", kSuffix = ".weight";
      if (name.starts_with(kPrefix)) name.erase(0, kPrefix.size());
      if (name.ends_with(kSuffix)) name.erase(name.size() - kSuffix.size());
      return name;
    }
  return "";
}

}  // namespace loom

// The trainable LoRA parameters: the A/B matrices of every (layer, target) in
// one contiguous f32 arena, and their gradients in a second arena of the same
// layout (zeroing is one memset). Only training owns gradients, so this stays
// in train/; the targets, config and shapes are model/lora.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/lora.h"

namespace loom {

// Where one adapter's matrices sit in the arenas. A is [r, in] and B is [out, r]
// (PEFT's lora_A.weight / lora_B.weight shapes): y += scale * B (A x).
struct LoraSlot {
  bool active = false;
  int64_t in = 0, out = 0;
  size_t a_offset = 0, b_offset = 0;  // in floats, into params() and grads()
};

class LoraModel {
 public:
  // Lays out the arenas for `model` (every layer, every targeted module) and
  // initializes: A Kaiming-uniform as PEFT (bound 1/sqrt(in)), seeded; B zero.
  LoraModel(const ModelConfig& model, const LoraConfig& config);

  const LoraConfig& config() const { return config_; }
  float scale() const { return scale_; }
  int64_t n_layers() const { return n_layers_; }
  int64_t param_count() const { return static_cast<int64_t>(params_.size()); }

  float* params() { return params_.data(); }
  const float* params() const { return params_.data(); }
  float* grads() { return grads_.data(); }
  const float* grads() const { return grads_.data(); }
  void zero_grads();

  const LoraSlot& slot(int64_t layer, LoraTarget t) const;
  // f32 views of A [r, in] and B [out, r] (and their gradients) of an active slot.
  Tensor a(int64_t layer, LoraTarget t) { return view(params_, layer, t, true); }
  Tensor b(int64_t layer, LoraTarget t) { return view(params_, layer, t, false); }
  Tensor grad_a(int64_t layer, LoraTarget t) { return view(grads_, layer, t, true); }
  Tensor grad_b(int64_t layer, LoraTarget t) { return view(grads_, layer, t, false); }

  // PEFT's tensor name, e.g. "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
  static std::string peft_name(int64_t layer, LoraTarget t, bool is_a);
  // The adapter matrix holding arena element `offset`, PEFT's name without its
  // prefix and suffix: "layers.3.self_attn.q_proj.lora_B"; "" when none does.
  std::string tensor_at(size_t offset) const;

 private:
  Tensor view(std::vector<float>& arena, int64_t layer, LoraTarget t, bool is_a);

  LoraConfig config_;
  float scale_ = 1;
  int64_t n_layers_ = 0;
  std::vector<LoraSlot> slots_;  // [layer * kLoraTargetCount + target]
  std::vector<float> params_, grads_;
};

// Applies lora_permute_qk_rows to every active q/k B of `arena` (lora.params() or
// lora.grads()); a no-op for models that do not need it.
void lora_permute_qk_rows(LoraModel& lora, float* arena, const ModelConfig& model, bool hf_to_model);

}  // namespace loom

// LoRA adapters of a Llama-family decoder: configuration, the trainable A/B
// matrices of every (layer, target) in one contiguous f32 arena, and their
// gradients in a second arena of the same layout (zeroing is one memset).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace loom {

// The seven linear layers of a decoder layer that can carry an adapter.
enum class LoraTarget { q, k, v, o, gate, up, down };
inline constexpr int kLoraTargetCount = 7;
inline constexpr LoraTarget kAllLoraTargets[] = {LoraTarget::q,    LoraTarget::k,  LoraTarget::v,   LoraTarget::o,
                                                 LoraTarget::gate, LoraTarget::up, LoraTarget::down};
// q/k/v/o live under self_attn, the others under mlp.
inline bool lora_target_is_attention(LoraTarget t) { return static_cast<int>(t) < 4; }

// "q_proj", ..., "down_proj" (PEFT / Hugging Face module names).
const char* lora_target_peft_name(LoraTarget t);
// Accepts "q" and "q_proj" (and likewise for the others); nullopt otherwise.
std::optional<LoraTarget> lora_target_from_name(std::string_view name);

struct LoraConfig {
  int64_t r = 8;
  double alpha = 16;
  // Inverted dropout on each adapter's input (PEFT lora_dropout); 0 disables it.
  double dropout = 0;
  std::array<bool, kLoraTargetCount> targets{true, true, true, true, true, true, true};
  bool use_rslora = false;  // scale alpha / sqrt(r) instead of alpha / r
  uint64_t seed = 0;        // initialization of A (and the dropout masks)

  double scale() const;
  bool targets_module(LoraTarget t) const { return targets[static_cast<size_t>(t)]; }
  // Sets `targets` from names ("q", "q_proj", ...). Throws invalid_input naming
  // an unknown module, or for an empty list.
  void set_targets(std::span<const std::string> names);
  // Throws invalid_input for r < 1, alpha <= 0, dropout outside [0, 1), no target.
  void validate() const;
};

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

 private:
  Tensor view(std::vector<float>& arena, int64_t layer, LoraTarget t, bool is_a);

  LoraConfig config_;
  float scale_ = 1;
  int64_t n_layers_ = 0;
  std::vector<LoraSlot> slots_;  // [layer * kLoraTargetCount + target]
  std::vector<float> params_, grads_;
};

// Models with RopeLayout::interleaved (llama from GGUF) store the q and k rows of
// each head permuted (HF row j -> 2j, row j + d/2 -> 2j + 1) so that RoPE pairs
// are adjacent. A LoRA B of q or k acts on those rows, so PEFT adapters (HF row
// order) must be permuted the same way on load and back on save. A is unchanged.
// Permutes B [n_heads * head_dim, r] in place: HF -> model order, or back.
void lora_permute_qk_rows(Tensor B, int64_t n_heads, int64_t head_dim, bool hf_to_model);
// Whether `model` needs it: true for RopeLayout::interleaved.
inline bool lora_needs_qk_permutation(const ModelConfig& model) {
  return model.rope_layout == RopeLayout::interleaved;
}
// Applies lora_permute_qk_rows to every active q/k B of `arena` (lora.params() or
// lora.grads()); a no-op for models that do not need it.
void lora_permute_qk_rows(LoraModel& lora, float* arena, const ModelConfig& model, bool hf_to_model);

}  // namespace loom

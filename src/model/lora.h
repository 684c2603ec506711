// LoRA adapters of a Llama-family decoder as inference, serving and training
// all see them: the seven targets and their names, the configuration, the
// shapes, and the q/k row order of RoPE-interleaved models. The trainable arena
// (LoraModel) is train/'s (train/lora_params.h).
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
// "self_attn.q_proj", ..., "mlp.down_proj": the module under "model.layers.N.".
std::string lora_target_hf_module(LoraTarget t);
// "attn_q", ..., "ffn_down": llama.cpp's GGUF name, between "blk.N." and ".weight".
const char* lora_target_gguf_name(LoraTarget t);
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

// The input and output widths of a target's linear layer (A is [r, in], B [out, r]).
int64_t lora_target_in(const ModelConfig& c, LoraTarget t);
int64_t lora_target_out(const ModelConfig& c, LoraTarget t);

// Models with RopeLayout::interleaved (llama from GGUF) store the q and k rows of
// each head permuted (HF row j -> 2j, row j + d/2 -> 2j + 1) so that RoPE pairs
// are adjacent. A LoRA B of q or k acts on those rows, so PEFT adapters (HF row
// order) must be permuted the same way on load and back on save. A is unchanged.
// Permutes B [n_heads * head_dim, cols] in place: HF -> model order, or back
// (also whole q/k weight matrices and biases, cols = in or 1).
void lora_permute_qk_rows(Tensor B, int64_t n_heads, int64_t head_dim, bool hf_to_model);
// Whether `model` needs it: true for RopeLayout::interleaved.
inline bool lora_needs_qk_permutation(const ModelConfig& model) {
  return model.rope_layout == RopeLayout::interleaved;
}
}  // namespace loom

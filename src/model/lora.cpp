// LoRA targets, configuration, shapes and the q/k row permutation.
#include "model/lora.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"

namespace loom {
namespace {

constexpr const char* kPeftNames[kLoraTargetCount] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"};
constexpr const char* kShortNames[kLoraTargetCount] = {"q", "k", "v", "o", "gate", "up", "down"};
constexpr const char* kGgufNames[kLoraTargetCount] = {"attn_q",   "attn_k", "attn_v",  "attn_output",
                                                      "ffn_gate", "ffn_up", "ffn_down"};

}  // namespace

const char* lora_target_peft_name(LoraTarget t) { return kPeftNames[static_cast<int>(t)]; }

std::string lora_target_hf_module(LoraTarget t) {
  return std::string(lora_target_is_attention(t) ? "self_attn." : "mlp.") + lora_target_peft_name(t);
}

const char* lora_target_gguf_name(LoraTarget t) { return kGgufNames[static_cast<int>(t)]; }

int64_t lora_target_in(const ModelConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::o:
      return c.q_dim();
    case LoraTarget::down:
      return c.intermediate;
    default:
      return c.hidden;
  }
}

int64_t lora_target_out(const ModelConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::q:
      return c.q_dim();
    case LoraTarget::k:
    case LoraTarget::v:
      return c.kv_dim();
    case LoraTarget::gate:
    case LoraTarget::up:
      return c.intermediate;
    default:
      return c.hidden;
  }
}

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

}  // namespace loom

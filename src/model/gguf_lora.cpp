#include "model/gguf_lora.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "io/gguf.h"
#include "kernels/cpu/dequant.h"
#include "model/lora.h"

namespace loom::peft {

namespace {

// "blk.12.attn_q.weight.lora_a" -> layer 12, q, A. nullopt for any other name.
struct GgufLoraName {
  int layer;
  LoraTarget target;
  bool lora_b;
};

std::optional<GgufLoraName> parse_gguf_lora_name(const std::string& name) {
  constexpr std::string_view kBlk = "blk.", kA = ".weight.lora_a", kB = ".weight.lora_b";
  if (name.rfind(kBlk, 0) != 0) return std::nullopt;
  const bool b = name.ends_with(kB);
  if (!b && !name.ends_with(kA)) return std::nullopt;
  const std::string mid = name.substr(kBlk.size(), name.size() - kBlk.size() - kA.size());  // "12.attn_q"
  const size_t dot = mid.find('.');
  if (dot == 0 || dot == std::string::npos || dot > 6) return std::nullopt;
  const std::string digits = mid.substr(0, dot), proj = mid.substr(dot + 1);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  for (LoraTarget t : kAllLoraTargets)
    if (proj == lora_target_gguf_name(t)) return GgufLoraName{std::stoi(digits), t, b};
  return std::nullopt;
}

// The tensor's values as f32 (any type loom reads), checked finite.
std::vector<float> f32_values(const gguf::TensorInfo& t, const std::string& path) {
  const Tensor v = t.view();
  std::vector<float> out(static_cast<size_t>(v.numel()));
  dequantize_row(t.dtype, t.data, out.data(), v.numel());
  for (size_t i = 0; i < out.size(); ++i)
    if (!std::isfinite(out[i]))
      fail(ErrorKind::invalid_input, "{}: tensor '{}' holds a value that is not finite (at {})", path, t.name,
           i);
  return out;
}

}  // namespace

AdapterTensors read_gguf_lora(const std::string& path, const ModelConfig& base) {
  const auto f = gguf::File::open(path);
  const std::string type = f->opt_string("general.type").value_or("");
  if (type != "adapter")
    fail(ErrorKind::invalid_input, "{}: a GGUF {} (general.type '{}'), not a LoRA adapter", path,
         type.empty() || type == "model" ? "model" : "file", type.empty() ? "model" : type);
  const std::string kind = f->opt_string("adapter.type").value_or("");
  if (kind != "lora")
    fail(ErrorKind::unsupported, "{}: adapter.type '{}'; loom reads LoRA adapters ('lora')", path, kind);
  const std::string arch = f->opt_string("general.architecture").value_or("");
  if (arch != arch_name(base.arch))
    fail(ErrorKind::invalid_input, "{}: an adapter for architecture '{}', the model is '{}'", path, arch,
         arch_name(base.arch));

  std::map<std::pair<int, LoraTarget>, std::pair<const gguf::TensorInfo*, const gguf::TensorInfo*>> found;
  for (const auto& t : f->tensors()) {
    const auto n = parse_gguf_lora_name(t.name);
    if (!n)
      fail(ErrorKind::unsupported,
           "{}: tensor '{}': loom reads the LoRA A/B of the seven projections of each "
           "layer (blk.N.attn_q.weight.lora_a, ...)",
           path, t.name);
    if (t.ndim != 2) fail(ErrorKind::invalid_input, "{}: tensor '{}' is not a matrix", path, t.name);
    auto& slot = found[{n->layer, n->target}];
    (n->lora_b ? slot.second : slot.first) = &t;
  }
  if (found.empty()) fail(ErrorKind::invalid_input, "{}: no LoRA tensors", path);

  AdapterTensors out;
  AdapterConfig& c = out.config;
  c.r = static_cast<int>(found.begin()->second.first ? found.begin()->second.first->shape[0] : 0);
  std::set<LoraTarget> targets;
  std::set<int> layers;
  for (const auto& [key, ab] : found) {
    const auto [layer, target] = key;
    const std::string name = fmt::format("blk.{}.{}.weight", layer, lora_target_gguf_name(target));
    if (ab.first == nullptr || ab.second == nullptr)
      fail(ErrorKind::invalid_input, "{}: '{}' has {} but no {}", path, name, ab.first ? "lora_a" : "lora_b",
           ab.first ? "lora_b" : "lora_a");
    const gguf::TensorInfo &a = *ab.first, &b = *ab.second;
    if (a.shape[0] != c.r || b.shape[1] != c.r)
      fail(ErrorKind::unsupported,
           "{}: '{}' has rank {} (A) and {} (B), other tensors {}: loom reads one rank "
           "per adapter",
           path, name, a.shape[0], b.shape[1], c.r);
    LoraPair p;
    p.in = a.shape[1];
    p.out = b.shape[0];
    p.a = f32_values(a, path);
    p.b = f32_values(b, path);
    const int64_t heads = target == LoraTarget::q   ? base.n_heads
                          : target == LoraTarget::k ? base.n_kv_heads
                                                    : 0;
    if (heads > 0 && lora_needs_qk_permutation(base)) {  // GGUF's RoPE row order back to Hugging Face's
      if (p.out != heads * base.head_dim)
        fail(ErrorKind::invalid_input, "{}: '{}' B has {} rows, the model's projection {}", path, name, p.out,
             heads * base.head_dim);
      lora_permute_qk_rows(make_tensor(p.b.data(), DType::f32, {p.out, static_cast<int64_t>(c.r)}), heads,
                           base.head_dim, /*hf_to_model=*/false);
    }
    out.pairs.emplace(key, std::move(p));
    targets.insert(target);
    layers.insert(layer);
  }
  const double alpha = f->opt_float("adapter.lora.alpha").value_or(0.0);
  c.lora_alpha = alpha > 0 ? alpha : c.r;  // llama.cpp: alpha 0 scales B A by 1
  for (LoraTarget t : kAllLoraTargets)
    if (targets.count(t)) c.target_modules.push_back(t);
  const bool every_layer = static_cast<int64_t>(layers.size()) == base.n_layers && *layers.begin() == 0 &&
                           *layers.rbegin() == base.n_layers - 1;
  if (!every_layer) c.layers_to_transform.assign(layers.begin(), layers.end());
  c.base_model_name_or_path = f->opt_string("general.base_model.0.name").value_or("");
  check_adapter_fits(out, base, path);
  return out;
}

AdapterTensors read_any_adapter(const std::string& path, const ModelConfig& base, bool map_f32) {
  return gguf::is_gguf_file(path) ? read_gguf_lora(path, base) : read_adapter(path, map_f32);
}

}  // namespace loom::peft

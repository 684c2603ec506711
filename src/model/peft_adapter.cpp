// PEFT adapter folders (see peft_adapter.h). The config is checked field by
// field against what loom's LoRA implements; anything that would change the
// math silently (DoRA, fan_in_fan_out, per-layer ranks, ...) is refused.
#include "model/peft_adapter.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/finite_scan.h"
#include "core/half.h"
#include "core/mapped_file.h"
#include "io/file_write.h"
#include "io/safetensors_writer.h"
#include "model/config.h"

namespace loom::peft {
namespace {

constexpr std::string_view kPrefix = "base_model.model.model.layers.";

// Parses "<layer>.<self_attn|mlp>.<target>.lora_<A|B>.weight" after the prefix.
struct ParsedName {
  int layer;
  LoraTarget target;
  bool lora_b;
};
std::optional<ParsedName> parse_tensor_name(std::string_view name) {
  if (!name.starts_with(kPrefix)) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  int layer = -1;
  const auto [ptr, ec] = std::from_chars(name.data(), name.data() + name.size(), layer);
  if (ec != std::errc() || layer < 0 || ptr == name.data() || (name[0] == '0' && ptr - name.data() > 1))
    return std::nullopt;
  name.remove_prefix(static_cast<size_t>(ptr - name.data()));
  for (LoraTarget t : kAllLoraTargets)
    for (bool b : {false, true})
      if (name == tensor_name(layer, t, b).substr(tensor_name(layer, t, b).find('.', kPrefix.size())))
        return ParsedName{layer, t, b};
  return std::nullopt;
}

[[noreturn]] void unsupported_field(const std::string& file, std::string_view field, const nlohmann::json& v,
                                    std::string_view why) {
  fail(ErrorKind::unsupported, "{}: field '{}' = {} is not supported ({})", file, field, v.dump(), why);
}

// A field that must be absent, null, false, or an empty container.
void require_unset(const std::string& file, const nlohmann::json& cfg, std::string_view field,
                   std::string_view why) {
  const auto it = cfg.find(field);
  if (it == cfg.end() || it->is_null()) return;
  if (it->is_boolean() && !it->get<bool>()) return;
  if ((it->is_object() || it->is_array()) && it->empty()) return;
  unsupported_field(file, field, *it, why);
}

// PEFT's layers_to_transform: an index or a list of indices (null: every layer).
// layers_pattern names the module list holding the layers; Llama-family models
// have one, "layers", so only that (or nothing) is accepted.
std::vector<int> parse_layers_to_transform(const std::string& file, const nlohmann::json& cfg) {
  if (const auto lp = cfg.find("layers_pattern"); lp != cfg.end() && !lp->is_null()) {
    const bool layers = (lp->is_string() && (*lp == "layers" || *lp == "")) ||
                        (lp->is_array() && (lp->empty() || (lp->size() == 1 && (*lp)[0] == "layers")));
    if (!layers) unsupported_field(file, "layers_pattern", *lp, "Llama-family layers are in \"layers\"");
  }
  const auto lt = cfg.find("layers_to_transform");
  if (lt == cfg.end() || lt->is_null()) return {};
  const nlohmann::json list = lt->is_array() ? *lt : nlohmann::json::array({*lt});
  std::set<int> layers;
  for (const auto& v : list) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 100000)
      fail(ErrorKind::invalid_input, "{}: field 'layers_to_transform' must be a layer index or a list of them, got {}",
           file, lt->dump());
    layers.insert(v.get<int>());
  }
  if (layers.empty())
    fail(ErrorKind::invalid_input, "{}: field 'layers_to_transform' is an empty list (no layer would be adapted)", file);
  return {layers.begin(), layers.end()};
}

AdapterConfig parse_config(const std::string& file, const nlohmann::json& cfg) {
  if (!cfg.is_object()) fail(ErrorKind::invalid_input, "{}: not a JSON object", file);
  AdapterConfig c;
  const auto str_field = [&](std::string_view k) -> std::string {
    const auto it = cfg.find(k);
    if (it == cfg.end()) fail(ErrorKind::invalid_input, "{}: missing field '{}'", file, k);
    if (!it->is_string()) fail(ErrorKind::invalid_input, "{}: field '{}' must be a string, got {}", file, k, it->dump());
    return it->get<std::string>();
  };
  const std::string type = str_field("peft_type");
  if (type != "LORA") unsupported_field(file, "peft_type", type, "loom reads LORA adapters only");
  const auto r = cfg.find("r");
  if (r == cfg.end() || !r->is_number_integer() || r->get<int64_t>() < 1 || r->get<int64_t>() > 65536)
    fail(ErrorKind::invalid_input, "{}: field 'r' must be a positive integer, got {}", file,
         r == cfg.end() ? "nothing" : r->dump());
  c.r = r->get<int>();
  const auto alpha = cfg.find("lora_alpha");
  if (alpha == cfg.end() || !alpha->is_number() || !(alpha->get<double>() > 0))
    fail(ErrorKind::invalid_input, "{}: field 'lora_alpha' must be a positive number, got {}", file,
         alpha == cfg.end() ? "nothing" : alpha->dump());
  c.lora_alpha = alpha->get<double>();
  if (const auto d = cfg.find("lora_dropout"); d != cfg.end() && !d->is_null()) {
    if (!d->is_number() || d->get<double>() < 0 || d->get<double>() >= 1)
      fail(ErrorKind::invalid_input, "{}: field 'lora_dropout' must be in [0, 1), got {}", file, d->dump());
    c.lora_dropout = d->get<double>();
  }
  if (const auto rs = cfg.find("use_rslora"); rs != cfg.end() && !rs->is_null()) {
    if (!rs->is_boolean()) fail(ErrorKind::invalid_input, "{}: field 'use_rslora' must be a boolean", file);
    c.use_rslora = rs->get<bool>();
  }
  if (const auto b = cfg.find("base_model_name_or_path"); b != cfg.end() && b->is_string())
    c.base_model_name_or_path = b->get<std::string>();
  if (const auto v = cfg.find("peft_version"); v != cfg.end() && v->is_string()) c.peft_version = v->get<std::string>();
  if (const auto b = cfg.find("bias"); b != cfg.end() && !b->is_null() && *b != "none")
    unsupported_field(file, "bias", *b, "only bias \"none\"");
  require_unset(file, cfg, "use_dora", "DoRA");
  require_unset(file, cfg, "fan_in_fan_out", "transposed (Conv1D) weights");
  c.layers_to_transform = parse_layers_to_transform(file, cfg);
  require_unset(file, cfg, "rank_pattern", "one rank for every layer");
  require_unset(file, cfg, "alpha_pattern", "one alpha for every layer");
  require_unset(file, cfg, "modules_to_save", "fully trained extra modules");
  require_unset(file, cfg, "lora_bias", "LoRA B biases");
  require_unset(file, cfg, "use_qalora", "QALoRA");
  require_unset(file, cfg, "layer_replication", "layer replication");
  require_unset(file, cfg, "target_parameters", "parameter targeting");
  require_unset(file, cfg, "trainable_token_indices", "trainable tokens");
  require_unset(file, cfg, "use_bdlora", "BD-LoRA");
  const auto tm = cfg.find("target_modules");
  if (tm == cfg.end() || !tm->is_array() || tm->empty())
    fail(tm != cfg.end() && tm->is_string() ? ErrorKind::unsupported : ErrorKind::invalid_input,
         "{}: field 'target_modules' must be a non-empty list of module names, got {}", file,
         tm == cfg.end() ? "nothing" : tm->dump());
  std::set<LoraTarget> seen;
  for (const auto& m : *tm) {
    auto t = m.is_string() ? lora_target_from_name(m.get<std::string>()) : std::nullopt;
    if (t && m.get<std::string>() != lora_target_peft_name(*t)) t = std::nullopt;  // PEFT spells q_proj, ...
    if (!t)
      fail(ErrorKind::unsupported, "{}: field 'target_modules': {} is not one of q_proj, k_proj, v_proj, o_proj, "
           "gate_proj, up_proj, down_proj", file, m.dump());
    seen.insert(*t);
  }
  for (LoraTarget t : kAllLoraTargets)
    if (seen.count(t)) c.target_modules.push_back(t);
  return c;
}

// The layers that have tensors must be exactly layers_to_transform, or 0..n-1
// when the adapter adapts every layer.
void check_adapted_layers(const AdapterConfig& c, const std::set<int>& layers, const std::string& st_path,
                          const std::string& cfg_path, int n_layers) {
  if (c.layers_to_transform.empty()) {
    if (static_cast<int>(layers.size()) != n_layers)
      fail(ErrorKind::invalid_input, "{}: layers are not numbered 0..{} (found {} layers) and {} has no "
           "layers_to_transform", st_path, n_layers - 1, layers.size(), cfg_path);
    return;
  }
  for (int layer : layers)
    if (!std::binary_search(c.layers_to_transform.begin(), c.layers_to_transform.end(), layer))
      fail(ErrorKind::invalid_input, "{}: has tensors for layer {}, which is not in layers_to_transform of {}",
           st_path, layer, cfg_path);
  for (int layer : c.layers_to_transform)
    if (!layers.count(layer))
      fail(ErrorKind::invalid_input, "{}: no tensors for layer {}, which layers_to_transform of {} lists", st_path,
           layer, cfg_path);
}

std::vector<float> to_f32(const safetensors::TensorInfo& info) {
  std::vector<float> out(static_cast<size_t>(info.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (info.st_dtype == safetensors::StDType::f32) {
      std::memcpy(&out[i], info.data + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, info.data + 2 * i, 2);
      out[i] = info.st_dtype == safetensors::StDType::f16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
    }
  }
  return out;
}

void check_finite(const std::string& file, const std::string& tensor, const float* v, size_t n) {
  if (const int64_t i = scan_finite(v, static_cast<int64_t>(n)).first_non_finite; i >= 0)
    fail(ErrorKind::invalid_input, "{}: tensor '{}' has the non-finite value {} at element {}", file, tensor,
         v[i], i);
}

}  // namespace

std::string tensor_name(int layer, LoraTarget t, bool lora_b) {
  return fmt::format("{}{}.{}.{}.lora_{}.weight", kPrefix, layer, lora_target_is_attention(t) ? "self_attn" : "mlp",
                     lora_target_peft_name(t), lora_b ? 'B' : 'A');
}

double AdapterConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / r;
}

const LoraPair* AdapterTensors::find(int layer, LoraTarget t) const {
  const auto it = pairs.find({layer, t});
  return it == pairs.end() ? nullptr : &it->second;
}

int AdapterTensors::n_layers() const {
  int n = 0;
  for (const auto& [key, pair] : pairs) n = std::max(n, key.first + 1);
  return n;
}

void write_adapter(const std::string& dir, const AdapterTensors& adapter, safetensors::StDType dtype,
                   const FolderWriteOptions& opt) {
  const AdapterConfig& c = adapter.config;
  const std::string cfg_path = (std::filesystem::path(dir) / "adapter_config.json").string();
  const std::string st_path = (std::filesystem::path(dir) / "adapter_model.safetensors").string();
  if (c.r < 1 || !(c.lora_alpha > 0))
    fail(ErrorKind::invalid_input, "{}: r {} and lora_alpha {} must be positive", cfg_path, c.r, c.lora_alpha);
  safetensors::Writer w(st_path);
  w.set_metadata("format", "pt");
  for (const auto& [key, p] : adapter.pairs) {
    const auto [layer, t] = key;
    const std::string a_name = tensor_name(layer, t, false);
    if (std::find(c.target_modules.begin(), c.target_modules.end(), t) == c.target_modules.end())
      fail(ErrorKind::invalid_input, "{}: tensor '{}' targets {}, which is not in target_modules", st_path, a_name,
           lora_target_peft_name(t));
    const size_t r = static_cast<size_t>(c.r);
    if (p.in < 1 || p.out < 1 || p.a.size() != r * static_cast<size_t>(p.in) ||
        p.b.size() != static_cast<size_t>(p.out) * r)
      fail(ErrorKind::invalid_input, "{}: layer {} {}: A has {} values, B {}; expected [{}, {}] and [{}, {}]", st_path,
           layer, lora_target_peft_name(t), p.a.size(), p.b.size(), r, p.in, p.out, r);
    w.add(a_name, p.a, {c.r, p.in}, dtype);
    w.add(tensor_name(layer, t, true), p.b, {p.out, c.r}, dtype);
  }
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  std::vector<std::string> targets;
  for (LoraTarget t : c.target_modules) targets.push_back(lora_target_peft_name(t));
  // Keys sorted as PEFT writes them; the fields PEFT needs to load the adapter.
  j["alpha_pattern"] = nlohmann::ordered_json::object();
  j["base_model_name_or_path"] = c.base_model_name_or_path;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layers_pattern"] = nullptr;
  if (c.layers_to_transform.empty())
    j["layers_to_transform"] = nullptr;
  else
    j["layers_to_transform"] = c.layers_to_transform;
  // PEFT writes an integer alpha as an integer; keep files diffable with its output.
  if (c.lora_alpha == std::floor(c.lora_alpha) && c.lora_alpha < 1e9)
    j["lora_alpha"] = static_cast<int64_t>(c.lora_alpha);
  else
    j["lora_alpha"] = c.lora_alpha;
  j["lora_dropout"] = c.lora_dropout;
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["peft_version"] = c.peft_version;
  j["r"] = c.r;
  j["rank_pattern"] = nlohmann::ordered_json::object();
  j["target_modules"] = targets;
  j["task_type"] = "CAUSAL_LM";
  j["use_dora"] = false;
  j["use_rslora"] = c.use_rslora;
  // Both files are staged and swapped in together: never new weights beside an old config.
  const std::string image = w.serialize(safetensors::WriteOrder::reference);
  write_folder_atomic(dir, [&](const std::string& staging) {
    write_file_atomic(staging + "/adapter_model.safetensors", image);
    write_file_atomic(staging + "/adapter_config.json", j.dump(2) + "\n");
  }, opt);
}

AdapterTensors read_adapter(const std::string& dir, bool map_f32) {
  if (std::error_code ec; std::filesystem::is_regular_file(dir, ec))
    fail(ErrorKind::invalid_input,
         "{}: a file; a PEFT adapter is a folder (adapter_config.json, "
         "adapter_model.safetensors){}",
         dir, dir.ends_with(".gguf") ? " (a GGUF LoRA file is read by generate, chat, merge and serve)" : "");
  const std::string cfg_path = (std::filesystem::path(dir) / "adapter_config.json").string();
  const std::string st_path = (std::filesystem::path(dir) / "adapter_model.safetensors").string();
  AdapterTensors out;
  {
    const std::string text = read_text_file(cfg_path);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail(ErrorKind::invalid_input, "{}: invalid JSON: {}", cfg_path, e.what());
    }
    out.config = parse_config(cfg_path, j);
  }
  const AdapterConfig& c = out.config;
  if (!std::filesystem::exists(st_path)) {
    if (std::filesystem::exists(std::filesystem::path(dir) / "adapter_model.bin"))
      fail(ErrorKind::unsupported, "{}: missing; adapter_model.bin (pickle) is not read, convert it to safetensors",
           st_path);
    fail(ErrorKind::not_found, "{}: no such file", st_path);
  }
  std::shared_ptr<const safetensors::File> file = safetensors::File::open(st_path);
  std::map<std::pair<int, LoraTarget>, std::pair<const safetensors::TensorInfo*, const safetensors::TensorInfo*>> found;
  for (const auto& info : file->tensors()) {
    const auto parsed = parse_tensor_name(info.name);
    if (!parsed)
      fail(ErrorKind::unsupported, "{}: unexpected tensor '{}' (only PEFT LoRA A/B weights of the seven Llama "
           "projections are read)", st_path, info.name);
    if (std::find(c.target_modules.begin(), c.target_modules.end(), parsed->target) == c.target_modules.end())
      fail(ErrorKind::invalid_input, "{}: tensor '{}' targets {}, which is not in target_modules of {}", st_path,
           info.name, lora_target_peft_name(parsed->target), cfg_path);
    if (info.st_dtype != safetensors::StDType::f32 && info.st_dtype != safetensors::StDType::f16 &&
        info.st_dtype != safetensors::StDType::bf16)
      fail(ErrorKind::unsupported, "{}: tensor '{}' has dtype {} (F32, F16 or BF16 expected)", st_path, info.name,
           safetensors::st_dtype_name(info.st_dtype));
    if (info.ndim != 2)
      fail(ErrorKind::invalid_input, "{}: tensor '{}' has shape {} (2 dimensions expected)", st_path, info.name,
           info.shape_string());
    const int64_t r_dim = parsed->lora_b ? info.shape[1] : info.shape[0];
    const int64_t other = parsed->lora_b ? info.shape[0] : info.shape[1];
    if (r_dim != c.r || other < 1)
      fail(ErrorKind::invalid_input, "{}: tensor '{}' has shape {}; expected {} with r = {} from {}", st_path,
           info.name, info.shape_string(), parsed->lora_b ? "[out, r]" : "[r, in]", c.r, cfg_path);
    auto& slot = found[{parsed->layer, parsed->target}];
    (parsed->lora_b ? slot.second : slot.first) = &info;
  }
  if (found.empty()) fail(ErrorKind::invalid_input, "{}: no LoRA tensors", st_path);
  std::set<int> layers;
  for (const auto& [key, ab] : found) layers.insert(key.first);
  for (int layer : layers)
    for (LoraTarget t : c.target_modules) {
      const auto it = found.find({layer, t});
      const bool has_a = it != found.end() && it->second.first, has_b = it != found.end() && it->second.second;
      if (!has_a || !has_b)
        fail(ErrorKind::invalid_input, "{}: missing tensor '{}'", st_path, tensor_name(layer, t, has_a));
      LoraPair p;
      p.in = it->second.first->shape[1];
      p.out = it->second.second->shape[0];
      auto mappable = [&](const safetensors::TensorInfo& info) {
        return map_f32 && info.st_dtype == safetensors::StDType::f32 && info.aligned;
      };
      if (mappable(*it->second.first))
        p.a_map = reinterpret_cast<const float*>(it->second.first->data);
      else
        p.a = to_f32(*it->second.first);
      if (mappable(*it->second.second))
        p.b_map = reinterpret_cast<const float*>(it->second.second->data);
      else
        p.b = to_f32(*it->second.second);
      out.pairs.emplace(it->first, std::move(p));
    }
  check_adapted_layers(c, layers, st_path, cfg_path, out.n_layers());
  // Every layer of one target has the same in/out (the model's layers are identical).
  for (const auto& [key, p] : out.pairs) {
    const int first_layer = *layers.begin();
    const LoraPair& first = out.pairs.at({first_layer, key.second});
    if (p.in != first.in || p.out != first.out)
      fail(ErrorKind::invalid_input, "{}: layer {} {}: A/B shapes [{}, {}]/[{}, {}] differ from layer {}'s", st_path,
           key.first, lora_target_peft_name(key.second), c.r, p.in, p.out, c.r, first_layer);
  }
  for (const auto& [key, p] : out.pairs) {  // a NaN/Inf weight would poison every output silently
    const auto [layer, t] = key;
    const size_t r = static_cast<size_t>(c.r);
    check_finite(st_path, tensor_name(layer, t, false), p.a_data(), r * static_cast<size_t>(p.in));
    check_finite(st_path, tensor_name(layer, t, true), p.b_data(), static_cast<size_t>(p.out) * r);
  }
  if (map_f32) out.mapping = std::move(file);
  return out;
}

void check_adapter_fits(const AdapterTensors& adapter, const ModelConfig& model, std::string_view what) {
  if (adapter.n_layers() > model.n_layers)
    fail(ErrorKind::invalid_input, "{}: adapter has {} layers, the model {}", what, adapter.n_layers(), model.n_layers);
  // Without layers_to_transform an adapter adapts every layer (PEFT's meaning):
  // one that stops short was cut, and would change only the first layers.
  if (adapter.config.layers_to_transform.empty() && adapter.n_layers() < model.n_layers)
    fail(ErrorKind::invalid_input,
         "{}: adapter has tensors for layers 0..{} only, the model has {} layers, and its "
         "adapter_config.json has "
         "no layers_to_transform (which would name the adapted layers)",
         what, adapter.n_layers() - 1, model.n_layers);
  for (const auto& [key, p] : adapter.pairs) {
    const int64_t in = lora_target_in(model, key.second), out = lora_target_out(model, key.second);
    if (p.in != in || p.out != out)
      fail(ErrorKind::invalid_input, "{}: '{}' is [{}, {}] and its B [{}, {}]; the model needs [{}, {}] and [{}, {}]",
           what, tensor_name(key.first, key.second, false), adapter.config.r, p.in, p.out, adapter.config.r,
           adapter.config.r, in, out, adapter.config.r);
  }
}

}  // namespace loom::peft

// ModelConfig from GGUF metadata or config.json. Each loader reads its own
// spelling of the keys, applies the defaults of the tool that wrote the file
// (llama.cpp / transformers), then shares validate_config().
#include "model/config_load.h"

#include <cmath>

#include "core/error.h"

namespace loom {
namespace {

using json = nlohmann::json;

// Upper bounds keep every product the model code forms (vocab * hidden,
// layers * ctx * kv_dim, ...) far from int64 overflow, and reject garbage early.
constexpr int64_t kMaxWidth = int64_t{1} << 20;    // hidden, intermediate, head_dim
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxContext = int64_t{1} << 28;

void check_range(int64_t v, int64_t hi, const std::string& source, const std::string& key) {
  if (v <= 0 || v > hi)
    fail(ErrorKind::invalid_input, "{}: {} = {} is out of range (must be in [1, {}])", source, key, v, hi);
}

// ---- GGUF ------------------------------------------------------------------

int64_t gguf_count(const gguf::File& f, const std::string& key) {
  const uint64_t v = f.get_uint(key);
  if (v > static_cast<uint64_t>(INT64_MAX))
    fail(ErrorKind::invalid_input, "{}: key '{}' = {} is too large", f.path(), key, v);
  return static_cast<int64_t>(v);
}

std::optional<int64_t> gguf_opt_count(const gguf::File& f, const std::string& key) {
  const gguf::Value* v = f.find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type == gguf::ValueType::array)
    fail(ErrorKind::unsupported, "{}: key '{}' is a per-layer array; only one value for all layers is supported",
         f.path(), key);
  return gguf_count(f, key);
}

int64_t gguf_req_count(const gguf::File& f, const std::string& key) {
  const auto v = gguf_opt_count(f, key);
  if (!v) fail(ErrorKind::invalid_input, "{}: missing required key '{}'", f.path(), key);
  return *v;
}

// ---- config.json -----------------------------------------------------------

const json* hf_find(const json& j, const char* key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::optional<int64_t> hf_opt_int(const json& j, const char* key, const std::string& path) {
  const json* v = hf_find(j, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number_integer() || (v->is_number_unsigned() && v->get<uint64_t>() > INT64_MAX))
    fail(ErrorKind::invalid_input, "{}: key '{}' must be an integer, found {} {}", path, key, v->type_name(),
         v->dump());
  return v->get<int64_t>();
}

int64_t hf_int(const json& j, const char* key, const std::string& path) {
  const auto v = hf_opt_int(j, key, path);
  if (!v) fail(ErrorKind::invalid_input, "{}: missing required key '{}'", path, key);
  return *v;
}

std::optional<double> hf_opt_number(const json& j, const char* key, const std::string& path) {
  const json* v = hf_find(j, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number())
    fail(ErrorKind::invalid_input, "{}: key '{}' must be a number, found {}", path, key, v->type_name());
  return v->get<double>();
}

double hf_number(const json& j, const char* key, const std::string& path) {
  const auto v = hf_opt_number(j, key, path);
  if (!v) fail(ErrorKind::invalid_input, "{}: missing required key '{}'", path, key);
  return *v;
}

std::optional<bool> hf_opt_bool(const json& j, const char* key, const std::string& path) {
  const json* v = hf_find(j, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean())
    fail(ErrorKind::invalid_input, "{}: key '{}' must be a boolean, found {}", path, key, v->type_name());
  return v->get<bool>();
}

std::optional<std::string> hf_opt_string(const json& j, const char* key, const std::string& path) {
  const json* v = hf_find(j, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_string())
    fail(ErrorKind::invalid_input, "{}: key '{}' must be a string, found {}", path, key, v->type_name());
  return v->get<std::string>();
}

// transformers 4 writes rope_theta + rope_scaling; 5 folds both into
// rope_parameters. Either way the scaling object carries rope_type (or the
// older "type").
void hf_read_rope(const json& j, const std::string& path, ModelConfig& c) {
  const json* params = hf_find(j, "rope_parameters");
  const char* params_key = "rope_parameters";
  if (params == nullptr) {
    params = hf_find(j, "rope_scaling");
    params_key = "rope_scaling";
  }
  if (params != nullptr && !params->is_object())
    fail(ErrorKind::invalid_input, "{}: key '{}' must be an object, found {}", path, params_key,
         params->type_name());

  std::optional<double> theta = hf_opt_number(j, "rope_theta", path);
  if (!theta && params != nullptr) theta = hf_opt_number(*params, "rope_theta", path + ": " + params_key);
  c.rope_theta = theta.value_or(10000.0);

  if (params == nullptr) return;
  const std::string where = path + ": " + params_key;
  std::optional<std::string> type = hf_opt_string(*params, "rope_type", where);
  if (!type) type = hf_opt_string(*params, "type", where);
  if (!type || *type == "default") return;
  if (*type != "llama3")
    fail(ErrorKind::unsupported, "{}: key '{}': rope type '{}' is not supported (only 'default' and 'llama3')",
         path, params_key, *type);
  c.rope_scaling.factor = hf_number(*params, "factor", where);
  c.rope_scaling.low_freq_factor = hf_number(*params, "low_freq_factor", where);
  c.rope_scaling.high_freq_factor = hf_number(*params, "high_freq_factor", where);
  c.rope_scaling.original_max_position = hf_int(*params, "original_max_position_embeddings", where);
}

}  // namespace

void validate_config(const ModelConfig& c, const std::string& source, const ConfigKeyNames& k) {
  check_range(c.vocab_size, kMaxVocab, source, k.vocab_size);
  check_range(c.hidden, kMaxWidth, source, k.hidden);
  check_range(c.intermediate, kMaxWidth, source, k.intermediate);
  check_range(c.n_layers, kMaxLayers, source, k.n_layers);
  check_range(c.n_heads, kMaxHeads, source, k.n_heads);
  check_range(c.n_kv_heads, kMaxHeads, source, k.n_kv_heads);
  check_range(c.head_dim, kMaxWidth, source, k.head_dim);
  check_range(c.max_context, kMaxContext, source, k.max_context);
  if (c.n_heads % c.n_kv_heads != 0)
    fail(ErrorKind::invalid_input, "{}: {} = {} is not a multiple of {} = {}", source, k.n_heads, c.n_heads,
         k.n_kv_heads, c.n_kv_heads);
  if (c.head_dim % 2 != 0)
    fail(ErrorKind::invalid_input, "{}: {} = {} must be even for RoPE", source, k.head_dim, c.head_dim);
  if (c.q_dim() > kMaxWidth)
    fail(ErrorKind::invalid_input, "{}: {} * {} = {} is too large", source, k.n_heads, k.head_dim, c.q_dim());
  if (!(std::isfinite(c.rms_eps) && c.rms_eps > 0 && c.rms_eps < 1))
    fail(ErrorKind::invalid_input, "{}: {} = {} must be in (0, 1)", source, k.rms_eps, c.rms_eps);
  if (!(std::isfinite(c.rope_theta) && c.rope_theta > 1))
    fail(ErrorKind::invalid_input, "{}: {} = {} must be a finite number > 1", source, k.rope_theta, c.rope_theta);
  const auto& s = c.rope_scaling;
  if (s.factor != 0) {
    if (!(std::isfinite(s.factor) && s.factor >= 1))
      fail(ErrorKind::invalid_input, "{}: {}: factor = {} must be >= 1", source, k.rope_scaling, s.factor);
    if (!(std::isfinite(s.low_freq_factor) && std::isfinite(s.high_freq_factor) && s.low_freq_factor > 0 &&
          s.high_freq_factor > s.low_freq_factor))
      fail(ErrorKind::invalid_input, "{}: {}: need 0 < low_freq_factor ({}) < high_freq_factor ({})", source,
           k.rope_scaling, s.low_freq_factor, s.high_freq_factor);
    check_range(s.original_max_position, kMaxContext, source, k.rope_scaling + ".original_max_position_embeddings");
  }
}

ModelConfig config_from_gguf(const gguf::File& f) {
  const std::string& file = f.path();
  if (const auto type = f.opt_string("general.type"); type && *type == "adapter")
    fail(ErrorKind::invalid_input,
         "{}: a LoRA adapter (general.type 'adapter'), not a model: give the base model "
         "with -m and this file with --adapter",
         file);
  const std::string arch = f.get_string("general.architecture");
  ModelConfig c;
  if (arch == "llama") {
    c.arch = Arch::llama;
    c.rope_layout = RopeLayout::interleaved;  // convert_hf_to_gguf permutes q/k rows for llama
  } else if (arch == "qwen2") {
    c.arch = Arch::qwen2;
    c.rope_layout = RopeLayout::half;
    c.qkv_bias = true;
  } else {
    fail(ErrorKind::unsupported, "{}: architecture '{}' is not supported (llama and qwen2 are)", file, arch);
  }
  const auto key = [&](const char* suffix) { return arch + "." + suffix; };
  // Mixtral files say "llama" too; their experts would be silently ignored.
  if (const auto e = gguf_opt_count(f, key("expert_count")); e && *e > 0)
    fail(ErrorKind::unsupported, "{}: {} = {}: mixture-of-experts models are not supported", file,
         key("expert_count"), *e);

  c.name = f.opt_string("general.name").value_or(arch);
  c.n_layers = gguf_req_count(f, key("block_count"));
  c.max_context = gguf_req_count(f, key("context_length"));
  c.hidden = gguf_req_count(f, key("embedding_length"));
  c.intermediate = gguf_req_count(f, key("feed_forward_length"));
  c.n_heads = gguf_req_count(f, key("attention.head_count"));
  c.n_kv_heads = gguf_opt_count(f, key("attention.head_count_kv")).value_or(c.n_heads);
  c.rms_eps = f.get_float(key("attention.layer_norm_rms_epsilon"));
  c.rope_theta = f.opt_float(key("rope.freq_base")).value_or(10000.0);

  if (const auto kl = gguf_opt_count(f, key("attention.key_length"))) {
    c.head_dim = *kl;
  } else {
    if (c.n_heads <= 0 || c.hidden % c.n_heads != 0)
      fail(ErrorKind::invalid_input, "{}: {} = {} is not a multiple of {} = {}", file, key("embedding_length"),
           c.hidden, key("attention.head_count"), c.n_heads);
    c.head_dim = c.hidden / c.n_heads;
  }
  if (const auto vl = gguf_opt_count(f, key("attention.value_length")); vl && *vl != c.head_dim)
    fail(ErrorKind::unsupported, "{}: {} = {} differs from the key length {}", file, key("attention.value_length"),
         *vl, c.head_dim);
  if (const auto rd = gguf_opt_count(f, key("rope.dimension_count")); rd && *rd != c.head_dim)
    fail(ErrorKind::unsupported, "{}: {} = {} != head_dim {}: partial rotary embeddings are not supported", file,
         key("rope.dimension_count"), *rd, c.head_dim);

  // Only "no scaling" is representable in metadata; Llama 3.1 files carry
  // their scaling as the rope_freqs.weight tensor (bound with the weights).
  if (const auto type = f.opt_string(key("rope.scaling.type")); type && *type != "none") {
    const double factor = f.opt_float(key("rope.scaling.factor")).value_or(1.0);
    if (!(*type == "linear" && factor == 1.0))
      fail(ErrorKind::unsupported, "{}: {} = '{}' (factor {}) is not supported", file, key("rope.scaling.type"),
           *type, factor);
  }
  if (const auto lin = f.opt_float(key("rope.scale_linear")); lin && *lin != 1.0)
    fail(ErrorKind::unsupported, "{}: {} = {}: linear RoPE scaling is not supported", file,
         key("rope.scale_linear"), *lin);

  const gguf::TensorInfo* embd = f.find_tensor("token_embd.weight");
  if (const auto v = gguf_opt_count(f, key("vocab_size"))) {
    c.vocab_size = *v;
  } else if (const gguf::Value* tokens = f.find("tokenizer.ggml.tokens");
             tokens != nullptr && tokens->type == gguf::ValueType::array) {
    c.vocab_size = static_cast<int64_t>(std::get<gguf::Array>(tokens->v).items.size());
  } else if (embd != nullptr && embd->ndim == 2) {
    c.vocab_size = embd->shape[0];
  } else {
    fail(ErrorKind::invalid_input, "{}: cannot tell the vocabulary size (no {}, tokenizer.ggml.tokens or "
         "token_embd.weight)", file, key("vocab_size"));
  }
  if (embd != nullptr && embd->ndim == 2 && (embd->shape[0] != c.vocab_size || embd->shape[1] != c.hidden))
    fail(ErrorKind::invalid_input, "{}: token_embd.weight has shape [{}, {}], expected [vocab {}, hidden {}]",
         file, embd->shape[0], embd->shape[1], c.vocab_size, c.hidden);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  c.unstructured_pruning = f.opt_string("loom.pruning.unstructured").value_or("");

  ConfigKeyNames k;
  k.vocab_size = key("vocab_size");
  k.hidden = key("embedding_length");
  k.intermediate = key("feed_forward_length");
  k.n_layers = key("block_count");
  k.n_heads = key("attention.head_count");
  k.n_kv_heads = key("attention.head_count_kv");
  k.head_dim = key("attention.key_length");
  k.max_context = key("context_length");
  k.rms_eps = key("attention.layer_norm_rms_epsilon");
  k.rope_theta = key("rope.freq_base");
  k.rope_scaling = key("rope.scaling");
  validate_config(c, file, k);
  return c;
}

ModelConfig config_from_hf(const json& j, const std::string& path) {
  if (!j.is_object())
    fail(ErrorKind::invalid_input, "{}: top level must be a JSON object, found {}", path, j.type_name());
  const auto model_type = hf_opt_string(j, "model_type", path);
  if (!model_type) fail(ErrorKind::invalid_input, "{}: missing required key 'model_type'", path);
  ModelConfig c;
  c.rope_layout = RopeLayout::half;  // transformers' rotate_half
  if (*model_type == "llama" || *model_type == "mistral") {
    c.arch = Arch::llama;
  } else if (*model_type == "qwen2") {
    c.arch = Arch::qwen2;
    c.qkv_bias = true;
  } else {
    fail(ErrorKind::unsupported, "{}: model_type '{}' is not supported (llama, mistral and qwen2 are)", path,
         *model_type);
  }

  // Features the forward pass does not implement: refuse rather than run a different model.
  // bitsandbytes 4-bit, compressed-tensors and ModelOpt folders are read by the weight
  // loader (model/bnb_folder.h, model/compressed_tensors.h, model/modelopt_folder.h),
  // which checks the rest of quantization_config; other methods are refused here.
  if (const json* q = hf_find(j, "quantization_config"); q != nullptr && !q->is_null()) {
    const auto m = q->is_object() ? q->find("quant_method") : q->end();
    const std::string method = q->is_object() && m != q->end() && m->is_string() ? m->get<std::string>() : "?";
    if (method != "bitsandbytes" && method != "compressed-tensors" && method != "modelopt")
      fail(ErrorKind::unsupported,
           "{}: key 'quantization_config': quant_method '{}' is not supported (loom reads bitsandbytes "
           "4-bit, compressed-tensors INT8/INT4 and ModelOpt NVFP4 / FP8 checkpoints)",
           path, method);
  }
  if (const auto act = hf_opt_string(j, "hidden_act", path); act && *act != "silu")
    fail(ErrorKind::unsupported, "{}: hidden_act '{}' is not supported (only silu)", path, *act);
  if (c.arch == Arch::llama && hf_opt_bool(j, "attention_bias", path).value_or(false))
    fail(ErrorKind::unsupported, "{}: attention_bias = true is not supported for {}", path, *model_type);
  if (hf_opt_bool(j, "mlp_bias", path).value_or(false))
    fail(ErrorKind::unsupported, "{}: mlp_bias = true is not supported", path);

  c.name = hf_opt_string(j, "_name_or_path", path).value_or("");
  if (c.name.empty()) c.name = *model_type;
  c.hidden = hf_int(j, "hidden_size", path);
  c.intermediate = hf_int(j, "intermediate_size", path);
  c.n_layers = hf_int(j, "num_hidden_layers", path);
  c.n_heads = hf_int(j, "num_attention_heads", path);
  c.n_kv_heads = hf_opt_int(j, "num_key_value_heads", path).value_or(c.n_heads);
  c.vocab_size = hf_int(j, "vocab_size", path);
  c.max_context = hf_int(j, "max_position_embeddings", path);
  c.rms_eps = hf_opt_number(j, "rms_norm_eps", path).value_or(1e-6);  // transformers' default
  c.tied_embeddings = hf_opt_bool(j, "tie_word_embeddings", path).value_or(false);
  c.torch_dtype = hf_opt_string(j, "torch_dtype", path).value_or(hf_opt_string(j, "dtype", path).value_or(""));
  if (const auto p = j.find("loom_pruning"); p != j.end() && p->is_object())
    c.unstructured_pruning = hf_opt_string(*p, "unstructured", path + " loom_pruning").value_or("");

  if (const auto hd = hf_opt_int(j, "head_dim", path)) {
    c.head_dim = *hd;
  } else {
    if (c.n_heads <= 0 || c.hidden % c.n_heads != 0)
      fail(ErrorKind::invalid_input, "{}: hidden_size = {} is not a multiple of num_attention_heads = {}", path,
           c.hidden, c.n_heads);
    c.head_dim = c.hidden / c.n_heads;
  }
  hf_read_rope(j, path, c);

  // A sliding window only changes attention beyond the window; capping the
  // context at the window keeps the dense forward pass exact.
  const bool sliding = c.arch == Arch::qwen2 ? hf_opt_bool(j, "use_sliding_window", path).value_or(false) : true;
  if (const auto w = hf_opt_int(j, "sliding_window", path); sliding && w) {
    if (*w <= 0) fail(ErrorKind::invalid_input, "{}: sliding_window = {} must be positive", path, *w);
    c.max_context = std::min(c.max_context, *w);
  }

  ConfigKeyNames k;
  k.vocab_size = "vocab_size";
  k.hidden = "hidden_size";
  k.intermediate = "intermediate_size";
  k.n_layers = "num_hidden_layers";
  k.n_heads = "num_attention_heads";
  k.n_kv_heads = "num_key_value_heads";
  k.head_dim = "head_dim";
  k.max_context = "max_position_embeddings";
  k.rms_eps = "rms_norm_eps";
  k.rope_theta = "rope_theta";
  k.rope_scaling = hf_find(j, "rope_parameters") ? "rope_parameters" : "rope_scaling";
  validate_config(c, path, k);
  return c;
}

}  // namespace loom

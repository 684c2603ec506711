// Exporting a loaded model as a Hugging Face folder (see hf_export.h).
#include "model/hf_export.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/file_write.h"
#include "io/safetensors_writer.h"
#include "model/lora.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_export.h"

namespace loom {
namespace {

// Reorders q/k rows (or bias entries, cols = 1) from the RoPE-interleaved model order back to HF order.
void to_hf_rows(std::vector<float>& m, int64_t n_heads, int64_t head_dim, int64_t cols) {
  lora_permute_qk_rows(make_tensor(m.data(), DType::f32, {n_heads * head_dim, cols}), n_heads, head_dim,
                       /*hf_to_model=*/false);
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(ErrorKind::io, "{}: cannot read", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

const char* torch_dtype_name(safetensors::StDType d) {
  switch (d) {
    case safetensors::StDType::bf16: return "bfloat16";
    case safetensors::StDType::f16: return "float16";
    default: return "float32";
  }
}


bool same_rope(const RopeTable& a, const RopeTable& b) {
  if (a.inv_freq.size() != b.inv_freq.size()) return false;
  for (size_t i = 0; i < a.inv_freq.size(); ++i)
    if (std::fabs(a.inv_freq[i] - b.inv_freq[i]) > 1e-5f * std::fabs(b.inv_freq[i])) return false;
  return true;
}

// GGUF llama files carry Llama-3 scaling only as per-pair divisors
// (rope_freqs.weight), which config_from_gguf leaves out of the config. A
// config.json needs the llama3 parameters: the divisors d satisfy
// 1/d = (1 - s)/factor + s with s linear in the frequency between the two
// wavelength bounds, so two points inside that band fix them (low_freq_factor
// is taken as 1; only the ratios matter). Anything else cannot be expressed.
ModelConfig config_with_rope_table(const ModelConfig& c, const RopeTable& rope, const std::string& source) {
  if (same_rope(make_rope_table(c), rope)) return c;
  ModelConfig plain = c;
  plain.rope_scaling = RopeScaling{};
  const RopeTable base = make_rope_table(plain);
  auto unsupported = [&] {
    fail(ErrorKind::unsupported,
         "{}: the RoPE frequencies (rope_freqs.weight) are not Llama-3 scaling of rope_theta; "
         "a config.json cannot express them",
         source);
  };
  if (base.inv_freq.size() != rope.inv_freq.size()) unsupported();
  double factor = 1;
  for (size_t i = 0; i < rope.inv_freq.size(); ++i)
    factor = std::max(factor, static_cast<double>(base.inv_freq[i]) / rope.inv_freq[i]);
  std::vector<std::pair<double, double>> band;  // (frequency, s)
  for (size_t i = 0; i < rope.inv_freq.size(); ++i) {
    const double d = static_cast<double>(base.inv_freq[i]) / rope.inv_freq[i];
    if (d > 1 + 1e-4 && d < factor * (1 - 1e-4))
      band.emplace_back(base.inv_freq[i], (1 / d - 1 / factor) / (1 - 1 / factor));
  }
  if (band.size() < 2) unsupported();
  // s = a f - b with a = old_ctx / (2 pi (high - low)) and b = low / (high - low).
  const auto [f0, s0] = band.front();
  const auto [f1, s1] = band.back();
  const double a = (s1 - s0) / (f1 - f0), b = a * f0 - s0;
  if (!(a > 0) || !(b > 0)) unsupported();
  plain.rope_scaling.low_freq_factor = 1;
  // The fit carries f32 rounding of the stored table: keep 4 decimals.
  plain.rope_scaling.factor = std::round(factor * 1e4) / 1e4;
  plain.rope_scaling.high_freq_factor = std::round((1 + 1 / b) * 1e4) / 1e4;
  plain.rope_scaling.original_max_position = std::llround(a * 2 * M_PI / b);
  if (!same_rope(make_rope_table(plain), rope)) unsupported();
  return plain;
}

// The files of write_hf_folder, written into the (staging) folder `out_dir`.
void write_hf_files(const Model& model, const ModelConfig& c, const std::string& out_dir, safetensors::StDType dtype,
                    const HfExportHooks* hooks) {
  const ModelWeights& w = model.weights();

  const bool permuted = lora_needs_qk_permutation(c);
  safetensors::Writer st(out_dir + "/model.safetensors");
  // scale: a projection's output scale, folded in (safetensors has no place for it).
  auto add_matrix = [&](const std::string& name, const Tensor& t, int64_t unpermute_heads,
                        float scale = 1.0f) {
    std::vector<float> m = matrix_f32(t, scale);
    if (permuted && unpermute_heads > 0) to_hf_rows(m, unpermute_heads, c.head_dim, t.cols());
    st.add(name, m, {t.rows(), t.cols()}, dtype);
  };
  // A layer's linear weight: the hook's tensors when a quantized export asks for them.
  auto add_linear = [&](const std::string& name, const LayerWeights& L, LoraTarget target,
                        int64_t unpermute_heads) {
    const Tensor& t = target_matrix(L, target);
    if (hooks == nullptr || !hooks->linear)
      return add_matrix(name, t, unpermute_heads, L.output_scale(target));
    std::vector<float> m = matrix_f32(t, L.output_scale(target));
    if (permuted && unpermute_heads > 0) to_hf_rows(m, unpermute_heads, c.head_dim, t.cols());
    hooks->linear(name.substr(0, name.size() - std::string_view(".weight").size()), m, t.rows(), t.cols(), st);
  };
  auto add_vector = [&](const std::string& name, const float* v, int64_t n) {
    st.add(name, std::span<const float>(v, static_cast<size_t>(n)), {n}, dtype);
  };
  const bool tied = w.output.data == w.token_embd.data;
  add_matrix("model.embed_tokens.weight", w.token_embd, 0);
  add_vector("model.norm.weight", w.output_norm, c.hidden);
  if (!tied) add_matrix("lm_head.weight", w.output, 0);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    add_vector(p + "input_layernorm.weight", L.attn_norm, c.hidden);
    add_vector(p + "post_attention_layernorm.weight", L.ffn_norm, c.hidden);
    add_linear(p + "self_attn.q_proj.weight", L, LoraTarget::q, c.n_heads);
    add_linear(p + "self_attn.k_proj.weight", L, LoraTarget::k, c.n_kv_heads);
    add_linear(p + "self_attn.v_proj.weight", L, LoraTarget::v, 0);
    add_linear(p + "self_attn.o_proj.weight", L, LoraTarget::o, 0);
    if (L.bq) {  // biases are per row: q/k ones are permuted like the rows
      std::vector<float> bq(L.bq, L.bq + c.q_dim()), bk(L.bk, L.bk + c.kv_dim());
      if (permuted) {
        to_hf_rows(bq, c.n_heads, c.head_dim, 1);
        to_hf_rows(bk, c.n_kv_heads, c.head_dim, 1);
      }
      add_vector(p + "self_attn.q_proj.bias", bq.data(), c.q_dim());
      add_vector(p + "self_attn.k_proj.bias", bk.data(), c.kv_dim());
      add_vector(p + "self_attn.v_proj.bias", L.bv, c.kv_dim());
    }
    add_linear(p + "mlp.gate_proj.weight", L, LoraTarget::gate, 0);
    add_linear(p + "mlp.up_proj.weight", L, LoraTarget::up, 0);
    add_linear(p + "mlp.down_proj.weight", L, LoraTarget::down, 0);
  }
  st.set_metadata("format", "pt");
  st.write(safetensors::WriteOrder::reference);

  const bool qwen = c.arch == Arch::qwen2;
  nlohmann::ordered_json cfg;
  cfg["architectures"] = {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
  cfg["model_type"] = qwen ? "qwen2" : "llama";
  cfg["hidden_size"] = c.hidden;
  cfg["intermediate_size"] = c.intermediate;
  cfg["num_hidden_layers"] = c.n_layers;
  cfg["num_attention_heads"] = c.n_heads;
  cfg["num_key_value_heads"] = c.n_kv_heads;
  cfg["head_dim"] = c.head_dim;
  cfg["hidden_act"] = "silu";
  // GGUF stores eps as f32: write its shortest f32 spelling (1e-05, not 9.99999974e-06).
  cfg["rms_norm_eps"] = model.is_gguf() ? std::stod(fmt::format("{}", static_cast<float>(c.rms_eps))) : c.rms_eps;
  cfg["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.factor > 0)
    cfg["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", c.rope_scaling.factor},
                           {"low_freq_factor", c.rope_scaling.low_freq_factor},
                           {"high_freq_factor", c.rope_scaling.high_freq_factor},
                           {"original_max_position_embeddings", c.rope_scaling.original_max_position}};
  else
    cfg["rope_scaling"] = nullptr;
  cfg["max_position_embeddings"] = c.max_context;
  cfg["vocab_size"] = c.vocab_size;
  cfg["tie_word_embeddings"] = tied;
  if (!qwen) {
    cfg["attention_bias"] = false;
    cfg["mlp_bias"] = false;
  }
  cfg["torch_dtype"] = torch_dtype_name(dtype);
  if (!c.unstructured_pruning.empty()) cfg["loom_pruning"] = {{"unstructured", c.unstructured_pruning}};
  if (hooks != nullptr && !hooks->quantization_config.is_null()) cfg["quantization_config"] = hooks->quantization_config;
  nlohmann::ordered_json gen = nlohmann::ordered_json::object();
  if (!model.is_gguf()) {  // an HF source: keep its special ids
    const auto src = nlohmann::json::parse(read_file_bytes(model.path() + "/config.json"), nullptr, false);
    for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"})
      if (src.is_object() && src.contains(k) && !src[k].is_null()) cfg[k] = src[k];
  } else if (model.has_tokenizer()) {
    const Tokenizer& tok = model.tokenizer();
    if (tok.bos() >= 0) cfg["bos_token_id"] = gen["bos_token_id"] = tok.bos();
    if (tok.eos() >= 0) cfg["eos_token_id"] = tok.eos();
  }
  std::vector<int32_t> eos = model.extra_eos_ids();
  if (model.has_tokenizer() && model.tokenizer().eos() >= 0 &&
      std::find(eos.begin(), eos.end(), model.tokenizer().eos()) == eos.end())
    eos.insert(eos.begin(), model.tokenizer().eos());
  if (eos.size() == 1) gen["eos_token_id"] = eos[0];
  else if (!eos.empty()) gen["eos_token_id"] = eos;
  write_file_atomic(out_dir + "/config.json", cfg.dump(2) + "\n");
  if (model.is_gguf()) write_file_atomic(out_dir + "/generation_config.json", gen.dump(2) + "\n");

  if (!model.is_gguf()) {
    for (const char* f : {"generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "special_tokens_map.json"}) {
      const std::string src = model.path() + "/" + f;
      struct stat sb {};
      if (::stat(src.c_str(), &sb) == 0) write_file_atomic(out_dir + "/" + f, read_file_bytes(src));
    }
  } else if (model.has_tokenizer()) {  // a GGUF has no tokenizer files to copy: write them from its tokenizer
    write_tokenizer_files(model.tokenizer(), model.chat_template_text(), c.max_context, out_dir);
  }
}

}  // namespace

void write_hf_folder(const Model& model, const std::string& out_dir, safetensors::StDType dtype,
                     const FolderWriteOptions& opt) {
  const ModelConfig c = config_with_rope_table(model.config(), model.weights().rope, model.path());
  write_folder_atomic(out_dir, [&](const std::string& staging) { write_hf_files(model, c, staging, dtype, nullptr); },
                      opt);
}

void write_hf_folder(const Model& model, const std::string& out_dir, safetensors::StDType dtype,
                     const FolderWriteOptions& opt, const HfExportHooks& hooks) {
  const ModelConfig c = config_with_rope_table(model.config(), model.weights().rope, model.path());
  write_folder_atomic(out_dir, [&](const std::string& staging) { write_hf_files(model, c, staging, dtype, &hooks); },
                      opt);
}

}  // namespace loom

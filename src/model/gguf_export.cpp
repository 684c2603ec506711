#include "model/gguf_export.h"

#include <cmath>
#include <cstring>
#include <map>

#include <fmt/format.h>

#include "core/error.h"
#include "core/half.h"
#include "io/gguf.h"
#include "kernels/cpu/dequant.h"
#include "model/model.h"
#include "model/peft_adapter.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_gguf.h"

namespace loom {
namespace {

Tensor vector_view(const float* v, int64_t n) { return make_tensor(const_cast<float*>(v), DType::f32, {n}); }

// llama.cpp's general.* and <arch>.* keys for a config (what convert_hf_to_gguf.py writes).
// The keys structured pruning changes: layers, MLP width, heads (and the
// head size, which llama.cpp otherwise takes as hidden / heads).
void set_shape_metadata(gguf::Writer& w, const ModelConfig& c) {
  const std::string a = arch_name(c.arch);
  auto u32 = [&](const std::string& k, int64_t v) { w.set_u32(a + "." + k, static_cast<uint32_t>(v)); };
  u32("block_count", c.n_layers);
  u32("feed_forward_length", c.intermediate);
  u32("attention.head_count", c.n_heads);
  u32("attention.head_count_kv", c.n_kv_heads);
  if (c.head_dim * c.n_heads != c.hidden) {
    u32("attention.key_length", c.head_dim);
    u32("attention.value_length", c.head_dim);
  } else {
    w.erase(a + ".attention.key_length");
    w.erase(a + ".attention.value_length");
  }
}

void set_model_metadata(gguf::Writer& w, const ModelConfig& c, const std::string& name) {
  const std::string a = arch_name(c.arch);
  auto u32 = [&](const std::string& k, int64_t v) { w.set_u32(a + "." + k, static_cast<uint32_t>(v)); };
  w.set_string("general.architecture", a);
  w.set_string("general.type", "model");
  w.set_string("general.name", name);
  u32("context_length", c.max_context);
  u32("embedding_length", c.hidden);
  set_shape_metadata(w, c);
  w.set_f32(a + ".rope.freq_base", static_cast<float>(c.rope_theta));
  w.set_f32(a + ".attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_eps));
  u32("vocab_size", c.vocab_size);
  u32("rope.dimension_count", c.head_dim);
  if (!c.unstructured_pruning.empty()) w.set_string("loom.pruning.unstructured", c.unstructured_pruning);
}

// Llama 3's frequency scaling as convert_hf_to_gguf.py stores it: one divisor
// per rotated pair (rope_freqs.weight).
std::vector<float> llama3_rope_factors(const ModelConfig& c) {
  const RopeScaling& s = c.rope_scaling;
  const double low_wavelen = static_cast<double>(s.original_max_position) / s.low_freq_factor;
  const double high_wavelen = static_cast<double>(s.original_max_position) / s.high_freq_factor;
  std::vector<float> out;
  for (int64_t i = 0; i < c.head_dim; i += 2) {
    const float freq = 1.0f / std::pow(static_cast<float>(c.rope_theta), static_cast<float>(i) / c.head_dim);
    const double wavelen = 2 * M_PI / freq;
    double f = s.factor;
    if (wavelen < high_wavelen) {
      f = 1;
    } else if (wavelen <= low_wavelen) {
      const double smooth =
          (static_cast<double>(s.original_max_position) / wavelen - s.low_freq_factor) /
          (s.high_freq_factor - s.low_freq_factor);
      f = 1 / ((1 - smooth) / s.factor + smooth);
    }
    out.push_back(static_cast<float>(f));
  }
  return out;
}

// The model's tensors under llama.cpp's names, as loaded (merged copies included).
std::vector<GgufTensorSource> weight_tensors(const ModelConfig& c, const ModelWeights& w, bool hf_qk_order) {
  std::vector<GgufTensorSource> t;
  auto matrix = [&](std::string name, const Tensor& v, int64_t qk_heads = 0) {
    t.push_back({std::move(name), v, {v.rows(), v.cols()}, hf_qk_order ? qk_heads : 0});
  };
  auto vector = [&](std::string name, const float* v, int64_t n) {
    t.push_back({std::move(name), vector_view(v, n), {n}, 0});
  };
  matrix("token_embd.weight", w.token_embd);
  vector("output_norm.weight", w.output_norm, c.hidden);
  if (w.output.data != w.token_embd.data) matrix("output.weight", w.output);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("blk.{}.", l);
    vector(p + "attn_norm.weight", L.attn_norm, c.hidden);
    matrix(p + "attn_q.weight", L.wq, c.n_heads);
    matrix(p + "attn_k.weight", L.wk, c.n_kv_heads);
    matrix(p + "attn_v.weight", L.wv);
    matrix(p + "attn_output.weight", L.wo);
    if (L.bq != nullptr) {  // qwen2: GGUF keeps its rotate_half order, so biases are never permuted
      vector(p + "attn_q.bias", L.bq, c.q_dim());
      vector(p + "attn_k.bias", L.bk, c.kv_dim());
      vector(p + "attn_v.bias", L.bv, c.kv_dim());
    }
    vector(p + "ffn_norm.weight", L.ffn_norm, c.hidden);
    matrix(p + "ffn_gate.weight", L.w_gate);
    matrix(p + "ffn_up.weight", L.w_up);
    matrix(p + "ffn_down.weight", L.w_down);
    // llama.cpp's per-tensor output scales, where not 1 (folded ones are 1).
    for (LoraTarget target : kAllLoraTargets)
      if (L.output_scale(target) != 1.0f)
        vector(p + lora_target_gguf_name(target) + ".scale", &L.out_scale[static_cast<size_t>(target)], 1);
  }
  return t;
}

std::vector<int64_t> shape_of(const gguf::TensorInfo& t) { return {t.shape.begin(), t.shape.begin() + t.ndim}; }

}  // namespace

int64_t GgufTensorSource::rows() const {
  int64_t r = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) r *= shape[i];
  return r;
}

const uint8_t* GgufTensorSource::source_row(int64_t r) const {
  if (qk_heads > 0) {
    const int64_t head_dim = rows() / qk_heads, head = r / head_dim, j = r % head_dim, half = head_dim / 2;
    r = head * head_dim + (j % 2 == 0 ? j / 2 : half + j / 2);
  }
  return view.row_ptr(r);
}

void GgufTensorSource::row_f32(int64_t r, float* out) const { dequantize_row(view.dtype, source_row(r), out, cols()); }

GgufModelSource gguf_source_of(const gguf::File& f) {
  GgufModelSource s;
  s.path = f.path();
  s.arch = f.get_string("general.architecture");
  s.n_layers = static_cast<int64_t>(f.get_uint(s.arch + ".block_count"));
  s.n_heads = static_cast<int64_t>(f.get_uint(s.arch + ".attention.head_count"));
  s.n_kv_heads = static_cast<int64_t>(f.opt_uint(s.arch + ".attention.head_count_kv").value_or(s.n_heads));
  s.write_metadata = [&f](gguf::Writer& w) { gguf::copy_metadata(f, w); };
  for (const auto& t : f.tensors()) s.tensors.push_back({t.name, t.view(), shape_of(t), 0});
  return s;
}

GgufModelSource gguf_source_of(const Model& m, const std::string& name) {
  const ModelConfig& c = m.config();
  GgufModelSource s;
  s.path = m.path();
  s.arch = arch_name(c.arch);
  s.n_layers = c.n_layers;
  s.n_heads = c.n_heads;
  s.n_kv_heads = c.n_kv_heads;
  s.owned = std::make_shared<std::vector<std::vector<float>>>();
  if (m.is_gguf()) {
    // The file's metadata and extra tensors (rope_freqs), with the model's current matrices.
    const gguf::File& f = *m.gguf_file();
    std::map<std::string, GgufTensorSource> current;
    for (auto& t : weight_tensors(c, m.weights(), false)) current.emplace(t.name, std::move(t));
    s.write_metadata = [&f, c](gguf::Writer& w) {
      gguf::copy_metadata(f, w);
      w.erase("general.file_type");
      set_shape_metadata(w, c);  // the model may have been reshaped (structured pruning)
      if (!c.unstructured_pruning.empty()) w.set_string("loom.pruning.unstructured", c.unstructured_pruning);
    };
    for (const auto& t : f.tensors()) {
      const auto it = current.find(t.name);
      // A layer pruned away, or an output scale folded into its matrix (which
      // output.scale always is, model/weights.h).
      if (it == current.end() && (t.name.starts_with("blk.") || t.name == "output.scale")) continue;
      s.tensors.push_back(it != current.end() ? it->second : GgufTensorSource{t.name, t.view(), shape_of(t), 0});
    }
    return s;
  }
  if (!m.has_tokenizer())
    fail(ErrorKind::unsupported, "{}: the model has no tokenizer; a GGUF file needs one", m.path());
  const Tokenizer& tok = m.tokenizer();
  const std::string chat = m.chat_template_text().value_or("");
  {  // fail now, not in the middle of writing, when the tokenizer has no GGUF form
    gguf::Writer probe;
    set_gguf_tokenizer(probe, tok, c.vocab_size, chat, m.path());
  }
  s.write_metadata = [&m, &tok, c, chat, name](gguf::Writer& w) {
    set_model_metadata(w, c, name);
    set_gguf_tokenizer(w, tok, c.vocab_size, chat, m.path());
  };
  s.tensors = weight_tensors(c, m.weights(), c.arch == Arch::llama && c.rope_layout == RopeLayout::half);
  if (c.arch == Arch::llama && c.rope_scaling.factor > 0) {
    s.owned->push_back(llama3_rope_factors(c));
    const auto& f = s.owned->back();
    s.tensors.push_back({"rope_freqs.weight", vector_view(f.data(), static_cast<int64_t>(f.size())),
                         {static_cast<int64_t>(f.size())}, 0});
  }
  return s;
}

void write_lora_gguf(const peft::AdapterTensors& adapter, const ModelConfig& base, const std::string& path,
                     DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f16)
    fail(ErrorKind::invalid_input, "a GGUF LoRA adapter is written as f32 or f16, not {}", dtype_name(dtype));
  check_adapter_fits(adapter, base, path);
  const peft::AdapterConfig& ac = adapter.config;
  // llama.cpp scales B·A by alpha / r; rsLoRA's alpha / sqrt(r) is that with alpha' = alpha sqrt(r).
  const double alpha = ac.use_rslora ? ac.lora_alpha * std::sqrt(static_cast<double>(ac.r)) : ac.lora_alpha;
  const bool permute = base.arch == Arch::llama && base.rope_layout == RopeLayout::interleaved;
  gguf::Writer w;
  w.set_string("general.architecture", arch_name(base.arch));
  w.set_string("general.type", "adapter");
  w.set_string("adapter.type", "lora");
  w.set_f32("adapter.lora.alpha", static_cast<float>(alpha));
  auto put = [&](uint8_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      if (dtype == DType::f32) {
        std::memcpy(dst + 4 * i, src + i, 4);
      } else {
        const uint16_t h = fp32_to_fp16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
    }
  };
  for (const auto& [key, pair] : adapter.pairs) {
    const auto [layer, target] = key;
    const std::string name = fmt::format("blk.{}.{}.weight", layer, lora_target_gguf_name(target));
    const int64_t r = ac.r, in = pair.in, out = pair.out;
    const peft::LoraPair* p = &pair;
    w.add_tensor(name + ".lora_a", dtype, {r, in}, [=](uint8_t* dst) { put(dst, p->a_data(), r * in); });
    const int64_t heads = target == LoraTarget::q ? base.n_heads : target == LoraTarget::k ? base.n_kv_heads : 0;
    w.add_tensor(name + ".lora_b", dtype, {out, r}, [=, &base](uint8_t* dst) {
      if (!permute || heads == 0) {
        put(dst, p->b_data(), out * r);
        return;
      }
      // PEFT's B rows are in Hugging Face order; the GGUF weight's are RoPE-interleaved.
      const int64_t half = base.head_dim / 2;
      for (int64_t row = 0; row < out; ++row) {
        const int64_t head = row / base.head_dim, j = row % base.head_dim;
        const int64_t src = head * base.head_dim + (j % 2 == 0 ? j / 2 : half + j / 2);
        put(dst + row * r * dtype_row_bytes(dtype, 1), p->b_data() + src * r, r);
      }
    });
  }
  if (adapter.pairs.empty()) fail(ErrorKind::invalid_input, "{}: the adapter has no LoRA pairs", path);
  w.write(path);
}

}  // namespace loom

#include "quant/quantize_plan.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <regex>

#include "core/error.h"

namespace loom {
namespace {

struct FileTypeInfo {
  FileType type;
  const char* name;
  DType default_type;
};

constexpr FileTypeInfo kFileTypes[] = {
    {FileType::all_f32, "F32", DType::f32},      {FileType::f16, "F16", DType::f16},
    {FileType::bf16, "BF16", DType::bf16},       {FileType::q4_0, "Q4_0", DType::q4_0},
    {FileType::q4_1, "Q4_1", DType::q4_1},       {FileType::q5_0, "Q5_0", DType::q5_0},
    {FileType::q5_1, "Q5_1", DType::q5_1},       {FileType::q8_0, "Q8_0", DType::q8_0},
    {FileType::q2_k, "Q2_K", DType::q2_k},       {FileType::q2_k_s, "Q2_K_S", DType::q2_k},
    {FileType::q3_k_s, "Q3_K_S", DType::q3_k},   {FileType::q3_k_m, "Q3_K_M", DType::q3_k},
    {FileType::q3_k_l, "Q3_K_L", DType::q3_k},   {FileType::q4_k_s, "Q4_K_S", DType::q4_k},
    {FileType::q4_k_m, "Q4_K_M", DType::q4_k},   {FileType::q5_k_s, "Q5_K_S", DType::q5_k},
    {FileType::q5_k_m, "Q5_K_M", DType::q5_k},   {FileType::q6_k, "Q6_K", DType::q6_k},
    {FileType::iq4_nl, "IQ4_NL", DType::iq4_nl}, {FileType::iq4_xs, "IQ4_XS", DType::iq4_xs},
    {FileType::iq3_m, "IQ3_M", DType::iq3_s},    {FileType::iq3_s, "IQ3_S", DType::iq3_s},
    {FileType::iq3_xs, "IQ3_XS", DType::iq3_s},  {FileType::iq3_xxs, "IQ3_XXS", DType::iq3_xxs},
    {FileType::iq2_m, "IQ2_M", DType::iq2_s},    {FileType::iq2_s, "IQ2_S", DType::iq2_xs},
    {FileType::iq2_xs, "IQ2_XS", DType::iq2_xs}, {FileType::iq2_xxs, "IQ2_XXS", DType::iq2_xxs},
    {FileType::iq1_m, "IQ1_M", DType::iq1_m},    {FileType::iq1_s, "IQ1_S", DType::iq1_s},
    {FileType::q1_0, "Q1_0", DType::q1_0},       {FileType::q2_0, "Q2_0", DType::q2_0},
    {FileType::tq1_0, "TQ1_0", DType::tq1_0},    {FileType::tq2_0, "TQ2_0", DType::tq2_0},
};

const FileTypeInfo& info(FileType t) {
  for (const auto& i : kFileTypes)
    if (i.type == t) return i;
  LOOM_ASSERT(false && "unknown FileType");
  return kFileTypes[0];
}

// llama.cpp's broad tensor categories (tensor_get_category), checked in its order.
enum class Category { output, token_embd, attn_qkv, attn_kv_b, attn_v, attn_k, attn_q, attn_output, ffn_up,
                      ffn_gate, ffn_down, other };

Category category_of(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (name == "output.weight") return Category::output;
  if (name == "token_embd.weight") return Category::token_embd;
  if (has("attn_qkv.weight")) return Category::attn_qkv;
  if (has("attn_kv_b.weight")) return Category::attn_kv_b;
  if (has("attn_v.weight")) return Category::attn_v;
  if (has("attn_k.weight")) return Category::attn_k;
  if (has("attn_q.weight")) return Category::attn_q;
  if (has("attn_output.weight")) return Category::attn_output;
  if (has("ffn_up")) return Category::ffn_up;
  if (has("ffn_gate")) return Category::ffn_gate;
  if (has("ffn_down")) return Category::ffn_down;
  return Category::other;
}

bool is_attn_v_like(Category c) { return c == Category::attn_v || c == Category::attn_qkv || c == Category::attn_kv_b; }

// Layers that get more bits in the _M mixes: the first and last eighth, and
// every third layer between them.
bool use_more_bits(int64_t i, int64_t n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

int layer_of(const std::string& name) {
  int layer = -1;
  if (name.rfind("blk.", 0) == 0) {
    const char* b = name.c_str() + 4;
    const auto [p, ec] = std::from_chars(b, name.c_str() + name.size(), layer);
    if (ec != std::errc() || *p != '.') layer = -1;
  }
  return layer;
}

// ggml_n_dims: dimensions up to the last one larger than 1.
size_t effective_dims(const std::vector<int64_t>& shape) {
  size_t lead = 0;
  while (lead + 1 < shape.size() && shape[lead] == 1) ++lead;
  return shape.size() - lead;
}

// Counters of the mix rules, advanced in processing order.
struct MixState {
  int64_t n_attention_wv = 0, i_attention_wv = 0;
  int64_t n_ffn = 0, i_ffn_down = 0, i_ffn_gate = 0, i_ffn_up = 0;
  bool tied_embeddings = true;
};

// The 1- and 2-bit grid file types, which llama.cpp's rules treat as one family.
bool is_iq2_family(FileType f) {
  return f == FileType::iq2_xxs || f == FileType::iq2_xs || f == FileType::iq1_s || f == FileType::iq2_s ||
         f == FileType::iq2_m || f == FileType::iq1_m;
}

// The IQ2/IQ1 family's own chain (no other rule applies to its tensors but the
// output's and the token embedding's): attn_v and the first eighth of ffn_down get
// Q2_K (IQ2_S, IQ2_M: IQ3_S; Q4_K with grouped-query attention), attn_output
// IQ2_XXS (IQ1) or IQ3_S (IQ2_S, IQ2_M).
DType iq2_family_type(MixState& s, FileType f, int64_t n_gqa, DType t, Category cat) {
  const bool s_or_m = f == FileType::iq2_s || f == FileType::iq2_m;
  if (is_attn_v_like(cat)) {
    ++s.i_attention_wv;
    return n_gqa >= 4 ? DType::q4_k : s_or_m ? DType::iq3_s : DType::q2_k;
  }
  if (cat == Category::ffn_down) {
    if (s.i_ffn_down++ < s.n_ffn / 8) return s_or_m ? DType::iq3_s : DType::q2_k;
    return t;
  }
  if (cat == Category::attn_output) {
    if (f == FileType::iq1_s || f == FileType::iq1_m) return DType::iq2_xxs;
    if (s_or_m) return DType::iq3_s;
  }
  return t;
}

// llama_tensor_get_type_impl for the file types loom writes (one rule a line, as
// llama.cpp's chains read).
// clang-format off
DType mix_type(MixState& s, const ModelShapeInfo& m, const QuantizeOptions& opt, DType t, const TensorInput& tensor,
               Category cat) {
  const FileType f = opt.file_type;
  const int64_t n_gqa = m.n_kv_heads > 0 ? m.n_heads / m.n_kv_heads : 1;
  if (cat == Category::output || (s.tied_embeddings && cat == Category::token_embd)) {
    if (opt.output_type) return *opt.output_type;
    if (tensor.shape.back() % dtype_block_size(t) != 0) return DType::q8_0;
    if (is_iq2_family(f) || f == FileType::iq3_xxs) return DType::q5_k;
    return t != DType::q8_0 ? DType::q6_k : t;
  }
  if (cat == Category::token_embd) {
    if (opt.token_embedding_type) return *opt.token_embedding_type;
    if (f == FileType::iq2_xxs || f == FileType::iq2_xs || f == FileType::iq1_s || f == FileType::iq1_m) return DType::q2_k;
    if (f == FileType::iq2_s || f == FileType::iq2_m || f == FileType::iq3_xxs) return DType::iq3_s;
    return f == FileType::q2_0 || f == FileType::tq1_0 || f == FileType::tq2_0 ? DType::q4_k : t;
  }
  if (is_iq2_family(f)) return iq2_family_type(s, f, n_gqa, t, cat);
  if (is_attn_v_like(cat)) {
    const int64_t i = s.i_attention_wv, n = s.n_attention_wv;
    if (f == FileType::q2_k) t = n_gqa >= 4 ? DType::q4_k : DType::q3_k;
    else if (f == FileType::q2_k_s && n_gqa >= 4) t = DType::q4_k;
    else if (f == FileType::iq3_xxs) t = n_gqa >= 4 ? DType::q4_k : !opt.has_imatrix ? DType::iq3_s : DType::iq3_xxs;
    else if ((f == FileType::iq3_xs || f == FileType::iq3_s) && n_gqa >= 4) t = DType::q4_k;
    else if (f == FileType::iq3_m) t = DType::q4_k;
    else if (f == FileType::q3_k_m) t = i < 2 ? DType::q5_k : DType::q4_k;
    else if (f == FileType::q3_k_l) t = DType::q5_k;
    else if ((f == FileType::iq4_nl || f == FileType::iq4_xs) && n_gqa >= 4) t = DType::q5_k;
    else if ((f == FileType::q4_k_m || f == FileType::q5_k_m) && use_more_bits(i, n)) t = DType::q6_k;
    else if (f == FileType::q4_k_s && i < 4) t = DType::q5_k;
    if (m.is_70b && (t == DType::q3_k || t == DType::q4_k)) t = DType::q5_k;
    ++s.i_attention_wv;
    return t;
  }
  if (cat == Category::ffn_down) {
    const int64_t i = s.i_ffn_down, n = s.n_ffn;
    if (f == FileType::q2_k) t = DType::q3_k;
    else if (f == FileType::q2_k_s) { if (i < n / 8) t = DType::q4_k; }
    else if (f == FileType::iq3_xxs && !opt.has_imatrix) t = i < n / 8 ? DType::q4_k : DType::q3_k;
    else if (f == FileType::q3_k_m) t = i < n / 16 ? DType::q5_k : DType::q4_k;
    else if (f == FileType::iq3_m && i < n / 8) t = DType::q4_k;
    else if (f == FileType::q3_k_l) t = DType::q5_k;
    else if (f == FileType::q4_k_m) { if (use_more_bits(i, n)) t = DType::q6_k; }
    else if (i < n / 8 && (f == FileType::iq4_nl || f == FileType::iq4_xs) && !opt.has_imatrix) t = DType::q5_k;
    else if (f == FileType::q5_k_m && use_more_bits(i, n)) t = DType::q6_k;
    else if (f == FileType::q4_k_s && i < n / 8) t = DType::q5_k;
    else if ((f == FileType::q4_0 || f == FileType::q5_0) && opt.has_imatrix && i < n / 8)
      t = f == FileType::q4_0 ? DType::q4_1 : DType::q5_1;
    ++s.i_ffn_down;
    return t;
  }
  if (cat == Category::attn_output) {
    if (f == FileType::q2_k) t = DType::q3_k;
    else if (f == FileType::iq3_xxs) t = DType::iq3_s;
    else if (f == FileType::q3_k_m) t = DType::q4_k;
    else if (f == FileType::q3_k_l) t = DType::q5_k;
    else if (f == FileType::iq3_m) t = DType::q4_k;
    return t;
  }
  if (cat == Category::attn_k || cat == Category::attn_q) {
    if (f == FileType::iq3_xs) t = DType::iq3_xxs;
    else if (f == FileType::iq3_xxs) t = DType::iq2_s;
    return t;
  }
  if (cat == Category::ffn_gate || cat == Category::ffn_up) {  // IQ3_XS: iq3_xxs between the first and last eighth
    int64_t& i = cat == Category::ffn_gate ? s.i_ffn_gate : s.i_ffn_up;
    const int64_t n = s.n_ffn;
    if (f == FileType::iq3_xs && i >= n / 8 && i < 7 * n / 8) t = DType::iq3_xxs;
    ++i;
    return t;
  }
  if (cat == Category::attn_qkv) {
    if (f == FileType::q3_k_m || f == FileType::q3_k_l || f == FileType::iq3_m) t = DType::q4_k;
    else if (f == FileType::q4_k_m) t = DType::q5_k;
    else if (f == FileType::q5_k_m) t = DType::q6_k;
  }
  return t;
}

// tensor_type_fallback: a k-quant whose 256 does not divide the row width
// becomes a 32-block type; if even that does not fit, f16. Q2_0 (64) and the
// ternary types fall back to q4_0; Q1_0 (128) has no fallback in llama.cpp,
// which stops (the caller too).
DType fit_to_width(DType t, int64_t cols, bool& fell_back) {
  if (cols % dtype_block_size(t) == 0) return t;
  fell_back = true;
  switch (t) {
    case DType::q2_k: case DType::q3_k: case DType::q2_0: case DType::tq1_0: case DType::tq2_0: t = DType::q4_0; break;
    case DType::q4_k: t = DType::q5_0; break;
    case DType::q5_k: t = DType::q5_1; break;
    case DType::q6_k: t = DType::q8_0; break;
    case DType::iq4_xs: case DType::iq3_xxs: case DType::iq3_s: case DType::iq2_xxs: case DType::iq2_xs:
    case DType::iq2_s: case DType::iq1_s: case DType::iq1_m: t = DType::iq4_nl; break;
    default: break;
  }
  return cols % dtype_block_size(t) == 0 ? t : DType::f16;
}
// clang-format on

}  // namespace

std::optional<FileType> file_type_from_name(std::string_view name) {
  std::string upper(name);
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const auto& i : kFileTypes)
    if (upper == i.name) return i.type;
  uint32_t id = 0;
  const auto [p, ec] = std::from_chars(name.data(), name.data() + name.size(), id);
  if (ec == std::errc() && p == name.data() + name.size())
    for (const auto& i : kFileTypes)
      if (static_cast<uint32_t>(i.type) == id) return i.type;
  return std::nullopt;
}

const char* file_type_name(FileType t) { return info(t).name; }
DType file_type_default(FileType t) { return info(t).default_type; }

std::vector<FileType> all_file_types() {
  std::vector<FileType> v;
  for (const auto& i : kFileTypes) v.push_back(i.type);
  return v;
}

bool plan_requires_importance(const TensorPlan& p, FileType file_type) {
  if (!p.quantized || p.to == p.from || p.name == "token_embd.weight" || p.name == "output.weight") return false;
  if (p.to == DType::q2_k) return file_type == FileType::q2_k_s;
  return p.to == DType::iq3_xxs || p.to == DType::iq2_xxs || p.to == DType::iq2_xs || p.to == DType::iq2_s ||
         p.to == DType::iq1_s || p.to == DType::iq1_m;
}

bool tensor_is_quantizable(const TensorInput& t, bool quantize_output) {
  if (effective_dims(t.shape) < 2) return false;
  const std::string& n = t.name;
  if (n.size() < 6 || n.compare(n.size() - 6, 6, "weight") != 0) return false;
  if (n.find("_norm.weight") != std::string::npos) return false;
  if (!quantize_output && n == "output.weight") return false;
  for (const char* skip : {"ffn_gate_inp.weight", "position_embd", "token_types", "rope_freqs", "attn_rel_b.weight"})
    if (n.find(skip) != std::string::npos) return false;
  return true;
}

std::vector<TensorPlan> plan_quantization(std::vector<TensorInput> tensors, const ModelShapeInfo& model,
                                          const QuantizeOptions& opt) {
  // llama_model_loader's weights_map order: by layer (no layer first), then by name.
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorInput& a, const TensorInput& b) {
    const int la = layer_of(a.name), lb = layer_of(b.name);
    return la != lb ? la < lb : a.name < b.name;
  });
  std::vector<std::pair<std::regex, DType>> overrides;
  for (const auto& o : opt.overrides) {
    try {
      overrides.emplace_back(std::regex(o.pattern), o.type);
    } catch (const std::regex_error& e) {
      fail(ErrorKind::invalid_input, "--tensor-type pattern '{}' is not a valid regular expression: {}", o.pattern,
           e.what());
    }
  }
  MixState s;
  s.n_ffn = model.n_layers;
  for (const auto& t : tensors) {
    const Category c = category_of(t.name);
    if (is_attn_v_like(c)) ++s.n_attention_wv;
    if (c == Category::output) s.tied_embeddings = false;
  }
  const DType base = file_type_default(opt.file_type);
  std::vector<TensorPlan> plan;
  plan.reserve(tensors.size());
  for (const auto& t : tensors) {
    TensorPlan p{t.name, t.dtype, t.dtype};
    p.quantized = tensor_is_quantizable(t, opt.quantize_output);
    if (p.quantized) {
      const Category c = category_of(t.name);
      if (opt.token_embedding_type && c == Category::token_embd) {
        p.to = *opt.token_embedding_type;
      } else if (opt.output_type && c == Category::output) {
        p.to = *opt.output_type;
      } else {
        p.to = base;
        if (dtype_is_quantized(base)) {
          bool manual = false;
          for (const auto& [re, type] : overrides)
            if (std::regex_search(t.name, re)) {
              p.to = type;
              manual = true;
              break;
            }
          if (!manual && !opt.pure) p.to = mix_type(s, model, opt, p.to, t, c);
          if (p.to == DType::q1_0 && t.shape.back() % dtype_block_size(DType::q1_0) != 0)
            fail(ErrorKind::unsupported,
                 "tensor '{}': rows of {} values are not a multiple of Q1_0's block of 128, and Q1_0 has no "
                 "fallback type (llama-quantize stops too): choose the tensor's type with --tensor-type",
                 t.name, t.shape.back());
          p.to = fit_to_width(p.to, t.shape.back(), p.fallback);
        }
      }
    }
    plan.push_back(std::move(p));
  }
  return plan;
}

}  // namespace loom

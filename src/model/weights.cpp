#include "model/weights.h"

#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/dequant.h"

namespace loom {

Tensor& target_matrix(LayerWeights& L, LoraTarget t) {
  switch (t) {
    case LoraTarget::q: return L.wq;
    case LoraTarget::k: return L.wk;
    case LoraTarget::v: return L.wv;
    case LoraTarget::o: return L.wo;
    case LoraTarget::gate: return L.w_gate;
    case LoraTarget::up: return L.w_up;
    case LoraTarget::down: return L.w_down;
  }
  LOOM_ASSERT(false);
  return L.wq;
}

const Tensor& target_matrix(const LayerWeights& L, LoraTarget t) {
  return target_matrix(const_cast<LayerWeights&>(L), t);
}
namespace {

class Binder {
 public:
  Binder(const TensorLookup& lookup, const std::string& source, ModelWeights& w)
      : lookup_(lookup), source_(source), w_(w) {}

  std::optional<Tensor> find(const std::string& name) { return lookup_(name); }

  Tensor matrix(const std::string& name, int64_t rows, int64_t cols) {
    auto t = lookup_(name);
    if (!t) fail(ErrorKind::invalid_input, "{}: missing tensor '{}'", source_, name);
    if (t->ndim != 2 || t->dim(0) != rows || t->dim(1) != cols)
      fail(ErrorKind::invalid_input, "{}: tensor '{}' has shape {}, expected [{}, {}]", source_, name,
           t->shape_string(), rows, cols);
    if (!weight_type_supported(t->dtype))
      fail(ErrorKind::unsupported, "{}: tensor '{}' has type {}, which loom cannot multiply", source_, name,
           dtype_name(t->dtype));
    return *t;
  }

  const float* vector(const std::string& name, int64_t n, bool required = true) {
    auto t = lookup_(name);
    if (!t) {
      if (required) fail(ErrorKind::invalid_input, "{}: missing tensor '{}'", source_, name);
      return nullptr;
    }
    if (t->numel() != n)
      fail(ErrorKind::invalid_input, "{}: tensor '{}' has shape {}, expected [{}]", source_, name,
           t->shape_string(), n);
    const bool aligned = reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0;
    if (t->dtype == DType::f32 && aligned) return t->as<const float>();
    if (t->dtype != DType::f32 && t->dtype != DType::f16 && t->dtype != DType::bf16)
      fail(ErrorKind::unsupported, "{}: tensor '{}' has type {}; norms and biases must be f32, f16 or bf16",
           source_, name, dtype_name(t->dtype));
    auto& v = w_.owned.emplace_back(static_cast<size_t>(n));
    dequantize_row(t->dtype, t->data, v.data(), n);
    return v.data();
  }

 private:
  const TensorLookup& lookup_;
  const std::string& source_;
  ModelWeights& w_;
};

// A per-tensor output scale, tensor `name` (GGUF's "<proj>.scale", by which
// llama.cpp multiplies the projection's output; NVIDIA ModelOpt's
// weight_scale_2 of NVFP4 weights); 1 where the file has none.
float read_output_scale(Binder& b, const std::string& name, const std::string& proj,
                        const std::string& source) {
  if (!b.find(name)) return 1.0f;
  const float s = *b.vector(name, 1);
  if (!std::isfinite(s))
    fail(ErrorKind::invalid_input,
         "{}: tensor '{}' (the output scale of '{}.weight') is {}, not a finite number", source, name, proj,
         s);
  return s;
}

}  // namespace

size_t decode_matrix_bytes(const ModelWeights& w) {
  size_t n = w.output.data != nullptr ? w.output.nbytes() : 0;
  for (const LayerWeights& L : w.layers) {
    if (!L.held()) continue;
    for (const Tensor* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) n += t->nbytes();
  }
  return n;
}

std::vector<float> matrix_f32(const Tensor& t, float scale) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (int64_t r = 0; r < t.rows(); ++r) {
    float* row = out.data() + r * t.cols();
    dequantize_row(t.dtype, t.row_ptr(r), row, t.cols());
    if (scale != 1.0f)
      for (int64_t i = 0; i < t.cols(); ++i) row[i] *= scale;
  }
  return out;
}

namespace {

// t becomes an f32 copy times `scale`, held in w.owned.
void replace_by_f32(ModelWeights& w, Tensor& t, float scale) {
  t.data = w.owned.emplace_back(matrix_f32(t, scale)).data();
  t.dtype = DType::f32;
}

}  // namespace

bool has_output_scales(const ModelWeights& w) {
  for (const LayerWeights& L : w.layers)
    for (float s : L.out_scale)
      if (s != 1.0f) return true;
  return false;
}

void fold_output_scales(ModelWeights& w) {
  for (LayerWeights& L : w.layers) {
    if (!L.held()) continue;
    for (LoraTarget t : kAllLoraTargets) {
      float& s = L.out_scale[static_cast<size_t>(t)];
      if (s == 1.0f) continue;
      replace_by_f32(w, target_matrix(L, t), s);
      s = 1.0f;
    }
  }
}

void dequantize_weights(ModelWeights& w) {
  fold_output_scales(w);
  auto expand = [&w](Tensor& t) {
    if (t.data == nullptr || t.dtype == DType::f32) return;  // not held (a pipeline stage's cut), or f32 already
    replace_by_f32(w, t, 1.0f);
  };
  const bool tied = w.output.data == w.token_embd.data;
  expand(w.token_embd);
  if (tied) w.output = w.token_embd;
  else expand(w.output);
  for (auto& L : w.layers)
    for (Tensor* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) expand(*t);
}

void prepare_weights(ModelWeights& w, Backend& backend) {
  // Again after an update (full fine-tuning): every handle is prepared in place,
  // reusing its memory, so a training step allocates nothing here.
  w.prepared.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    if (!L.held()) continue;
    PreparedLayer& P = w.prepared[l];
    P.wq = backend.prepare_weight(L.wq, "attn_q", std::move(P.wq));
    P.wk = backend.prepare_weight(L.wk, "attn_k", std::move(P.wk));
    P.wv = backend.prepare_weight(L.wv, "attn_v", std::move(P.wv));
    P.wo = backend.prepare_weight(L.wo, "attn_output", std::move(P.wo));
    P.w_gate = backend.prepare_weight(L.w_gate, "ffn_gate", std::move(P.w_gate));
    P.w_up = backend.prepare_weight(L.w_up, "ffn_up", std::move(P.w_up));
    P.w_down = backend.prepare_weight(L.w_down, "ffn_down", std::move(P.w_down));
  }
  if (w.output.data != nullptr)
    w.output_prepared = backend.prepare_weight(w.output, "output", std::move(w.output_prepared));
}

RopeTable make_rope_table(const ModelConfig& c) {
  RopeTable r;
  r.head_dim = c.head_dim;
  r.interleaved = c.rope_layout == RopeLayout::interleaved;
  const int64_t half = c.head_dim / 2;
  const auto& sc = c.rope_scaling;
  for (int64_t i = 0; i < half; ++i) {
    double f = std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(c.head_dim));
    if (sc.factor > 0) {  // Llama 3.1 frequency-dependent scaling
      const double old_ctx = static_cast<double>(sc.original_max_position);
      const double low_wavelen = old_ctx / sc.low_freq_factor, high_wavelen = old_ctx / sc.high_freq_factor;
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= sc.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (old_ctx / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
        f = (1 - smooth) * f / sc.factor + smooth * f;
      }
    }
    r.inv_freq.push_back(static_cast<float>(f));
  }
  return r;
}

ModelWeights bind_weights(const ModelConfig& c, WeightNaming naming, const TensorLookup& lookup,
                          const std::string& source) {
  ModelWeights w;
  Binder b(lookup, source, w);
  const bool gg = naming == WeightNaming::gguf;
  const int64_t H = c.hidden, F = c.intermediate, Q = c.q_dim(), KV = c.kv_dim(), V = c.vocab_size;

  w.token_embd = b.matrix(gg ? "token_embd.weight" : "model.embed_tokens.weight", V, H);
  w.output_norm = b.vector(gg ? "output_norm.weight" : "model.norm.weight", H);
  const std::string out_name = gg ? "output.weight" : "lm_head.weight";
  if (!c.tied_embeddings && b.find(out_name)) w.output = b.matrix(out_name, V, H);
  else w.output = w.token_embd;
  // llama.cpp's output scale ("output.scale"), rare (ModelOpt leaves lm_head
  // unquantized): folded into an f32 copy at once, so that the logits, the
  // loss and every export see one matrix (a tied one becomes untied).
  if (gg)
    if (const float s = read_output_scale(b, "output.scale", "output", source); s != 1.0f)
      replace_by_f32(w, w.output, s);

  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = gg ? fmt::format("blk.{}.", l) : fmt::format("model.layers.{}.", l);
    auto name = [&](const char* gguf_name, const char* hf_name) { return p + (gg ? gguf_name : hf_name); };
    LayerWeights L;
    L.attn_norm = b.vector(name("attn_norm.weight", "input_layernorm.weight"), H);
    L.wq = b.matrix(name("attn_q.weight", "self_attn.q_proj.weight"), Q, H);
    L.wk = b.matrix(name("attn_k.weight", "self_attn.k_proj.weight"), KV, H);
    L.wv = b.matrix(name("attn_v.weight", "self_attn.v_proj.weight"), KV, H);
    L.wo = b.matrix(name("attn_output.weight", "self_attn.o_proj.weight"), H, Q);
    L.bq = b.vector(name("attn_q.bias", "self_attn.q_proj.bias"), Q, c.qkv_bias);
    L.bk = b.vector(name("attn_k.bias", "self_attn.k_proj.bias"), KV, c.qkv_bias);
    L.bv = b.vector(name("attn_v.bias", "self_attn.v_proj.bias"), KV, c.qkv_bias);
    L.ffn_norm = b.vector(name("ffn_norm.weight", "post_attention_layernorm.weight"), H);
    L.w_gate = b.matrix(name("ffn_gate.weight", "mlp.gate_proj.weight"), F, H);
    L.w_up = b.matrix(name("ffn_up.weight", "mlp.up_proj.weight"), F, H);
    L.w_down = b.matrix(name("ffn_down.weight", "mlp.down_proj.weight"), H, F);
    // GGUF's "<projection>.scale"; the scale a quantized folder's reader
    // supplies as "<module>.output_scale" (model/modelopt_folder.h).
    for (LoraTarget t : kAllLoraTargets) {
      const std::string proj = p + (gg ? lora_target_gguf_name(t) : lora_target_hf_module(t));
      L.out_scale[static_cast<size_t>(t)] =
          read_output_scale(b, proj + (gg ? ".scale" : ".output_scale"), proj, source);
    }
    w.layers.push_back(L);
  }
  // A layer past the config's count: the config and the weights disagree (an
  // edited num_hidden_layers / block_count), and the model would run on part of
  // its layers without a word.
  const std::string past = gg ? fmt::format("blk.{}.attn_q.weight", c.n_layers)
                              : fmt::format("model.layers.{}.self_attn.q_proj.weight", c.n_layers);
  if (b.find(past))
    fail(ErrorKind::invalid_input,
         "{}: holds tensor '{}', but its config gives {} layers ({}): the config and the "
         "weights disagree",
         source, past, c.n_layers, gg ? "the GGUF's block_count" : "num_hidden_layers");

  w.rope = make_rope_table(c);
  // GGUF stores Llama-3 scaling as per-pair divisors of the base frequencies.
  if (gg) {
    if (const float* freqs = b.vector("rope_freqs.weight", c.head_dim / 2, false)) {
      ModelConfig plain = c;
      plain.rope_scaling = RopeScaling{};
      w.rope = make_rope_table(plain);
      for (size_t i = 0; i < w.rope.inv_freq.size(); ++i) {
        if (!(freqs[i] > 0)) fail(ErrorKind::invalid_input, "{}: rope_freqs.weight[{}] must be > 0", source, i);
        w.rope.inv_freq[i] /= freqs[i];
      }
    }
  }
  return w;
}

}  // namespace loom

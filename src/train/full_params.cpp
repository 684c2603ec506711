// The f32 parameter and gradient arenas of full fine-tuning.
#include "train/full_params.h"

#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/cpu/dequant.h"

namespace loom {

FullParams::FullParams(ModelWeights& w, const ModelConfig& c, ThreadPool& pool) {
  tied_ = w.output.data != nullptr && w.output.data == w.token_embd.data;  // both in one process (or one stage)
  // Pass 1: sizes and offsets, in a fixed order; pass 2 copies and re-points.
  size_t total = 0;
  // `cut`: how tensor parallel cuts it (model/tensor_parallel.h): a layer's projections and biases.
  auto add = [&](int64_t n, bool decay, std::string name, int64_t rows = 0, Cut cut = Cut::none) {
    spans_.push_back({total, static_cast<size_t>(n), decay, std::move(name), rows, cut});
    total += static_cast<size_t>(n);
    return spans_.size() - 1;
  };
  const int64_t H = c.hidden;
  // A pipeline stage (model/pipeline_stage.h) holds some layers and maybe the
  // embedding or the head: the arena takes only what it holds.
  const bool has_embd = w.token_embd.data != nullptr, has_head = w.output.data != nullptr;
  // Tied embeddings split over the first and the last stage: each holds a copy.
  const bool tied_copy = c.tied_embeddings && has_embd != has_head;
  const size_t embd =
      has_embd ? add(w.token_embd.numel(), true, "model.embed_tokens.weight", w.token_embd.rows()) : SIZE_MAX;
  struct LayerSpans {
    size_t attn_norm, wq, wk, wv, wo, bq = SIZE_MAX, bk = SIZE_MAX, bv = SIZE_MAX, ffn_norm, gate, up, down;
  };
  std::vector<LayerSpans> ls;
  for (const LayerWeights& L : w.layers) {
    LayerSpans s{};
    if (!L.held()) {  // another stage's: an empty run where it would be keeps the layers' runs adjacent
      ls.push_back(s);
      layer_ranges_.push_back({total, total});
      continue;
    }
    const std::string p = fmt::format("model.layers.{}.", ls.size());  // Hugging Face names
    s.attn_norm = add(H, false, p + "input_layernorm.weight");
    s.wq = add(L.wq.numel(), true, p + "self_attn.q_proj.weight", L.wq.rows(), Cut::rows);
    s.wk = add(L.wk.numel(), true, p + "self_attn.k_proj.weight", L.wk.rows(), Cut::rows);
    s.wv = add(L.wv.numel(), true, p + "self_attn.v_proj.weight", L.wv.rows(), Cut::rows);
    s.wo = add(L.wo.numel(), true, p + "self_attn.o_proj.weight", L.wo.rows(), Cut::columns);
    if (L.bq != nullptr) {
      s.bq = add(L.wq.rows(), false, p + "self_attn.q_proj.bias", 0, Cut::rows);
      s.bk = add(L.wk.rows(), false, p + "self_attn.k_proj.bias", 0, Cut::rows);
      s.bv = add(L.wv.rows(), false, p + "self_attn.v_proj.bias", 0, Cut::rows);
    }
    s.ffn_norm = add(H, false, p + "post_attention_layernorm.weight");
    s.gate = add(L.w_gate.numel(), true, p + "mlp.gate_proj.weight", L.w_gate.rows(), Cut::rows);
    s.up = add(L.w_up.numel(), true, p + "mlp.up_proj.weight", L.w_up.rows(), Cut::rows);
    s.down = add(L.w_down.numel(), true, p + "mlp.down_proj.weight", L.w_down.rows(), Cut::columns);
    ls.push_back(s);
    layer_ranges_.push_back({spans_[s.attn_norm].offset, spans_[s.down].offset + spans_[s.down].size});
  }
  const size_t out_norm = w.output_norm != nullptr ? add(H, false, "model.norm.weight") : SIZE_MAX;
  const char* head_name = tied_copy ? "model.embed_tokens.weight" : "lm_head.weight";  // the last stage's copy
  const size_t output = !has_head ? SIZE_MAX : tied_ ? embd : add(w.output.numel(), true, head_name, w.output.rows());
  if (tied_copy) tied_copy_span_ = has_embd ? embd : output;

  params_.assign(total, 0.0f);
  grads_.assign(total, 0.0f);
  auto p = [&](size_t span) { return params_.data() + spans_[span].offset; };
  auto g = [&](size_t span) { return grads_.data() + spans_[span].offset; };
  // Matrices: dequantize rows in parallel into the arena, then point the tensor
  // there. Both return the parameter's gradient in the gradient arena.
  auto take_matrix = [&](Tensor& t, size_t span) {
    float* dst = p(span);
    const Tensor src = t;
    bound_bytes_ += src.nbytes();
    pool.parallel_for(src.rows(), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequantize_row(src.dtype, src.row_ptr(r), dst + r * src.cols(), src.cols());
    });
    t.data = dst;
    t.dtype = DType::f32;
    return g(span);
  };
  auto take_vector = [&](const float*& v, size_t span) {
    std::memcpy(p(span), v, spans_[span].size * sizeof(float));
    bound_bytes_ += spans_[span].size * sizeof(float);
    v = p(span);
    return g(span);
  };
  if (has_embd) {
    take_matrix(w.token_embd, embd);
    embd_grad_ = g(embd);
  }
  if (tied_)
    w.output = w.token_embd;
  else if (has_head)
    take_matrix(w.output, output);
  if (has_head) output_grad_ = g(output);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    LayerWeights& L = w.layers[l];
    const LayerSpans& s = ls[l];
    LayerGrads lg;
    if (!L.held()) {
      layers_.push_back(lg);
      continue;
    }
    lg.attn_norm = take_vector(L.attn_norm, s.attn_norm);
    lg.wq = take_matrix(L.wq, s.wq);
    lg.wk = take_matrix(L.wk, s.wk);
    lg.wv = take_matrix(L.wv, s.wv);
    lg.wo = take_matrix(L.wo, s.wo);
    if (s.bq != SIZE_MAX) {
      lg.bq = take_vector(L.bq, s.bq);
      lg.bk = take_vector(L.bk, s.bk);
      lg.bv = take_vector(L.bv, s.bv);
    }
    lg.ffn_norm = take_vector(L.ffn_norm, s.ffn_norm);
    lg.w_gate = take_matrix(L.w_gate, s.gate);
    lg.w_up = take_matrix(L.w_up, s.up);
    lg.w_down = take_matrix(L.w_down, s.down);
    layers_.push_back(lg);
  }
  if (out_norm != SIZE_MAX) output_norm_grad_ = take_vector(w.output_norm, out_norm);
}

std::span<float> FullParams::tied_copy_grads() {
  if (tied_copy_span_ == SIZE_MAX) return {};
  return {grads_.data() + spans_[tied_copy_span_].offset, spans_[tied_copy_span_].size};
}

std::string FullParams::tensor_at(size_t offset) const {
  for (const Span& s : spans_)
    if (offset >= s.offset && offset - s.offset < s.size) return s.name;
  return "";
}

std::vector<TensorSpan> FullParams::tensor_spans() const {
  std::vector<TensorSpan> out;
  for (const Span& s : spans_) out.push_back({s.offset, s.size, s.rows});
  return out;
}

std::vector<std::pair<size_t, size_t>> FullParams::unsplit_ranges() const {
  std::vector<std::pair<size_t, size_t>> out;
  for (const Span& s : spans_)
    if (s.cut == Cut::none) out.push_back({s.offset, s.size});
  return out;
}

std::vector<FullParams::CutSpan> FullParams::cut_spans() const {
  std::vector<CutSpan> out;
  for (const Span& s : spans_)
    out.push_back({s.offset, s.size, s.rows, s.cut});
  return out;
}

void FullParams::zero_grads() { std::memset(grads_.data(), 0, grads_.size() * sizeof(float)); }

std::vector<ParamGroup> FullParams::param_groups(double lr, double weight_decay) const {
  // Runs of equal decay become one group each (groups must be contiguous).
  std::vector<ParamGroup> groups;
  for (const Span& s : spans_) {
    if (!groups.empty() && groups.back().decay == s.decay && groups.back().offset + groups.back().size == s.offset) {
      groups.back().size += s.size;
      continue;
    }
    ParamGroup pg;
    pg.name = s.decay ? "weights" : "norms_and_biases";
    pg.offset = s.offset;
    pg.size = s.size;
    pg.lr = lr;
    pg.weight_decay = weight_decay;
    pg.decay = s.decay;
    groups.push_back(pg);
  }
  return groups;
}

int64_t FullParams::keep_zeros() {
  masked_spans_.clear();
  size_t bits = 0;
  for (size_t i = 0; i < spans_.size(); ++i)
    if (spans_[i].name.starts_with("model.layers.") && spans_[i].name.ends_with("_proj.weight")) {
      masked_spans_.push_back(i);
      bits += spans_[i].size;
    }
  zero_bits_.assign((bits + 63) / 64, 0);
  int64_t zeros = 0;
  size_t bit = 0;
  for (size_t i : masked_spans_) {
    const float* p = params_.data() + spans_[i].offset;
    for (size_t j = 0; j < spans_[i].size; ++j, ++bit)
      if (p[j] == 0.0f) {
        zero_bits_[bit / 64] |= uint64_t{1} << (bit % 64);
        ++zeros;
      }
  }
  return zeros;
}

void FullParams::apply_mask(float* arena) const {
  size_t bit = 0;
  for (size_t i : masked_spans_) {
    float* p = arena + spans_[i].offset;
    for (size_t j = 0; j < spans_[i].size; ++j, ++bit)
      if ((zero_bits_[bit / 64] >> (bit % 64)) & 1) p[j] = 0.0f;
  }
}

}  // namespace loom

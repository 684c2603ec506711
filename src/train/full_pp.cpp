// The stages' exchanges of full fine-tuning under pipeline parallel (full_pp.h).
#include "train/full_pp.h"

#include "core/error.h"
#include "model/pipeline_stage.h"

namespace loom {

namespace {

// Past the pipeline's micro-batch tags (2 i, 2 i + 1): every such message of
// the step has been received before these are sent.
constexpr int kTiedTag = 30000, kGatherTag = 30001;

// One f32 tensor a stage sends: a matrix (`mat`, its shape that of `like`) or a vector of n (`vec`).
struct Run {
  Tensor* mat = nullptr;
  const float** vec = nullptr;
  const Tensor* like = nullptr;
  int64_t n = 0;
};

// Layer L's tensors in the order both sides of the gather walk them; `like`:
// a layer of the same shapes (the receiver's own first layer).
std::vector<Run> layer_runs(LayerWeights& L, const LayerWeights& like, int64_t hidden) {
  std::vector<Run> r = {{nullptr, &L.attn_norm, nullptr, hidden},
                        {&L.wq, nullptr, &like.wq, like.wq.numel()},
                        {&L.wk, nullptr, &like.wk, like.wk.numel()},
                        {&L.wv, nullptr, &like.wv, like.wv.numel()},
                        {&L.wo, nullptr, &like.wo, like.wo.numel()}};
  if (like.bq != nullptr) {
    r.push_back({nullptr, &L.bq, nullptr, like.wq.rows()});
    r.push_back({nullptr, &L.bk, nullptr, like.wk.rows()});
    r.push_back({nullptr, &L.bv, nullptr, like.wv.rows()});
  }
  r.push_back({nullptr, &L.ffn_norm, nullptr, hidden});
  r.push_back({&L.w_gate, nullptr, &like.w_gate, like.w_gate.numel()});
  r.push_back({&L.w_up, nullptr, &like.w_up, like.w_up.numel()});
  r.push_back({&L.w_down, nullptr, &like.w_down, like.w_down.numel()});
  return r;
}

// Stage k's tensors, in order: its layers, then (the last stage) the final
// norm and, when not tied, the output matrix.
std::vector<Run> stage_runs(ModelWeights& w, const LayerWeights& like, const Tensor& embd,
                            const ModelConfig& c, PipelineStage s) {
  std::vector<Run> out;
  const LayerSpan span = pipeline_stage_layers(c.n_layers, s);
  for (int64_t l = span.first; l < span.last; ++l)
    for (const Run& r : layer_runs(w.layers[static_cast<size_t>(l)], like, c.hidden)) out.push_back(r);
  if (span.last == c.n_layers) {
    out.push_back({nullptr, &w.output_norm, nullptr, c.hidden});
    if (!c.tied_embeddings)
      out.push_back({&w.output, nullptr, &embd, embd.numel()});  // [vocab, hidden] as the embedding
  }
  return out;
}

}  // namespace

void sum_tied_embedding_grads(Communicator& pp, std::span<float> tied) {
  if (tied.empty()) return;
  const int s = pp.rank(), last = pp.size() - 1;
  LOOM_ASSERT(s == 0 || s == last);
  std::vector<float> theirs(tied.size());
  auto send = pp.start_send(tied.data(), tied.size_bytes(), s == 0 ? last : 0, kTiedTag);
  pp.recv(theirs.data(), theirs.size() * sizeof(float), s == 0 ? last : 0, kTiedTag);
  pp.wait(*send, "tied embedding gradients");
  // first + last on both stages, in that order (float addition commutes: the same bits either way)
  for (size_t i = 0; i < tied.size(); ++i) tied[i] = s == 0 ? tied[i] + theirs[i] : theirs[i] + tied[i];
}

void gather_full_pipeline(Communicator& pp, ModelWeights& w, const ModelConfig& c,
                          std::vector<std::vector<float>>& store) {
  const int S = pp.size(), s = pp.rank();
  if (s > 0) {  // send this stage's tensors (the f32 arena's views) in stage_runs' order
    const LayerSpan span = pipeline_stage_layers(c.n_layers, {s, S});
    const LayerWeights like = w.layers[static_cast<size_t>(span.first)];
    for (const Run& r : stage_runs(w, like, w.output, c, {s, S})) {
      const void* p = r.mat != nullptr ? r.mat->data : static_cast<const void*>(*r.vec);
      LOOM_ASSERT(r.mat == nullptr || r.mat->dtype == DType::f32);
      auto req = pp.start_send(p, static_cast<size_t>(r.n) * sizeof(float), 0, kGatherTag);
      pp.wait(*req, "pipeline gather of the trained weights");
    }
    return;
  }
  const LayerWeights like = w.layers[0];  // stage 0 holds layer 0; every layer has its shapes
  LOOM_ASSERT(like.held() && w.token_embd.data != nullptr);
  for (int k = 1; k < S; ++k)
    for (const Run& r : stage_runs(w, like, w.token_embd, c, {k, S})) {
      std::vector<float>& v = store.emplace_back(static_cast<size_t>(r.n));
      pp.recv(v.data(), v.size() * sizeof(float), k, kGatherTag);
      if (r.mat != nullptr)
        *r.mat = make_tensor(v.data(), DType::f32, {r.like->rows(), r.like->cols()});
      else
        *r.vec = v.data();
    }
  if (c.tied_embeddings) w.output = w.token_embd;
}

}  // namespace loom

// Full fine-tuning: every weight of the model as f32 in one parameter arena,
// with a gradient arena of the same layout (zeroing is one memset). The model's
// ModelWeights are re-pointed into the arena, so the forward reads the weights
// being trained and write_hf_folder exports them.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/config.h"
#include "model/weights.h"
#include "train/optimizer.h"

namespace loom {

// Gradients of one layer, pointers into FullParams::grads() (nullptr: absent, e.g. biases of llama).
struct LayerGrads {
  float *attn_norm = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  float *bq = nullptr, *bk = nullptr, *bv = nullptr;
  float *ffn_norm = nullptr, *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;
};

class FullParams {
 public:
  // Copies every weight of `w` (dequantized to f32) into the arena and points
  // `w`'s tensors and vectors at it; `w` must then be (re)packed. Tied output
  // and embedding stay one tensor (one parameter, both gradients summed).
  // A pipeline stage's `w` (model/pipeline_stage.h): only the tensors it holds;
  // with tied embeddings the first and the last stage each hold a copy
  // (tied_copy_grads), whose gradients the Trainer sums between them.
  FullParams(ModelWeights& w, const ModelConfig& c, ThreadPool& pool);

  int64_t param_count() const { return static_cast<int64_t>(params_.size()); }
  float* params() { return params_.data(); }
  float* grads() { return grads_.data(); }
  const float* grads() const { return grads_.data(); }
  void zero_grads();

  const LayerGrads& layer_grads(int64_t l) const { return layers_[static_cast<size_t>(l)]; }
  float* token_embd_grad() const { return embd_grad_; }
  float* output_grad() const { return output_grad_; }  // == token_embd_grad() when tied
  float* output_norm_grad() const { return output_norm_grad_; }
  bool tied() const { return tied_; }
  // The bytes of the weights as they were bound before the arena took them
  // (a pipeline stage's file pages read: Model::weight_bytes now counts the arena).
  size_t bound_bytes() const { return bound_bytes_; }
  // Pipeline parallel: this stage's copy of a tied embedding (empty otherwise).
  std::span<float> tied_copy_grads();

  // Two groups like transformers' Trainer: matrices and embeddings decay,
  // norms and biases do not.
  std::vector<ParamGroup> param_groups(double lr, double weight_decay) const;
  // The Hugging Face name of the weight holding arena element `offset`
  // ("model.layers.3.mlp.up_proj.weight"); "" past the end.
  std::string tensor_at(size_t offset) const;
  std::vector<TensorSpan> tensor_spans() const;  // every weight's run of the arena
  // Tensor parallel: the runs of the tensors it does not cut (norms, embedding,
  // output), whole and alike on every rank, their gradients too (computed from
  // the summed input gradients).
  std::vector<std::pair<size_t, size_t>> unsplit_ranges() const;
  // Every tensor's run of the arena and how tensor parallel cuts it (train/full_tp.h
  // maps a rank's arena onto the whole model's with them).
  enum class Cut { none, rows, columns };  // biases: rows (of one column)
  struct CutSpan {
    size_t offset, size;
    int64_t rows;
    Cut cut;
  };
  std::vector<CutSpan> cut_spans() const;
  // Layer l's run [begin, end) of the arena: its norms, matrices and biases.
  const std::vector<std::pair<size_t, size_t>>& layer_ranges() const { return layer_ranges_; }

  // A pruned model's zeros stay zero: the zeros of every layer's seven linear
  // weights are remembered now; mask_grads() zeroes their gradients (before
  // clipping and AdamW) and mask_params() the weights (after the update, so
  // that no optimizer state can move them). Returns how many there are.
  int64_t keep_zeros();
  void mask_grads() { apply_mask(grads_.data()); }
  void mask_params() { apply_mask(params_.data()); }

 private:
  struct Span {
    size_t offset, size;
    bool decay;
    std::string name;
    int64_t rows = 0;  // matrices: their rows
    Cut cut = Cut::none;  // by tensor parallel
  };
  void apply_mask(float* arena) const;

  std::vector<Span> spans_;
  std::vector<size_t> masked_spans_;  // indices into spans_ of the linear weights
  std::vector<uint64_t> zero_bits_;   // their zeros, one bit per element in span order
  std::vector<float> params_, grads_;
  std::vector<LayerGrads> layers_;
  std::vector<std::pair<size_t, size_t>> layer_ranges_;
  float *embd_grad_ = nullptr, *output_grad_ = nullptr, *output_norm_grad_ = nullptr;
  bool tied_ = false;
  size_t bound_bytes_ = 0;
  size_t tied_copy_span_ = SIZE_MAX;  // index into spans_
};

}  // namespace loom

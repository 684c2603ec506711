// Pipeline parallel's share of a TrainSession: the forward and the backward
// of one micro-batch through a run of layers (train/trainer_pp.cpp). The same
// kernels in the same order as forward_backward, so a pipeline of stages
// gives the gradients of one process bit for bit.
#include <cstring>

#include "core/error.h"
#include "train/train_step.h"

namespace loom {

const float* TrainSession::forward_stage(const Batch& batch, float grad_scale, uint64_t step, int64_t first,
                                         int64_t last, const float* x_in, LossResult* loss, bool backward) {
  LOOM_ASSERT(0 <= first && first < last && last <= c_.n_layers);
  LOOM_ASSERT(segment_layers() == 0 && !bf16_records());  // the trainer refuses them with pipeline parallel
  LOOM_ASSERT((first == 0) == (x_in == nullptr));
  check_batch(batch);
  const int64_t T = batch.rows * batch.seq_len, H = c_.hidden;
  const bool dropout = backward && lora_ && lora_->config().dropout > 0;
  reserve(T);
  set_positions(batch);
  float* x0 = layers_[static_cast<size_t>(first)].x;
  if (first == 0)
    dec_.embed(batch.tokens.data(), T, x0);
  else
    std::memcpy(x0, x_in, static_cast<size_t>(T * H) * sizeof(float));
  dec_.rope_table(pos_.data(), T, rope_cs_);
  for (int64_t l = first; l < last; ++l) forward_layer(l, T, dropout, step, next_input(l));
  stage_ = {first, last, dropout, step};
  if (last < c_.n_layers) return next_input(last - 1);
  LOOM_ASSERT(loss != nullptr);
  *loss = loss_and_head_backward(batch, grad_scale, backward);  // the gradient of the last output in dres_
  return nullptr;
}

const float* TrainSession::backward_stage(const float* dy) {
  const int64_t T = tokens_, H = c_.hidden;
  const Stage& s = stage_;
  LOOM_ASSERT((s.last == c_.n_layers) == (dy == nullptr));
  if (dy != nullptr) std::memcpy(dres_, dy, static_cast<size_t>(T * H) * sizeof(float));
  for (int64_t l = s.last - 1; l >= s.first; --l) {
    backward_layer(l, T, s.dropout, s.step, dres_);
    if (layer_done_) layer_done_(l);
  }
  if (s.first > 0) return dres_;
  return nullptr;  // LoRA: the embedding is frozen (full fine-tuning is not split into stages yet)
}

}  // namespace loom

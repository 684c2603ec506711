// Pipeline parallel's share of a TrainSession: the forward and the backward
// of one micro-batch through the layers a stage holds (train/trainer_pp.cpp).
// The same kernels in the same order as forward_backward, so a pipeline of
// stages gives the gradients of one process bit for bit (LoRA; full
// fine-tuning's tied embedding sums its two stages' parts in another order).
#include <cstring>

#include "core/error.h"
#include "train/train_step.h"

namespace loom {

const float* TrainSession::forward_stage(const Batch& batch, float grad_scale, uint64_t step, const float* x_in,
                                         LossResult* loss, bool backward) {
  const int64_t first = span_.first, last = span_.last;
  LOOM_ASSERT(first < last);
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
  forward_layers(T, dropout, step, backward);
  stage_.dropout = dropout;
  stage_.step = step;
  if (backward && full_ != nullptr && first == 0) stage_.tokens.assign(batch.tokens.begin(), batch.tokens.end());  // for the backward
  if (last < c_.n_layers) return x_final_;  // the stage's output
  LOOM_ASSERT(loss != nullptr);
  *loss = loss_and_head_backward(batch, grad_scale, backward);  // the gradient of the last output in dres_
  return nullptr;
}

const float* TrainSession::backward_stage(const float* dy) {
  const int64_t T = tokens_, H = c_.hidden;
  LOOM_ASSERT((span_.last == c_.n_layers) == (dy == nullptr));
  if (dy != nullptr) std::memcpy(dres_, dy, static_cast<size_t>(T * H) * sizeof(float));
  backward_segments(T, stage_.dropout, stage_.step);
  if (span_.first > 0) return dres_;
  // dres_ is d(embedding rows): full fine-tuning's first stage trains the embedding (LoRA's is frozen).
  if (full_ != nullptr)
    be_.embedding_backward(full_->token_embd_grad(), dres_, stage_.tokens.data(), T, c_.vocab_size, H);
  return nullptr;
}

}  // namespace loom

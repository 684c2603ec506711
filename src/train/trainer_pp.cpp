// The Trainer under pipeline parallel (dist.pp S): rank s holds the decoder
// layers [s L / S, (s+1) L / S) (model/pipeline_stage.h: only their weights are
// loaded, prepared and transposed; stage 0 adds the embedding, the last stage
// the head; the LoRA arena stays whole on every rank, full fine-tuning's
// arena holds the stage's tensors only: train/full_pp.h), the stages of a pipeline
// read the same micro-batches (N pipelines on N S ranks split the data as data
// parallel does), and they flow through the stages in the 1F1B order: stage s
// runs S - s - 1 forwards, then one forward and one backward in turn, then the
// remaining backwards (PipeDream-Flush, Megatron-LM's default). Activations go
// forward and their gradients back as point-to-point messages. Each layer's
// gradients are accumulated micro-batch after micro-batch as one process does
// it, then (LoRA) summed over the stages (each gradient is non-zero on one stage
// only): the same bits as one process with the same grad_accum.
#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "train/train_log.h"
#include "train/trainer.h"

namespace loom {

void Trainer::check_pipeline_parallel() const {
  const int pp = c_.dist.pp;
  if (pp == 1) return;
  if (c_.method == TrainMethod::full) check_pipeline_full();
  if (c_.qat.enabled())
    fail(ErrorKind::unsupported, "{}: qat with dist.pp is not built yet (the fake-quantized W + s B A spans the "
         "stages' layers)", c_.source);
}

// Full fine-tuning splits its arena into the stages' tensors: what would need
// one layout on every stage (the whole arena) is refused (with dist.tp too:
// load_trainable_model refuses that).
void Trainer::check_pipeline_full() const {
  if (c_.checkpoint_interval > 0 || c_.checkpoint_minutes > 0 || rt_.resume.has_value())
    fail(ErrorKind::unsupported, "{}: checkpoints of full fine-tuning with dist.pp are not written yet (each stage "
         "holds only its tensors and their AdamW moments); leave checkpoint_interval and checkpoint_minutes at 0 and "
         "do not --resume", c_.source);
  // Both copies of a tied embedding must take the same update: they are summed
  // after the data-parallel sum, which must then be the plain one (a ZeRO shard
  // or a compressed gradient would differ between the first and last stage's arenas).
  if (world() > model_ranks() && (c_.dist.zero1 || c_.dist.sync.compression != GradCompression::none))
    fail(ErrorKind::unsupported, "{}: dist.zero and dist.compression across pipelines of full fine-tuning are not "
         "built yet; leave them off", c_.source);
}

void Trainer::setup_pipeline_parallel() {
  if (c_.dist.pp == 1) return;
  const int64_t L = model_->config().n_layers, S = c_.dist.pp;
  const LayerSpan span = pipeline_stage_layers(L, *model_->stage());  // the layers the model holds
  // One session (its saved activations) per micro-batch in flight: 1F1B has
  // at most S - s on stage s. They share the first's transposed backward weights.
  stage_sessions_.clear();
  for (int64_t i = 1; i < in_flight(); ++i) stage_sessions_.push_back(session_->sibling());
  log_->record(LogLevel::info, "dist",
               fmt::format("pipeline parallel: {} stages of about {} layers, 1F1B over {} micro-batches a step; stage "
                           "{} runs layers [{}, {})", S, L / S, c_.grad_accum, stage(), span.first, span.last),
               {{"dist", {{"pipeline_stages", S}, {"micro_batches", c_.grad_accum}}}});
}

int64_t Trainer::in_flight() const { return std::min<int64_t>(c_.grad_accum, c_.dist.pp - stage()); }

TrainSession& Trainer::stage_session(size_t i) {
  const size_t j = i % static_cast<size_t>(in_flight());
  return j == 0 ? *session_ : *stage_sessions_[j - 1];
}

// One step's micro-batches through this stage in 1F1B order; returns the
// loss sum over the step (every rank: the last stage's, all-reduced).
double Trainer::pipeline_step(float scale, int64_t step) {
  const int S = c_.dist.pp, s = stage();
  const auto G = static_cast<int64_t>(micro_.size());
  const int64_t H = model_->config().hidden;
  // The sends out of each session's buffers (its output, its input gradient):
  // done before the session takes the next micro-batch, and at the end of the step.
  const int64_t K = in_flight();
  std::vector<std::vector<std::unique_ptr<CommRequest>>> sends(static_cast<size_t>(K));
  auto wait_sends = [&](int64_t j) {
    for (auto& r : sends[static_cast<size_t>(j)]) pp_comm_->wait(*r, "pipeline send");
    sends[static_cast<size_t>(j)].clear();
  };
  std::vector<float> x;
  double loss_sum = 0;
  int64_t sent = 0;  // bytes this stage sends
  auto tokens = [&](int64_t i) { return micro_[static_cast<size_t>(i)].rows * micro_[static_cast<size_t>(i)].seq_len; };
  auto forward = [&](int64_t i) {
    const Batch& b = micro_[static_cast<size_t>(i)];
    if (b.target_tokens == 0) return;  // every stage skips it, as one process does
    const int64_t n = tokens(i) * H;
    wait_sends(i % K);  // micro-batch i - K's, whose receivers have it or are about to take it
    if (s > 0) {
      x.resize(static_cast<size_t>(n));
      pp_comm_->recv(x.data(), x.size() * sizeof(float), s - 1, static_cast<int>(2 * i));
    }
    LossResult r;
    // The one process's numbering of the micro-batch (trainer_dist.cpp's backward_step).
    const auto mask_counter = static_cast<uint64_t>((step * data_ranks() + data_rank()) * G + i);
    const float* out =
        stage_session(static_cast<size_t>(i)).forward_stage(b, scale, mask_counter, s > 0 ? x.data() : nullptr, &r);
    if (s + 1 < S) {
      sends[static_cast<size_t>(i % K)].push_back(
          pp_comm_->start_send(out, static_cast<size_t>(n) * sizeof(float), s + 1, static_cast<int>(2 * i)));
      sent += n * static_cast<int64_t>(sizeof(float));
    } else {
      loss_sum += r.loss_sum;
    }
    input_tokens_ += tokens(i);
  };
  std::vector<float> dy;
  auto backward = [&](int64_t i) {
    if (micro_[static_cast<size_t>(i)].target_tokens == 0) return;
    const int64_t n = tokens(i) * H;
    if (s + 1 < S) {
      dy.resize(static_cast<size_t>(n));
      pp_comm_->recv(dy.data(), dy.size() * sizeof(float), s + 1, static_cast<int>(2 * i + 1));
    }
    const float* dx = stage_session(static_cast<size_t>(i)).backward_stage(s + 1 < S ? dy.data() : nullptr);
    if (s > 0) {  // the session keeps dx until its next call
      sends[static_cast<size_t>(i % K)].push_back(
          pp_comm_->start_send(dx, static_cast<size_t>(n) * sizeof(float), s - 1, static_cast<int>(2 * i + 1)));
      sent += n * static_cast<int64_t>(sizeof(float));
    }
  };
  const int64_t warm = std::min<int64_t>(S - s - 1, G);
  for (int64_t i = 0; i < warm; ++i) forward(i);
  for (int64_t i = warm; i < G; ++i) {
    forward(i);
    backward(i - warm);
  }
  for (int64_t i = G - warm; i < G; ++i) backward(i);
  for (int64_t j = 0; j < K; ++j) wait_sends(j);
  // LoRA: each layer's gradients live on its stage: the sum over stages gives
  // every rank all of them. Full fine-tuning: each stage keeps its own
  // (sum_tied_stage_grads follows the data-parallel sum).
  if (!params_->split_into_stages()) pp_comm_->allreduce_sum(params_->grads());
  double v[2] = {loss_sum, static_cast<double>(sent)};  // the last stage's loss; every stage's bytes
  pp_comm_->allreduce_sum(std::span<double>(v, 2));
  step_pp_bytes_ = static_cast<int64_t>(v[1]);
  return v[0];
}

// An evaluation batch by batch through the stages (forward only); the
// data-parallel pipelines take batches i with i mod N = R.
LossResult Trainer::eval_pipeline(const DataSplit& split) {
  const int S = c_.dist.pp, s = stage();
  const int64_t W = data_ranks(), R = data_rank();
  const int64_t H = model_->config().hidden;
  DataLoader loader(split, data_->pad_id, c_.batch_size, /*shuffle=*/false, 0);
  LossResult sum;
  Batch b;
  std::vector<float> x;
  for (int64_t i = 0, nb = loader.batches_per_epoch(); i < nb; ++i) {
    if (i % W != R) {
      loader.skip();
      continue;
    }
    loader.next(b);
    if (b.target_tokens == 0) continue;
    const auto n = static_cast<size_t>(b.rows * b.seq_len * H);
    if (s > 0) {
      x.resize(n);
      pp_comm_->recv(x.data(), n * sizeof(float), s - 1, 0);
    }
    LossResult r;
    const float* out =
        session_->forward_stage(b, 0.0f, 0, s > 0 ? x.data() : nullptr, &r, false);
    if (s + 1 < S) {
      auto req = pp_comm_->start_send(out, n * sizeof(float), s + 1, 0);
      pp_comm_->wait(*req, "pipeline send");
    } else if (tp_rank() == 0) {  // the last stage's tensor-parallel ranks have the same loss: one counts
      sum.loss_sum += r.loss_sum;
      sum.n_tokens += r.n_tokens;
      sum.n_correct += r.n_correct;
    }
  }
  double v[3] = {sum.loss_sum, static_cast<double>(sum.n_tokens), static_cast<double>(sum.n_correct)};
  rt_.comm->allreduce_sum(std::span<double>(v, 3));  // only last stages add: the sum over the pipelines
  return {v[0], static_cast<int64_t>(v[1]), static_cast<int64_t>(v[2])};
}

}  // namespace loom

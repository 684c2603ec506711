// The Trainer under tensor parallel (dist.tp N; model/tensor_parallel.h): every
// rank trains the same batches on its shard of the heads and MLP channels; the
// decoder sums the o and down products over the ranks, the backward the input
// gradients of q/k/v and gate/up, and after the backward the gradients of the
// adapters every rank holds whole (their partial sums). The global gradient
// norm counts each shard once and the whole adapters once. Rank 0 gathers the
// adapters of the whole model at the end.
#include <cmath>

#include "core/error.h"
#include "dist/partial_sums.h"
#include "train/trainer.h"

namespace loom {

// What this first step of tensor parallel does not combine with, refused before the model loads.
void Trainer::check_tensor_parallel() const {
  const int tp = c_.dist.tp;
  if (tp == 1) return;
  if (world() > model_ranks() && (c_.dist.zero1 || c_.dist.sync.compression != GradCompression::none))
    fail(ErrorKind::unsupported, "{}: dist.zero and dist.compression across tensor-parallel groups are not built yet "
         "(their checkpoints would hold one shard's state); run {} ranks or leave them off", c_.source, model_ranks());
  if (c_.lora.dropout > 0)
    fail(ErrorKind::unsupported, "{}: dist.tp with lora.dropout {}: the dropout masks of split inputs are not drawn "
         "as one process draws them yet; set lora.dropout: 0", c_.source, c_.lora.dropout);
  if (c_.checkpoint_interval > 0 || c_.checkpoint_minutes > 0)
    fail(ErrorKind::unsupported, "{}: checkpoints of a tensor-parallel run (dist.tp) are not written yet; leave "
         "checkpoint_interval and checkpoint_minutes at 0", c_.source);
  if (c_.qat.enabled())
    fail(ErrorKind::unsupported, "{}: qat with dist.tp is not built yet", c_.source);
}

void Trainer::setup_tensor_parallel() {
  if (c_.dist.tp == 1) return;
  tp_full_config_ = model_->config();
  tp_full_config_.n_heads *= c_.dist.tp;
  tp_full_config_.n_kv_heads *= c_.dist.tp;
  tp_full_config_.intermediate *= c_.dist.tp;
  tp_sums_ = std::make_unique<CommunicatorSums>(*tp_comm_);
  session_->set_partial_sums(tp_sums_.get());
}

// The gradients of the adapters every rank holds whole are partial sums: one
// all-reduce of all of them.
void Trainer::sum_replicated_grads() {
  if (!tp_sums_) return;
  const std::span<float> g = params_->grads();
  const std::vector<std::pair<size_t, size_t>> runs = params_->replicated_ranges();
  std::vector<float> buf;
  for (const auto& [o, n] : runs) buf.insert(buf.end(), g.begin() + static_cast<std::ptrdiff_t>(o),
                                             g.begin() + static_cast<std::ptrdiff_t>(o + n));
  tp_sums_->sum(buf.data(), static_cast<int64_t>(buf.size()));
  size_t at = 0;
  for (const auto& [o, n] : runs) {
    std::copy(buf.begin() + static_cast<std::ptrdiff_t>(at), buf.begin() + static_cast<std::ptrdiff_t>(at + n),
              g.begin() + static_cast<std::ptrdiff_t>(o));
    at += n;
  }
}

// The squared norm of the whole model's gradient from this rank's arena (sum
// of squares `local`): the shards' parts summed over the ranks, the whole
// adapters' part once.
double Trainer::global_sum_squares(double local) {
  if (!tp_sums_) return local;
  const std::span<const float> g = params_->grads();
  double whole = 0;
  for (const auto& [o, n] : params_->replicated_ranges())
    for (size_t i = o; i < o + n; ++i) whole += static_cast<double>(g[i]) * g[i];
  double shard = local - whole;
  tp_comm_->allreduce_sum(std::span<double>(&shard, 1));
  return shard + whole;
}

}  // namespace loom

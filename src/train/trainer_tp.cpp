// The Trainer under tensor parallel (dist.tp N; model/tensor_parallel.h): every
// rank trains the same batches on its shard of the heads and MLP channels; the
// decoder sums the o and down products over the ranks, the backward the input
// gradients of q/k/v and gate/up, and after the backward the gradients of the
// adapters every rank holds whole (their partial sums; full fine-tuning's
// uncut norms, embedding and output have alike gradients already, train/full_tp.h
// gathers its weights at the end). The global gradient
// norm counts each shard once and the whole adapters once. LoRA dropout draws
// one process's masks (TrainSession::set_tensor_parallel). Rank 0 gathers the
// adapters (or weights) of the whole model at the end, and at each checkpoint
// the trained params and AdamW's moments in one process's layout
// (train/lora_tp.h, train/full_tp.h), which every rank of a resumed run cuts
// its shard from, whatever its dist.tp.
#include <cmath>

#include "core/error.h"
#include "dist/partial_sums.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace loom {

// What tensor parallel does not combine with yet, refused before the model loads.
void Trainer::check_tensor_parallel() const {
  const int tp = c_.dist.tp;
  if (tp == 1) return;
  const bool checkpoints = c_.checkpoint_interval > 0 || c_.checkpoint_minutes > 0 || rt_.resume.has_value();
  // PowerSGD's Q matrices are per shard (each rank's tensors have their own shapes), and a checkpoint keeps one.
  if (world() > model_ranks() && c_.dist.sync.compression == GradCompression::powersgd && checkpoints)
    fail(ErrorKind::unsupported, "{}: dist.compression powersgd across tensor-parallel groups keeps no checkpoints "
         "(its Q matrices are per shard); use dist.compression topk, or leave checkpoint_interval and "
         "checkpoint_minutes at 0 and do not --resume", c_.source);
  // adamw8bit quantizes each tensor's moments in blocks from its first element: a shard's blocks are not the
  // whole tensor's, so its state cannot be written in (or read from) one process's layout.
  if (c_.optimizer == OptimizerKind::adamw8bit && checkpoints)
    fail(ErrorKind::unsupported, "{}: optim.kind adamw8bit with dist.tp keeps no checkpoints (its 8-bit blocks of a "
         "shard are not those of the whole tensor); use optim.kind adamw, or leave checkpoint_interval and "
         "checkpoint_minutes at 0 and do not --resume", c_.source);
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
  session_->set_tensor_parallel(tp_sums_.get(), tp_rank(), c_.dist.tp);
}

// The gradients of the adapters every rank holds whole are partial sums: one
// all-reduce of all of them.
void Trainer::sum_replicated_grads() {
  if (!tp_sums_ || !params_->replicated_grads_are_partial_sums()) return;
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
  if (c_.dist.pp > 1) local = params_->stage_sum_squares(*pp_comm_, local);  // full fine-tuning: over the stages
  if (!tp_sums_) return local;
  const std::span<const float> g = params_->grads();
  double whole = 0;
  for (const auto& [o, n] : params_->replicated_ranges())
    for (size_t i = o; i < o + n; ++i) whole += static_cast<double>(g[i]) * g[i];
  double shard = local - whole;
  tp_comm_->allreduce_sum(std::span<double>(&shard, 1));
  return shard + whole;
}

// Rank 0's `parts` (AdamW's m and v) and the params returned become the whole
// model's, gathered into `whole`; on the other ranks they are left as they are
// (only rank 0 writes). Only the first data-parallel group gathers: with
// dist.zero its parts alone hold the whole arena's state (gather_zero_state).
std::span<const float> Trainer::gather_tensor_parallel_state(std::vector<AdamW::StatePart>& parts,
                                                             std::vector<std::vector<float>>& whole) {
  const std::span<const float> mine = params_->params();
  if (!tp_sums_ || data_rank() != 0) return mine;
  if (opt_->kind() != OptimizerKind::adamw)  // a signal's or memory alarm's checkpoint (check_tensor_parallel)
    fail(ErrorKind::unsupported, "{}: a checkpoint of dist.tp with optim.kind {} cannot be written (only adamw's "
         "moments are kept in one process's layout)", c_.source, optimizer_kind_name(opt_->kind()));
  whole.resize(1 + parts.size());
  params_->gather_tensor_parallel_array(*tp_comm_, mine, whole[0]);
  for (size_t i = 0; i < parts.size(); ++i) {
    AdamW::StatePart& part = parts[i];
    LOOM_ASSERT(part.bytes == mine.size_bytes() && part.file_offset == 0);  // adamw: a float per parameter
    params_->gather_tensor_parallel_array(*tp_comm_, {static_cast<const float*>(part.data), mine.size()},
                                          whole[i + 1]);
    if (!is_root()) continue;
    part.data = whole[i + 1].data();
    part.bytes = part.file_bytes = whole[i + 1].size() * sizeof(float);
  }
  return is_root() ? std::span<const float>(whole[0]) : mine;
}

// Each rank reads the whole model's arenas and keeps its shard (of this run's
// dist.tp, which need not be the writer's).
void Trainer::load_tensor_parallel_arenas(const std::string& path) {
  if (opt_->kind() != OptimizerKind::adamw)
    fail(ErrorKind::unsupported, "checkpoint {}: dist.tp resumes optim.kind adamw only", path);
  load_checkpoint_arenas(path, params_->params(), *opt_, params_->tensor_parallel_whole_size(),
                         [&](std::span<const float> whole, std::span<float> mine) {
                           params_->take_tensor_parallel_shard(whole, mine);
                         });
}

}  // namespace loom

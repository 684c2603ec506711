// AdamW over a flat fp32 parameter arena (torch.optim.AdamW semantics), global
// gradient-norm clipping, transformers-style warm-up LR schedules, and a
// checksummed binary save/load of the optimizer state for checkpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/backend.h"

namespace loom {

// Learning-rate multipliers of transformers' get_{constant,linear,cosine}_schedule_with_warmup.
enum class LrScheduleKind { constant, linear, cosine };
const char* lr_schedule_name(LrScheduleKind k);
LrScheduleKind lr_schedule_from_name(std::string_view name);  // throws invalid_input

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::constant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;   // ignored by constant
  double num_cycles = 0.5;   // cosine only (transformers' default: half a cosine)
  // Multiplier for the update made after `step` completed optimizer steps
  // (LambdaLR's last_epoch: 0 for the first update).
  double multiplier(int64_t step) const;
};

// A contiguous run [offset, offset + size) of the parameter arena with its own
// learning rate and decay. Norms and biases set decay = false.
struct ParamGroup {
  std::string name;
  size_t offset = 0;
  size_t size = 0;
  double lr = 1e-4;            // peak (pre-schedule) learning rate
  double weight_decay = 0.0;
  bool decay = true;           // false: no weight decay whatever weight_decay says
  bool lora_b = false;         // a LoRA B matrix: scaled by the LoRA+ ratio
};

// LoRA+: B matrices learn `ratio` times faster (lr_B = ratio * lr). Returns a copy.
std::vector<ParamGroup> apply_lora_plus(std::vector<ParamGroup> groups, double ratio);

// optim.kind: f32 moments, or bitsandbytes-style block-wise 8-bit moments
// (bnb.optim.AdamW8bit: blocks of 256, tensors under kMin8bitSize elements keep f32).
enum class OptimizerKind { adamw, adamw8bit };
const char* optimizer_kind_name(OptimizerKind k);
inline constexpr size_t kMin8bitSize = 4096;  // bitsandbytes' min_8bit_size

// One parameter tensor's run [offset, offset + size) of the arena: the unit
// adamw8bit quantizes (its blocks start at the tensor's first element).
struct TensorSpan {
  size_t offset = 0;
  size_t size = 0;
  int64_t rows = 0;  // a matrix [rows, size / rows] (PowerSGD's unit); 0: a vector
};

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double max_grad_norm = 1.0;  // <= 0 disables clipping
  // dist.compression topk: the moments are updated lazily (AdamWLazyUpdate,
  // kernels/backend.h) on the steps set_sparse_gradients(true) marks; holds
  // one more float per parameter (each one's gap since its gradient arrived).
  bool sparse_gradients = false;
};

// ZeRO stage 1: this process keeps the optimizer state of, and updates, only
// the parameters [begin, end) of the arena (data parallel ranks split it; see
// train/trainer_dist.cpp). With optim.kind adamw8bit the bounds must fall
// between tensors (its 8-bit blocks start at a tensor's first element).
struct OptimizerShard {
  size_t begin = 0;
  size_t end = SIZE_MAX;  // SIZE_MAX: to the end (no sharding)
};

struct StepStats {
  double grad_norm = 0;   // global L2 norm before clipping
  double clip_scale = 1;  // factor the gradients were multiplied by
  double lr_multiplier = 1;
};

// Global L2 norm of `grads` (accumulated in double).
double grad_global_norm(std::span<const float> grads);
// torch.nn.utils.clip_grad_norm_: scales grads by min(1, max_norm / (norm + 1e-6)).
// Returns the pre-clip norm; *scale receives the factor when non-null.
double clip_grad_global_norm(std::span<float> grads, double max_norm, double* scale = nullptr);
// The factor clip_grad_global_norm multiplies by for a gradient of norm `norm`.
float clip_coefficient(double norm, double max_norm);

class AdamW {
 public:
  // Groups must lie inside [0, n_params) and not overlap (throws invalid_input).
  // The moments live in `backend`'s memory and every update runs as its ops.
  // adamw8bit: each piece of a group inside one of `tensors` (none given: each
  // group is one tensor) with >= kMin8bitSize elements gets 8-bit moments, the
  // others f32 ones updated as adamw does.
  // `shard`: the part of the arena this AdamW keeps state for and updates (ZeRO-1).
  AdamW(Backend& backend, AdamWConfig config, std::vector<ParamGroup> groups, size_t n_params,
        LrSchedule schedule = {}, OptimizerKind kind = OptimizerKind::adamw, std::vector<TensorSpan> tensors = {},
        OptimizerShard shard = {});

  // One update: clips `grads` in place, then updates `params` group by group
  // with lr = group.lr * schedule.multiplier(step_count()). Elements outside
  // every group are left untouched. Both arenas are in the backend's memory.
  // `grad_norm`: the global norm of `grads` when the caller has it already
  // (the trainer's non-finite check computes it the same way), else computed here.
  StepStats step(std::span<float> params, std::span<float> grads, std::optional<double> grad_norm = std::nullopt);

  int64_t step_count() const { return step_; }
  const AdamWConfig& config() const { return config_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  const LrSchedule& schedule() const { return schedule_; }
  double current_lr(size_t group) const;  // lr the next step() will use
  // Multiplies every group's learning rate (a divergence rollback lowers it;
  // train/faults.h). Not part of save(): the checkpoint's FaultState holds it.
  void set_lr_scale(double scale) { lr_scale_ = scale; }
  // This step's gradient is sparse (zero: not sent): the lazy update. Needs
  // AdamWConfig::sparse_gradients; off, the plain AdamW (dense warm-up steps).
  void set_sparse_gradients(bool on);

  double lr_scale() const { return lr_scale_; }
  // The f32 moments: adamw, arenas of the parameter arena's layout; adamw8bit,
  // those of the small pieces only, back to back in arena order.
  std::span<const float> exp_avg() const { return {m_.floats(), n_f32_}; }
  std::span<const float> exp_avg_sq() const { return {v_.floats(), n_f32_}; }
  std::span<float> exp_avg() { return {m_.floats(), n_f32_}; }
  std::span<float> exp_avg_sq() { return {v_.floats(), n_f32_}; }
  void set_step_count(int64_t step) { step_ = step; }
  OptimizerKind kind() const { return kind_; }
  size_t n_params() const { return n_; }
  size_t n_8bit() const { return n_q8_; }  // parameters whose moments are 8-bit
  const OptimizerShard& shard() const { return shard_; }

  // The whole state as files of a checkpoint (raw bytes in the backend's
  // memory): adam_m.f32 and adam_v.f32, and for adamw8bit the codes
  // (adam_m.q8, adam_v.q8) and block absmax (adam_m_absmax.f32, adam_v_absmax.f32).
  // A shard's part is the run [file_offset, file_offset + bytes) of the
  // unsharded part's file_bytes; the shards of the ranks, in rank order, are the whole.
  struct StatePart {
    const char* file;
    void* data;
    size_t bytes;
    size_t file_offset = 0;
    size_t file_bytes = 0;
    bool zero_if_absent = false;  // a checkpoint without it (written before it existed) reads zeros
  };
  std::vector<StatePart> state_parts() const;
  // Bytes of optimizer state held (moments, codes, absmax and the two maps).
  size_t state_bytes() const;

  // Binary state file: magic, version, kind, n_params, step, each state part
  // (size, bytes), FNV-1a checksum.
  // Written to a temp file then renamed. load() checks size and checksum and
  // throws loom::Error naming the file.
  void save(const std::string& path) const;
  void load(const std::string& path);

 private:
  AdamWConfig config_;
  std::vector<ParamGroup> groups_;
  LrSchedule schedule_;
  int64_t step_ = 0;
  double lr_scale_ = 1;
  // A piece of one group inside one tensor, with its moments' place.
  struct Segment {
    size_t offset = 0, size = 0, group = 0;
    bool q8 = false;
    size_t at = 0;     // into the f32 moments, or the codes (q8)
    size_t block = 0;  // q8: first absmax
  };
  void plan_segments(const std::vector<TensorSpan>& tensors);
  void keep_shard();

  Backend& be_;
  OptimizerKind kind_ = OptimizerKind::adamw;
  size_t n_ = 0;
  std::vector<Segment> segments_;
  size_t n_f32_ = 0, n_q8_ = 0, n_blocks_ = 0;
  OptimizerShard shard_;
  // Where this shard's f32 moments, 8-bit codes and absmax start in the
  // unsharded layout, and that layout's sizes (state_parts' file offsets).
  size_t first_f32_ = 0, first_q8_ = 0, first_block_ = 0;
  size_t all_f32_ = 0, all_q8_ = 0, all_blocks_ = 0;
  DeviceBuffer m_, v_;                   // f32 moments
  DeviceBuffer mq_, vq_, ma_, va_;       // adamw8bit: codes and absmax
  DeviceBuffer maps_;                    // adamw8bit: Blockwise8Map signed, unsigned
  DeviceBuffer gap_;                     // sparse_gradients: steps since each f32 entry's gradient arrived, - 1
  bool sparse_now_ = false;
};

}  // namespace loom

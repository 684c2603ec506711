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

// optim.kind: f32 moments, or bitsandbytes-style block-wise 8-bit moments.
enum class OptimizerKind { adamw, adamw8bit };
const char* optimizer_kind_name(OptimizerKind k);

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double max_grad_norm = 1.0;  // <= 0 disables clipping
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
  AdamW(Backend& backend, AdamWConfig config, std::vector<ParamGroup> groups, size_t n_params,
        LrSchedule schedule = {});

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
  double lr_scale() const { return lr_scale_; }
  // Moment arenas, same layout as the parameter arena.
  std::span<const float> exp_avg() const { return {m_.floats(), n_}; }
  std::span<const float> exp_avg_sq() const { return {v_.floats(), n_}; }
  std::span<float> exp_avg() { return {m_.floats(), n_}; }
  std::span<float> exp_avg_sq() { return {v_.floats(), n_}; }
  void set_step_count(int64_t step) { step_ = step; }

  // Binary state file: magic, version, n_params, step, m, v, FNV-1a checksum.
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
  Backend& be_;
  size_t n_ = 0;
  DeviceBuffer m_, v_;
};

}  // namespace loom

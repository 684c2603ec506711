// Non-finite steps and divergence (docs/training.md "Faults"). A step whose
// loss or gradient holds a NaN or inf is not applied; after max_bad_steps in a
// row on_divergence rolls back to the last good checkpoint with a lower
// learning rate, or stops. fp16 loss scaling will use the same check.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "core/thread_pool.h"

namespace loom {

// What a checkpoint keeps of the fault handling so a resumed run goes on the
// same way (train/checkpoint.h writes it in state.json).
struct FaultState {
  int64_t bad_in_a_row = 0;   // non-finite steps since the last applied one
  int64_t skipped_steps = 0;  // non-finite steps in all
  int64_t rollbacks = 0;      // rollbacks done (at most max_rollbacks)
  double lr_scale = 1;        // product of rollback_lr_factor over the rollbacks
};

// Index of the first NaN or inf of `a`, or nullopt when every element is
// finite. Splits the scan over `pool` (gradient arenas of full fine-tuning are
// hundreds of MiB); a finite arena costs one pass at memory speed.
std::optional<size_t> first_non_finite(std::span<const float> a, ThreadPool* pool = nullptr);

// Why a step is not applied.
struct NonFiniteStep {
  bool loss = false;       // the loss was not finite (else a gradient element)
  double loss_value = 0;   // the step's mean loss
  bool element = false;    // a gradient element is not finite: offset, value, tensor name it
  size_t offset = 0;       // the first bad element of the gradient arena
  float value = 0;         // its value
  std::string tensor;      // the tensor holding it (TrainableParams::tensor_at), else "loss"
                           // or "gradient norm" (finite elements whose norm is not)
};

}  // namespace loom

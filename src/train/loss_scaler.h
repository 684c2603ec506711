// Dynamic loss scaling for fp16 training with the rules of torch.amp.GradScaler
// (docs/training.md "Mixed precision and loss scaling"): the loss gradient is
// multiplied by scale(), the gradients are unscaled (times inv_scale()) before
// clipping and the optimizer, a step whose gradients hold an inf or NaN is
// skipped and the scale multiplied by backoff_factor; after growth_interval
// clean steps in a row it is multiplied by growth_factor (if the result is
// finite). The scale is a float, as GradScaler's tensor is.
#pragma once

#include <cstdint>

namespace loom {

struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// What a checkpoint keeps so that a resumed run scales as the uninterrupted one.
struct LossScalerState {
  float scale = 65536.0f;
  int64_t growth_tracker = 0;  // clean steps in a row since the last change
};

class LossScaler {
 public:
  // Throws invalid_input for options GradScaler refuses (scale <= 0, growth_factor <= 1,
  // backoff_factor outside (0, 1), growth_interval < 1).
  explicit LossScaler(LossScalerOptions o = {});

  float scale() const { return st_.scale; }
  // 1 / scale computed in double and rounded to float, as GradScaler.unscale_ does.
  float inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(st_.scale)); }
  int64_t growth_tracker() const { return st_.growth_tracker; }

  // The end of a step (GradScaler.update): found_inf says whether its unscaled
  // gradients held an inf or NaN (the step is then not applied).
  void update(bool found_inf);

  const LossScalerOptions& options() const { return o_; }
  const LossScalerState& state() const { return st_; }
  // Throws invalid_input for a state no scaler could reach (non-finite or
  // non-positive scale, negative tracker).
  void restore(const LossScalerState& s);

 private:
  LossScalerOptions o_;
  LossScalerState st_;
};

}  // namespace loom

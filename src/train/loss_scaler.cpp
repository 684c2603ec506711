// torch.amp.GradScaler's update rule (ATen's _amp_update_scale_ CPU kernel).
#include "train/loss_scaler.h"

#include <cmath>

#include "core/error.h"

namespace loom {

LossScaler::LossScaler(LossScalerOptions o) : o_(o) {
  if (!(o.init_scale > 0) || !std::isfinite(o.init_scale))
    fail(ErrorKind::invalid_input, "loss scaler: init_scale {} must be a positive finite number", o.init_scale);
  if (!(o.growth_factor > 1))
    fail(ErrorKind::invalid_input, "loss scaler: growth_factor {} must be above 1", o.growth_factor);
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
    fail(ErrorKind::invalid_input, "loss scaler: backoff_factor {} must be in (0, 1)", o.backoff_factor);
  if (o.growth_interval < 1)
    fail(ErrorKind::invalid_input, "loss scaler: growth_interval {} must be at least 1", o.growth_interval);
  st_.scale = static_cast<float>(o.init_scale);
  st_.growth_tracker = 0;
}

void LossScaler::update(bool found_inf) {
  if (found_inf) {
    st_.scale = static_cast<float>(static_cast<double>(st_.scale) * o_.backoff_factor);
    st_.growth_tracker = 0;
    return;
  }
  const int64_t successful = st_.growth_tracker + 1;
  if (successful == o_.growth_interval) {
    const auto grown = static_cast<float>(static_cast<double>(st_.scale) * o_.growth_factor);
    if (std::isfinite(grown)) st_.scale = grown;
    st_.growth_tracker = 0;
  } else {
    st_.growth_tracker = successful;
  }
}

void LossScaler::restore(const LossScalerState& s) {
  if (!(s.scale > 0) || !std::isfinite(s.scale) || s.growth_tracker < 0 || s.growth_tracker >= o_.growth_interval)
    fail(ErrorKind::invalid_input, "loss scaler state: scale {} / growth tracker {} is not one a scaler with "
         "growth_interval {} reaches", s.scale, s.growth_tracker, o_.growth_interval);
  st_ = s;
}

}  // namespace loom

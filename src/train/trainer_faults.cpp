// The Trainer's fault path (faults.h; docs/training.md "Faults"): the
// LOOM_FAILPOINTS site "step", non-finite steps (not applied, counted,
// logged), what max_bad_steps in a row lead to (rollback to the last good
// checkpoint with a lower learning rate, or a diverged error), and the record
// of the error that ends a run.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/failpoints.h"
#include "train/checkpoint.h"
#include "train/train_log.h"
#include "train/train_metrics.h"
#include "train/trainer.h"

namespace loom {

namespace {

const char* bad_value_name(float v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }

std::string describe(const NonFiniteStep& b) {
  const std::string where =
      b.element ? fmt::format("{} in {}, arena element {}", bad_value_name(b.value), b.tensor, b.offset) : "";
  if (b.loss)
    return b.element ? fmt::format("non-finite loss ({}; first bad gradient: {})", b.loss_value, where)
                     : fmt::format("non-finite loss ({})", b.loss_value);
  return b.element ? fmt::format("non-finite gradient ({})", where)
                   : std::string("non-finite gradient norm (every element finite)");
}

// ECS error.type of an error that ends a run.
const char* error_type(ErrorKind k) {
  switch (k) {
    case ErrorKind::invalid_input: return "invalid_input";
    case ErrorKind::not_found: return "not_found";
    case ErrorKind::unsupported: return "unsupported";
    case ErrorKind::io: return "io";
    case ErrorKind::diverged: return "diverged";
    case ErrorKind::internal: return "internal";
  }
  return "internal";
}

}  // namespace

void Trainer::inject_step_faults(StepReport& r) {
  // The attempt number only goes up: a skipped step's retry and a rollback get new ones.
  attempt_ = std::max(attempt_, r.step - 1) + 1;
  const std::optional<FailpointFire> f = fail_point(rt_.failpoints, "step", attempt_);
  if (!f) return;
  const std::span<float> g = params_->grads();
  switch (f->action) {
    case FailAction::nan_grad: g[g.size() / 2] = std::numeric_limits<float>::quiet_NaN(); break;
    case FailAction::inf_grad: g[g.size() / 2] = std::numeric_limits<float>::infinity(); break;
    case FailAction::nan_loss: r.loss = std::nan(""); break;
    default: LOOM_ASSERT(false);  // Failpoints::parse lets no other action reach this site
  }
}

std::optional<NonFiniteStep> Trainer::check_finite(const StepReport& r, double& grad_norm) {
  // The global norm (AdamW's clipping needs it anyway: it is passed on) is
  // finite exactly when every element is: squares of finite floats summed in
  // double cannot overflow. Only a bad step pays for the scan that names the tensor.
  const std::span<const float> g = params_->grads();
  grad_norm = std::sqrt(global_sum_squares(backend_->sum_squares(g.data(), g.size())));  // tensor parallel: whole
  NonFiniteStep b;
  b.loss_value = r.loss;
  b.loss = r.target_tokens > 0 && !std::isfinite(r.loss);  // no target token: NaN by definition, nothing applied
  if (std::isfinite(grad_norm) && !b.loss) return std::nullopt;
  b.tensor = b.loss ? "loss" : "gradient norm";  // the latter: a backend that sums squares in float
  if (!std::isfinite(grad_norm)) {
    if (const std::optional<size_t> i = first_non_finite(g, pool_.get())) {
      b.element = true;
      b.offset = *i;
      b.value = g[*i];
      b.tensor = params_->tensor_at(*i);
    }
  }
  return b;
}

StepReport Trainer::skip_step(StepReport r, const NonFiniteStep& bad, Clock::time_point started) {
  ++faults_.bad_in_a_row;
  ++faults_.skipped_steps;
  r.skipped = true;
  r.lr = opt_->current_lr(0);
  r.grad_norm = std::nan("");
  r.input_tokens = input_tokens_;
  r.step_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  train_seconds_ += r.step_seconds;
  log_->record(LogLevel::warning, "skipped_step",
               fmt::format("step {}: {}; step not applied ({} in a row of max_bad_steps {}; {} skipped in all)",
                           r.step, describe(bad), faults_.bad_in_a_row, c_.max_bad_steps, faults_.skipped_steps),
               {{"step", r.step},
                {"attempt", attempt_},
                {"reason", bad.loss ? "loss" : "gradient"},
                {"tensor", bad.tensor},
                {"arena_offset", bad.element ? nlohmann::json(bad.offset) : nlohmann::json()},
                {"bad_in_a_row", faults_.bad_in_a_row},
                {"skipped_steps", faults_.skipped_steps}});
  if (rt_.metrics) rt_.metrics->on_skipped_step();
  if (faults_.bad_in_a_row >= c_.max_bad_steps) on_divergence(r, bad);
  return r;
}

// precision (train_step.h): the session's products; fp16 adds the loss
// scaler. (An optim.eps too small for fp16's gradients is config advice:
// config_advice.cpp.)
void Trainer::setup_precision() {
  session_->set_precision(c_.precision);
  if (c_.precision != TrainPrecision::fp16) return;
  scaler_.emplace();
  if (rt_.metrics) rt_.metrics->on_loss_scale(scaler_->scale(), false);
}

StepReport Trainer::loss_scale_skip(StepReport r, const NonFiniteStep& bad, Clock::time_point started) {
  const float was = scaler_->scale();
  scaler_->update(true);
  r.skipped = true;
  r.lr = opt_->current_lr(0);
  r.grad_norm = std::nan("");
  r.input_tokens = input_tokens_;
  r.step_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  train_seconds_ += r.step_seconds;
  log_->record(LogLevel::info, "loss_scale",
               fmt::format("step {}: fp16 gradients overflowed at loss scale {} ({}); step not applied, loss "
                           "scale now {}", r.step, was, describe(bad), scaler_->scale()),
               {{"step", r.step},
                {"attempt", attempt_},
                {"loss_scale", scaler_->scale()},
                {"previous_loss_scale", was},
                {"tensor", bad.tensor}});
  if (rt_.metrics) rt_.metrics->on_loss_scale(scaler_->scale(), true);
  return r;
}

void Trainer::on_divergence(const StepReport& r, const NonFiniteStep& bad) {
  if (c_.on_divergence == TrainConfig::OnDivergence::stop) stop_diverged(r, bad, "on_divergence: stop");
  if (faults_.rollbacks >= c_.max_rollbacks)
    stop_diverged(r, bad, fmt::format("no rollback left (max_rollbacks {})", c_.max_rollbacks));
  std::vector<SkippedCheckpoint> skipped;
  const std::optional<std::string> path = latest_good_checkpoint(checkpoint_dir_, skipped);
  for (const SkippedCheckpoint& s : skipped)
    log_->record(LogLevel::warning, "rollback", fmt::format("rollback: checkpoint {} skipped: {}", s.path, s.reason),
                 {{"checkpoint", {{"path", s.path}, {"skipped", s.reason}}}});
  if (!path)
    stop_diverged(r, bad, fmt::format("no checkpoint in '{}' to roll back to (checkpoint_interval or "
                                      "checkpoint_minutes writes them)", checkpoint_dir_));
  // The counts go on across the rollback (the checkpoint's are older): the
  // factor is cumulative and max_rollbacks bounds the whole run.
  FaultState f = faults_;
  const int64_t from = r.step;
  load_checkpoint(*path);
  f.bad_in_a_row = 0;
  ++f.rollbacks;
  f.lr_scale *= c_.rollback_lr_factor;
  restore_faults(f);
  log_->record(LogLevel::warning, "rollback",
               fmt::format("step {}: {} non-finite steps in a row; rolled back to {} (step {}) with the learning "
                           "rate times {} (lr scale {:.4g}, next lr {:.3e}; rollback {} of max_rollbacks {})",
                           from, c_.max_bad_steps, *path, steps_done(), c_.rollback_lr_factor, f.lr_scale,
                           opt_->current_lr(0), f.rollbacks, c_.max_rollbacks),
               {{"step", from},
                {"checkpoint", {{"path", *path}, {"step", steps_done()}}},
                {"lr_scale", f.lr_scale},
                {"lr", opt_->current_lr(0)},
                {"rollbacks", f.rollbacks}});
}

void Trainer::stop_diverged(const StepReport& r, const NonFiniteStep& bad, const std::string& why) {
  fail(ErrorKind::diverged,
       "training diverged at step {}: {} steps in a row had a non-finite loss or gradient (last: {}); {}; lower "
       "optim.lr ({:.3g} now, lr scale {:.4g}), raise schedule.warmup_steps or keep optim.max_grad_norm on",
       r.step, faults_.bad_in_a_row, describe(bad), why, opt_->current_lr(0), faults_.lr_scale);
}

void Trainer::restore_faults(const FaultState& f) {
  LOOM_ASSERT(opt_);
  faults_ = f;
  opt_->set_lr_scale(f.lr_scale);
}

void Trainer::log_failure(Error& e) {
  if (e.reported() || !is_root()) return;  // other ranks have no log: the app prints their errors
  e.set_reported();
  if (!opt_) {  // setup() did not finish: bad config, model or data; nothing to resume
    log_->error("error", e.what(), error_type(e.kind()), {{"exit_code", error_exit_code(e.kind())}});
    return;
  }
  std::optional<std::string> ck;
  try {  // the newest checkpoint that verifies (a torn one from a failed write is not it)
    std::vector<SkippedCheckpoint> skipped;
    if (!checkpoint_dir_.empty()) ck = latest_good_checkpoint(checkpoint_dir_, skipped);
  } catch (const Error&) {  // an unreadable checkpoint_dir: say there is none
  }
  const std::string resume = ck ? fmt::format("resume from {} with: loom train {} --resume", *ck, c_.source)
                                : std::string("no checkpoint to resume from");
  const int64_t step = current_step_ > 0 ? current_step_ : steps_done();
  const std::string message =
      e.kind() == ErrorKind::diverged
          ? fmt::format("{}; {}", e.what(), resume)
          : fmt::format("training failed {} step {}: {}; {}", current_step_ > 0 ? "during" : "after", step, e.what(),
                        resume);
  log_->error(e.kind() == ErrorKind::diverged ? "diverged" : "error", message, error_type(e.kind()),
              {{"step", step},
               {"steps_done", steps_done()},
               {"checkpoint", ck ? nlohmann::json(*ck) : nlohmann::json()},
               {"exit_code", error_exit_code(e.kind())}});
}

}  // namespace loom

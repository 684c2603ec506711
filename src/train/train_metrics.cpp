// The loom_train_ series and the curves' history (train/train_metrics.h).
#include "train/train_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

namespace loom {

namespace {

// Seconds. A step takes milliseconds on the tiny test models and minutes on big
// ones with long rows; a checkpoint from a few ms (adapters) to minutes (full).
const std::vector<double> kStepBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                          2.5,   5,    10,    25,   60,  120, 300, 600};
const std::vector<double> kCheckpointBuckets = {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

nlohmann::json num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

// Keeps every other point (the first included) and doubles the stride.
template <typename P>
void thin(std::vector<P>& points, int64_t& stride) {
  size_t w = 0;
  for (size_t i = 0; i < points.size(); i += 2) points[w++] = points[i];
  points.resize(w);
  stride *= 2;
}

template <typename P>
void add_point(std::vector<P>& points, int64_t& stride, const P& p) {
  if (p.step % stride != 0 && !points.empty()) return;
  points.push_back(p);
  if (points.size() >= TrainMetrics::kMaxPoints) thin(points, stride);
}

}  // namespace

TrainMetrics::TrainMetrics(MetricsRegistry& r)
    : registry_(r),
      start_time_(r.gauge("loom_train_start_time_seconds", "Unix time the run was set up.")),
      step_(r.gauge("loom_train_step", "Optimizer steps done.")),
      total_steps_(r.gauge("loom_train_total_steps", "Optimizer steps the run will take.")),
      loss_(r.gauge("loom_train_loss", "Mean training loss of the last step (over its target tokens).")),
      eval_loss_(r.gauge("loom_train_eval_loss", "Mean loss over the eval split at the last evaluation.")),
      eval_accuracy_(r.gauge("loom_train_eval_token_accuracy",
                             "Share of eval target tokens predicted exactly (argmax) at the last evaluation.")),
      lr_(r.gauge("loom_train_learning_rate", "Learning rate of the first parameter group at the last step.")),
      grad_norm_(r.gauge("loom_train_grad_norm", "Global gradient norm (before clipping) of the last step.")),
      tokens_(r.counter("loom_train_tokens_total", "Input tokens (rows x seq_len) trained on.")),
      target_tokens_(r.counter("loom_train_target_tokens_total", "Target tokens the loss was taken over.")),
      tokens_per_s_(r.gauge("loom_train_tokens_per_second", "Input tokens per second of training time so far.")),
      step_seconds_(r.histogram("loom_train_step_seconds", "Wall time of each optimizer step.", kStepBuckets)),
      skipped_steps_(r.counter("loom_train_skipped_steps_total",
                               "Steps not applied because the loss or a gradient was not finite.")),
      checkpoints_(r.counter("loom_train_checkpoints_total", "Checkpoints written.")),
      checkpoint_seconds_(r.histogram("loom_train_checkpoint_seconds", "Time to write each checkpoint.",
                                      kCheckpointBuckets)),
      last_checkpoint_time_(r.gauge("loom_train_last_checkpoint_time_seconds",
                                    "Unix time of the last checkpoint written (0: none yet).")),
      rss_(r.gauge("loom_train_memory_rss_bytes", "Resident set size of the trainer process.")),
      memory_limit_(r.gauge("loom_train_memory_limit_bytes", "The memory limit the alarms are fractions of.")),
      memory_alarm_(r.gauge("loom_train_memory_alarm_level",
                            "memory_alarm thresholds crossed (0: below all; 2: above the upper of two).")),
      progress_(r.gauge("loom_train_progress_ratio", "Steps done / total steps (0..1).")),
      eta_(r.gauge("loom_train_eta_seconds", "Estimated seconds until the last step.")),
      loss_scale_(r.gauge("loom_train_loss_scale", "fp16 loss scale after the last step (1: no loss scaling).")),
      loss_scale_skips_(r.counter("loom_train_loss_scale_skipped_steps_total",
                                  "fp16 steps not applied because the scaled gradients overflowed (the scale "
                                  "was halved); not faults.")) {
  loss_scale_.set(1);
  eval_loss_.set(kNaN);
  eval_accuracy_.set(kNaN);
  loss_.set(kNaN);
}

void TrainMetrics::on_start(const std::string& model, const std::string& method, int64_t total_steps,
                            int64_t start_step) {
  registry_.gauge("loom_train_info", "The run: base model and method (value 1).",
                  {{"model", model}, {"method", method}})
      .set(1);
  start_time_.set(unix_seconds());
  total_steps_.set(static_cast<double>(total_steps));
  step_.set(static_cast<double>(start_step));
  progress_.set(total_steps > 0 ? static_cast<double>(start_step) / static_cast<double>(total_steps) : 0);
  std::lock_guard lock(mu_);
  model_ = model;
  method_ = method;
  t0_ = std::chrono::steady_clock::now();
  done_ = false;
}

void TrainMetrics::on_step(const StepReport& r, int64_t total_steps, double tokens_per_s, double eta_s) {
  step_.set(static_cast<double>(r.step));
  total_steps_.set(static_cast<double>(total_steps));
  loss_.set(r.loss);
  lr_.set(r.lr);
  grad_norm_.set(r.grad_norm);
  tokens_per_s_.set(tokens_per_s);
  step_seconds_.observe(r.step_seconds);
  target_tokens_.inc(static_cast<double>(std::max<int64_t>(0, r.target_tokens)));
  progress_.set(total_steps > 0 ? std::min(1.0, static_cast<double>(r.step) / static_cast<double>(total_steps)) : 0);
  eta_.set(std::isfinite(eta_s) ? std::max(0.0, eta_s) : kNaN);
  std::lock_guard lock(mu_);
  // StepReport::input_tokens is the run's running total: count what is new.
  if (r.input_tokens > last_input_tokens_) tokens_.inc(static_cast<double>(r.input_tokens - last_input_tokens_));
  last_input_tokens_ = r.input_tokens;
  const TrainPoint p{r.step, r.loss, r.lr, r.grad_norm};
  last_train_ = p;
  add_point(train_, train_stride_, p);
}

void TrainMetrics::on_eval(int64_t step, double loss, std::optional<double> token_accuracy) {
  eval_loss_.set(loss);
  eval_accuracy_.set(token_accuracy.value_or(kNaN));
  std::lock_guard lock(mu_);
  add_point(eval_, eval_stride_, EvalPoint{step, loss, token_accuracy.value_or(kNaN)});
}

void TrainMetrics::on_skipped_step() { skipped_steps_.inc(); }

void TrainMetrics::on_loss_scale(double scale, bool skipped) {
  loss_scale_.set(scale);
  if (skipped) loss_scale_skips_.inc();
}

void TrainMetrics::on_checkpoint(double seconds) {
  checkpoints_.inc();
  checkpoint_seconds_.observe(seconds);
  last_checkpoint_time_.set(unix_seconds());
}

void TrainMetrics::on_memory(const MemoryFigures& m) {
  {
    // The arena series are made on the first report and looked up by name after that.
    std::lock_guard lock(mu_);
    for (const auto& entry : m.arenas) {
      const auto& [arena, bytes] = entry;
      // Compared through `entry`: clang before 16 refuses to capture a structured binding.
      auto it = std::find_if(arena_gauges_.begin(), arena_gauges_.end(),
                             [&](const auto& g) { return g.first == entry.first; });
      if (it == arena_gauges_.end()) {
        arena_gauges_.emplace_back(
            arena, &registry_.gauge("loom_train_memory_bytes", "Bytes held, by arena.", {{"arena", arena}}));
        it = arena_gauges_.end() - 1;
      }
      it->second->set(static_cast<double>(bytes));
    }
  }
  rss_.set(static_cast<double>(m.rss_bytes));
  memory_limit_.set(static_cast<double>(m.limit_bytes));
  memory_alarm_.set(m.alarm_level);
}

void TrainMetrics::on_finish() {
  progress_.set(1);
  eta_.set(0);
  std::lock_guard lock(mu_);
  done_ = true;
}

void TrainMetrics::set_endpoint(std::string url) {
  std::lock_guard lock(mu_);
  endpoint_ = std::move(url);
}

std::string TrainMetrics::endpoint() const {
  std::lock_guard lock(mu_);
  return endpoint_;
}

std::vector<TrainMetrics::TrainPoint> TrainMetrics::train_history() const {
  std::lock_guard lock(mu_);
  std::vector<TrainPoint> out = train_;
  if (last_train_ && (out.empty() || out.back().step < last_train_->step)) out.push_back(*last_train_);
  return out;
}

std::vector<TrainMetrics::EvalPoint> TrainMetrics::eval_history() const {
  std::lock_guard lock(mu_);
  return eval_;
}

std::string TrainMetrics::curves_json() const {
  const std::vector<TrainPoint> train = train_history();
  const std::vector<EvalPoint> eval = eval_history();
  nlohmann::json t = {{"step", nlohmann::json::array()}, {"loss", nlohmann::json::array()},
                      {"lr", nlohmann::json::array()}, {"grad_norm", nlohmann::json::array()}};
  for (const TrainPoint& p : train) {
    t["step"].push_back(p.step);
    t["loss"].push_back(num(p.loss));
    t["lr"].push_back(num(p.lr));
    t["grad_norm"].push_back(num(p.grad_norm));
  }
  nlohmann::json e = {{"step", nlohmann::json::array()}, {"loss", nlohmann::json::array()},
                      {"token_accuracy", nlohmann::json::array()}};
  for (const EvalPoint& p : eval) {
    e["step"].push_back(p.step);
    e["loss"].push_back(num(p.loss));
    e["token_accuracy"].push_back(num(p.token_accuracy));
  }
  nlohmann::json j;
  {
    std::lock_guard lock(mu_);
    j["model"] = model_;
    j["method"] = method_;
    j["done"] = done_;
    j["elapsed_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  j["step"] = static_cast<int64_t>(step_.value());
  j["total_steps"] = static_cast<int64_t>(total_steps_.value());
  j["progress"] = num(progress_.value());
  j["eta_s"] = num(eta_.value());
  j["tokens_per_s"] = num(tokens_per_s_.value());
  j["train"] = std::move(t);
  j["eval"] = std::move(e);
  return j.dump();
}

}  // namespace loom

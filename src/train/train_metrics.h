// The loom_train_ Prometheus series of a training run (on a core/prometheus.h
// registry) and a bounded history of its curves for the live page. The
// Trainer updates it (TrainRuntime::metrics); `loom train --metrics-port`
// serves render() at /metrics and curves_json() at /curves.json.
// Thread-safe: the trainer writes while HTTP threads read.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/prometheus.h"
#include "train/train_hooks.h"

namespace loom {

// What part M's memory accounting reports, in the shape the metrics need.
struct MemoryFigures {
  std::vector<std::pair<std::string, int64_t>> arenas;  // (arena, bytes)
  int64_t rss_bytes = 0;
  int64_t limit_bytes = 0;  // 0: unknown
  int alarm_level = 0;      // memory_alarm thresholds crossed (0: none)
};

class TrainMetrics {
 public:
  // Registers every series (so the first scrape shows them all; eval figures
  // start as NaN: not measured yet). `registry` must outlive this.
  explicit TrainMetrics(MetricsRegistry& registry);
  TrainMetrics(const TrainMetrics&) = delete;
  TrainMetrics& operator=(const TrainMetrics&) = delete;

  // The run is set up: loom_train_info{model,method}, total steps, the step it
  // starts from (non-zero on resume), the start time.
  void on_start(const std::string& model, const std::string& method, int64_t total_steps, int64_t start_step);
  // One optimizer step was applied.
  void on_step(const StepReport& r, int64_t total_steps, double tokens_per_s, double eta_s);
  // An evaluation after `step` steps; accuracy nullopt: not measured.
  void on_eval(int64_t step, double loss, std::optional<double> token_accuracy);
  // A step with a non-finite loss or gradient was not applied.
  void on_skipped_step();
  // fp16 loss scaling: the scale after a step, and whether the step was
  // skipped for overflowing gradients (a normal event, not a fault).
  void on_loss_scale(double scale, bool skipped);
  // A checkpoint was written in `seconds`.
  void on_checkpoint(double seconds);
  void on_memory(const MemoryFigures& m);
  // The output was written: progress 1, ETA 0.
  void on_finish();

  std::string render() const { return registry_.render(); }  // text format 0.0.4

  // Where the series are served ("http://127.0.0.1:9100/"; set by the app that
  // serves them), for the trainer's start record; empty: not served.
  void set_endpoint(std::string url);
  std::string endpoint() const;

  // The curves and the run's state as JSON for the live page: {"model",
  // "method", "step", "total_steps", "progress", "eta_s", "tokens_per_s",
  // "elapsed_s", "done", "train": {"step": [...], "loss", "lr", "grad_norm"},
  // "eval": {"step": [...], "loss", "token_accuracy"}}; non-finite values are null.
  std::string curves_json() const;

  struct TrainPoint {
    int64_t step;
    double loss, lr, grad_norm;
  };
  struct EvalPoint {
    int64_t step;
    double loss, token_accuracy;  // NaN: not measured
  };
  // At most kMaxPoints of each; past that, every other point is dropped and
  // only every stride-th step is kept from then on (the curve's shape stays,
  // the memory is bounded on long runs). train_history() ends with the newest
  // step.
  static constexpr size_t kMaxPoints = 2000;
  std::vector<TrainPoint> train_history() const;
  std::vector<EvalPoint> eval_history() const;

 private:
  MetricsRegistry& registry_;
  Gauge& start_time_;
  Gauge& step_;
  Gauge& total_steps_;
  Gauge& loss_;
  Gauge& eval_loss_;
  Gauge& eval_accuracy_;
  Gauge& lr_;
  Gauge& grad_norm_;
  Counter& tokens_;
  Counter& target_tokens_;
  Gauge& tokens_per_s_;
  Histogram& step_seconds_;
  Counter& skipped_steps_;
  Counter& checkpoints_;
  Histogram& checkpoint_seconds_;
  Gauge& last_checkpoint_time_;
  Gauge& rss_;
  Gauge& memory_limit_;
  Gauge& memory_alarm_;
  Gauge& progress_;
  Gauge& eta_;
  Gauge& loss_scale_;
  Counter& loss_scale_skips_;

  mutable std::mutex mu_;  // guards everything below
  std::string model_, method_, endpoint_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  int64_t last_input_tokens_ = 0;
  bool done_ = false;
  std::vector<TrainPoint> train_;
  std::vector<EvalPoint> eval_;
  int64_t train_stride_ = 1, eval_stride_ = 1;
  std::optional<TrainPoint> last_train_;
  std::vector<std::pair<std::string, Gauge*>> arena_gauges_;  // loom_train_memory_bytes{arena}  // the newest step, kept even when the stride skips it
};

}  // namespace loom

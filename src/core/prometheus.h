// A small Prometheus registry (counters, gauges, fixed-bucket histograms, optional labels) rendered in the
// text exposition format 0.0.4. Thread-safe throughout. `loom serve` (serve/metrics.h) and `loom train`
// (train/train_metrics.h) register their series on it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void inc(double v = 1);  // v must be >= 0: counters only go up
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

class Gauge {
 public:
  void set(double v) { v_.store(v, std::memory_order_relaxed); }
  void inc(double v = 1) { v_.fetch_add(v, std::memory_order_relaxed); }
  void dec(double v = 1) { v_.fetch_add(-v, std::memory_order_relaxed); }
  double value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

class Histogram {
 public:
  // Upper bounds, finite and strictly increasing; the +Inf bucket is implicit.
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double v);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;  // consistent: count == cumulative.back()
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Get or create the series `name{labels}`. The returned reference lives as long as the registry. Throws
  // invalid_input for a bad metric or label name, or a name already registered with another type, help
  // text or bucket layout.
  Counter& counter(std::string_view name, std::string_view help, const MetricLabels& labels = {});
  Gauge& gauge(std::string_view name, std::string_view help, const MetricLabels& labels = {});
  Histogram& histogram(std::string_view name, std::string_view help, const std::vector<double>& upper_bounds,
                       const MetricLabels& labels = {});

  // Every family in registration order, series in creation order (text format 0.0.4).
  std::string render() const;

 private:
  struct Family;
  Family& family(std::string_view name, std::string_view help, int type, const std::vector<double>* bounds);
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Family>> families_;
};

// The content type of render()'s output.
inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace loom

// A small Prometheus registry (counters, gauges, fixed-bucket histograms, optional labels) rendered in the
// text exposition format 0.0.4, and the loom_ metrics `loom serve` exports. Thread-safe throughout.
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

// The metrics of `loom serve`, registered on construction (so every series shows from the first scrape).
struct ServeMetrics {
  explicit ServeMetrics(MetricsRegistry& registry);

  MetricsRegistry& registry;
  Gauge& requests_running;         // loom_requests_running
  Gauge& requests_waiting;         // loom_requests_waiting
  Gauge& kv_cache_usage;           // loom_kv_cache_usage_ratio, 0..1
  Gauge& adapters_loaded;          // loom_adapters_loaded
  Counter& prompt_tokens;          // loom_prompt_tokens_total
  Counter& generation_tokens;      // loom_generation_tokens_total
  Histogram& time_to_first_token;  // loom_time_to_first_token_seconds
  Histogram& inter_token_latency;  // loom_inter_token_latency_seconds
  Histogram& e2e_request_latency;  // loom_e2e_request_latency_seconds

  // loom_requests_finished_total{finished_reason="stop"|"length"|"abort"|"error"}
  Counter& requests_finished(std::string_view reason);
  // loom_http_requests_total{code="200"}
  Counter& http_requests(int status);
};

}  // namespace loom

// The loom_ metrics `loom serve` exports, on the Prometheus registry of core/prometheus.h.
#pragma once

#include <string_view>

#include "core/prometheus.h"

namespace loom {

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
  Counter& spec_draft_tokens;      // loom_spec_decode_draft_tokens_total
  Counter& spec_accepted_tokens;   // loom_spec_decode_accepted_tokens_total
  Histogram& time_to_first_token;  // loom_time_to_first_token_seconds
  Histogram& inter_token_latency;  // loom_inter_token_latency_seconds
  Histogram& e2e_request_latency;  // loom_e2e_request_latency_seconds

  // loom_requests_finished_total{finished_reason="stop"|"length"|"abort"|"error"}
  Counter& requests_finished(std::string_view reason);
  // loom_http_requests_total{code="200"}
  Counter& http_requests(int status);
};

}  // namespace loom

// The loom_ serving metrics, registered on construction.
#include "serve/metrics.h"

#include <string>
#include <vector>

namespace loom {

namespace {

// Seconds; CPU decode steps run from about a millisecond (tiny models) to seconds (big ones, many threads
// busy).
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                          0.75,  1,     2.5,  5,    7.5,  10,   20,   40,  80,   160};
const std::vector<double> kItlBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                         0.3,   0.4,    0.5,   0.75, 1,     2.5,  5,     10,  20,   40};
const std::vector<double> kE2eBuckets = {0.1, 0.3, 0.5, 0.8, 1,  1.5, 2,   2.5, 5,   10,  15,
                                         20,  30,  40,  50,  60, 120, 240, 480, 960, 1920};

const char* kFinishedHelp = "Finished sequences (one per choice), by finish reason.";
const char* kHttpHelp = "HTTP requests answered, by status code.";

}  // namespace

ServeMetrics::ServeMetrics(MetricsRegistry& r)
    : registry(r),
      requests_running(r.gauge("loom_requests_running", "Requests in the running batch.")),
      requests_waiting(r.gauge("loom_requests_waiting", "Requests queued, waiting for a batch slot.")),
      kv_cache_usage(r.gauge("loom_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).")),
      adapters_loaded(r.gauge("loom_adapters_loaded", "LoRA adapters loaded.")),
      prompt_tokens(r.counter("loom_prompt_tokens_total", "Prompt tokens processed.")),
      generation_tokens(r.counter("loom_generation_tokens_total", "Tokens generated.")),
      spec_draft_tokens(r.counter("loom_spec_decode_draft_tokens_total",
                                  "Tokens proposed by prompt-lookup speculation (--spec-ngram).")),
      spec_accepted_tokens(
          r.counter("loom_spec_decode_accepted_tokens_total", "Proposed tokens the model agreed with.")),
      time_to_first_token(r.histogram("loom_time_to_first_token_seconds",
                                      "Seconds from a request's arrival to its first generated token.",
                                      kTtftBuckets)),
      inter_token_latency(r.histogram("loom_inter_token_latency_seconds",
                                      "Seconds between consecutive output deltas of one choice.",
                                      kItlBuckets)),
      e2e_request_latency(r.histogram("loom_e2e_request_latency_seconds",
                                      "Seconds from a generation request's arrival to its last byte.",
                                      kE2eBuckets)) {
  for (const char* reason : {"stop", "length", "abort", "error"}) requests_finished(reason);
}

Counter& ServeMetrics::requests_finished(std::string_view reason) {
  return registry.counter("loom_requests_finished_total", kFinishedHelp,
                          {{"finished_reason", std::string(reason)}});
}

Counter& ServeMetrics::http_requests(int status) {
  return registry.counter("loom_http_requests_total", kHttpHelp, {{"code", std::to_string(status)}});
}

}  // namespace loom

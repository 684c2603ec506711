// Prometheus registry: exact text exposition, bucket semantics, label escaping, misuse errors, thread safety.
#include <gtest/gtest.h>

#include <regex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/prometheus.h"
#include "serve/metrics.h"

namespace loom {
namespace {

TEST(Metrics, RendersCounterGaugeHistogramExactly) {
  MetricsRegistry r;
  r.counter("loom_test_total", "Things counted.").inc(3);
  r.gauge("loom_test_gauge", "A level.").set(-1.5);
  auto& h = r.histogram("loom_test_seconds", "Durations.", {0.1, 1, 2.5});
  h.observe(0.05);
  h.observe(0.1);  // le is inclusive
  h.observe(2);
  h.observe(7);
  EXPECT_EQ(r.render(),
            "# HELP loom_test_total Things counted.\n"
            "# TYPE loom_test_total counter\n"
            "loom_test_total 3\n"
            "# HELP loom_test_gauge A level.\n"
            "# TYPE loom_test_gauge gauge\n"
            "loom_test_gauge -1.5\n"
            "# HELP loom_test_seconds Durations.\n"
            "# TYPE loom_test_seconds histogram\n"
            "loom_test_seconds_bucket{le=\"0.1\"} 2\n"
            "loom_test_seconds_bucket{le=\"1\"} 2\n"
            "loom_test_seconds_bucket{le=\"2.5\"} 3\n"
            "loom_test_seconds_bucket{le=\"+Inf\"} 4\n"
            "loom_test_seconds_sum 9.15\n"
            "loom_test_seconds_count 4\n");
}

TEST(Metrics, LabelledSeriesShareOneFamilyAndEscapeValues) {
  MetricsRegistry r;
  r.counter("loom_x_total", "Help with \\ and\nnewline.", {{"reason", "stop"}}).inc();
  r.counter("loom_x_total", "Help with \\ and\nnewline.", {{"reason", "a\"b\\c\nd"}}).inc(2);
  r.counter("loom_x_total", "Help with \\ and\nnewline.", {{"reason", "stop"}}).inc();  // same series
  auto& h = r.histogram("loom_h", "H.", {1}, {{"model", "m"}});
  h.observe(0.5);
  EXPECT_EQ(r.render(),
            "# HELP loom_x_total Help with \\\\ and\\nnewline.\n"
            "# TYPE loom_x_total counter\n"
            "loom_x_total{reason=\"stop\"} 2\n"
            "loom_x_total{reason=\"a\\\"b\\\\c\\nd\"} 2\n"
            "# HELP loom_h H.\n"
            "# TYPE loom_h histogram\n"
            "loom_h_bucket{model=\"m\",le=\"1\"} 1\n"
            "loom_h_bucket{model=\"m\",le=\"+Inf\"} 1\n"
            "loom_h_sum{model=\"m\"} 0.5\n"
            "loom_h_count{model=\"m\"} 1\n");
}

TEST(Metrics, SpecialValuesUsePrometheusSpelling) {
  MetricsRegistry r;
  auto& g = r.gauge("g", "g");
  g.set(std::numeric_limits<double>::infinity());
  EXPECT_NE(r.render().find("g +Inf\n"), std::string::npos);
  g.set(-std::numeric_limits<double>::infinity());
  EXPECT_NE(r.render().find("g -Inf\n"), std::string::npos);
  g.set(std::nan(""));
  EXPECT_NE(r.render().find("g NaN\n"), std::string::npos);
  g.set(1e-7);
  EXPECT_NE(r.render().find("g 1e-07\n"), std::string::npos);
  g.set(123456789);
  EXPECT_NE(r.render().find("g 123456789\n"), std::string::npos);
}

TEST(Metrics, HistogramBucketsAreCumulativeOnAwkwardValues) {
  Histogram h({-1, 0, 0.25, 3});
  const double values[] = {-5, -1, -0.999, 0, 1e-12, 0.25, 0.2500001, 3, 3.5, 1e9};
  double sum = 0;
  for (double v : values) {
    h.observe(v);
    sum += v;
  }
  const auto s = h.snapshot();
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{2, 4, 6, 8, 10}));
  EXPECT_EQ(s.count, 10u);
  EXPECT_DOUBLE_EQ(s.sum, sum);
}

TEST(Metrics, MisuseThrowsNamingTheMetric) {
  MetricsRegistry r;
  r.counter("loom_a_total", "A.");
  EXPECT_THROW(r.gauge("loom_a_total", "A."), Error);
  EXPECT_THROW(r.counter("loom_a_total", "Other help."), Error);
  EXPECT_THROW(r.counter("9bad", "x"), Error);
  EXPECT_THROW(r.counter("bad-name", "x"), Error);
  EXPECT_THROW(r.counter("ok", "x", {{"bad-label", "v"}}), Error);
  EXPECT_THROW(r.counter("ok2", "x", {{"__reserved", "v"}}), Error);
  EXPECT_THROW(r.counter("ok3", "x", {{"a", "1"}, {"a", "2"}}), Error);
  EXPECT_THROW(r.histogram("h", "x", {1, 1}), Error);
  EXPECT_THROW(r.histogram("h2", "x", {2, 1}), Error);
  EXPECT_THROW(r.histogram("h3", "x", {1, std::numeric_limits<double>::infinity()}), Error);
  EXPECT_THROW(r.histogram("h4", "x", {1}, {{"le", "x"}}), Error);
  r.histogram("h5", "x", {1, 2});
  EXPECT_THROW(r.histogram("h5", "x", {1, 3}), Error);
  try {
    r.counter("loom_a_total", "A.").inc(-1);
    ADD_FAILURE() << "negative inc accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot go down"), std::string::npos);
  }
}

TEST(Metrics, ConcurrentUpdatesAreExact) {
  MetricsRegistry r;
  constexpr int kThreads = 8, kIters = 20000;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&r, t] {
      for (int i = 0; i < kIters; ++i) {
        // Registration races with use: every thread asks for the same series.
        r.counter("c_total", "c", {{"k", t % 2 ? "odd" : "even"}}).inc();
        r.gauge("g", "g").inc(1);
        r.histogram("h", "h", {0.5}).observe(i % 2 ? 1.0 : 0.25);
        if (i % 1000 == 0) (void)r.render();
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(r.counter("c_total", "c", {{"k", "odd"}}).value(), kThreads / 2 * kIters);
  EXPECT_EQ(r.counter("c_total", "c", {{"k", "even"}}).value(), kThreads / 2 * kIters);
  EXPECT_EQ(r.gauge("g", "g").value(), kThreads * kIters);
  const auto s = r.histogram("h", "h", {0.5}).snapshot();
  EXPECT_EQ(s.count, uint64_t(kThreads) * kIters);
  EXPECT_EQ(s.cumulative[0], uint64_t(kThreads) * kIters / 2);
}

// Every line is a comment (# HELP / # TYPE) or `name{labels} value` with Prometheus' grammar.
TEST(Metrics, ServeMetricsRenderValidExposition) {
  MetricsRegistry r;
  ServeMetrics m(r);
  m.requests_running.set(3);
  m.kv_cache_usage.set(0.25);
  m.generation_tokens.inc(17);
  m.requests_finished("stop").inc();
  m.http_requests(200).inc();
  m.time_to_first_token.observe(0.03);
  const std::string text = r.render();
  for (const char* name :
       {"loom_requests_running", "loom_requests_waiting", "loom_kv_cache_usage_ratio", "loom_adapters_loaded",
        "loom_prompt_tokens_total", "loom_generation_tokens_total", "loom_time_to_first_token_seconds",
        "loom_inter_token_latency_seconds", "loom_e2e_request_latency_seconds",
        "loom_requests_finished_total", "loom_http_requests_total"}) {
    EXPECT_NE(text.find(std::string("# TYPE ") + name + " "), std::string::npos) << name;
  }
  EXPECT_NE(text.find("loom_requests_running 3\n"), std::string::npos);
  EXPECT_NE(text.find("loom_generation_tokens_total 17\n"), std::string::npos);
  EXPECT_NE(text.find("loom_requests_finished_total{finished_reason=\"stop\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("loom_requests_finished_total{finished_reason=\"abort\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("loom_http_requests_total{code=\"200\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("loom_time_to_first_token_seconds_bucket{le=\"0.04\"} 1\n"), std::string::npos);
  const std::regex sample(
      R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? (-?[0-9.e+-]+|\+Inf|-Inf|NaN)$)");
  const std::regex comment(R"(^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$)");
  std::istringstream in(text);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    EXPECT_TRUE(std::regex_match(line, sample) || std::regex_match(line, comment)) << line;
  }
  EXPECT_GT(lines, 60);
  EXPECT_EQ(text.back(), '\n');
}

}  // namespace
}  // namespace loom

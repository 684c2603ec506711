// Prometheus registry and text exposition (format 0.0.4).
#include "core/prometheus.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <variant>

#include "core/error.h"

namespace loom {

void Counter::inc(double v) {
  if (!(v >= 0)) fail(ErrorKind::invalid_input, "metrics: a counter cannot go down (inc by {})", v);
  v_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (!std::isfinite(bounds_[i]) || (i > 0 && !(bounds_[i] > bounds_[i - 1])))
      fail(ErrorKind::invalid_input,
           "metrics: histogram bounds must be finite and strictly increasing (bound {} is {})", i,
           bounds_[i]);
  }
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::observe(double v) {
  // First bucket whose bound is >= v ("le" is inclusive); NaN lands in +Inf.
  const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard lock(mu_);
  counts_[std::isnan(v) ? bounds_.size() : b]++;
  sum_ += v;
  count_++;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  std::lock_guard lock(mu_);
  s.cumulative.resize(counts_.size());
  uint64_t run = 0;
  for (size_t i = 0; i < counts_.size(); ++i) s.cumulative[i] = run += counts_[i];
  s.sum = sum_;
  s.count = count_;
  return s;
}

namespace {

enum Type { kCounter, kGauge, kHistogram };
const char* type_name(int t) { return t == kCounter ? "counter" : t == kGauge ? "gauge" : "histogram"; }

bool valid_name(std::string_view s, bool allow_colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                    (allow_colon && c == ':') || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

// Go's ParseFloat accepts these; Prometheus spells infinities +Inf/-Inf.
std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

std::string escape_label_value(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string escape_help(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

// `a="x",b="y"` (no braces); `extra` is appended last (histograms' le).
std::string label_text(const MetricLabels& labels, std::string_view extra = {}) {
  std::string out;
  for (const auto& [k, v] : labels) {
    if (!out.empty()) out += ',';
    out += fmt::format("{}=\"{}\"", k, escape_label_value(v));
  }
  if (!extra.empty()) {
    if (!out.empty()) out += ',';
    out += extra;
  }
  return out;
}

std::string braced(const std::string& labels) { return labels.empty() ? std::string() : "{" + labels + "}"; }

}  // namespace

struct MetricsRegistry::Family {
  std::string name, help;
  int type = kCounter;
  std::vector<double> bounds;
  struct Series {
    MetricLabels labels;
    std::string key;  // label_text(labels), for lookup
    std::variant<std::unique_ptr<Counter>, std::unique_ptr<Gauge>, std::unique_ptr<Histogram>> metric;
  };
  std::vector<Series> series;

  Series* find(const std::string& key) {
    for (auto& s : series)
      if (s.key == key) return &s;
    return nullptr;
  }
};

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

MetricsRegistry::Family& MetricsRegistry::family(std::string_view name, std::string_view help, int type,
                                                 const std::vector<double>* bounds) {
  if (!valid_name(name, true)) fail(ErrorKind::invalid_input, "metrics: invalid metric name '{}'", name);
  for (auto& f : families_) {
    if (f->name != name) continue;
    if (f->type != type)
      fail(ErrorKind::invalid_input, "metrics: '{}' is already registered as a {}", name, type_name(f->type));
    if (f->help != help)
      fail(ErrorKind::invalid_input, "metrics: '{}' registered again with other help text", name);
    if (bounds && f->bounds != *bounds)
      fail(ErrorKind::invalid_input, "metrics: histogram '{}' registered again with other buckets", name);
    return *f;
  }
  auto f = std::make_unique<Family>();
  f->name = name;
  f->help = help;
  f->type = type;
  if (bounds) f->bounds = *bounds;
  families_.push_back(std::move(f));
  return *families_.back();
}

namespace {

void check_labels(std::string_view metric, const MetricLabels& labels, bool histogram) {
  for (size_t i = 0; i < labels.size(); ++i) {
    const auto& k = labels[i].first;
    if (!valid_name(k, false) || k.starts_with("__"))
      fail(ErrorKind::invalid_input, "metrics: invalid label name '{}' on '{}'", k, metric);
    if (histogram && k == "le")
      fail(ErrorKind::invalid_input, "metrics: histogram '{}' cannot have a label 'le'", metric);
    for (size_t j = 0; j < i; ++j)
      if (labels[j].first == k)
        fail(ErrorKind::invalid_input, "metrics: label '{}' repeated on '{}'", k, metric);
  }
}

}  // namespace

Counter& MetricsRegistry::counter(std::string_view name, std::string_view help, const MetricLabels& labels) {
  check_labels(name, labels, false);
  std::lock_guard lock(mu_);
  Family& f = family(name, help, kCounter, nullptr);
  const std::string key = label_text(labels);
  if (auto* s = f.find(key)) return *std::get<std::unique_ptr<Counter>>(s->metric);
  f.series.push_back({labels, key, std::make_unique<Counter>()});
  return *std::get<std::unique_ptr<Counter>>(f.series.back().metric);
}

Gauge& MetricsRegistry::gauge(std::string_view name, std::string_view help, const MetricLabels& labels) {
  check_labels(name, labels, false);
  std::lock_guard lock(mu_);
  Family& f = family(name, help, kGauge, nullptr);
  const std::string key = label_text(labels);
  if (auto* s = f.find(key)) return *std::get<std::unique_ptr<Gauge>>(s->metric);
  f.series.push_back({labels, key, std::make_unique<Gauge>()});
  return *std::get<std::unique_ptr<Gauge>>(f.series.back().metric);
}

Histogram& MetricsRegistry::histogram(std::string_view name, std::string_view help,
                                      const std::vector<double>& upper_bounds, const MetricLabels& labels) {
  check_labels(name, labels, true);
  auto h = std::make_unique<Histogram>(upper_bounds);  // validates the bounds
  std::lock_guard lock(mu_);
  Family& f = family(name, help, kHistogram, &upper_bounds);
  const std::string key = label_text(labels);
  if (auto* s = f.find(key)) return *std::get<std::unique_ptr<Histogram>>(s->metric);
  f.series.push_back({labels, key, std::move(h)});
  return *std::get<std::unique_ptr<Histogram>>(f.series.back().metric);
}

std::string MetricsRegistry::render() const {
  std::string out;
  std::lock_guard lock(mu_);
  for (const auto& f : families_) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f->name, escape_help(f->help), f->name,
                       type_name(f->type));
    for (const auto& s : f->series) {
      if (f->type == kCounter) {
        out += fmt::format("{}{} {}\n", f->name, braced(s.key),
                           format_value(std::get<std::unique_ptr<Counter>>(s.metric)->value()));
      } else if (f->type == kGauge) {
        out += fmt::format("{}{} {}\n", f->name, braced(s.key),
                           format_value(std::get<std::unique_ptr<Gauge>>(s.metric)->value()));
      } else {
        const auto& h = *std::get<std::unique_ptr<Histogram>>(s.metric);
        const auto snap = h.snapshot();
        for (size_t i = 0; i < snap.cumulative.size(); ++i) {
          const std::string le = i < h.bounds().size() ? format_value(h.bounds()[i]) : "+Inf";
          out += fmt::format("{}_bucket{{{}}} {}\n", f->name, label_text(s.labels, "le=\"" + le + "\""),
                             snap.cumulative[i]);
        }
        out += fmt::format("{}_sum{} {}\n", f->name, braced(s.key), format_value(snap.sum));
        out += fmt::format("{}_count{} {}\n", f->name, braced(s.key), snap.count);
      }
    }
  }
  return out;
}

}  // namespace loom

// Reading metrics_file JSONL for `loom plot`, and axis ticks (curves_data.h).
#include "apps/curves_data.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace loom::app {

namespace {

using json = nlohmann::json;

struct Field {
  const char* name;
  Curve MetricsRun::*curve;
};
constexpr Field kFields[] = {{"loss", &MetricsRun::loss},
                             {"eval_loss", &MetricsRun::eval_loss},
                             {"eval_accuracy", &MetricsRun::eval_accuracy},
                             {"lr", &MetricsRun::lr},
                             {"grad_norm", &MetricsRun::grad_norm}};
constexpr size_t kNumFields = std::size(kFields);

// nlohmann's message without its "[json.exception.parse_error.101] " prefix.
std::string parse_message(const json::exception& e) {
  std::string m = e.what();
  const size_t p = m.find("] ");
  return p == std::string::npos ? m : m.substr(p + 2);
}

std::string type_of(const json& v) { return v.type_name(); }

// One line's points into `by_step` (per field, step -> value; later lines win).
// Returns false when the line holds none of the fields.
bool read_record(const json& o, const std::string& where, std::map<int64_t, double> (&by_step)[kNumFields]) {
  if (!o.is_object()) fail(ErrorKind::invalid_input, "{}: a {} where a JSON object was expected", where, type_of(o));
  bool any = false;
  for (const Field& f : kFields) any = any || o.contains(f.name);
  if (!any) return false;
  const auto s = o.find("step");
  if (s == o.end()) fail(ErrorKind::invalid_input, "{}: a record with metrics but no \"step\"", where);
  if (!s->is_number_integer() || s->get<int64_t>() < 0)
    fail(ErrorKind::invalid_input, "{}: \"step\" must be an integer >= 0, got {}", where, s->dump());
  const auto step = s->get<int64_t>();
  for (size_t i = 0; i < kNumFields; ++i) {
    const auto v = o.find(kFields[i].name);
    if (v == o.end()) continue;
    if (!v->is_number() && !v->is_null())
      fail(ErrorKind::invalid_input, "{}: \"{}\" must be a number or null, got {}", where, kFields[i].name,
           type_of(*v));
    by_step[i][step] = v->is_null() ? std::nan("") : v->get<double>();
  }
  return true;
}

}  // namespace

int64_t MetricsRun::max_step() const {
  int64_t m = 0;
  for (const Field& f : kFields)
    if (!(this->*f.curve).empty()) m = std::max(m, (this->*f.curve).back().first);
  return m;
}

bool MetricsRun::empty() const {
  return std::all_of(std::begin(kFields), std::end(kFields), [&](const Field& f) { return (this->*f.curve).empty(); });
}

MetricsRun read_metrics_jsonl(const std::string& path, std::vector<std::string>* warnings) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    fail(ErrorKind::not_found, "metrics file '{}' does not exist", path);
  if (std::filesystem::is_directory(path, ec))
    fail(ErrorKind::invalid_input, "metrics file '{}' is a folder, not a JSONL file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorKind::io, "metrics file '{}' cannot be read", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (text.find_first_not_of(" \t\r\n") == std::string::npos)
    fail(ErrorKind::invalid_input, "metrics file '{}' is empty (no record yet?)", path);

  std::map<int64_t, double> by_step[kNumFields];
  int64_t records = 0, line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    const size_t end = text.find('\n', pos);
    const bool terminated = end != std::string::npos;
    const std::string line = text.substr(pos, terminated ? end - pos : std::string::npos);
    pos = terminated ? end + 1 : text.size();
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path, line_no);
    json o;
    try {
      o = json::parse(line);
    } catch (const json::exception& e) {
      if (!terminated) {  // the line a running trainer is writing
        if (warnings) warnings->push_back(fmt::format("{}: skipped an incomplete last line", where));
        continue;
      }
      fail(ErrorKind::invalid_input, "{}: not JSON: {}", where, parse_message(e));
    }
    records += read_record(o, where, by_step);
  }
  if (records == 0)
    fail(ErrorKind::invalid_input,
         "metrics file '{}' has no step or eval record (no line with loss, eval_loss, eval_accuracy, lr or "
         "grad_norm): is it a loom train metrics_file?",
         path);
  MetricsRun run;
  run.path = path;
  run.label = std::filesystem::path(path).filename().string();
  for (size_t i = 0; i < kNumFields; ++i)
    run.*kFields[i].curve = Curve(by_step[i].begin(), by_step[i].end());
  return run;
}

Ticks nice_ticks(double lo, double hi, int target, double min_step) {
  LOOM_ASSERT(std::isfinite(lo) && std::isfinite(hi) && lo <= hi && target >= 1);
  if (hi - lo <= 1e-12 * std::max(1.0, std::fabs(lo))) {  // one value: a range around it
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  Ticks t;
  t.step = std::max(min_step, (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag);
  const double first = std::floor(lo / t.step + 1e-9), last = std::ceil(hi / t.step - 1e-9);
  t.lo = first * t.step;
  t.hi = last * t.step;
  for (double k = first; k <= last + 0.5; k += 1) {
    const double v = k * t.step;
    t.values.push_back(std::fabs(v) < 1e-9 * t.step ? 0.0 : v);
  }
  return t;
}

std::string format_tick(double value, double step, double span) {
  if (value == 0) return "0";
  const double big = std::max(std::fabs(value), step);
  const double axis = std::max(big, span);
  if (axis >= 1e-2 && axis < 1e6) {  // fixed, as many decimals as the step has
    const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)));
    return fmt::format("{:.{}f}", value, decimals);
  }
  // Scientific with the digits that tell ticks apart: 1.50e-03 -> 1.5e-3.
  const int digits = std::max(
      1, static_cast<int>(std::floor(std::log10(big) + 1e-9) - std::floor(std::log10(step) + 1e-9)) + 1);
  const std::string s = fmt::format("{:.{}e}", value, digits - 1);
  const size_t e = s.find('e');
  std::string mant = s.substr(0, e), expo = s.substr(e + 1);
  if (mant.find('.') != std::string::npos) {
    while (mant.back() == '0') mant.pop_back();
    if (mant.back() == '.') mant.pop_back();
  }
  const bool neg = expo[0] == '-';
  expo = expo.substr(1);
  while (expo.size() > 1 && expo[0] == '0') expo.erase(0, 1);
  return mant + "e" + (neg ? "-" : "") + expo;
}

}  // namespace loom::app

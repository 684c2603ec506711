// Text and JSON of the report and the advice (report.h).
#include "profile/report.h"

#include <algorithm>

#include "profile/units.h"

namespace loom {

namespace {

using json = nlohmann::ordered_json;

std::string header(const Trace& t, const Analysis& a) {
  const TraceMeta& m = t.meta;
  std::string s = fmt::format("trace {}\n", t.path);
  s += fmt::format("command {}, {}, {} threads", m.command.empty() ? "?" : m.command,
                   m.cpu.empty() ? "cpu ?" : m.cpu, a.threads);
  if (!m.model_path.empty())
    s += fmt::format(", model {} ({}, {} layers)", m.model_path, m.model_type.empty() ? "?" : m.model_type,
                     m.model_layers);
  s += "\n";
  const double mean = a.units > 0 ? a.total_us / static_cast<double>(a.units) : 0;
  if (a.unit == "step")
    s += fmt::format("{} steps: {}, {} a step (recording {})\n", a.units, ms(a.total_us), ms(mean),
                     ms(a.span_us));
  else
    s += fmt::format("{} top-level phases ({}): {}, mean {} (recording {})\n", a.units,
                     a.unit.empty() ? "none" : a.unit, ms(a.total_us), ms(mean), ms(a.span_us));
  return s;
}

size_t name_width(const std::vector<TimeRow>& rows, size_t at_least) {
  size_t w = at_least;
  for (const TimeRow& r : rows) w = std::max(w, r.name.size());
  return w;
}

std::string phase_table(const Analysis& a) {
  const size_t w = name_width(a.phases, 34);
  std::string s = fmt::format("\n{:<{}}  {:>10}  {:>6}  {:>6}  {:>10}\n", "by phase", w + 2, "time", "share",
                              "count", "mean");
  for (const TimeRow& r : a.phases)
    s += fmt::format("  {:<{}}  {:>10}  {:>6}  {:>6}  {:>10}\n", r.name, w, ms(r.us), pct(a.share(r.us)),
                     r.count, r.count ? ms(r.mean_us()) : "");
  s += fmt::format("  {:<{}}  {:>10}  {:>6}\n", "waiting (threads idle inside ops)", w, ms(a.waiting_us),
                   pct(a.share(a.waiting_us)));
  if (!a.outside.empty()) {
    s += "  outside the accounted time:";
    for (const TimeRow& r : a.outside) s += fmt::format(" {} {} ({}x)", r.name, ms(r.us), r.count);
    s += "\n";
  }
  return s;
}

std::string op_table(const Analysis& a, int top) {
  const size_t n = std::min(a.ops.size(), static_cast<size_t>(std::max(top, 0)));
  std::vector<TimeRow> shown(a.ops.begin(), a.ops.begin() + static_cast<ptrdiff_t>(n));
  const std::string title = fmt::format("op kinds (top {} of {})", n, a.ops.size());
  const size_t w = std::max(name_width(shown, 12), title.size() - 2);
  std::string s = fmt::format("\n{:<{}}  {:>7}  {:>10}  {:>6}  {:>10}  {:>10}\n", title, w + 2, "count",
                              "time", "share", "mean", "waiting");
  for (const TimeRow& r : shown)
    s += fmt::format("  {:<{}}  {:>7}  {:>10}  {:>6}  {:>10}  {:>10}\n", r.name, w, r.count, ms(r.us),
                     pct(a.share(r.us)), ms(r.mean_us()), ms(r.waiting_us));
  if (a.ops.size() > n) {
    TimeRow rest{fmt::format("({} more)", a.ops.size() - n)};
    for (size_t i = n; i < a.ops.size(); ++i) {
      rest.count += a.ops[i].count;
      rest.us += a.ops[i].us;
      rest.waiting_us += a.ops[i].waiting_us;
    }
    s += fmt::format("  {:<{}}  {:>7}  {:>10}  {:>6}  {:>10}  {:>10}\n", rest.name, w, rest.count,
                     ms(rest.us), pct(a.share(rest.us)), "", ms(rest.waiting_us));
  }
  s += fmt::format("  {:<{}}  {:>7}  {:>10}  {:>6}\n", "all ops", w, "", ms(a.op_us), pct(a.share(a.op_us)));
  return s;
}

// The `top` slowest layers, the others as one line with their spread (a
// decoder's layers cost alike: a layer far above the rest is the news), then
// the ops outside the layers.
std::string layer_table(const Analysis& a, int top) {
  if (a.layers.empty()) return {};
  std::vector<LayerRow> layers, none;
  for (const LayerRow& l : a.layers) (l.layer < 0 ? none : layers).push_back(l);
  std::stable_sort(layers.begin(), layers.end(), [](const LayerRow& x, const LayerRow& y) { return x.us > y.us; });
  const size_t n = std::min(layers.size(), static_cast<size_t>(std::max(top, 0)));
  const std::string title = fmt::format("layers (top {} of {})", n, layers.size());
  std::string s = fmt::format("\n{:<22}  {:>7}  {:>10}  {:>6}\n", title, "count", "time", "share");
  for (size_t i = 0; i < n; ++i)
    s += fmt::format("  {:<20}  {:>7}  {:>10}  {:>6}\n", layers[i].layer, layers[i].count, ms(layers[i].us),
                     pct(a.share(layers[i].us)));
  if (layers.size() > n) {
    LayerRow rest;
    for (size_t i = n; i < layers.size(); ++i) rest.count += layers[i].count, rest.us += layers[i].us;
    s += fmt::format("  {:<20}  {:>7}  {:>10}  {:>6}  ({} to {} each)\n",
                     fmt::format("({} more)", layers.size() - n), rest.count, ms(rest.us), pct(a.share(rest.us)),
                     ms(layers.back().us), ms(layers[n].us));
  }
  for (const LayerRow& l : none)
    s += fmt::format("  {:<20}  {:>7}  {:>10}  {:>6}\n", "outside the layers", l.count, ms(l.us), pct(a.share(l.us)));
  return s;
}

// A class this far above its peak says the peak does not describe the run (the
// note under the table says why that happens).
constexpr double kAbovePeak = 1.15;

std::string matmul_table(const Trace& t, const Analysis& a, const PeakTable* peak) {
  if (a.matmuls.empty()) return {};
  int above = 0;
  size_t w = 12;
  for (const MatmulClass& c : a.matmuls) w = std::max(w, c.op.size() + c.dtype.size() + c.regime.size() + 2);
  std::string s = fmt::format("\n{:<{}}  {:>6}  {:>7}  {:>10}  {:>6}  {:>8}  {:>7}  {:>15}  {:>7}  {:>9}\n",
                              "matmul classes", w + 2, "mean T", "count", "time", "share", "GFLOP/s", "GB/s",
                              "peak", "of peak", "roofline");
  for (const MatmulClass& c : a.matmuls) {
    const ClassPeak p = class_peak(c, peak, class_precision(t, c));
    const std::string name = c.op + " " + c.dtype + " " + c.regime;
    std::string peak_s = "-", frac_s = "-", roof_s = "-";
    if (p.peak) {
      peak_s = fmt::format("{:.1f} {}", p.value, c.regime == "decode" ? "GB/s" : "GFLOP/s");
      frac_s = pct(p.fraction);
      roof_s = fmt::format("{:.1f}", p.roofline);
      above += p.fraction > kAbovePeak;
    }
    s += fmt::format("  {:<{}}  {:>6.0f}  {:>7}  {:>10}  {:>6}  {:>8.1f}  {:>7.1f}  {:>15}  {:>7}  {:>9}\n",
                     name, w, c.mean_T(), c.count, ms(c.us), pct(a.share(c.us)), c.gflops(), c.gbps(), peak_s,
                     frac_s, roof_s);
  }
  if (!peak) s += "  (no peak: --no-peak)\n";
  // Seen on a shared VM whose memory speed moves through the day: a 1B-shape
  // decode at 155% of a peak cached hours before.
  if (above > 0)
    s += fmt::format(
        "  ({} above {:.0f}% of the peak: weights that fit in the caches beat its uncached reference, and "
        "a peak measured while the machine was slower (other tenants on a shared host) reads low: "
        "--remeasure measures it again)\n",
        above, 100 * kAbovePeak);
  return s;
}

json rows_json(const Analysis& a, const std::vector<TimeRow>& rows, bool waiting) {
  json out = json::array();
  for (const TimeRow& r : rows) {
    json o = {{"name", r.name},
              {"count", r.count},
              {"us", r.us},
              {"share", a.share(r.us)},
              {"mean_us", r.mean_us()}};
    if (waiting) o["waiting_us"] = r.waiting_us;
    out.push_back(std::move(o));
  }
  return out;
}

json meta_json(const Trace& t, const Analysis& a) {
  const TraceMeta& m = t.meta;
  return {{"trace", t.path},
          {"command", m.command},
          {"version", m.version},
          {"cpu", m.cpu},
          {"threads", a.threads},
          {"model", {{"path", m.model_path}, {"type", m.model_type}, {"layers", m.model_layers}}},
          {"unit", a.unit},
          {"units", a.units},
          {"total_us", a.total_us},
          {"mean_us", a.units > 0 ? a.total_us / static_cast<double>(a.units) : 0},
          {"span_us", a.span_us}};
}

}  // namespace

ClassPeak class_peak(const MatmulClass& c, const PeakTable* peak, const std::string& precision) {
  ClassPeak p;
  if (!peak) return p;
  p.peak = peak->find_class(c.op, c.dtype, c.regime, precision);
  if (!p.peak) return p;
  const bool decode = c.regime == "decode";
  p.value = decode ? p.peak->gbps : p.peak->gflops;
  p.fraction = p.value > 0 ? (decode ? c.gbps() : c.gflops()) / p.value : 0;
  const GemmPeak* batch = peak->find_class(c.op, c.dtype, "batch", precision);
  const double compute = batch ? batch->gflops : p.peak->gflops;
  p.roofline = c.bytes > 0 ? std::min(compute, peak->read_gbps * c.flops / c.bytes) : compute;
  return p;
}

// Serving traces: the mean step of each kind (the `top` most frequent) and its
// time in the four longest op kinds, the rest of its ops as one column, and
// its time outside any op (sampling, streaming, the scheduler's own work).
constexpr size_t kStepKindOps = 4;

std::string step_kind_table(const Analysis& a, int top) {
  if (a.step_kinds.empty()) return "";
  const size_t n = std::min(a.step_kinds.size(), static_cast<size_t>(std::max(top, 0)));
  const size_t n_ops = std::min(a.ops.size(), kStepKindOps);
  std::string s = fmt::format("\n{:<26}  {:>6}  {:>10}", "serve steps by kind (mean)", "count", "step");
  for (size_t i = 0; i < n_ops; ++i) s += fmt::format("  {:>10}", a.ops[i].name);
  s += fmt::format("  {:>10}  {:>11}\n", "other ops", "outside ops");
  for (size_t k = 0; k < n; ++k) {
    const StepKindRow& r = a.step_kinds[k];
    s += fmt::format("  {:<24}  {:>6}  {:>10}", r.kind, r.count, ms(r.mean_us()));
    const double per = r.count > 0 ? 1.0 / static_cast<double>(r.count) : 0;
    double other = 0, in_ops = 0;
    for (size_t i = 0; i < r.ops.size(); ++i) {
      in_ops += r.ops[i].second;
      if (i < n_ops)
        s += fmt::format("  {:>10}", ms(r.ops[i].second * per));
      else
        other += r.ops[i].second;
    }
    s += fmt::format("  {:>10}  {:>11}\n", ms(other * per), ms(std::max(0.0, r.us - in_ops) * per));
  }
  if (a.step_kinds.size() > n) s += fmt::format("  ({} more kinds)\n", a.step_kinds.size() - n);
  return s;
}

std::string format_report(const Trace& t, const Analysis& a, const PeakTable* peak, int top) {
  return header(t, a) + phase_table(a) + op_table(a, top) + step_kind_table(a, top) + layer_table(a, top) +
         matmul_table(t, a, peak);
}

nlohmann::ordered_json report_json(const Trace& t, const Analysis& a, const PeakTable* peak) {
  json o = meta_json(t, a);
  o["phases"] = rows_json(a, a.phases, false);
  o["outside"] = rows_json(a, a.outside, false);
  o["waiting"] = {{"us", a.waiting_us},
                  {"share", a.share(a.waiting_us)},
                  {"by_phase", rows_json(a, a.waiting_by_phase, false)}};
  o["op_us"] = a.op_us;
  o["ops"] = rows_json(a, a.ops, true);
  json layers = json::array();
  for (const LayerRow& l : a.layers)
    layers.push_back({{"layer", l.layer < 0 ? json(nullptr) : json(l.layer)},
                      {"count", l.count},
                      {"us", l.us},
                      {"share", a.share(l.us)}});
  o["layers"] = std::move(layers);
  json kinds = json::array();
  for (const StepKindRow& r : a.step_kinds) {
    json ops = json::object();
    for (const auto& [name, us] : r.ops) ops[name] = r.count > 0 ? us / static_cast<double>(r.count) : 0;
    kinds.push_back(
        {{"kind", r.kind}, {"count", r.count}, {"mean_us", r.mean_us()}, {"op_mean_us", std::move(ops)}});
  }
  o["serve_step_kinds"] = std::move(kinds);
  json classes = json::array();
  for (const MatmulClass& c : a.matmuls) {
    const ClassPeak p = class_peak(c, peak, class_precision(t, c));
    json j = {{"op", c.op},       {"dtype", c.dtype},       {"regime", c.regime},   {"count", c.count},
              {"us", c.us},       {"share", a.share(c.us)}, {"mean_T", c.mean_T()}, {"flops", c.flops},
              {"bytes", c.bytes}, {"gflops", c.gflops()},   {"gbps", c.gbps()}};
    j["peak"] = p.peak ? json(p.value) : json(nullptr);
    j["peak_unit"] = c.regime == "decode" ? "GB/s" : "GFLOP/s";
    j["peak_precision"] = p.peak && !p.peak->precision.empty() ? json(p.peak->precision) : json(nullptr);
    j["fraction_of_peak"] = p.peak ? json(p.fraction) : json(nullptr);
    j["roofline_gflops"] = p.peak ? json(p.roofline) : json(nullptr);
    classes.push_back(std::move(j));
  }
  o["matmuls"] = std::move(classes);
  if (peak)
    o["peak"] = {{"cpu", peak->key.cpu}, {"threads", peak->key.threads}, {"read_gbps", peak->read_gbps}};
  else
    o["peak"] = nullptr;
  return o;
}

std::string format_advice(const Trace& t, const Analysis& a, const Advice& advice) {
  std::string s = header(t, a);
  if (advice.findings.empty())
    s += "\nno rule fired: nothing in this trace crosses a threshold of docs/profiling.md\n";
  for (const Finding& f : advice.findings) {
    s += fmt::format("\n[{}] {}\n", f.rule, f.summary);
    for (size_t i = 0; i < f.change.size(); ++i)
      s += fmt::format("  {} {}\n", i == 0 ? "change:" : "    or:", f.change[i]);
    if (!f.gain.empty()) s += fmt::format("  gain:   {}\n", f.gain);
    if (!f.model.empty()) s += fmt::format("  model:  {}\n", f.model);
  }
  for (const std::string& n : advice.notes) s += fmt::format("\nnote: {}\n", n);
  return s;
}

nlohmann::ordered_json advice_json(const Trace& t, const Analysis& a, const Advice& advice) {
  json o = meta_json(t, a);
  json findings = json::array();
  for (const Finding& f : advice.findings) {
    json numbers = json::object();
    for (const auto& [k, v] : f.numbers) numbers[k] = v;
    findings.push_back({{"rule", f.rule},
                        {"summary", f.summary},
                        {"numbers", std::move(numbers)},
                        {"change", f.change},
                        {"gain", f.gain},
                        {"gain_share", f.gain_share},
                        {"model", f.model}});
  }
  o["findings"] = std::move(findings);
  o["notes"] = advice.notes;
  return o;
}

}  // namespace loom

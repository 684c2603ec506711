// Aggregating a trace (analysis.h): the phase tree per thread, the spans the
// shares are of, and the ops inside them.
#include "profile/analysis.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

namespace loom {

namespace {

// Recorded times are rounded to the microsecond or below; a child may end a
// hair after its parent.
constexpr double kSlackUs = 1.0;

bool contains(const ProfileEvent& outer, const ProfileEvent& inner) {
  return inner.ts >= outer.ts - kSlackUs && inner.end() <= outer.end() + kSlackUs;
}

// parent[i]: the innermost phase on the same thread holding phase i, or -1.
std::vector<int64_t> phase_parents(const std::vector<ProfileEvent>& phases) {
  std::vector<size_t> order(phases.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const ProfileEvent &x = phases[a], &y = phases[b];
    return std::tie(x.tid, x.ts) < std::tie(y.tid, y.ts) ||
           (x.tid == y.tid && x.ts == y.ts && (x.dur > y.dur || (x.dur == y.dur && a < b)));
  });
  std::vector<int64_t> parent(phases.size(), -1);
  std::vector<size_t> stack;
  for (size_t i : order) {
    while (!stack.empty() &&
           (phases[stack.back()].tid != phases[i].tid || !contains(phases[stack.back()], phases[i])))
      stack.pop_back();
    if (!stack.empty()) parent[i] = static_cast<int64_t>(stack.back());
    stack.push_back(i);
  }
  return parent;
}

// Rows by name in first-seen order, then sorted longest first.
class RowSet {
 public:
  TimeRow& at(const std::string& name) {
    const auto [it, added] = index_.emplace(name, rows_.size());
    if (added) rows_.push_back(TimeRow{name});
    return rows_[it->second];
  }
  std::vector<TimeRow> sorted() && {
    std::stable_sort(rows_.begin(), rows_.end(),
                     [](const TimeRow& a, const TimeRow& b) { return a.us > b.us; });
    return std::move(rows_);
  }

 private:
  std::map<std::string, size_t> index_;
  std::vector<TimeRow> rows_;
};

// The accounted spans by thread, sorted by start, for finding an op's span.
class Spans {
 public:
  void add(const ProfileEvent& e) { by_tid_[e.tid].push_back(&e); }
  void sort() {
    for (auto& [tid, v] : by_tid_)
      std::sort(v.begin(), v.end(),
                [](const ProfileEvent* a, const ProfileEvent* b) { return a->ts < b->ts; });
  }
  // The span holding e, or null.
  const ProfileEvent* find(const ProfileEvent& e) const {
    const auto it = by_tid_.find(e.tid);
    if (it == by_tid_.end()) return nullptr;
    const auto& v = it->second;
    // The last span starting at or before e (plus slack); spans of a thread do not overlap.
    auto s = std::upper_bound(v.begin(), v.end(), e.ts + kSlackUs,
                              [](double ts, const ProfileEvent* p) { return ts < p->ts; });
    return s != v.begin() && contains(**(s - 1), e) ? *(s - 1) : nullptr;
  }
  bool holds(const ProfileEvent& e) const { return find(e) != nullptr; }

 private:
  std::map<int64_t, std::vector<const ProfileEvent*>> by_tid_;
};

double op_waiting_us(const ProfileEvent& op) {
  if (op.threads <= 0 || op.busy_us < 0) return 0;
  const double n = static_cast<double>(op.threads);
  return std::max(0.0, n * op.dur - op.busy_us) / n;
}

void add_phases(const Trace& t, Analysis& a, Spans& spans) {
  const std::vector<int64_t> parent = phase_parents(t.phases);
  const bool steps =
      std::any_of(t.phases.begin(), t.phases.end(), [](const ProfileEvent& e) { return e.name == "step"; });
  std::vector<bool> root(t.phases.size(), false);
  for (size_t i = 0; i < t.phases.size(); ++i) root[i] = steps ? t.phases[i].name == "step" : parent[i] < 0;
  RowSet phases, outside;
  std::vector<std::string> unit_names;
  std::vector<double> child_us(t.phases.size(), 0);
  for (size_t i = 0; i < t.phases.size(); ++i) {
    const ProfileEvent& e = t.phases[i];
    if (root[i]) {
      ++a.units;
      a.total_us += e.dur;
      spans.add(e);
      if (!steps) {
        TimeRow& r = phases.at(e.name);
        ++r.count;
        r.us += e.dur;
        if (std::find(unit_names.begin(), unit_names.end(), e.name) == unit_names.end()) {
          a.unit += (unit_names.empty() ? "" : "+") + e.name;
          unit_names.push_back(e.name);
        }
      }
    } else if (steps && parent[i] >= 0 && root[static_cast<size_t>(parent[i])]) {
      TimeRow& r = phases.at(e.name);
      ++r.count;
      r.us += e.dur;
      child_us[static_cast<size_t>(parent[i])] += e.dur;
    } else if (parent[i] < 0) {
      TimeRow& r = outside.at(e.name);
      ++r.count;
      r.us += e.dur;
    }
  }
  if (steps) {
    a.unit = "step";
    double other = 0;
    for (size_t i = 0; i < t.phases.size(); ++i)
      if (root[i]) other += std::max(0.0, t.phases[i].dur - child_us[i]);
    if (other > 0) {
      TimeRow& r = phases.at("other");
      r.us = other;
      r.count = a.units;  // one remainder a step
    }
  }
  a.phases = std::move(phases).sorted();
  a.outside = std::move(outside).sorted();
  spans.sort();
}

void add_op(const ProfileEvent& op, Analysis& a, RowSet& kinds, RowSet& waits,
            std::map<int64_t, LayerRow>& layers,
            std::map<std::tuple<std::string, std::string, std::string>, MatmulClass>& classes) {
  const double wait = op_waiting_us(op);
  TimeRow& k = kinds.at(op.name);
  ++k.count;
  k.us += op.dur;
  k.waiting_us += wait;
  a.op_us += op.dur;
  a.waiting_us += wait;
  if (wait > 0) {
    TimeRow& w = waits.at(op.phase.empty() ? "-" : op.phase);
    ++w.count;
    w.us += wait;
  }
  LayerRow& l = layers[op.layer < 0 ? -1 : op.layer];
  l.layer = op.layer < 0 ? -1 : op.layer;
  ++l.count;
  l.us += op.dur;
  if (op.flops > 0) {
    const std::string dtype = op.dtype.empty() ? "-" : op.dtype;
    MatmulClass& c = classes[{op.name, dtype, matmul_regime(op.T)}];
    c.op = op.name;
    c.dtype = dtype;
    c.regime = matmul_regime(op.T);
    ++c.count;
    c.us += op.dur;
    c.flops += op.flops;
    c.bytes += op.bytes;
    c.rows += static_cast<double>(std::max<int64_t>(op.T, 0));
    if (op.N > 0 && op.K > 0) c.weights += static_cast<double>(op.N) * static_cast<double>(op.K);
  }
}

void add_ops(const Trace& t, const Spans& spans, Analysis& a) {
  RowSet kinds, waits;
  std::map<int64_t, LayerRow> layers;
  std::map<std::tuple<std::string, std::string, std::string>, MatmulClass> classes;
  for (const ProfileEvent& op : t.ops) {
    a.threads = std::max(a.threads, op.threads);
    if (spans.holds(op)) add_op(op, a, kinds, waits, layers, classes);
  }
  a.ops = std::move(kinds).sorted();
  a.waiting_by_phase = std::move(waits).sorted();
  for (const auto& [layer, row] : layers)
    if (layer >= 0) a.layers.push_back(row);
  if (layers.count(-1)) a.layers.push_back(layers[-1]);
  for (auto& [key, c] : classes) a.matmuls.push_back(c);
  std::stable_sort(a.matmuls.begin(), a.matmuls.end(),
                   [](const MatmulClass& x, const MatmulClass& y) { return x.us > y.us; });
}

std::string step_kind(const ProfileEvent& step) {
  const double prefill = step.value("prefill_tokens"), decode = step.value("decode_rows");
  if (prefill > 0) return decode > 0 ? "prefill + decode" : "prefill";
  if (decode > 0) return fmt::format("decode, {:.0f} rows", decode);
  return "empty";
}

// Analysis::step_kinds: each serve_step's kind, and each op by the step that holds it.
void add_step_kinds(const Trace& t, const Spans& spans, Analysis& a) {
  std::map<const ProfileEvent*, size_t> kind_of;  // serve_step -> its row
  std::map<std::string, size_t> row_of;
  for (const ProfileEvent& e : t.phases) {
    if (e.name != "serve_step" || !spans.holds(e)) continue;
    const std::string kind = step_kind(e);
    auto [it, added] = row_of.try_emplace(kind, a.step_kinds.size());
    if (added) {
      a.step_kinds.push_back({kind});
      for (const TimeRow& op : a.ops) a.step_kinds.back().ops.emplace_back(op.name, 0.0);
    }
    StepKindRow& row = a.step_kinds[it->second];
    ++row.count;
    row.us += e.dur;
    kind_of[&e] = it->second;
  }
  if (a.step_kinds.empty()) return;
  std::map<std::string, size_t> op_index;
  for (size_t i = 0; i < a.ops.size(); ++i) op_index[a.ops[i].name] = i;
  for (const ProfileEvent& op : t.ops) {
    const ProfileEvent* step = spans.find(op);
    const auto k = step ? kind_of.find(step) : kind_of.end();
    if (k == kind_of.end()) continue;
    a.step_kinds[k->second].ops[op_index.at(op.name)].second += op.dur;
  }
  std::stable_sort(a.step_kinds.begin(), a.step_kinds.end(),
                   [](const StepKindRow& x, const StepKindRow& y) { return x.count > y.count; });
}

const TimeRow* find_row(const std::vector<TimeRow>& rows, const std::string& name) {
  for (const TimeRow& r : rows)
    if (r.name == name) return &r;
  return nullptr;
}

}  // namespace

const char* matmul_regime(int64_t T) { return T > 0 && T <= kDecodeMaxRows ? "decode" : "batch"; }

const TimeRow* Analysis::phase(const std::string& name) const { return find_row(phases, name); }
const TimeRow* Analysis::outside_phase(const std::string& name) const { return find_row(outside, name); }
const TimeRow* Analysis::op(const std::string& name) const { return find_row(ops, name); }

double StepKindRow::op_mean_us(const std::string& name) const {
  for (const auto& [op, us] : ops)
    if (op == name) return count > 0 ? us / static_cast<double>(count) : 0;
  return 0;
}

Analysis analyze(const Trace& trace) {
  Analysis a;
  Spans spans;
  add_phases(trace, a, spans);
  add_ops(trace, spans, a);
  add_step_kinds(trace, spans, a);
  if (trace.meta.threads > 0) a.threads = trace.meta.threads;
  double first = std::numeric_limits<double>::infinity(), last = -first;
  for (const auto* v : {&trace.phases, &trace.ops})
    for (const ProfileEvent& e : *v) {
      first = std::min(first, e.ts);
      last = std::max(last, e.end());
    }
  a.span_us = last > first ? last - first : 0;
  return a;
}

}  // namespace loom

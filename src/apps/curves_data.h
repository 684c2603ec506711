// What `loom plot` reads and how its axes are divided: a training run's
// metrics_file (JSONL, one object per optimizer step and per evaluation; see
// docs/training.md) as curves against the step, and "nice" axis ticks.
// No drawing here (curves_plot.h), so the tests need no cairo.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom::app {

// Points (step, value) in increasing step; a NaN value (null in the file) is a
// gap in the curve.
using Curve = std::vector<std::pair<int64_t, double>>;

struct MetricsRun {
  std::string path;
  std::string label;  // the legend's name: the file name unless given
  Curve loss, eval_loss, eval_accuracy, lr, grad_norm;  // eval_accuracy as a fraction (0..1)
  int64_t max_step() const;
  bool empty() const;  // no point at all
};

// Reads a metrics_file. Step records carry loss / lr / grad_norm, eval
// records eval_loss / eval_accuracy; each with an integer "step" >= 0. A step
// recorded twice (a run that rolled back) keeps its last value. Blank lines and
// objects with none of those fields (other record kinds) are skipped; an
// unterminated last line that is not JSON (a run still writing it) is skipped
// with a note in `warnings`. Throws loom::Error naming "path:line" for a line
// that is not a JSON object, a missing or bad "step", or a field that is
// neither a number nor null; not_found for a missing file; invalid_input for
// an empty file or one without any plottable record.
MetricsRun read_metrics_jsonl(const std::string& path, std::vector<std::string>* warnings = nullptr);

// Axis ticks over [lo, hi]: a step of 1, 2 or 5 times a power of ten giving
// about `target` ticks, every multiple of the step inside the range (values
// within 1e-9 steps of zero are exactly 0); the step is at least min_step.
// lo == hi is widened first.
struct Ticks {
  double lo = 0, hi = 0;  // the range the axis shows (the data range, rounded out to ticks)
  double step = 0;
  std::vector<double> values;
};
Ticks nice_ticks(double lo, double hi, int target = 5, double min_step = 0);

// A tick's label: fixed with the step's decimals ("0.25", "150"), or
// scientific with the digits that tell ticks apart ("5e-4", "1.5e-3") when the
// axis's largest |value| (`span`, at least |value|) is below 0.01 or from 1e6,
// so that one axis uses one notation.
std::string format_tick(double value, double step, double span = 0);

}  // namespace loom::app

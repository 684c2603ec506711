// What `loom profile report` and `advise` print: text tables, or one JSON
// object with the same numbers, keys in a reading order (docs/profiling.md,
// "Report", "Advice").
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "profile/advice.h"
#include "profile/analysis.h"
#include "profile/peak.h"
#include "profile/trace_file.h"

namespace loom {

// The peak a matmul class is compared with: the same op measured over the same
// dtype in its regime (PeakTable::find_class at `precision`: class_precision);
// decode compares GB/s, batch GFLOP/s. Null: that op was not measured there.
struct ClassPeak {
  const GemmPeak* peak = nullptr;
  double value = 0;     // GB/s (decode) or GFLOP/s (batch)
  double fraction = 0;  // achieved / value
  double roofline = 0;  // GFLOP/s: min(the op's batch peak, read bandwidth x the class's flops per byte)
};
ClassPeak class_peak(const MatmulClass& c, const PeakTable* peak, const std::string& precision);

// `top`: op kinds shown (the rest summed in one line); the JSON has them all.
std::string format_report(const Trace& t, const Analysis& a, const PeakTable* peak, int top);
nlohmann::ordered_json report_json(const Trace& t, const Analysis& a, const PeakTable* peak);

std::string format_advice(const Trace& t, const Analysis& a, const Advice& advice);
nlohmann::ordered_json advice_json(const Trace& t, const Analysis& a, const Advice& advice);

}  // namespace loom

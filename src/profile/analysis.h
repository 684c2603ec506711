// The aggregates of `loom profile report` (docs/profiling.md, "Report"): the
// time a trace accounts for, split by phase, by op kind, by decoder layer and
// into matmul classes, and the time the pool's threads waited inside ops.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "profile/trace_file.h"

namespace loom {

// Time under one name (a phase, an op kind), summed over its events.
struct TimeRow {
  std::string name;
  int64_t count = 0;
  double us = 0;
  double waiting_us = 0;  // op rows: the threads' idle time inside them (see Analysis::waiting_us)
  double mean_us() const { return count > 0 ? us / static_cast<double>(count) : 0; }
};

struct LayerRow {
  int64_t layer = -1;  // -1: ops outside the decoder layers (embedding, loss, optimizer, ...)
  int64_t count = 0;
  double us = 0;
};

// Products of one op kind, weight type and regime: decode (T <= 8 rows, bound
// by reading the weights) or batch (T > 8, bound by arithmetic).
struct MatmulClass {
  std::string op, dtype, regime;
  int64_t count = 0;
  double us = 0, flops = 0, bytes = 0;
  double rows = 0;     // sum of T
  double weights = 0;  // sum of N*K (the weight elements each call multiplies)
  double gflops() const { return us > 0 ? flops / us / 1e3 : 0; }
  double gbps() const { return us > 0 ? bytes / us / 1e3 : 0; }
  double mean_T() const { return count > 0 ? rows / static_cast<double>(count) : 0; }
  double mean_weights() const { return count > 0 ? weights / static_cast<double>(count) : 0; }
};
inline constexpr int64_t kDecodeMaxRows = 8;
const char* matmul_regime(int64_t T);  // "decode" for 0 < T <= 8, else "batch"

// Serving traces: the `serve_step` phases of one kind (decode-only steps by
// their decode rows, steps that also prefill, prefill-only steps) and the time
// they spent in each op kind, so that a kind's cost (the LoRA products of a
// decode step with many adapters) is not averaged with the prefill chunks'.
struct StepKindRow {
  std::string kind;  // "decode, 16 rows", "prefill + decode", "prefill", "empty"
  int64_t count = 0;
  double us = 0;                                    // the steps' summed time
  std::vector<std::pair<std::string, double>> ops;  // summed time by op kind, in Analysis::ops' order
  double mean_us() const { return count > 0 ? us / static_cast<double>(count) : 0; }
  double op_mean_us(const std::string& name) const;  // 0 when the kind ran no such op
};

struct Analysis {
  // What the shares are of: the `step` phases of a training trace, else the
  // top-level phases (prefill and decode of generate / bench, serve_step).
  std::string unit;     // "step", or the top-level phases' names joined ("prefill+decode")
  int64_t units = 0;    // how many such spans
  double total_us = 0;  // their summed duration: 100% in every table
  double span_us = 0;   // first event's start to the last one's end (the whole recording)

  // By phase: training, the phases directly inside the steps by name, plus
  // "other" (step time outside them); otherwise the top-level phases by name.
  // Sums to total_us. Longest first.
  std::vector<TimeRow> phases;
  // Top-level phases outside the accounted spans (a training run's setup `data`,
  // `eval`, `checkpoint`), by name; not in total_us.
  std::vector<TimeRow> outside;
  std::vector<TimeRow> ops;          // op kinds inside the accounted spans, longest first
  std::vector<LayerRow> layers;      // by layer index, -1 (no layer) last
  std::vector<MatmulClass> matmuls;  // ops with flops > 0, longest first
  double op_us = 0;                  // time inside ops
  // Sum over ops of (threads * dur - busy_us) / threads: the mean time a pool
  // thread spent waiting inside an op (for the others, or descheduled).
  double waiting_us = 0;
  std::vector<TimeRow> waiting_by_phase;  // waiting_us by the ops' `phase` arg, most first
  int64_t threads = 0;                    // the trace's pool size (metadata, else the ops' largest `threads`)
  std::vector<StepKindRow> step_kinds;    // serve traces (serve_step phases): most steps first

  double share(double us) const { return total_us > 0 ? us / total_us : 0; }
  const TimeRow* phase(const std::string& name) const;
  const TimeRow* outside_phase(const std::string& name) const;
  const TimeRow* op(const std::string& name) const;
};

// Containment is by time on the same tid, with 1 us of slack for rounding.
Analysis analyze(const Trace& trace);

}  // namespace loom

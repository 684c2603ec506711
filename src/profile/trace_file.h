// A profiler trace as `loom profile report` and `advise` read it: the Chrome
// Trace Event JSON of docs/profiling.md ("The trace"), reduced to its complete
// events of the two categories (phases, ops) with typed arguments, and the
// otherData.loom metadata. Written by the recorder (core/trace.h); this file
// depends only on the documented format, not on the recorder's code.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

enum class TraceEventKind { phase, op };

// One complete ("ph": "X") event. Times are in microseconds.
struct ProfileEvent {
  TraceEventKind kind = TraceEventKind::phase;
  std::string name;
  int64_t tid = 0;
  double ts = 0, dur = 0;
  size_t index = 0;  // position in traceEvents, for messages
  // Op arguments (docs/profiling.md); absent: empty, -1, 0, or busy_us < 0.
  std::string phase, dtype;
  int64_t layer = -1, T = -1, N = -1, K = -1;
  double flops = 0, bytes = 0;
  int64_t threads = 0;
  double busy_us = -1;
  // Every numeric argument by name (the phases' own: tokens, prefill_tokens, preempted, ...).
  std::map<std::string, double> values;

  double end() const { return ts + dur; }
  double value(const std::string& key, double fallback = 0) const;
  bool has(const std::string& key) const { return values.count(key) != 0; }
};

// otherData.loom: what ran, where, with which settings. Missing fields stay
// empty (a trace from another tool, or one cut short).
struct TraceMeta {
  std::string command, version, cpu;
  int64_t threads = 0;  // the pool size; 0: not recorded (the ops' `threads` then stand in)
  std::vector<std::string> isa;
  std::string bf16_dot;  // "vdpbf16ps" or "fma" with AVX512-BF16 (kernels/cpu/bf16_dot.h); else empty
  std::string model_path, model_type;
  int64_t model_layers = 0, model_hidden = 0;
  nlohmann::json config = nlohmann::json::object();  // training config keys (train only)
  std::map<std::string, double> memory;              // the trainer's estimate in bytes by arena (train only)
  std::map<std::string, double> serve;               // the server's budgets (serve only)

  // config values by key (absent or of another type: the fallback).
  std::string config_string(const std::string& key, const std::string& fallback = "") const;
  double config_number(const std::string& key, double fallback = 0) const;
  bool has_config(const std::string& key) const { return config.contains(key) && !config[key].is_null(); }
};

struct Trace {
  std::string path;
  TraceMeta meta;
  std::vector<ProfileEvent> phases, ops;  // in file order
  size_t skipped = 0;                     // events of other types or categories (thread names, counters, ...)
};

// Reads `path`. Throws loom::Error naming the file: not_found (no such file),
// invalid_input (not JSON; not the JSON object form; no "traceEvents" array;
// an event that is not an object, or a phase / op event without a name, a
// numeric ts or a numeric dur >= 0, or with an argument of the wrong type,
// naming the event's index and name).
Trace read_trace(const std::string& path);
// The same from text already read (`path` only names it in messages).
Trace parse_trace(std::string_view text, const std::string& path);

}  // namespace loom

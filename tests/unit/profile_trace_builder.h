// Synthetic traces for the `loom profile` tests: phase and op events and the
// otherData.loom metadata of docs/profiling.md, as JSON text, a file, or a
// parsed Trace.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "profile/trace_file.h"

namespace loom::test_util {

struct TraceBuilder {
  using json = nlohmann::json;
  json events = json::array();
  json loom = {
      {"command", "train"}, {"version", "test"}, {"threads", 2}, {"cpu", "Test CPU"}, {"isa", json::array()}};

  TraceBuilder& phase(const std::string& name, double ts, double dur, json args = json::object(),
                      int tid = 0) {
    events.push_back({{"name", name},
                      {"cat", "phase"},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", tid},
                      {"ts", ts},
                      {"dur", dur},
                      {"args", std::move(args)}});
    return *this;
  }
  TraceBuilder& op(const std::string& name, double ts, double dur, json args = json::object(), int tid = 0) {
    events.push_back({{"name", name},
                      {"cat", "op"},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", tid},
                      {"ts", ts},
                      {"dur", dur},
                      {"args", std::move(args)}});
    return *this;
  }
  // A product's args: flops = 2 T N K, bytes = the weight (bytes_per_weight a weight) plus f32 rows in and
  // out.
  static json product(const std::string& phase, int64_t layer, int64_t T, int64_t N, int64_t K,
                      const std::string& dtype, double bytes_per_weight, int threads, double busy_us) {
    json a = {{"phase", phase},
              {"T", T},
              {"N", N},
              {"K", K},
              {"dtype", dtype},
              {"flops", 2.0 * double(T) * double(N) * double(K)},
              {"bytes", bytes_per_weight * double(N) * double(K) + 4.0 * double(T) * double(N + K)},
              {"threads", threads},
              {"busy_us", busy_us}};
    if (layer >= 0) a["layer"] = layer;
    return a;
  }
  std::string text() const {
    json root = {{"traceEvents", events}, {"displayTimeUnit", "ms"}, {"otherData", {{"loom", loom}}}};
    return root.dump();
  }
  Trace trace() const { return parse_trace(text(), "synthetic.json"); }
  std::string write(const std::string& path) const {
    std::ofstream(path, std::ios::binary) << text();
    return path;
  }
};

}  // namespace loom::test_util

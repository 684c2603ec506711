// The profiler's recorder (docs/profiling.md): timed spans of phases (step,
// forward, backward, optimizer, ...) and of backend ops (kernels/
// profiling_backend.h), written as Chrome Trace Event JSON for Perfetto,
// chrome://tracing and `loom profile report`. Passed explicitly: a command
// that profiles makes one and hands it to what it runs; nothing records
// without one. While not recording, a span costs one atomic load.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <ostream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom {

class ThreadPool;

// A numeric argument of an event: a name with static storage and a value.
using TraceArg = std::pair<const char*, double>;

// One complete ("X") event, 120 bytes (a recording writes one per op: the
// smaller, the fewer pages it touches). Strings have static storage (literals,
// dtype names).
struct TraceEvent {
  const char* name = nullptr;
  const char* cat = nullptr;  // "phase" or "op"
  int64_t ts_ns = 0, dur_ns = 0;
  // Ops: where they ran, their size and work (-1 / null / 0: absent).
  const char* phase = nullptr;
  const char* dtype = nullptr;
  double flops = 0, bytes = 0;
  int64_t T = -1, N = -1, K = -1;
  int64_t busy_ns = -1;
  int32_t layer = -1;
  int32_t threads = 0;
  uint32_t tid = 0;      // set by Tracer::add
  uint32_t n_args = 0;   // phases: arguments kept by the tracer (add_phase)
  uint64_t args_at = 0;  // where they start in its argument list
};

static_assert(sizeof(TraceEvent) == 120);

// A phase's arguments, at most this many.
using TraceArgs = std::array<TraceArg, 10>;

class Tracer {
 public:
  // Events kept at most (about 1 GB of ~250 bytes each); later ones are
  // counted as dropped and the file says so.
  static constexpr size_t kMaxEvents = size_t{4} << 20;

  Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Recording on and off (serve's /profile/start and /profile/stop); start()
  // clears what an earlier recording held and sets the time origin.
  void start();
  void stop();
  bool recording() const { return recording_.load(std::memory_order_relaxed); }

  int64_t now_ns() const;  // since start()
  void add(TraceEvent e);  // any thread; ignored while not recording
  void add_phase(TraceEvent e, const TraceArgs& args, uint32_t n_args);  // with its arguments

  // Where the thread issuing ops is (training's main thread, the server's
  // scheduler thread): the innermost open phase and the decoder layer. One
  // issuing thread at a time.
  void set_layer(int32_t layer) { layer_ = layer; }
  int32_t layer() const { return layer_; }
  const char* phase() const { return phases_.empty() ? nullptr : phases_.back(); }
  void push_phase(const char* name) { phases_.push_back(name); }
  void pop_phase() {
    if (!phases_.empty()) phases_.pop_back();
  }

  size_t event_count() const;
  size_t dropped() const;
  // The whole trace: {"traceEvents": [...], "displayTimeUnit": "ms",
  // "otherData": {"loom": <other_data_json>}}; `other_data_json` a JSON object.
  void write_chrome_json(std::ostream& out, std::string_view other_data_json) const;

 private:
  uint32_t thread_index();  // under mu_
  void push(TraceEvent& e);  // under mu_

  std::atomic<bool> recording_{false};
  std::atomic<int64_t> origin_ns_{0};
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
  std::vector<TraceArg> args_;  // the phases' arguments, back to back
  size_t dropped_ = 0;
  std::unordered_map<std::thread::id, uint32_t> tids_;
  std::thread::id last_thread_;  // the last adder and its index: the map is looked up on a change only
  uint32_t last_tid_ = 0;
  int32_t layer_ = -1;
  std::vector<const char*> phases_;
};

// A phase span: records [construction, destruction) as a "phase" event and is
// the innermost phase of the ops inside it. Null tracer or not recording: nothing.
class TraceScope {
 public:
  TraceScope(Tracer* tracer, const char* name, std::initializer_list<TraceArg> args = {});
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;
  // An argument known only at the end (tokens of a step, bytes written).
  void arg(const char* name, double value);

 private:
  Tracer* t_ = nullptr;
  TraceEvent e_;
  TraceArgs args_{};
  uint32_t n_args_ = 0;
};

// The decoder layer of the ops issued while it lives (-1 after).
class TraceLayer {
 public:
  TraceLayer(Tracer* tracer, int64_t layer) : t_(tracer && tracer->recording() ? tracer : nullptr) {
    if (t_) t_->set_layer(static_cast<int32_t>(layer));
  }
  ~TraceLayer() {
    if (t_) t_->set_layer(-1);
  }
  TraceLayer(const TraceLayer&) = delete;
  TraceLayer& operator=(const TraceLayer&) = delete;

 private:
  Tracer* t_;
};

}  // namespace loom

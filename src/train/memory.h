// Where a training run's memory goes: every arena by name (frozen and
// prepared weights, trainable parameters, gradients, optimizer moments, saved
// activations, scratch, the loss chunk, data), the process RSS, the limit it
// runs under (memory_limit, else the cgroup's, else the memory available at
// start), the estimate made before step 1 and the memory_alarm thresholds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/cgroup.h"

namespace loom {

struct MemoryArena {
  std::string name;  // "weights", "activations", ...: the label of loom_train_memory_bytes{arena=...}
  int64_t bytes = 0;
};

// The arenas of a training run, in this order. Each is exact bytes of the
// buffers it names (capacity, not use):
//  weights            frozen weights as the model file maps them (resident once read)
//  weights_prepared   the backend's copies the forward multiplies (CPU panels)
//  weights_backward   transposed copies for input gradients (f16 / bf16 / q8; none with exact or bf16 on AMX)
//  trainable          LoRA adapters, or the f32 copy of every weight (method: full)
//  gradients          same layout as trainable
//  optimizer          AdamW's two moments
//  activations        what the forward saves for the backward, for the largest micro-batch
//  backward_scratch   the backward's temporaries and the backend's workspaces (quantized activations, ...)
//  loss               the cross-entropy's chunk of logits and its rows
//  data               tokenized samples (the token cache), packed rows, the micro-batches
inline constexpr const char* kMemoryArenaNames[] = {
    "weights",   "weights_prepared", "weights_backward", "trainable",        "gradients",
    "optimizer", "activations",      "backward_scratch", "loss",             "data"};
inline constexpr int kMemoryArenaCount = 10;

// Where the limit came from.
enum class MemoryLimitSource { config, cgroup, available };
const char* memory_limit_source_name(MemoryLimitSource s);  // "memory_limit", "cgroup", "MemAvailable"

struct MemoryLimit {
  int64_t bytes = 0;
  MemoryLimitSource source = MemoryLimitSource::available;
};

// What memory_report() gives the logs and the loom_train_memory_bytes gauges.
struct MemoryReport {
  std::vector<MemoryArena> arenas;  // kMemoryArenaNames, in order
  int64_t accounted = 0;            // sum of the arenas
  int64_t rss = 0;                  // resident set of the process now
  int64_t limit = 0;
  MemoryLimitSource limit_source = MemoryLimitSource::available;
  // How many memory_alarm thresholds RSS is above (0: none; memory_alarm.size(): all).
  int alarm_level = 0;
  int64_t bytes(std::string_view arena) const;  // 0 for an unknown name
};

// ---- the process and the machine (Linux /proc and /sys) ----------------------

// Resident set size of this process (/proc/self/statm), bytes; 0 when unreadable.
int64_t process_rss_bytes();

// Parsers of the files below, for tests: nullopt when the text holds no value
// (cgroup "max", v1's "unlimited" 2^63 - page, a missing MemAvailable line).
std::optional<int64_t> parse_meminfo_available(std::string_view meminfo);
std::optional<int64_t> parse_cgroup_limit(std::string_view memory_max);

// The tightest memory limit (v2 memory.max, v1 memory.limit_in_bytes) from the
// process's cgroup up to its hierarchy's root, for the cgroups of
// find_cgroup("memory", ...) (core/cgroup.h); files are read under `fs_prefix`
// (empty for the live system, a fixture folder in tests). nullopt: no limit.
std::optional<int64_t> cgroup_memory_limit(const CgroupPaths& paths, const std::string& fs_prefix = "");

// memory_limit when configured (> 0); else the cgroup limit; else what the
// machine has available now (MemAvailable) plus what this process already holds.
MemoryLimit resolve_memory_limit(int64_t configured);

// ---- the estimate before step 1 ----------------------------------------------

struct MemoryEstimate {
  std::vector<MemoryArena> arenas;  // kMemoryArenaNames, in order
  int64_t other = 0;  // resident now and in no arena (code, libraries, tokenizer, thread stacks, heap)
  int64_t total = 0;  // arenas + other: the RSS the run should peak at
  int64_t seq_len = 0, batch_rows = 0;  // the micro-batch it was made for
};

// "needs about 1.42 GiB: weights 0.090, activations 0.870, ... (GiB; micro-batches of 2 x 512 tokens)"
// (arenas in MiB when the total is below 1 GiB; arenas of 0 bytes left out).
std::string format_memory_estimate(const MemoryEstimate& e);
// "1.42 GiB", "350.2 MiB", "12.0 KiB".
std::string format_bytes(int64_t bytes);

// Throws loom::Error(invalid_input) when e.total exceeds the limit: the
// message gives both figures and the keys that lower the estimate (data.seq_len,
// batch_size with grad_accum to keep the step, method: lora, backward).
// `source` names the config file.
void check_memory_estimate(const MemoryEstimate& e, const MemoryLimit& limit, const std::string& source);

// ---- alarms ------------------------------------------------------------------

// memory_alarm: thresholds (increasing fractions of the limit) that RSS
// crosses. The level is the number of thresholds RSS is at or above; it rises
// as soon as RSS reaches a threshold and falls back only once RSS is below the
// threshold minus `hysteresis` (a fraction of the limit), so RSS hovering at a
// threshold does not raise an alarm every step.
class MemoryAlarm {
 public:
  MemoryAlarm(std::vector<double> thresholds, int64_t limit, double hysteresis = 0.02);

  struct Change {
    int from = 0, to = 0;    // levels
    double threshold = 0;    // rising: the highest threshold reached; falling: the lowest one left
    double fraction = 0;     // RSS / limit
  };
  // Updates the level from an RSS reading; returns the change, if any.
  std::optional<Change> update(int64_t rss);
  int level() const { return level_; }
  int levels() const { return static_cast<int>(thresholds_.size()); }
  int64_t limit() const { return limit_; }

 private:
  std::vector<double> thresholds_;
  int64_t limit_;
  double hysteresis_;
  int level_ = 0;
};

}  // namespace loom

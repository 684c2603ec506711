// What this machine can do, for `loom profile report`'s "% of peak": memory
// read bandwidth, and the backend's matrix products per weight type at one row
// (decode: bound by reading the weights) and at a prompt-sized batch (bound by
// arithmetic), measured once with the trace's thread count and cached as JSON
// (docs/profiling.md, "Peak").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"

namespace loom {

// What a measurement holds for: another CPU, thread count, loom build or
// LOOM_CPU mask measures again.
struct PeakKey {
  std::string cpu;  // the CPU's model name
  int64_t threads = 1;
  std::string build;         // this loom build (the app passes the executable's identity)
  std::string cpu_mask;      // LOOM_CPU, which changes the kernels
  std::string hash() const;  // 16 hex digits of all four
  bool operator==(const PeakKey&) const = default;
};

// The CPU's model name from /proc/cpuinfo ("unknown CPU" where there is none).
std::string this_cpu_model();

struct GemmPeak {
  std::string dtype, regime;  // regime: "decode" (T = 1) or "batch"
  int64_t T = 0, N = 0, K = 0;
  double gflops = 0;
  double gbps = 0;  // the weight's stored bytes read per second
};

struct PeakTable {
  PeakKey key;
  double read_gbps = 0;  // streaming read of a large buffer by the pool's threads
  std::vector<GemmPeak> gemm;
  double seconds = 0;  // how long measuring took
  const GemmPeak* find(std::string_view dtype, std::string_view regime) const;
};

struct PeakOptions {
  size_t read_bytes = size_t{256} << 20;    // streamed for the read bandwidth
  size_t decode_bytes = size_t{256} << 20;  // weight bytes of each T = 1 product: more than caches hold
  int64_t batch_rows = 256;                 // T of the batch products
  int64_t rows = 1024, cols = 2048;  // the batch weight's shape; cols is also the decode weight's width
  double min_seconds = 0.12;         // each product repeated at least this long (and 3 times); best counts
  std::vector<DType> dtypes = peak_dtypes_default();
  static std::vector<DType> peak_dtypes_default();
};
// Sizes for tests: well under a second.
PeakOptions quick_peak_options();

using PeakProgress = std::function<void(const std::string&)>;
// Measures on the CPU backend computing with `pool` (key.threads should be
// pool.size()). Random weights of each type: quantize_rows' types, nf4 and
// i8_ch made from the same f32 matrix.
PeakTable measure_peak(ThreadPool& pool, const PeakKey& key, const PeakOptions& opt,
                       const PeakProgress& progress = nullptr);

// $XDG_CACHE_HOME/loom, else $HOME/.cache/loom (empty when neither is set).
std::string default_peak_cache_dir();
// DIR/peak-<key hash>.json.
std::string peak_cache_path(const std::string& dir, const PeakKey& key);

std::string peak_to_json(const PeakTable& t);
// Throws invalid_input naming `path` and the field for anything but what
// peak_to_json writes (a positive, finite number where numbers belong).
PeakTable peak_from_json(std::string_view text, const std::string& path);

struct CachedPeak {
  PeakTable table;
  std::string path;
  bool measured = false;  // measured now (else read from `path`)
  std::string note;       // why a cache file was not used, or could not be written
};
// The peak for `key`: read from `path` when it holds a valid measurement for
// that key (and not `remeasure`); else measured (progress on `progress`) and
// written there atomically. A corrupt or mismatched file is measured again
// and replaced, with the reason in `note`; a failed write is only a note.
CachedPeak cached_peak(ThreadPool& pool, const PeakKey& key, const std::string& path, bool remeasure,
                       const PeakOptions& opt = {}, const PeakProgress& progress = nullptr);

}  // namespace loom

// What this machine can do, for `loom profile report`'s "% of peak": memory
// read bandwidth, and each traced product op measured with the op itself: the
// forward `matmul` per weight type at one row (decode: bound by reading the
// weights) and at a prompt-sized batch (bound by arithmetic); the backward's
// `linear_backward_input` per backward precision, `linear_backward_weight`,
// `matmul_dense` and the fused `loss` at a batch. Measured once with the
// trace's thread count and cached as JSON (docs/profiling.md, "Peak").
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

class Backend;

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


// One op's measured speed, keyed as a trace's matmul class is (op, dtype,
// regime) plus the backward precision the op ran at. `dtype`, T, N, K and the
// FLOPs are what kernels/profiling_backend.cpp records for that call.
struct GemmPeak {
  std::string op;             // matmul, linear_backward_input, linear_backward_weight, matmul_dense, loss
  std::string dtype, regime;  // regime: "decode" (T = 1) or "batch"
  std::string precision;      // linear_backward_input and loss: exact, f16, int8, bf16; else empty
  int64_t T = 0, N = 0, K = 0;
  double gflops = 0;
  double gbps = 0;     // the weight bytes the profiler counts for the op, per second
  double seconds = 0;  // the best call's (gflops x seconds: the FLOPs the profiler records for it)
};

// Ops whose speed depends on training's `backward` precision: measured once per precision.
bool op_has_precision(std::string_view op);

struct PeakTable {
  PeakKey key;
  double read_gbps = 0;  // streaming read of a large buffer by the pool's threads
  std::vector<GemmPeak> gemm;
  double seconds = 0;  // how long measuring took
  // The entry of exactly this op, dtype, regime and precision (empty: none).
  const GemmPeak* find(std::string_view op, std::string_view dtype, std::string_view regime,
                       std::string_view precision = "") const;
  // The peak a trace's class (op, dtype, regime) is compared with, `precision`
  // the one the class ran at (advice.h's class_precision; empty: unknown, taken
  // as exact). Ops without a precision: their entry. linear_backward_input and
  // loss: the entry at that precision; for linear_backward_input else the
  // `exact` one (W read as stored: what a dtype the precision's W^T does not
  // have comes from). Null: the op was not measured for that dtype and regime,
  // never another op's figure.
  const GemmPeak* find_class(std::string_view op, std::string_view dtype, std::string_view regime,
                             std::string_view precision) const;
};

struct PeakOptions {
  size_t read_bytes = size_t{256} << 20;    // streamed for the read bandwidth
  size_t decode_bytes = size_t{256} << 20;  // weight bytes of each T = 1 product: more than caches hold
  int64_t batch_rows = 256;                 // T of the batch products (every op's)
  int64_t rows = 1024, cols = 2048;  // the batch matmul's weight; cols is also the decode weight's width
  // The training ops' weight {train_rows, train_cols} (a down projection of a
  // 576-wide model: dx [T, 1536] = dy [T, 576] W), also dW's and matmul_dense's shape.
  int64_t train_rows = 576, train_cols = 1536;
  // The loss's output projection [loss_vocab, loss_hidden] (loss_hidden rounded
  // up to the type's block: 768 for the K-quants' 256).
  int64_t loss_vocab = 4096, loss_hidden = 576;
  double min_seconds = 0.12;  // each product repeated at least this long (and 3 times); best counts
  std::vector<DType> dtypes = peak_dtypes_default();       // matmul's and linear_backward_input's weights
  std::vector<DType> loss_dtypes = loss_dtypes_default();  // the loss's output projections
  static std::vector<DType> peak_dtypes_default();
  static std::vector<DType> loss_dtypes_default();
};
// Sizes for tests: well under a second.
PeakOptions quick_peak_options();

// The pool's threads streaming `bytes` they wrote first (the best of repeated
// passes, at least `min_seconds` in all): what decode can read per second at
// most, the floor `loom bench` compares generation with.
double measure_read_gbps(ThreadPool& pool, size_t bytes = size_t{256} << 20, double min_seconds = 0.3);

// The same passes' best and median. On a machine shared with others the best
// pass catches moments the neighbours were idle (a streaming loop on a Zen 4
// VM: median 27.5 GB/s, best 37.9 over 11 passes), while a decode run averages
// over them; the median is what a long run can count on.
struct ReadBandwidth {
  double best_gbps = 0, median_gbps = 0;
};
ReadBandwidth measure_read_bandwidth(ThreadPool& pool, size_t bytes = size_t{256} << 20,
                                     double min_seconds = 0.3);

using PeakProgress = std::function<void(const std::string&)>;
// Measures on the CPU backend computing with `pool` (key.threads should be
// pool.size()). Random weights of each type: quantize_rows' types, nf4 and
// i8_ch made from the same f32 matrix. linear_backward_input: exact over each
// of `dtypes`, and f16, int8, bf16 over W^T from prepare_transposed (or W
// itself where the backend reads it directly), one entry per dtype recorded;
// the loss: each of `loss_dtypes` at each precision, all labels set, dh set.
// `backend`: the backend to time (it computes with `pool`); null: the CPU
// backend (tests pass a profiling backend over it, to see each call as traced).
PeakTable measure_peak(ThreadPool& pool, const PeakKey& key, const PeakOptions& opt,
                       const PeakProgress& progress = nullptr, Backend* backend = nullptr);

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

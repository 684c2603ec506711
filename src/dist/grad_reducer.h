// Data parallel's gradient all-reduce, overlapped with the backward: the
// gradient arena is cut into buckets of whole layers (last layer first, the
// order the backward finishes them); a bucket is handed to a communication
// thread as soon as its last layer's gradients are final, so its reduction
// runs while the backward computes the layers below. Optionally compressed
// with error feedback (top-k, PowerSGD) or reduced in a fixed rank order
// (deterministic). After finish() every rank holds the sum over ranks.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "dist/communicator.h"

namespace loom {

// dist.compression: none, top-k sparsification (the largest `ratio` of each
// bucket's entries as index/value pairs), or PowerSGD (rank-`rank` factors of
// each large matrix). Both keep what was not sent and add it to the next
// step's gradient (error feedback).
enum class GradCompression { none, topk, powersgd };
const char* grad_compression_name(GradCompression c);
const GradCompression* grad_compression_from_name(std::string_view name);

struct GradSyncOptions {
  size_t bucket_bytes = size_t{25} << 20;  // dist.bucket_mb (PyTorch DDP's 25 MB)
  bool overlap = true;                     // dist.overlap: reduce during the backward
  bool deterministic = false;              // dist.deterministic: sum in rank order 0..N-1
  GradCompression compression = GradCompression::none;
  double topk_ratio = 0.1;  // dist.ratio: share of entries sent (0.1 = 90% sparsity)
  int powersgd_rank = 4;    // dist.rank
  uint64_t seed = 0;        // PowerSGD's first Q (the same on every rank)
};

// A matrix of the arena: [rows, cols] at `offset` (PowerSGD's unit).
struct GradMatrix {
  size_t offset = 0;
  int64_t rows = 0, cols = 0;
};

// What one step's reduction moved. Bytes are what this rank sends under a
// bandwidth-optimal algorithm: all-reduce of B bytes 2 (N-1)/N B (ring),
// all-gather of B bytes from each rank (N-1) B.
struct GradSyncStats {
  int64_t wire_bytes = 0;               // with the compression in use
  int64_t uncompressed_wire_bytes = 0;  // the plain all-reduce of the same arena
  double wait_seconds = 0;              // the main thread waited in finish()
  double comm_seconds = 0;              // the communication thread was busy
  int64_t buckets = 0;
};

class GradientReducer {
 public:
  // `grads`: the arena every rank lays out alike. layer_ranges[l]: the
  // contiguous run of layer l's gradients (adjacent layers adjacent); what no
  // layer covers (embedding, final norm, output) is reduced at finish().
  // `matrices`: the arena's tensors (vectors as one row): top-k selects within
  // each, PowerSGD compresses the large matrices.
  GradientReducer(Communicator& comm, std::span<float> grads, std::vector<std::pair<size_t, size_t>> layer_ranges,
                  std::vector<GradMatrix> matrices, GradSyncOptions options);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // The step's last backward starts: layer_done() may now hand buckets over.
  void begin_step();
  // Layer l's gradients are final on this rank (main thread).
  void layer_done(int64_t l);
  // Hands over every bucket not yet handed over and waits for all of them.
  GradSyncStats finish();

  size_t bucket_count() const { return buckets_.size(); }
  // Compression off (plain sums, the residual kept as it is) until switched on:
  // dist.compression_warmup's dense first steps. On by default.
  void set_compression_enabled(bool on) { compression_on_ = on; }
  bool compression_enabled() const { return compression_on_ && opt_.compression != GradCompression::none; }
  // The compression's state, for checkpoints: this rank's error-feedback
  // residual (arena layout; empty without compression) and PowerSGD's Q of
  // every compressed matrix, back to back (the same on every rank).
  std::span<float> residual() { return residual_; }
  std::vector<float> powersgd_q() const;
  void set_powersgd_q(std::span<const float> q);  // throws invalid_input on a size mismatch
  const GradSyncOptions& options() const { return opt_; }
  // Bytes of error-feedback and compression state held (memory reports).
  size_t state_bytes() const;

 private:
  struct Bucket {
    size_t offset = 0, size = 0;
    int64_t layer_lo = -1, layer_hi = -1;  // layers inside (-1: a non-layer range)
    std::vector<size_t> matrices;          // PowerSGD: indices into matrices_ inside the bucket
  };
  void plan_buckets(const std::vector<std::pair<size_t, size_t>>& layers);
  void hand_over(size_t bucket);
  void thread_main();
  void reduce(const Bucket& b);
  void reduce_plain(float* g, size_t n);
  void reduce_deterministic(float* g, size_t n);
  void reduce_topk(const Bucket& b);
  void reduce_powersgd(const Bucket& b);
  void count_allreduce(size_t bytes, bool compressed);
  void count_allgather(size_t bytes_per_rank);

  Communicator& comm_;
  std::span<float> grads_;
  std::vector<GradMatrix> matrices_;
  GradSyncOptions opt_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_layer_;
  std::vector<int64_t> pending_layers_;  // per bucket: layers not done yet this step
  std::vector<bool> handed_;
  std::vector<float> residual_;          // error feedback (compression)
  std::vector<std::vector<float>> q_;    // PowerSGD: each compressed matrix's Q [cols, rank]
  std::vector<bool> compress_matrix_;
  std::vector<uint8_t> scratch_;         // gathers (comm thread)
  bool compression_on_ = true;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<size_t> queue_;
  size_t outstanding_ = 0;
  bool stop_ = false;
  GradSyncStats stats_;
  std::thread thread_;
};

}  // namespace loom

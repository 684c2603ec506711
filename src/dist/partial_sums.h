// Tensor parallel's sums over the ranks (model/tensor_parallel.h's PartialSums)
// as all-reduces of a Communicator: what the training and the server hand the
// decoder when it holds one rank's shard. Counts what this rank sends for them
// under a ring all-reduce (2 (N-1)/N of the bytes), as GradSyncStats does.
#pragma once

#include <span>

#include "dist/communicator.h"
#include "model/tensor_parallel.h"

namespace loom {

class CommunicatorSums final : public PartialSums {
 public:
  explicit CommunicatorSums(Communicator& comm) : comm_(comm) {}
  void sum(float* x, int64_t n) override {
    comm_.allreduce_sum(std::span<float>(x, static_cast<size_t>(n)));
    const double N = comm_.size();
    wire_bytes_ += static_cast<int64_t>(2.0 * (N - 1) / N * static_cast<double>(n) * sizeof(float));
    ++calls_;
  }
  int64_t wire_bytes() const { return wire_bytes_; }  // since construction
  int64_t calls() const { return calls_; }

 private:
  Communicator& comm_;
  int64_t wire_bytes_ = 0, calls_ = 0;
};

}  // namespace loom

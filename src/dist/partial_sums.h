// Tensor parallel's sums over the ranks (model/tensor_parallel.h's PartialSums)
// as all-reduces of a Communicator: what the training and the server hand the
// decoder when it holds one rank's shard.
#pragma once

#include <span>

#include "dist/communicator.h"
#include "model/tensor_parallel.h"

namespace loom {

class CommunicatorSums final : public PartialSums {
 public:
  explicit CommunicatorSums(Communicator& comm) : comm_(comm) {}
  void sum(float* x, int64_t n) override { comm_.allreduce_sum(std::span<float>(x, static_cast<size_t>(n))); }

 private:
  Communicator& comm_;
};

}  // namespace loom

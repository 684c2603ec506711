// Tensor parallelism of the decoder, Megatron-LM's split: each of N ranks
// holds the q/k/v rows of 1/N of the heads and the gate/up rows of 1/N of the
// MLP channels (column-parallel: their outputs are this rank's heads and
// channels), and the o and down columns that read them (row-parallel: their
// outputs are this rank's partial sums of the whole). Norms, embedding and
// output stay whole on every rank. A layer then needs two sums over the ranks
// in the forward (after o and after down) and two in the backward (the input
// gradients of q/k/v and of gate/up): PartialSums, which the caller backs with
// its collective library (dist/), so model/ stays free of it.
#pragma once

#include <cstdint>

#include "model/config.h"
#include "model/lora.h"
#include "model/weights.h"

namespace loom {

// Sums a buffer over the tensor-parallel ranks, in place (an all-reduce).
class PartialSums {
 public:
  virtual ~PartialSums() = default;
  virtual void sum(float* x, int64_t n) = 0;
};

// The shapes of one rank's shard: heads, kv heads and the MLP width divided
// by `ranks`. Throws invalid_input naming the sizes when one does not divide.
ModelConfig tensor_parallel_config(const ModelConfig& full, int ranks);

// o and down (row-parallel) read this rank's slice of the heads / MLP channels;
// the other targets read the whole hidden state and write this rank's slice
// (LoRA: A of o/down is split by columns, B of the others by rows).
inline bool tensor_parallel_splits_input(LoraTarget t) { return t == LoraTarget::o || t == LoraTarget::down; }

// Cuts `w` (bound, not yet prepared for a backend) to rank `rank`'s shard of
// `ranks`: row views for q/k/v, gate/up and the q/k/v biases; copies of the o
// and down columns in w.owned_bytes (whole blocks of the stored type when the
// cut falls on block bounds, else dequantized to f32).
void shard_weights_for_tensor_parallel(ModelWeights& w, const ModelConfig& full, int rank, int ranks);

}  // namespace loom

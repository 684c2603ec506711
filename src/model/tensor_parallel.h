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

// Cuts `w` (bound, not yet prepared for a backend) to rank `rank`'s shard of
// `ranks`: row views for q/k/v, gate/up and the q/k/v biases; copies of the o
// and down columns in w.owned_bytes (whole blocks of the stored type when the
// cut falls on block bounds, else dequantized to f32).
void shard_weights_for_tensor_parallel(ModelWeights& w, const ModelConfig& full, int rank, int ranks);

// LoRA on a shard (training's dist.tp and `loom serve --tp`): o and down read
// this rank's part of their input, so their A [r, in] is split by columns and
// their B kept whole (each rank's B A x is a partial sum, summed with the base
// product); q/k/v and gate/up write this rank's part of their output, so their
// B [out, r] is split by rows and their A kept whole.
bool lora_target_row_parallel(LoraTarget t);

// Copies rank `rank`'s shard of the pair A [r, in], B [out, r] (the whole
// model's shapes, in and out dividing by `ranks` where split) into a_out and
// b_out, which hold the shard's shapes (lora_target_in/out of
// tensor_parallel_config(full, ranks)).
void lora_pair_shard(LoraTarget t, const float* a, const float* b, int64_t r, int64_t in, int64_t out,
                     int rank, int ranks, float* a_out, float* b_out);

}  // namespace loom

// Full fine-tuning under tensor parallel (dist.tp, model/tensor_parallel.h):
// each rank trains the f32 shard of its heads and MLP channels; at the end
// rank 0 puts the whole model back together to write it.
#pragma once

#include <vector>

#include "dist/communicator.h"
#include "model/weights.h"

namespace loom {

// Rank 0's layer weights become the whole model's, gathered from every rank's
// f32 shard (FullParams' arena) over `comm`, the tensor-parallel group: q/k/v
// and gate/up rows and the q/k/v biases in rank order, o and down columns. The
// whole tensors live in `store`; the other ranks' weights are left as they
// are. A collective: every rank of `comm` calls it.
void gather_full_tensor_parallel(Communicator& comm, ModelWeights& w, std::vector<std::vector<float>>& store);

}  // namespace loom

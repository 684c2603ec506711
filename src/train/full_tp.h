// Full fine-tuning under tensor parallel (dist.tp, model/tensor_parallel.h):
// each rank trains the f32 shard of its heads and MLP channels; at the end
// rank 0 puts the whole model back together to write it, and at each
// checkpoint the arenas (params, AdamW's moments) in one process's layout.
#pragma once

#include <vector>

#include "dist/communicator.h"
#include "model/weights.h"
#include "train/full_params.h"
#include "train/tp_runs.h"

namespace loom {

// Rank 0's layer weights become the whole model's, gathered from every rank's
// f32 shard (FullParams' arena) over `comm`, the tensor-parallel group: q/k/v
// and gate/up rows and the q/k/v biases in rank order, o and down columns. The
// whole tensors live in `store`; the other ranks' weights are left as they
// are. A collective: every rank of `comm` calls it.
void gather_full_tensor_parallel(Communicator& comm, ModelWeights& w, std::vector<std::vector<float>>& store);

// The runs of rank `rank` of `ranks` whose arena is `shard`'s (tp_runs.h): a
// tensor cut by rows is one run at the rank's rows of the whole, one cut by
// columns a run per row, the uncut tensors replicated. The whole layout is
// one process's FullParams (the same tensors in the same order, the cut ones
// `ranks` times larger), so every rank count reads the other's checkpoints.
std::vector<TensorParallelRun> full_tensor_parallel_runs(const FullParams& shard, int rank, int ranks);
// Floats of the whole model's arena.
size_t full_tensor_parallel_whole_size(const FullParams& shard, int ranks);

}  // namespace loom

// Tensor parallel's map between one rank's LoRA arena (a LoraModel of the
// shard's shapes, model/tensor_parallel.h) and the whole model's (a LoraModel
// of the full shapes: one process's layout, which the initial values,
// checkpoints and the written adapter use), as runs of floats (tp_runs.h).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "dist/communicator.h"
#include "train/lora_params.h"
#include "train/tp_runs.h"

namespace loom {

// The runs of rank `rank` of `ranks` whose arena is laid out as `shard`: A of
// o/down this rank's columns (row by row), B of q/k/v/gate/up this rank's
// rows, the rest whole (replicated: A of q/k/v/gate/up, B of o/down).
// Together they cover the rank's arena exactly once.
std::vector<TensorParallelRun> lora_tensor_parallel_runs(const LoraModel& shard, int rank, int ranks);
// Floats of the whole model's arena.
size_t lora_tensor_parallel_whole_size(const LoraModel& shard, int ranks);

// Every rank's `mine` (the rank's layout) into `whole` (the whole layout) on
// rank 0; the whole-held runs are rank 0's. A collective over `comm`, whose
// ranks are the tensor-parallel ranks; `whole` is left empty elsewhere.
void gather_tensor_parallel_arena(Communicator& comm, const LoraModel& shard, std::span<const float> mine,
                                  std::vector<float>& whole);

}  // namespace loom

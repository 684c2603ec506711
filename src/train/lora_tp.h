// Tensor parallel's map between one rank's LoRA arena (a LoraModel of the
// shard's shapes, model/tensor_parallel.h) and the whole model's (a LoraModel
// of the full shapes: one process's layout, which the initial values,
// checkpoints and the written adapter use). The map is a list of runs of
// floats, so params, gradients and AdamW's moments all move the same way.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "dist/communicator.h"
#include "train/lora_params.h"

namespace loom {

struct TensorParallelRun {
  size_t mine = 0, whole = 0, n = 0;  // floats at `mine` in the rank's arena are at `whole` in the whole one
  bool replicated = false;            // every rank holds them (A of q/k/v/gate/up, B of o/down)
};

// The runs of rank `rank` of `ranks` whose arena is laid out as `shard`: A of
// o/down this rank's columns (row by row), B of q/k/v/gate/up this rank's
// rows, the rest whole. Together they cover the rank's arena exactly once.
std::vector<TensorParallelRun> lora_tensor_parallel_runs(const LoraModel& shard, int rank, int ranks);
// Floats of the whole model's arena.
size_t lora_tensor_parallel_whole_size(const LoraModel& shard, int ranks);

// This rank's shard `mine` of an array in the whole layout.
void take_tensor_parallel_shard(std::span<const TensorParallelRun> runs, std::span<const float> whole,
                                std::span<float> mine);

// Every rank's `mine` (the rank's layout) into `whole` (the whole layout) on
// rank 0; the whole-held runs are rank 0's. A collective over `comm`, whose
// ranks are the tensor-parallel ranks; `whole` is left empty elsewhere.
void gather_tensor_parallel_arena(Communicator& comm, const LoraModel& shard, std::span<const float> mine,
                                  std::vector<float>& whole);

}  // namespace loom

// Tensor parallel's map between one rank's arena and the whole model's (one
// process's layout, which checkpoints and the initial values use), as a list
// of runs of floats, so params, gradients and AdamW's moments all move the same
// way. LoRA's runs: train/lora_tp.h; full fine-tuning's: train/full_tp.h.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <vector>

#include "dist/communicator.h"

namespace loom {

struct TensorParallelRun {
  size_t mine = 0, whole = 0, n = 0;  // floats at `mine` in the rank's arena are at `whole` in the whole one
  bool replicated = false;            // every rank holds them (rank 0's are gathered)
};

// This rank's shard `mine` of an array in the whole layout.
void take_tensor_parallel_shard(std::span<const TensorParallelRun> runs, std::span<const float> whole,
                                std::span<float> mine);

// Every rank's `mine` (its arena's layout, `runs_of(k)` for rank k) into
// `whole` (whole_size floats) on rank 0; the replicated runs are rank 0's. A
// collective over `comm`, whose ranks are the tensor-parallel ranks; `whole`
// is left empty elsewhere.
void gather_tensor_parallel_runs(Communicator& comm, std::span<const float> mine, size_t whole_size,
                                 const std::function<std::vector<TensorParallelRun>(int)>& runs_of,
                                 std::vector<float>& whole);

}  // namespace loom

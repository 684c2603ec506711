// Moving arrays between a rank's arena and the whole model's (tp_runs.h).
#include "train/tp_runs.h"

#include <algorithm>

#include "core/error.h"

namespace loom {

void take_tensor_parallel_shard(std::span<const TensorParallelRun> runs, std::span<const float> whole,
                                std::span<float> mine) {
  for (const TensorParallelRun& run : runs) {
    LOOM_ASSERT(run.whole + run.n <= whole.size() && run.mine + run.n <= mine.size());
    std::copy_n(whole.begin() + static_cast<std::ptrdiff_t>(run.whole), run.n,
                mine.begin() + static_cast<std::ptrdiff_t>(run.mine));
  }
}

void gather_tensor_parallel_runs(Communicator& comm, std::span<const float> mine, size_t whole_size,
                                 const std::function<std::vector<TensorParallelRun>(int)>& runs_of,
                                 std::vector<float>& whole) {
  const int ranks = comm.size();
  const size_t n = mine.size();  // every rank's arena has the same size (the shards are equal)
  std::vector<float> all(comm.rank() == 0 ? static_cast<size_t>(ranks) * n : 0);
  comm.gatherv(mine.data(), all.data(), std::vector<size_t>(static_cast<size_t>(ranks), n * sizeof(float)),
               0);
  whole.clear();
  if (comm.rank() != 0) return;
  whole.assign(whole_size, 0.0f);
  for (int k = 0; k < ranks; ++k) {
    const float* from = all.data() + static_cast<size_t>(k) * n;
    for (const TensorParallelRun& run : runs_of(k))
      if (k == 0 || !run.replicated) {
        LOOM_ASSERT(run.mine + run.n <= n && run.whole + run.n <= whole_size);
        std::copy_n(from + run.mine, run.n, whole.begin() + static_cast<std::ptrdiff_t>(run.whole));
      }
  }
}

}  // namespace loom

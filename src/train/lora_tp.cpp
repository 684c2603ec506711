// The LoRA arena's tensor-parallel runs (lora_tp.h): computed from the shard's
// slots alone, since the whole model's slots are laid out in the same (layer,
// target) order with every split size times the rank count.
#include "train/lora_tp.h"

#include <algorithm>

#include "core/error.h"
#include "model/tensor_parallel.h"

namespace loom {

namespace {

// The whole model's A and B sizes of a shard's slot.
size_t whole_a(const LoraSlot& s, int64_t r, LoraTarget t, int ranks) {
  return static_cast<size_t>(r * s.in * (lora_target_row_parallel(t) ? ranks : 1));
}
size_t whole_b(const LoraSlot& s, int64_t r, LoraTarget t, int ranks) {
  return static_cast<size_t>(s.out * r * (lora_target_row_parallel(t) ? 1 : ranks));
}

}  // namespace

std::vector<TensorParallelRun> lora_tensor_parallel_runs(const LoraModel& shard, int rank, int ranks) {
  LOOM_ASSERT(rank >= 0 && rank < ranks);
  std::vector<TensorParallelRun> runs;
  const int64_t r = shard.config().r;
  size_t at = 0;  // the slot's A in the whole arena
  for (int64_t l = 0; l < shard.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const LoraSlot& s = shard.slot(l, t);
      if (!s.active) continue;
      const auto in = static_cast<size_t>(s.in), out = static_cast<size_t>(s.out), R = static_cast<size_t>(r);
      const auto k = static_cast<size_t>(rank), N = static_cast<size_t>(ranks);
      const size_t b_at = at + whole_a(s, r, t, ranks);
      if (lora_target_row_parallel(t)) {  // A [r, in N]: this rank's columns of each row; B whole
        for (size_t i = 0; i < R; ++i)
          runs.push_back({s.a_offset + i * in, at + i * in * N + k * in, in, false});
        runs.push_back({s.b_offset, b_at, out * R, true});
      } else {  // A whole; B [out N, r]: this rank's rows
        runs.push_back({s.a_offset, at, R * in, true});
        runs.push_back({s.b_offset, b_at + k * out * R, out * R, false});
      }
      at = b_at + whole_b(s, r, t, ranks);
    }
  return runs;
}

size_t lora_tensor_parallel_whole_size(const LoraModel& shard, int ranks) {
  size_t n = 0;
  const int64_t r = shard.config().r;
  for (int64_t l = 0; l < shard.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets)
      if (const LoraSlot& s = shard.slot(l, t); s.active)
        n += whole_a(s, r, t, ranks) + whole_b(s, r, t, ranks);
  return n;
}

void take_tensor_parallel_shard(std::span<const TensorParallelRun> runs, std::span<const float> whole,
                                std::span<float> mine) {
  for (const TensorParallelRun& run : runs) {
    LOOM_ASSERT(run.whole + run.n <= whole.size() && run.mine + run.n <= mine.size());
    std::copy_n(whole.begin() + static_cast<std::ptrdiff_t>(run.whole), run.n,
                mine.begin() + static_cast<std::ptrdiff_t>(run.mine));
  }
}

void gather_tensor_parallel_arena(Communicator& comm, const LoraModel& shard, std::span<const float> mine,
                                  std::vector<float>& whole) {
  const int ranks = comm.size();
  const size_t n = mine.size();
  LOOM_ASSERT(n == static_cast<size_t>(shard.param_count()));
  std::vector<float> all(comm.rank() == 0 ? static_cast<size_t>(ranks) * n : 0);
  comm.gatherv(mine.data(), all.data(), std::vector<size_t>(static_cast<size_t>(ranks), n * sizeof(float)),
               0);
  whole.clear();
  if (comm.rank() != 0) return;
  whole.assign(lora_tensor_parallel_whole_size(shard, ranks), 0.0f);
  for (int k = 0; k < ranks; ++k) {
    const float* from = all.data() + static_cast<size_t>(k) * n;
    for (const TensorParallelRun& run : lora_tensor_parallel_runs(shard, k, ranks))
      if (k == 0 || !run.replicated)
        std::copy_n(from + run.mine, run.n, whole.begin() + static_cast<std::ptrdiff_t>(run.whole));
  }
}

}  // namespace loom

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

void gather_tensor_parallel_arena(Communicator& comm, const LoraModel& shard, std::span<const float> mine,
                                  std::vector<float>& whole) {
  LOOM_ASSERT(mine.size() == static_cast<size_t>(shard.param_count()));
  const int ranks = comm.size();
  gather_tensor_parallel_runs(comm, mine, lora_tensor_parallel_whole_size(shard, ranks),
                              [&](int k) { return lora_tensor_parallel_runs(shard, k, ranks); }, whole);
}

}  // namespace loom

// One tensor-parallel rank's part of a LoRA adapter (`loom serve --tp N`), in
// f32: rank 0 cuts every rank's part when it loads an adapter, keeps its own
// and sends each follower rank its part, so followers never read the file.
// The split is model/tensor_parallel.h's (lora_pair_shard), training's too.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/config.h"
#include "model/peft_adapter.h"
#include "serve/lora_set.h"

namespace loom {

struct AdapterShard {
  float scale = 1.0f;
  std::vector<int64_t> slots;  // adapted (layer * kLoraTargetCount + target), increasing
  std::vector<int64_t> ranks;  // the LoRA rank r of each slot
  // Slot after slot: A [r, in] then B [out, r] in the shard's shapes, B's q/k
  // rows in the model's order (permuted for RopeLayout::interleaved).
  std::vector<float> data;
};

// Rank `rank` of `ranks`'s part of `t`, which must fit `full` (the whole
// model's shapes; peft::check_adapter_fits).
AdapterShard make_adapter_shard(const peft::AdapterTensors& t, const ModelConfig& full, int rank, int ranks);

// How many floats AdapterShard::data holds for these slots and ranks on a
// shard of `shard` shapes. Throws invalid_input for a slot outside the model or a rank < 1.
size_t adapter_shard_floats(std::span<const int64_t> slots, std::span<const int64_t> ranks,
                            const ModelConfig& shard);

// f32 views into s.data (which must outlive them) for the model shard of `shard` shapes.
ServeAdapter adapter_shard_view(const AdapterShard& s, const ModelConfig& shard);

}  // namespace loom

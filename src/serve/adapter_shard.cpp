// Cutting a PEFT adapter into tensor-parallel parts (adapter_shard.h).
#include "serve/adapter_shard.h"

#include "core/error.h"
#include "model/tensor_parallel.h"

namespace loom {

AdapterShard make_adapter_shard(const peft::AdapterTensors& t, const ModelConfig& full, int rank, int ranks) {
  const ModelConfig shard = tensor_parallel_config(full, ranks);
  AdapterShard s;
  s.scale = static_cast<float>(t.config.scaling());
  const int64_t r = t.config.r;
  for (const auto& [key, pair] : t.pairs) {  // (layer, target) order: slots increase
    s.slots.push_back(key.first * kLoraTargetCount + static_cast<int64_t>(key.second));
    s.ranks.push_back(r);
  }
  s.data.resize(adapter_shard_floats(s.slots, s.ranks, shard));
  float* at = s.data.data();
  for (const auto& [key, pair] : t.pairs) {
    const LoraTarget target = key.second;
    const int64_t in = lora_target_in(shard, target), out = lora_target_out(shard, target);
    LOOM_ASSERT(pair.in == lora_target_in(full, target) && pair.out == lora_target_out(full, target));
    float* a = at;
    float* b = at + r * in;
    lora_pair_shard(target, pair.a_data(), pair.b_data(), r, pair.in, pair.out, rank, ranks, a, b);
    // GGUF llama stores q/k rows RoPE-interleaved within each head; PEFT's B is
    // in HF order. A rank's rows are whole heads, so permuting them after the
    // cut equals cutting the permuted B.
    if (lora_needs_qk_permutation(shard) && (target == LoraTarget::q || target == LoraTarget::k))
      lora_permute_qk_rows(make_tensor(b, DType::f32, {out, r}),
                           target == LoraTarget::q ? shard.n_heads : shard.n_kv_heads, shard.head_dim,
                           /*hf_to_model=*/true);
    at = b + out * r;
  }
  return s;
}

size_t adapter_shard_floats(std::span<const int64_t> slots, std::span<const int64_t> ranks,
                            const ModelConfig& shard) {
  if (slots.size() != ranks.size())
    fail(ErrorKind::invalid_input, "adapter shard: {} slots with {} ranks", slots.size(), ranks.size());
  size_t n = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0 || slots[i] >= shard.n_layers * kLoraTargetCount || ranks[i] < 1)
      fail(ErrorKind::invalid_input, "adapter shard: slot {} of rank {} does not fit {} layers x {} targets",
           slots[i], ranks[i], shard.n_layers, kLoraTargetCount);
    const auto t = static_cast<LoraTarget>(slots[i] % kLoraTargetCount);
    n += static_cast<size_t>(ranks[i] * (lora_target_in(shard, t) + lora_target_out(shard, t)));
  }
  return n;
}

ServeAdapter adapter_shard_view(const AdapterShard& s, const ModelConfig& shard) {
  LOOM_ASSERT(s.data.size() == adapter_shard_floats(s.slots, s.ranks, shard));
  ServeAdapter view = ServeAdapter::empty(shard, s.scale);
  auto* at = const_cast<float*>(s.data.data());  // ServeLoraPair's views are read-only in use
  for (size_t i = 0; i < s.slots.size(); ++i) {
    const auto t = static_cast<LoraTarget>(s.slots[i] % kLoraTargetCount);
    const int64_t r = s.ranks[i], in = lora_target_in(shard, t), out = lora_target_out(shard, t);
    ServeLoraPair& p = view.pairs[static_cast<size_t>(s.slots[i])];
    p.a = make_tensor(at, DType::f32, {r, in});
    p.b = make_tensor(at + r * in, DType::f32, {out, r});
    at += r * (in + out);
  }
  return view;
}

}  // namespace loom

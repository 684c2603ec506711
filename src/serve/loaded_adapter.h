// One loaded copy of a served LoRA adapter and the forms it is kept in (f32,
// bf16, int8, 4 bits): AdapterRegistry makes them from PEFT folders, a
// tensor-parallel follower from the part rank 0 sends it (tp_adapters.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/huge_page_buffer.h"
#include "kernels/int_quant.h"
#include "model/peft_adapter.h"
#include "serve/adapter_shard.h"
#include "serve/lora_set.h"

namespace loom {

// Running sequences hold a shared_ptr, so unloading or evicting never pulls
// weights from under a running request.
struct LoadedAdapter {
  std::string name, path;
  // Unique per load (never reused): the prefix cache keys blocks by it, so a
  // prefix computed under one adapter is never reused under another; a
  // tensor-parallel server names the adapter to its followers by it.
  int64_t id = 0;
  peft::AdapterTensors tensors;           // keeps the file mapping alive (emptied when kept in 4 bits)
  std::vector<std::vector<float>> owned;  // q/k B rows permuted for the model, or a tensor-parallel part
  std::vector<PackedInt4> packed;         // the 4-bit factors (lora_bits 4)
  // Every factor in bf16 or int8, one block (lora_bits 16 or 8); in huge pages where the system gives
  // them, as decode rows of many adapters read their factors in short scattered spans
  // (core/huge_page_buffer.h).
  HugePageBuffer block;
  ServeAdapter view;
  size_t bytes = 0;      // memory of the factors as kept (f32, bf16, int8 or 4-bit): view.factor_bytes()
  size_t f32_bytes = 0;  // what they take in f32
  // Tensor parallel, rank 0: follower rank k's part at [k - 1], cut at load
  // (off the scheduler thread) and released once the first step that uses the
  // adapter has sent it (TpAdapterSender, on the scheduler thread, the only
  // one that touches it after the adapter is registered).
  mutable std::vector<AdapterShard> follower_shards;
};

// Sets a.f32_bytes and a.bytes from a.view's pairs (f32 views) and, for
// lora_bits 4, 8 or 16, replaces those views by 4-bit, int8 or bf16 copies (releasing
// what they pointed into when nothing else does). lora_bits 32 keeps them.
void keep_adapter_in_bits(LoadedAdapter& a, int lora_bits);

}  // namespace loom

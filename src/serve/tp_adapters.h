// The LoRA adapters of a tensor-parallel server (`loom serve --tp N`): rank 0
// loads and validates every adapter (AdapterRegistry, which cuts each rank's
// part); before each step it sends the followers the parts of the adapters the
// step uses that they lack, and tells them to drop the ones rank 0 no longer
// holds (unloaded, replaced or evicted, once no running request holds them).
// So a follower holds its part of exactly the adapters rank 0 holds and has
// used, and never reads an adapter file (a follower on another host may not
// see rank 0's disk).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>

#include "dist/communicator.h"
#include "model/config.h"
#include "serve/loaded_adapter.h"

namespace loom {

// Rank 0, scheduler thread.
class TpAdapterSender {
 public:
  explicit TpAdapterSender(Communicator& comm) : comm_(comm) {}
  // Before a step that uses `used` (nulls: the base model): the drops, then
  // the loads of those not sent yet (TpMessage::adapter_load, then each
  // follower's part point to point; rank 0 releases the parts once sent).
  void sync(std::span<const std::shared_ptr<const LoadedAdapter>> used);

 private:
  void send(const LoadedAdapter& a);

  Communicator& comm_;
  std::map<int64_t, std::weak_ptr<const LoadedAdapter>> sent_;  // by LoadedAdapter::id
};

// A follower rank.
class TpAdapterReceiver {
 public:
  // `shard`: this rank's model shapes; lora_bits as the server's (--lora-bits).
  TpAdapterReceiver(Communicator& comm, const ModelConfig& shard, int lora_bits)
      : comm_(comm), shard_(shard), lora_bits_(lora_bits) {}
  // An adapter_load message's payload: receives the part from rank 0 and keeps it.
  void load(std::span<const int64_t> message);
  void drop(int64_t id);
  // The adapter rank 0 named by `id` in a step; it sent it before that step.
  const ServeAdapter& get(int64_t id) const;

 private:
  Communicator& comm_;
  const ModelConfig& shard_;
  int lora_bits_;
  std::map<int64_t, std::unique_ptr<LoadedAdapter>> held_;
};

}  // namespace loom

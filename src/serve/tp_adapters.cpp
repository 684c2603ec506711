// Keeping the followers' adapters in step with rank 0's (tp_adapters.h).
#include "serve/tp_adapters.h"

#include <bit>

#include "core/error.h"
#include "serve/tp_link.h"

namespace loom {

namespace {

// The point-to-point tag of adapter parts (the server sends nothing else point to point).
constexpr int kAdapterPartTag = 41;

}  // namespace

void TpAdapterSender::sync(std::span<const std::shared_ptr<const LoadedAdapter>> used) {
  for (auto it = sent_.begin(); it != sent_.end();) {
    if (it->second.expired()) {
      const int64_t id = it->first;
      tp_send(comm_, TpMessage::adapter_drop, std::span<const int64_t>(&id, 1));
      it = sent_.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& a : used)
    if (a != nullptr && !sent_.contains(a->id)) {
      send(*a);
      sent_.emplace(a->id, a);
    }
}

// Payload: id, how many adapters the follower holds with this one (its
// check that it mirrors rank 0), the scale's bits, the slot count n, n slots,
// n ranks. Every follower's part has the same slots and shapes; only the values differ.
void TpAdapterSender::send(const LoadedAdapter& a) {
  const auto followers = static_cast<size_t>(comm_.size() - 1);
  LOOM_ASSERT(a.id > 0 && a.follower_shards.size() == followers);
  const AdapterShard& first = a.follower_shards[0];
  std::vector<int64_t> m = {a.id, static_cast<int64_t>(sent_.size() + 1),
                            static_cast<int64_t>(std::bit_cast<uint32_t>(first.scale)),
                            static_cast<int64_t>(first.slots.size())};
  m.insert(m.end(), first.slots.begin(), first.slots.end());
  m.insert(m.end(), first.ranks.begin(), first.ranks.end());
  tp_send(comm_, TpMessage::adapter_load, m);
  std::vector<std::unique_ptr<CommRequest>> sends;
  for (size_t k = 0; k < followers; ++k) {
    const std::vector<float>& d = a.follower_shards[k].data;
    sends.push_back(
        comm_.start_send(d.data(), d.size() * sizeof(float), static_cast<int>(k + 1), kAdapterPartTag));
  }
  for (auto& s : sends) comm_.wait(*s, "sending an adapter's part");
  a.follower_shards.clear();
  a.follower_shards.shrink_to_fit();
}

void TpAdapterReceiver::load(std::span<const int64_t> m) {
  constexpr size_t kHead = 4;  // id, adapters held, scale, n
  LOOM_ASSERT(m.size() >= kHead && m.size() == kHead + 2 * static_cast<size_t>(m[3]));
  const auto n = static_cast<std::ptrdiff_t>(m[3]);
  AdapterShard s;
  s.scale = std::bit_cast<float>(static_cast<uint32_t>(m[2]));
  s.slots.assign(m.begin() + kHead, m.begin() + kHead + n);
  s.ranks.assign(m.begin() + kHead + n, m.end());
  s.data.resize(adapter_shard_floats(s.slots, s.ranks, shard_));
  comm_.recv(s.data.data(), s.data.size() * sizeof(float), 0, kAdapterPartTag);
  auto a = std::make_unique<LoadedAdapter>();
  a->id = m[0];
  a->view = adapter_shard_view(s, shard_);
  a->owned.push_back(std::move(s.data));  // the buffer the views point into moves along
  keep_adapter_in_bits(*a, lora_bits_);
  held_[a->id] = std::move(a);
  // The same adapters as rank 0 sent and still holds: a lost load or drop ends the run here.
  LOOM_ASSERT(static_cast<int64_t>(held_.size()) == m[1]);
}

void TpAdapterReceiver::drop(int64_t id) {
  const size_t erased = held_.erase(id);
  LOOM_ASSERT(erased == 1);  // rank 0 drops only what it sent
}

const ServeAdapter& TpAdapterReceiver::get(int64_t id) const {
  const auto it = held_.find(id);
  LOOM_ASSERT(it != held_.end());
  return it->second->view;
}

}  // namespace loom

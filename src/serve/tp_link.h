// What rank 0 of a tensor-parallel server (`loom serve --tp N`) tells the
// follower ranks: one message at a time, a header {kind, length} and then
// `length` int64 values, both broadcast from rank 0. Adapter data follows its
// adapter_load message point to point (tp_adapters.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dist/communicator.h"

namespace loom {

enum class TpMessage : int64_t {
  stop = 0,          // the server stops: followers return
  step = 1,          // a forward step (BatchForward)
  adapter_load = 2,  // an adapter's part follows (TpAdapterSender)
  adapter_drop = 3,  // rank 0 no longer holds the adapter with this id
};

// Rank 0.
void tp_send(Communicator& comm, TpMessage kind, std::span<const int64_t> payload);

// A follower: waits for rank 0's next message, without a deadline (an idle
// server sends nothing for as long as it is idle), and returns its kind with
// the payload in `payload`.
TpMessage tp_receive(Communicator& comm, std::vector<int64_t>& payload);

// Start-up: rank 0 says whether it started (its start-up adapters loaded),
// so a follower whose rank 0 failed ends too instead of waiting for steps.
// Every rank calls it; returns rank 0's `ok`.
bool tp_agree_started(Communicator& comm, bool ok);

}  // namespace loom

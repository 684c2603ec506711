// Rank 0 -> follower messages of a tensor-parallel server (tp_link.h).
#include "serve/tp_link.h"

#include "core/error.h"

namespace loom {

namespace {

// Broadcasts with no deadline (a follower waits while rank 0 is idle or
// loading), restoring the communicator's afterwards.
void broadcast_waiting(Communicator& comm, void* data, size_t bytes) {
  const double deadline = comm.timeout_seconds();
  comm.set_timeout_seconds(1e12);
  comm.broadcast(data, bytes, 0);
  comm.set_timeout_seconds(deadline);
}

}  // namespace

void tp_send(Communicator& comm, TpMessage kind, std::span<const int64_t> payload) {
  LOOM_ASSERT(comm.rank() == 0);
  int64_t header[2] = {static_cast<int64_t>(kind), static_cast<int64_t>(payload.size())};
  comm.broadcast(header, sizeof(header), 0);
  if (!payload.empty()) comm.broadcast(const_cast<int64_t*>(payload.data()), payload.size_bytes(), 0);
}

TpMessage tp_receive(Communicator& comm, std::vector<int64_t>& payload) {
  LOOM_ASSERT(comm.rank() != 0);
  int64_t header[2] = {0, 0};
  broadcast_waiting(comm, header, sizeof(header));
  LOOM_ASSERT(header[0] >= 0 && header[0] <= static_cast<int64_t>(TpMessage::adapter_drop) && header[1] >= 0);
  payload.resize(static_cast<size_t>(header[1]));
  if (!payload.empty()) comm.broadcast(payload.data(), payload.size() * sizeof(int64_t), 0);
  return static_cast<TpMessage>(header[0]);
}

bool tp_agree_started(Communicator& comm, bool ok) {
  int64_t flag = ok ? 1 : 0;
  broadcast_waiting(comm, &flag, sizeof(flag));
  return flag != 0;
}

}  // namespace loom

// The parts of the Communicator that need no library: the deadline wait, the
// algorithm names, the single-process stand-in and the launcher detection.
#include "dist/communicator.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"

namespace loom {

namespace {

struct AlgorithmName {
  CollectiveAlgorithm algorithm;
  const char* name;
};
constexpr AlgorithmName kAlgorithms[] = {{CollectiveAlgorithm::automatic, "auto"},
                                         {CollectiveAlgorithm::ring, "ring"},
                                         {CollectiveAlgorithm::tree, "tree"},
                                         {CollectiveAlgorithm::rabenseifner, "rabenseifner"},
                                         {CollectiveAlgorithm::recursive_doubling, "recursive_doubling"}};

class DoneRequest final : public CommRequest {
 public:
  bool test() override { return true; }
};

class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string describe() const override { return "single process"; }
  void allreduce_sum(std::span<double>) override {}
  void allreduce_sum(std::span<float>) override {}
  void allreduce_max(std::span<int64_t>) override {}
  void broadcast(void*, size_t, int) override {}
  void barrier() override {}
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts) override {
    if (send != recv && !counts.empty()) std::memcpy(recv, send, counts[0]);
  }
  void gatherv(const void* send, void* recv, std::span<const size_t> counts, int) override {
    allgatherv(send, recv, counts);
  }
  std::unique_ptr<CommRequest> start_allreduce_sum(float*, size_t) override { return std::make_unique<DoneRequest>(); }
  std::unique_ptr<CommRequest> start_allgather(const void* send, void* recv, size_t bytes) override {
    if (send != recv) std::memcpy(recv, send, bytes);
    return std::make_unique<DoneRequest>();
  }
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<SingleProcessCommunicator>(); }
  [[noreturn]] void abort(const std::string& why) override {
    std::fprintf(stderr, "loom: %s\n", why.c_str());
    std::_Exit(3);
  }
};

}  // namespace

const char* collective_algorithm_name(CollectiveAlgorithm a) {
  for (const AlgorithmName& n : kAlgorithms)
    if (n.algorithm == a) return n.name;
  return "?";
}

const CollectiveAlgorithm* collective_algorithm_from_name(std::string_view name) {
  for (const AlgorithmName& n : kAlgorithms)
    if (name == n.name) return &n.algorithm;
  return nullptr;
}

std::unique_ptr<CommRequest> Communicator::start_send(const void*, size_t, int dest, int) {
  fail(ErrorKind::unsupported, "{}: no point-to-point messages (to rank {})", describe(), dest);
}

void Communicator::recv(void*, size_t, int source, int) {
  fail(ErrorKind::unsupported, "{}: no point-to-point messages (from rank {})", describe(), source);
}

std::unique_ptr<Communicator> Communicator::split(int color, int) {
  fail(ErrorKind::unsupported, "{}: cannot be split into groups (color {})", describe(), color);
}

void Communicator::wait(CommRequest& r, std::string_view what) {
  // Open MPI's non-blocking collectives progress only inside MPI calls: test
  // in a loop that yields the core for the first 200 us (a small collective
  // completes in a few us; a sleep, however short, costs ~60 us of timer
  // slack: 160 us a collective, measured, bench/results/allreduce.md), then
  // with sleeps growing to 200 us, so a long wait does not take a core from
  // the compute.
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  std::chrono::microseconds nap(10);
  while (!r.test()) {
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    if (waited > timeout_s_)
      abort(fmt::format("{} did not complete within dist.timeout {:.0f} s: another rank died or hangs; every rank "
                        "stops now (resume from the last checkpoint with --resume)",
                        what, timeout_s_));
    if (waited < 200e-6) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::microseconds(200)) nap *= 2;
  }
}

std::unique_ptr<Communicator> make_single_process_communicator() {
  return std::make_unique<SingleProcessCommunicator>();
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

}  // namespace loom

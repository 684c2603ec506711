// The Communicator over MPI (Open MPI from Debian): MPI_COMM_WORLD, or a group
// split from it, for the main thread's blocking collectives, a duplicate of it
// for the communication thread's non-blocking ones. Blocking calls are
// non-blocking ones waited on with the deadline, so a dead peer ends the run
// instead of hanging it.
// The C API only: Open MPI's deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "dist/communicator.h"

namespace loom {

namespace {

class MpiRequest final : public CommRequest {
 public:
  bool test() override {
    if (done_) return true;
    int flag = 0;
    MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
    done_ = flag != 0;
    return done_;
  }
  MPI_Request* handle() { return &req_; }
  ~MpiRequest() override {
    if (!done_ && req_ != MPI_REQUEST_NULL) MPI_Wait(&req_, MPI_STATUS_IGNORE);
  }

 private:
  MPI_Request req_ = MPI_REQUEST_NULL;
  bool done_ = false;
};

// Open MPI's MCA variables for the all-reduce algorithm, set before MPI_Init:
// coll/tuned (blocking; dynamic rules on) and coll/libnbc (non-blocking).
void select_algorithm(CollectiveAlgorithm a) {
  const char* tuned = nullptr;
  const char* libnbc = nullptr;
  switch (a) {
    case CollectiveAlgorithm::automatic: return;
    case CollectiveAlgorithm::ring: tuned = "4", libnbc = "1"; break;
    case CollectiveAlgorithm::tree: tuned = "2", libnbc = "2"; break;  // reduce + bcast / binomial tree
    case CollectiveAlgorithm::rabenseifner: tuned = "6", libnbc = "3"; break;
    case CollectiveAlgorithm::recursive_doubling: tuned = "3", libnbc = "4"; break;
  }
  setenv("OMPI_MCA_coll_tuned_use_dynamic_rules", "1", 1);
  setenv("OMPI_MCA_coll_tuned_allreduce_algorithm", tuned, 1);
  setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", libnbc, 1);
}

std::vector<int> to_ints(std::span<const size_t> v, std::string_view what) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] > static_cast<size_t>(INT32_MAX))
      fail(ErrorKind::unsupported, "{}: {} bytes from one rank exceed MPI's int count", what, v[i]);
    out[i] = static_cast<int>(v[i]);
  }
  return out;
}

std::vector<int> displacements(const std::vector<int>& counts, std::string_view what) {
  std::vector<int> d(counts.size());
  int64_t at = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (at > INT32_MAX) fail(ErrorKind::unsupported, "{}: {} bytes in all exceed MPI's int displacements", what, at);
    d[i] = static_cast<int>(at);
    at += counts[i];
  }
  return d;
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(CollectiveAlgorithm algorithm) : world_(true) {
    select_algorithm(algorithm);
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (provided < MPI_THREAD_MULTIPLE) {
      MPI_Finalize();
      fail(ErrorKind::unsupported, "the MPI library gives thread level {} (needs MPI_THREAD_MULTIPLE = {}): the "
           "gradient all-reduce runs on its own thread", provided, MPI_THREAD_MULTIPLE);
    }
    comm_ = MPI_COMM_WORLD;
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_dup(comm_, &async_);
    char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int len = 0;
    MPI_Get_library_version(version, &len);
    library_ = std::string(version, static_cast<size_t>(len));
    if (const size_t cut = library_.find(','); cut != std::string::npos) library_.resize(cut);
    hosts_ = count_hosts();
  }
  // A group of `parent`'s ranks (split()).
  MpiCommunicator(const MpiCommunicator& parent, MPI_Comm group) : world_(false), comm_(group) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_dup(comm_, &async_);
    library_ = parent.library_;
    hosts_ = count_hosts();
    set_timeout_seconds(parent.timeout_seconds());
  }
  ~MpiCommunicator() override {
    MPI_Comm_free(&async_);
    if (world_) {
      MPI_Finalize();
    } else {
      MPI_Comm_free(&comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override {
    return fmt::format("{}, {} ranks on {} host{}", library_, size_, hosts_, hosts_ == 1 ? "" : "s");
  }

  void allreduce_sum(std::span<double> d) override {
    MpiRequest r;
    MPI_Iallreduce(MPI_IN_PLACE, d.data(), count(d.size()), MPI_DOUBLE, MPI_SUM, comm_, r.handle());
    wait(r, "all-reduce (sum)");
  }
  void allreduce_sum(std::span<float> d) override {
    MpiRequest r;
    MPI_Iallreduce(MPI_IN_PLACE, d.data(), count(d.size()), MPI_FLOAT, MPI_SUM, comm_, r.handle());
    wait(r, "all-reduce (sum)");
  }
  void allreduce_max(std::span<int64_t> d) override {
    MpiRequest r;
    MPI_Iallreduce(MPI_IN_PLACE, d.data(), count(d.size()), MPI_INT64_T, MPI_MAX, comm_, r.handle());
    wait(r, "all-reduce (max)");
  }
  void broadcast(void* data, size_t bytes, int root) override {
    MpiRequest r;
    MPI_Ibcast(data, count(bytes), MPI_BYTE, root, comm_, r.handle());
    wait(r, "broadcast");
  }
  void barrier() override {
    MpiRequest r;
    MPI_Ibarrier(comm_, r.handle());
    wait(r, "barrier");
  }
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts) override {
    const std::vector<int> c = to_ints(counts, "allgatherv");
    const std::vector<int> d = displacements(c, "allgatherv");
    MpiRequest r;
    // This rank's part already in place (ZeRO-1's parameter gather): MPI wants MPI_IN_PLACE, not aliasing.
    const bool in_place = send == static_cast<const char*>(recv) + d[static_cast<size_t>(rank_)];
    MPI_Iallgatherv(in_place ? MPI_IN_PLACE : send, c[static_cast<size_t>(rank_)], MPI_BYTE, recv, c.data(), d.data(),
                    MPI_BYTE, comm_, r.handle());
    wait(r, "all-gather");
  }
  void gatherv(const void* send, void* recv, std::span<const size_t> counts, int root) override {
    const std::vector<int> c = to_ints(counts, "gatherv");
    const std::vector<int> d = displacements(c, "gatherv");
    MpiRequest r;
    MPI_Igatherv(send, c[static_cast<size_t>(rank_)], MPI_BYTE, recv, c.data(), d.data(), MPI_BYTE, root,
                 comm_, r.handle());
    wait(r, "gather");
  }

  std::unique_ptr<CommRequest> start_send(const void* data, size_t bytes, int dest, int tag) override {
    auto r = std::make_unique<MpiRequest>();
    MPI_Isend(data, count(bytes), MPI_BYTE, dest, tag, comm_, r->handle());
    return r;
  }
  void recv(void* data, size_t bytes, int source, int tag) override {
    MpiRequest r;
    MPI_Irecv(data, count(bytes), MPI_BYTE, source, tag, comm_, r.handle());
    wait(r, fmt::format("receive from rank {}", source));
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm group = MPI_COMM_NULL;
    MPI_Comm_split(comm_, color, key, &group);  // blocking, as every setup collective: no rank is gone yet
    return std::make_unique<MpiCommunicator>(*this, group);
  }

  std::unique_ptr<CommRequest> start_allreduce_sum(float* data, size_t n) override {
    auto r = std::make_unique<MpiRequest>();
    MPI_Iallreduce(MPI_IN_PLACE, data, count(n), MPI_FLOAT, MPI_SUM, async_, r->handle());
    return r;
  }
  std::unique_ptr<CommRequest> start_allgather(const void* send, void* recv, size_t bytes) override {
    auto r = std::make_unique<MpiRequest>();
    MPI_Iallgather(send, count(bytes), MPI_BYTE, recv, count(bytes), MPI_BYTE, async_, r->handle());
    return r;
  }

  [[noreturn]] void abort(const std::string& why) override {
    int world_rank = 0, world_size = 1;  // the run's ranks, whichever group found the fault
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    std::fprintf(stderr, "loom: rank %d of %d: %s\n", world_rank, world_size, why.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::_Exit(3);
  }

 private:
  static int count(size_t n) {
    if (n > static_cast<size_t>(INT32_MAX))
      fail(ErrorKind::unsupported, "a collective of {} elements exceeds MPI's int count", n);
    return static_cast<int>(n);
  }
  int count_hosts() {
    MPI_Comm node;
    MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
    int node_rank = 0;
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_free(&node);
    int leaders = node_rank == 0 ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &leaders, 1, MPI_INT, MPI_SUM, comm_);
    return leaders;
  }

  bool world_ = false;  // MPI_COMM_WORLD: finalizes MPI when destroyed
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  MPI_Comm async_ = MPI_COMM_NULL;
  std::string library_;
  int hosts_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(CollectiveAlgorithm algorithm) {
  return std::make_unique<MpiCommunicator>(algorithm);
}

}  // namespace loom

// The collective library behind data, tensor and pipeline parallelism: one
// interface over MPI (CPU; mpi_communicator.cpp, Open MPI from Debian) and a
// single-process stand-in, with NCCL to come behind the same calls. Every
// collective waits with a deadline: a rank that died or hangs ends the run
// with a message naming the operation, never a silent hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace loom {

// A collective started without waiting (MPI_I*): test() progresses it and says
// whether it finished. Owned by one thread at a time.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual bool test() = 0;
};

// dist.algorithm: the all-reduce algorithm where the library lets one choose
// (Open MPI's coll/tuned and coll/libnbc); auto leaves the library's choice.
enum class CollectiveAlgorithm { automatic, ring, tree, rabenseifner, recursive_doubling };
const char* collective_algorithm_name(CollectiveAlgorithm a);
// nullptr when `name` is none of "auto", "ring", "tree", "rabenseifner", "recursive_doubling".
const CollectiveAlgorithm* collective_algorithm_from_name(std::string_view name);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "Open MPI 4.1.4, 2 ranks on 1 host", "single process".
  virtual std::string describe() const = 0;

  // Blocking collectives of the main thread (each waits with the deadline).
  virtual void allreduce_sum(std::span<double> data) = 0;
  virtual void allreduce_sum(std::span<float> data) = 0;
  virtual void allreduce_max(std::span<int64_t> data) = 0;
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Rank r's `send` (counts[r] bytes) lands at recv + sum(counts[0..r)) on
  // every rank (allgatherv), or only on `root` (gatherv; recv may be null elsewhere).
  // allgatherv's `send` may be this rank's place inside `recv` (gathered in place).
  virtual void allgatherv(const void* send, void* recv, std::span<const size_t> counts) = 0;
  virtual void gatherv(const void* send, void* recv, std::span<const size_t> counts, int root) = 0;

  // Non-blocking collectives for a communication thread: a channel of their
  // own (MPI_Comm_dup), so the main thread's blocking calls never interleave
  // with them. Only one thread may use these at a time.
  virtual std::unique_ptr<CommRequest> start_allreduce_sum(float* data, size_t n) = 0;
  // Every rank's `bytes` bytes at recv + rank * bytes.
  virtual std::unique_ptr<CommRequest> start_allgather(const void* send, void* recv, size_t bytes) = 0;
  // Point to point (pipeline parallel), main thread: a send whose buffer must
  // stay until its request tests done, and a receive that waits with the
  // deadline. Messages between two ranks with one tag arrive in order.
  virtual std::unique_ptr<CommRequest> start_send(const void* data, size_t bytes, int dest, int tag);
  virtual void recv(void* data, size_t bytes, int source, int tag);

  // The ranks with the same `color` in a communicator of their own, ordered
  // by `key` (MPI_Comm_split; a collective of every rank here). Data parallel
  // across tensor- or pipeline-parallel groups: one communicator per group of
  // each kind. The new one keeps this one's deadline; abort() still ends every
  // rank of the run. Must be destroyed before this one.
  virtual std::unique_ptr<Communicator> split(int color, int key);

  // Waits for `r` until the deadline; past it, abort() naming `what`.
  void wait(CommRequest& r, std::string_view what);

  // Seconds a collective may wait before the run is ended (dist.timeout).
  double timeout_seconds() const { return timeout_s_; }
  void set_timeout_seconds(double s) { timeout_s_ = s; }
  // Ends every rank's process: prints "loom: rank R: <why>" and exits with code 3 (MPI_Abort).
  [[noreturn]] virtual void abort(const std::string& why) = 0;

 private:
  double timeout_s_ = 600;
};

// One process, no library: every collective returns its input.
std::unique_ptr<Communicator> make_single_process_communicator();

// Whether this process was started by an MPI launcher (mpirun, srun with PMI/PMIx):
// Open MPI's, PMI's or PMIx's rank variable is set.
bool launched_by_mpi();

// MPI_Init_thread (MPI_THREAD_MULTIPLE) on MPI_COMM_WORLD with `algorithm` set
// through Open MPI's MCA variables first; the communicator finalizes MPI when
// destroyed. Throws loom::Error (unsupported) when the library gives less
// than MPI_THREAD_MULTIPLE. Call once per process, before any thread starts.
std::unique_ptr<Communicator> make_mpi_communicator(CollectiveAlgorithm algorithm);

}  // namespace loom

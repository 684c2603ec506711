// An in-process stand-in for an N-rank Communicator: N std::threads, one per
// rank, each with its own ThreadCommunicator; the collectives meet in a shared
// ThreadGroup (std::mutex / std::condition_variable). For tests of what runs
// over a Communicator (gradient reducer, ZeRO, tensor parallelism) without MPI.
//
//   test_util::ThreadGroup group(3);
//   test_util::run_ranks(group, [&](test_util::ThreadCommunicator& comm) { ... comm.rank() ... });
//
// Semantics, as the MPI communicator's:
// - The blocking calls (main thread) and the non-blocking ones (start_*, the
//   communication thread) are two channels: each rank's n-th call on a channel
//   meets every other rank's n-th call on the same channel, so the two never
//   interleave.
// - Ranks must make the same calls: the same collective, the same byte count
//   (allgatherv/gatherv: the same counts; broadcast/gatherv: the same root).
//   A mismatch is a test failure (ADD_FAILURE naming both), then an abort.
// - A non-blocking request copies its input at start and completes inside
//   test() once every rank has started it (so a request stays pending while
//   another rank is still computing: overlap is real).
// - Float/double sums are taken in float/double in the group's SumOrder, once
//   per collective: every rank receives the same bits. The default order is
//   descending rank (N-1 first), unlike the reducer's rank-order sums, so a
//   test can tell an all-reduce from a rank-ordered sum bit for bit.
// - Waits are bounded by the rank's timeout_seconds() (dist.timeout); past it,
//   abort(). abort() records ADD_FAILURE, prints the reason, wakes every rank
//   (their pending and later collectives throw) and throws. On a thread run_ranks
//   started the exception is caught and reported; thrown on another thread (the
//   reducer's communication thread calls abort() itself) it ends the test binary
//   through std::terminate after the reason was printed, as MPI_Abort would.
// - op_log(rank) lists each rank's collectives (kind, bytes, channel) in the
//   order they were started: tests check bucket sizes and order with it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator.h"

namespace loom::test_util {

class ThreadGroup;

// What a rank started, in order.
struct CommOp {
  std::string kind;  // "allreduce_sum_f32", "allreduce_sum_f64", "allreduce_max_i64", "broadcast", "barrier",
                     // "allgatherv", "gatherv", "allgather"
  size_t bytes = 0;  // this rank's contribution
  bool nonblocking = false;
};

// Thrown by the collectives of every rank once one rank aborted.
struct GroupAborted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(ThreadGroup& group, int rank) : group_(group), rank_(rank) { set_timeout_seconds(60); }

  int rank() const override { return rank_; }
  int size() const override;
  std::string describe() const override;

  void allreduce_sum(std::span<double> data) override;
  void allreduce_sum(std::span<float> data) override;
  void allreduce_max(std::span<int64_t> data) override;
  void broadcast(void* data, size_t bytes, int root) override;
  void barrier() override;
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts) override;
  void gatherv(const void* send, void* recv, std::span<const size_t> counts, int root) override;
  std::unique_ptr<CommRequest> start_allreduce_sum(float* data, size_t n) override;
  std::unique_ptr<CommRequest> start_allgather(const void* send, void* recv, size_t bytes) override;
  [[noreturn]] void abort(const std::string& why) override;

 private:
  ThreadGroup& group_;
  int rank_;
  uint64_t next_seq_[2] = {0, 0};  // per channel: 0 blocking, 1 non-blocking
};

class ThreadGroup {
 public:
  enum class SumOrder { descending, ascending };

  explicit ThreadGroup(int n, SumOrder order = SumOrder::descending) : n_(n), order_(order) {
    for (int r = 0; r < n; ++r) comms_.push_back(std::make_unique<ThreadCommunicator>(*this, r));
    log_.resize(static_cast<size_t>(n));
  }
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  int size() const { return n_; }
  ThreadCommunicator& comm(int rank) { return *comms_.at(static_cast<size_t>(rank)); }
  std::vector<CommOp> op_log(int rank) const {
    std::lock_guard<std::mutex> lock(mu_);
    return log_.at(static_cast<size_t>(rank));
  }
  size_t op_count(int rank) const {
    std::lock_guard<std::mutex> lock(mu_);
    return log_.at(static_cast<size_t>(rank)).size();
  }
  bool aborted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }
  // Wakes every rank: their collectives throw GroupAborted from now on.
  void abort_all(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!aborted_) why_ = why;
      aborted_ = true;
    }
    cv_.notify_all();
  }

 private:
  friend class ThreadCommunicator;
  friend class ThreadRequest;

  struct Round {
    std::string kind;
    size_t bytes = 0;
    int root = -1;
    std::vector<size_t> counts;
    std::vector<std::vector<uint8_t>> contrib;  // per rank
    int arrived = 0, consumed = 0;
    bool reduced = false;
    std::vector<uint8_t> result;  // sums, computed once
  };
  // How a round's result lands in one rank's buffer (called under the lock, once every rank arrived).
  using Deliver = std::function<void(Round&)>;

  // Posts rank's contribution to its collective number `seq` on `channel` (0 blocking, 1 non-blocking).
  uint64_t post(int rank, int channel, uint64_t seq, const std::string& kind, const void* data, size_t bytes,
                int root, std::span<const size_t> counts, bool same_bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_)
      throw GroupAborted("rank " + std::to_string(rank) + ": " + kind + " after an abort: " + why_);
    log_[static_cast<size_t>(rank)].push_back({kind, bytes, channel == 1});
    Round& r = rounds_[channel][seq];
    std::string mismatch;
    if (r.arrived == 0) {
      r.kind = kind;
      r.bytes = bytes;
      r.root = root;
      r.counts.assign(counts.begin(), counts.end());
      r.contrib.resize(static_cast<size_t>(n_));
    } else if (r.kind != kind) {
      mismatch = "collective " + kind + " meets " + r.kind;
    } else if (same_bytes && r.bytes != bytes) {
      mismatch = kind + " of " + std::to_string(bytes) + " bytes meets one of " + std::to_string(r.bytes);
    } else if (r.root != root) {
      mismatch = kind + " with root " + std::to_string(root) + " meets root " + std::to_string(r.root);
    } else if (!std::equal(counts.begin(), counts.end(), r.counts.begin(), r.counts.end())) {
      mismatch = kind + " with different counts";
    }
    if (!mismatch.empty()) {
      lock.unlock();
      comm(rank).abort("rank " + std::to_string(rank) + ", " + (channel ? "non-blocking" : "blocking") +
                       " collective #" + std::to_string(seq) + ": " + mismatch);
    }
    auto& mine = r.contrib[static_cast<size_t>(rank)];
    mine.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + bytes);
    ++r.arrived;
    lock.unlock();
    cv_.notify_all();
    return seq;
  }

  // Under the lock: whether every rank arrived; if so delivers and retires this rank's part.
  bool try_complete_locked(int rank, int channel, uint64_t seq, const Deliver& deliver) {
    if (aborted_) throw GroupAborted("rank " + std::to_string(rank) + ": collective aborted: " + why_);
    auto it = rounds_[channel].find(seq);
    if (it == rounds_[channel].end() || it->second.arrived < n_) return false;
    deliver(it->second);
    if (++it->second.consumed == n_) rounds_[channel].erase(it);
    return true;
  }
  bool try_complete(int rank, int channel, uint64_t seq, const Deliver& deliver) {
    std::lock_guard<std::mutex> lock(mu_);
    return try_complete_locked(rank, channel, seq, deliver);
  }
  // Blocking: waits for every rank until the rank's deadline.
  void complete(int rank, int channel, uint64_t seq, const std::string& what, const Deliver& deliver) {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double>(comm(rank).timeout_seconds()));
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (try_complete_locked(rank, channel, seq, deliver)) return;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        if (try_complete_locked(rank, channel, seq, deliver)) return;
        lock.unlock();
        comm(rank).abort(what + " did not complete within the timeout");
      }
    }
  }

  // Elementwise sum of the contributions (as T), in the group's order, once.
  template <typename T>
  const T* summed(Round& r) {
    if (!r.reduced) {
      const size_t n = r.bytes / sizeof(T);
      std::vector<T> acc(n);
      for (int k = 0; k < n_; ++k) {
        const int src = order_ == SumOrder::ascending ? k : n_ - 1 - k;
        const auto* v = reinterpret_cast<const T*>(r.contrib[static_cast<size_t>(src)].data());
        for (size_t i = 0; i < n; ++i) acc[i] = k == 0 ? v[i] : acc[i] + v[i];
      }
      r.result.resize(n * sizeof(T));
      std::memcpy(r.result.data(), acc.data(), n * sizeof(T));
      r.reduced = true;
    }
    return reinterpret_cast<const T*>(r.result.data());
  }

  int n_;
  SumOrder order_;
  std::vector<std::unique_ptr<ThreadCommunicator>> comms_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Round> rounds_[2];
  std::vector<std::vector<CommOp>> log_;
  bool aborted_ = false;
  std::string why_;
};

class ThreadRequest final : public CommRequest {
 public:
  ThreadRequest(ThreadGroup& g, int rank, uint64_t seq, ThreadGroup::Deliver deliver)
      : g_(g), rank_(rank), seq_(seq), deliver_(std::move(deliver)) {}
  bool test() override {
    if (!done_) done_ = g_.try_complete(rank_, 1, seq_, deliver_);
    return done_;
  }

 private:
  ThreadGroup& g_;
  int rank_;
  uint64_t seq_;
  ThreadGroup::Deliver deliver_;
  bool done_ = false;
};

inline int ThreadCommunicator::size() const { return group_.size(); }
inline std::string ThreadCommunicator::describe() const {
  return "in-process test group of " + std::to_string(group_.size()) + " ranks";
}

inline void ThreadCommunicator::allreduce_sum(std::span<double> data) {
  const uint64_t seq = group_.post(rank_, 0, next_seq_[0]++, "allreduce_sum_f64", data.data(),
                                   data.size_bytes(), -1, {}, true);
  group_.complete(rank_, 0, seq, "allreduce_sum_f64", [&](ThreadGroup::Round& r) {
    std::memcpy(data.data(), group_.summed<double>(r), data.size_bytes());
  });
}

inline void ThreadCommunicator::allreduce_sum(std::span<float> data) {
  const uint64_t seq = group_.post(rank_, 0, next_seq_[0]++, "allreduce_sum_f32", data.data(),
                                   data.size_bytes(), -1, {}, true);
  group_.complete(rank_, 0, seq, "allreduce_sum_f32", [&](ThreadGroup::Round& r) {
    std::memcpy(data.data(), group_.summed<float>(r), data.size_bytes());
  });
}

inline void ThreadCommunicator::allreduce_max(std::span<int64_t> data) {
  const uint64_t seq = group_.post(rank_, 0, next_seq_[0]++, "allreduce_max_i64", data.data(),
                                   data.size_bytes(), -1, {}, true);
  group_.complete(rank_, 0, seq, "allreduce_max_i64", [&](ThreadGroup::Round& r) {
    for (size_t i = 0; i < data.size(); ++i) {
      int64_t m = INT64_MIN;
      for (const auto& c : r.contrib) m = std::max(m, reinterpret_cast<const int64_t*>(c.data())[i]);
      data[i] = m;
    }
  });
}

inline void ThreadCommunicator::broadcast(void* data, size_t bytes, int root) {
  const uint64_t seq = group_.post(rank_, 0, next_seq_[0]++, "broadcast", data, bytes, root, {}, true);
  group_.complete(rank_, 0, seq, "broadcast", [&](ThreadGroup::Round& r) {
    if (bytes) std::memcpy(data, r.contrib.at(static_cast<size_t>(root)).data(), bytes);
  });
}

inline void ThreadCommunicator::barrier() {
  const uint64_t seq = group_.post(rank_, 0, next_seq_[0]++, "barrier", nullptr, 0, -1, {}, true);
  group_.complete(rank_, 0, seq, "barrier", [](ThreadGroup::Round&) {});
}

inline void ThreadCommunicator::allgatherv(const void* send, void* recv, std::span<const size_t> counts) {
  if (counts.size() != static_cast<size_t>(size()))
    abort("allgatherv: " + std::to_string(counts.size()) + " counts for " + std::to_string(size()) +
          " ranks");
  const size_t mine = counts[static_cast<size_t>(rank_)];
  const uint64_t seq = group_.post(rank_, 0, next_seq_[0]++, "allgatherv", send, mine, -1, counts, false);
  group_.complete(rank_, 0, seq, "allgatherv", [&](ThreadGroup::Round& r) {
    auto* out = static_cast<uint8_t*>(recv);
    for (const auto& c : r.contrib) {
      if (!c.empty()) std::memcpy(out, c.data(), c.size());
      out += c.size();
    }
  });
}

inline void ThreadCommunicator::gatherv(const void* send, void* recv, std::span<const size_t> counts,
                                        int root) {
  if (counts.size() != static_cast<size_t>(size()))
    abort("gatherv: " + std::to_string(counts.size()) + " counts for " + std::to_string(size()) + " ranks");
  const size_t mine = counts[static_cast<size_t>(rank_)];
  const uint64_t seq = group_.post(rank_, 0, next_seq_[0]++, "gatherv", send, mine, root, counts, false);
  group_.complete(rank_, 0, seq, "gatherv", [&](ThreadGroup::Round& r) {
    if (rank_ != root) return;
    auto* out = static_cast<uint8_t*>(recv);
    for (const auto& c : r.contrib) {
      if (!c.empty()) std::memcpy(out, c.data(), c.size());
      out += c.size();
    }
  });
}

inline std::unique_ptr<CommRequest> ThreadCommunicator::start_allreduce_sum(float* data, size_t n) {
  const uint64_t seq =
      group_.post(rank_, 1, next_seq_[1]++, "allreduce_sum_f32", data, n * sizeof(float), -1, {}, true);
  return std::make_unique<ThreadRequest>(group_, rank_, seq, [this, data, n](ThreadGroup::Round& r) {
    std::memcpy(data, group_.summed<float>(r), n * sizeof(float));
  });
}

inline std::unique_ptr<CommRequest> ThreadCommunicator::start_allgather(const void* send, void* recv,
                                                                        size_t bytes) {
  const uint64_t seq = group_.post(rank_, 1, next_seq_[1]++, "allgather", send, bytes, -1, {}, true);
  return std::make_unique<ThreadRequest>(group_, rank_, seq, [recv, bytes](ThreadGroup::Round& r) {
    auto* out = static_cast<uint8_t*>(recv);
    for (const auto& c : r.contrib) {
      if (bytes) std::memcpy(out, c.data(), bytes);
      out += bytes;
    }
  });
}

inline void ThreadCommunicator::abort(const std::string& why) {
  const std::string msg = "loom test communicator: rank " + std::to_string(rank_) + ": abort: " + why;
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  ADD_FAILURE() << msg;
  group_.abort_all(msg);
  throw GroupAborted(msg);
}

// Runs fn(comm) for every rank of `group`, each on its own thread, and joins
// them. An exception out of fn is a test failure naming the rank; it aborts
// the group so that no other rank waits for it until the deadline.
inline void run_ranks(ThreadGroup& group, const std::function<void(ThreadCommunicator&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < group.size(); ++r)
    threads.emplace_back([&group, &fn, r] {
      try {
        fn(group.comm(r));
      } catch (const GroupAborted& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << " threw: " << e.what();
        group.abort_all("rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  for (auto& t : threads) t.join();
}

inline void run_ranks(int n, const std::function<void(ThreadCommunicator&)>& fn) {
  ThreadGroup group(n);
  run_ranks(group, fn);
}

}  // namespace loom::test_util

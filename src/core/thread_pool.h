// A fork-join pool tuned for per-op dispatch during decoding: workers spin for a
// bounded time on a generation counter, then sleep on a futex, so a parallel op
// costs a few microseconds on a quiet machine. The bound adapts (1 ms down to
// 16 us): each spin that runs out halves it, so on a busy machine threads give
// their CPU back quickly instead of keeping descheduled siblings off it. run(fn) calls fn(i, n) once for every index i
// in [0, n), n = size(); the threads (the caller among them) claim indices as
// they arrive, so the split of the work stays the same (results do not change)
// while an index whose thread has been descheduled is run by another. Passed
// explicitly; there is no global pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "core/cpu_budget.h"  // default_thread_count, resolve_thread_count

namespace loom {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Profiling (core/trace.h): while on, the pool sums the time its threads
  // spend running indices (busy) and the caller's time inside run() (in_run).
  // An op of wall time D then kept the threads busy for
  // busy + (D - in_run) (the caller's serial part); size() * D minus that is
  // the time threads waited. Two clock reads per index while on; none off.
  struct WorkTime {
    int64_t busy_ns = 0, in_run_ns = 0;
  };
  void set_accounting(bool on) { accounting_.store(on, std::memory_order_relaxed); }
  bool accounting() const { return accounting_.load(std::memory_order_relaxed); }
  WorkTime work_time() const;  // the caller's: after run() returned

  // Calls fn(index, size()) once for each index in [0, size()), each on some
  // thread of the pool (one thread may run several indices, one after another);
  // returns when all are done.
  template <typename F>
  void run(F&& fn) {
    run_impl(&invoke<std::remove_reference_t<F>>, static_cast<void*>(&fn));
  }

  // Splits [0, n) into one contiguous chunk per thread (chunk rounded to `grain`).
  template <typename F>
  void parallel_for(int64_t n, F&& fn, int64_t grain = 1) {
    if (n <= 0) return;
    const int nt = n_threads_;
    if (nt == 1 || n <= grain) { fn(int64_t{0}, n); return; }
    run([&](int ti, int tn) {
      int64_t chunk = (n + tn - 1) / tn;
      chunk = (chunk + grain - 1) / grain * grain;
      const int64_t b = chunk * ti;
      const int64_t e = b + chunk < n ? b + chunk : n;
      if (b < e) fn(b, e);
    });
  }

 private:
  using Trampoline = void (*)(void*, int, int);
  template <typename F>
  static void invoke(void* ctx, int ti, int tn) { (*static_cast<F*>(ctx))(ti, tn); }

  void run_impl(Trampoline tramp, void* ctx);
  void worker_loop();
  void run_claimed();  // claims and runs indices of the current run until none is left
  void wait_all_done();

  int n_threads_;
  template <class Done>
  bool spin(Done done);  // spins up to the current budget and adapts it; says whether done()

  int64_t spin_max_;  // 0 when the pool has more threads than usable CPUs: never spin
  std::atomic<int64_t> spin_ns_;  // the current spin budget (see thread_pool.cpp)
  std::vector<std::thread> workers_;
  // Futex words are 32-bit (generation_, done_).
  alignas(64) std::atomic<uint32_t> generation_{0};  // bumped by each run; workers sleep on it
  std::atomic<uint32_t> sleepers_{0};                // workers asleep on generation_
  alignas(64) std::atomic<int> next_{0};             // next unclaimed index (>= n: none)
  alignas(64) std::atomic<uint32_t> done_{0};        // indices finished; the caller sleeps on it
  std::atomic<bool> caller_waiting_{false};
  Trampoline tramp_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<bool> stop_{false};
  std::atomic<bool> accounting_{false};
  // Busy time per index of a run, each on its own cache line (an index runs on
  // one thread at a time, and runs one after another: no contention).
  struct alignas(64) BusySlot {
    std::atomic<int64_t> ns{0};
  };
  std::unique_ptr<BusySlot[]> busy_;
  std::atomic<int64_t> in_run_ns_{0};  // written by the caller only
};

}  // namespace loom

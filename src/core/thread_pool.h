// A fork-join pool tuned for per-op dispatch during decoding: workers spin
// briefly on a generation counter before sleeping, so a parallel op costs a
// few microseconds, not a condition-variable round trip. The calling thread
// takes part as worker 0. Passed explicitly; there is no global pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace loom {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(thread_index, n_threads) on every thread; returns when all are done.
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
  void worker_loop(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<bool> caller_waiting_{false};  // run_impl sleeps on pending_
  Trampoline tramp_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<bool> stop_{false};
};

// Physical cores available to this process (what -t defaults to).
int default_thread_count();

}  // namespace loom

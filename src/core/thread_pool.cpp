#include "core/thread_pool.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <algorithm>
#include <climits>

namespace loom {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// How long a thread spins for the next run (a worker) or for the last index to
// finish (the caller) before it sleeps: up to kMaxSpin on a quiet machine
// (prompt batches leave workers idle for hundreds of microseconds between
// ops; a futex wake-up costs tens), halved each time a spin runs out (the
// thread waited for was descheduled: a busy machine, where spinning only keeps
// it off the CPU) down to kMinSpin, and grown back by a sixteenth of kMaxSpin
// after each spin that succeeds.
constexpr int64_t kMaxSpin = 1'000'000, kMinSpin = 16'000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Spins until done() or `budget_ns` have passed; says whether done() held.
template <class Done>
bool spin_until(Done done, int64_t budget_ns) {
  if (done()) return true;
  if (budget_ns <= 0) return false;
  const int64_t end = now_ns() + budget_ns;
  for (;;) {
    for (int i = 0; i < 32; ++i) {  // the clock is read once per 32 pauses
      cpu_relax();
      if (done()) return true;
    }
    if (now_ns() >= end) return false;
  }
}

// Private futexes on 32-bit atomics (std::atomic::wait would add its own
// spinning and sched_yield loop before sleeping).
template <class T>
void futex_wait(std::atomic<T>& word, T expected) {
  static_assert(sizeof(T) == 4);
  syscall(SYS_futex, reinterpret_cast<T*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
template <class T>
void futex_wake(std::atomic<T>& word, int n) {
  static_assert(sizeof(T) == 4);
  syscall(SYS_futex, reinterpret_cast<T*>(&word), FUTEX_WAKE_PRIVATE, n, nullptr, nullptr, 0);
}

}  // namespace

ThreadPool::ThreadPool(int n_threads)
    : n_threads_(n_threads < 1 ? 1 : n_threads),
      // More threads than CPUs: a spinning thread only keeps a descheduled one
      // from running, so threads sleep at once.
      spin_max_(n_threads_ <= cpu_budget().usable ? kMaxSpin : 0),
      spin_ns_(spin_max_),
      busy_(std::make_unique<BusySlot[]>(static_cast<size_t>(n_threads_))) {
  workers_.reserve(static_cast<size_t>(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_seq_cst);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(generation_, INT_MAX);
  for (auto& w : workers_) w.join();
}

template <class Done>
bool ThreadPool::spin(Done done) {
  const int64_t budget = spin_ns_.load(std::memory_order_relaxed);
  const bool ok = spin_until(done, budget);
  if (spin_max_ == 0) return ok;
  // Racy read-modify-write on purpose: the budget is a hint shared by all threads.
  const int64_t next = ok ? std::min(spin_max_, budget + spin_max_ / 16) : std::max(kMinSpin, budget / 2);
  if (next != budget) spin_ns_.store(next, std::memory_order_relaxed);
  return ok;
}

ThreadPool::WorkTime ThreadPool::work_time() const {
  WorkTime w;
  for (int i = 0; i < n_threads_; ++i) w.busy_ns += busy_[i].ns.load(std::memory_order_relaxed);
  w.in_run_ns = in_run_ns_.load(std::memory_order_relaxed);
  return w;
}

void ThreadPool::run_impl(Trampoline tramp, void* ctx) {
  if (n_threads_ == 1) { tramp(ctx, 0, 1); return; }
  // The previous run is complete (every index done), so no thread reads these now.
  tramp_ = tramp;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  next_.store(0, std::memory_order_release);  // claims acquire this (and the two lines above)
  // The run's span starts before any worker can see it: a caller preempted after
  // the wake would otherwise count less time than the workers already busy.
  const int64_t start = accounting() ? now_ns() : 0;
  // Dekker-style with worker_loop (seq_cst both sides): either a worker going to
  // sleep sees the new generation, or we see it in sleepers_ and wake it.
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) != 0) futex_wake(generation_, INT_MAX);
  run_claimed();
  wait_all_done();
  if (start) in_run_ns_.store(in_run_ns_.load(std::memory_order_relaxed) + now_ns() - start, std::memory_order_relaxed);
}

void ThreadPool::run_claimed() {
  const int n = n_threads_;
  for (int i; (i = next_.fetch_add(1, std::memory_order_acquire)) < n;) {
    // A claimed index keeps the run from completing, so tramp_/ctx_ are this run's.
    if (accounting()) {
      const int64_t start = now_ns();
      tramp_(ctx_, i, n);
      busy_[i].ns.fetch_add(now_ns() - start, std::memory_order_relaxed);
    } else {
      tramp_(ctx_, i, n);
    }
    if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == static_cast<uint32_t>(n) &&
        caller_waiting_.load(std::memory_order_seq_cst))
      futex_wake(done_, 1);
  }
}

void ThreadPool::wait_all_done() {
  const auto n = static_cast<uint32_t>(n_threads_);
  if (spin([&] { return done_.load(std::memory_order_acquire) == n; })) return;
  // Sleep until the last index finishes (its thread may have been descheduled:
  // spinning or yielding would only keep it from running). Dekker-style with
  // run_claimed: either it sees caller_waiting_ and wakes us, or we see done_ == n.
  caller_waiting_.store(true, std::memory_order_seq_cst);
  for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) != n;) futex_wait(done_, d);
  caller_waiting_.store(false, std::memory_order_relaxed);
}

void ThreadPool::worker_loop() {
  uint32_t seen = 0;  // the value before any run(); reading it here could miss the first run
  for (;;) {
    if (!spin([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      while (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(generation_, seen);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    // Runs seen..now are all complete except possibly the latest: claiming finds
    // only its indices (or none, if others took them all).
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    run_claimed();
  }
}

}  // namespace loom

#include "core/thread_pool.h"

#include <sched.h>

#include <fstream>
#include <set>
#include <string>
#include <utility>

#include "core/error.h"

namespace loom {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Iterations a worker spins before it sleeps; roughly 50-100 us.
constexpr int kSpinIterations = 20000;

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  workers_.reserve(static_cast<size_t>(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run_impl(Trampoline tramp, void* ctx) {
  if (n_threads_ == 1) { tramp(ctx, 0, 1); return; }
  tramp_ = tramp;
  ctx_ = ctx;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  tramp(ctx, 0, n_threads_);
  // Spin briefly, then sleep until the last worker wakes us: when a worker has
  // been descheduled (a busy machine), spinning or yielding would only keep it
  // from running (a yield loop made tiny models ~100x slower under load).
  for (int spins = 0; spins < kSpinIterations; ++spins) {
    if (pending_.load(std::memory_order_acquire) == 0) return;
    cpu_relax();
  }
  // Dekker-style handshake (seq_cst on both sides): either the last worker sees
  // caller_waiting_ and notifies, or we see pending_ == 0 before sleeping.
  caller_waiting_.store(true, std::memory_order_seq_cst);
  for (int p; (p = pending_.load(std::memory_order_seq_cst)) != 0;) pending_.wait(p, std::memory_order_seq_cst);
  caller_waiting_.store(false, std::memory_order_relaxed);
}

void ThreadPool::worker_loop(int index) {
  uint32_t seen = 0;  // the value before any run(); reading it here could miss the first run
  for (;;) {
    uint32_t g;
    int spins = 0;
    while ((g = generation_.load(std::memory_order_acquire)) == seen) {
      if (++spins < kSpinIterations) { cpu_relax(); continue; }
      generation_.wait(seen, std::memory_order_acquire);
      spins = 0;
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    tramp_(ctx_, index, n_threads_);
    if (pending_.fetch_sub(1, std::memory_order_seq_cst) == 1 && caller_waiting_.load(std::memory_order_seq_cst))
      pending_.notify_one();
  }
}

int default_thread_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  std::set<std::pair<int, int>> cores;  // (package, core) pairs
  int logical = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    ++logical;
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::ifstream core_f(base + "core_id"), pkg_f(base + "physical_package_id");
    int core = -1, pkg = -1;
    if (!(core_f >> core) || !(pkg_f >> pkg)) { cores.insert({-1, cpu}); continue; }
    cores.insert({pkg, core});
  }
  const int n = static_cast<int>(cores.size());
  return n > 0 ? n : (logical > 0 ? logical : 1);
}

}  // namespace loom

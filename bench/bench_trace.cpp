// What recording a profile costs per op (docs/profiling.md, Collect): a small
// backend op (add over 64 floats, the size that makes the bookkeeping stand
// out) through the plain CPU backend, the profiling backend not recording, and
// recording; and the thread pool's run() with its work-time accounting off and
// on. Multiply the difference by a step's ops (the trace's event count / steps)
// for the cost a step pays.
//   build/bench/loom_bench --benchmark_filter='Trace' --benchmark_min_time=0.2s
#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

#include "core/thread_pool.h"
#include "core/trace.h"
#include "kernels/backend.h"
#include "kernels/profiling_backend.h"

namespace loom {
namespace {

// mode 0: plain backend; 1: profiling backend, not recording; 2: recording.
void BM_TraceOpCost(benchmark::State& state) {
  const auto mode = state.range(0);
  ThreadPool pool(1);
  Tracer tracer;
  std::unique_ptr<Backend> be = make_backend(kCpu, pool);
  if (mode > 0) be = make_profiling_backend(std::move(be), tracer, pool);
  std::vector<float> a(64, 1.0f), b(64, 2.0f), out(64);
  int64_t n = 0;
  for (auto _ : state) {
    // A recording keeps every event: restart it now and then so memory stays flat.
    if (mode == 2 && n++ % 100000 == 0) {
      state.PauseTiming();
      tracer.start();
      state.ResumeTiming();
    }
    be->add(out.data(), a.data(), b.data(), 64);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_TraceOpCost)->Arg(0)->Arg(1)->Arg(2)->ArgName("plain0_idle1_recording2");

void BM_TracePoolRun(benchmark::State& state) {
  ThreadPool pool(2);
  pool.set_accounting(state.range(0) != 0);
  for (auto _ : state) pool.run([](int, int) { benchmark::ClobberMemory(); });
}
BENCHMARK(BM_TracePoolRun)->Arg(0)->Arg(1)->ArgName("accounting");

}  // namespace
}  // namespace loom

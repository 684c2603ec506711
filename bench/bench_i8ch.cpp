// i8_ch (W8A8: per-channel int8 weights, per-token int8 activations) against
// q8_0 at the same SmolLM2 / Llama shapes, packed weights, 2 threads, wall time:
//   loom_bench --benchmark_filter='Matmul/(q8_0|i8_ch)/N'
// Names: Matmul/<type>/N<rows>xK<cols>/T<tokens>/t2. The weights are the same
// normal(0, 0.05) values, quantized by quantize_row_ref (q8_0) and with min-max
// scales and zero points (i8_ch). GFLOP/s counts 2 N K T.
// MatmulRatio/i8_ch_vs_q8_0/...: both products in turn, each iteration; the
// counters are the best time of each (us_q8_0, us_i8_ch) and their ratio
// (speedup), which a busy machine disturbs far less than separate runs.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/cpu/matmul.h"
#include "kernels/quantize.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

struct I8ChCase {
  DType type;
  int64_t N, K, T;
  int threads;
};

std::vector<uint8_t> weights(DType type, int64_t N, int64_t K) {
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> w(static_cast<size_t>(N * K));
  for (auto& v : w) v = dist(rng);
  std::vector<uint8_t> out(static_cast<size_t>(N) * dtype_row_bytes(type, K));
  if (type == DType::q8_0) {
    for (int64_t n = 0; n < N; ++n)
      quantize_row_ref(type, w.data() + n * K, out.data() + static_cast<size_t>(n) * dtype_row_bytes(type, K), K);
    return out;
  }
  std::vector<float> scales(static_cast<size_t>(N)), zeros(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    const auto [lo, hi] = std::minmax_element(w.begin() + n * K, w.begin() + (n + 1) * K);
    const float s = (*hi - *lo) / 255.0f;
    scales[static_cast<size_t>(n)] = s;
    zeros[static_cast<size_t>(n)] = s > 0 ? std::clamp(std::round(-128.0f - *lo / s), -128.0f, 127.0f) : 0.0f;
  }
  quantize_rows_i8_ch(w.data(), N, K, scales.data(), zeros.data(), out.data());
  return out;
}

void run_i8ch_case(benchmark::State& state, I8ChCase c) {
  auto w = weights(c.type, c.N, c.K);
  ThreadPool pool(c.threads);
  const PackedWeight pw = PackedWeight::pack(make_tensor(w.data(), c.type, {c.N, c.K}), &pool);
  std::vector<float> x(static_cast<size_t>(c.T * c.K)), y(static_cast<size_t>(c.T * c.N));
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  MatmulScratch scratch;
  for (auto _ : state) {
    matmul(pool, pw, x.data(), y.data(), c.T, scratch);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * static_cast<double>(c.N) * static_cast<double>(c.K) * static_cast<double>(c.T);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void run_ratio_case(benchmark::State& state, I8ChCase c) {
  auto wq = weights(DType::q8_0, c.N, c.K), wi = weights(DType::i8_ch, c.N, c.K);
  ThreadPool pool(c.threads);
  const PackedWeight pq = PackedWeight::pack(make_tensor(wq.data(), DType::q8_0, {c.N, c.K}), &pool);
  const PackedWeight pi = PackedWeight::pack(make_tensor(wi.data(), DType::i8_ch, {c.N, c.K}), &pool);
  std::vector<float> x(static_cast<size_t>(c.T * c.K)), y(static_cast<size_t>(c.T * c.N));
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  MatmulScratch scratch;
  double best_q = 1e30, best_i = 1e30;
  using Clock = std::chrono::steady_clock;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    matmul(pool, pq, x.data(), y.data(), c.T, scratch);
    const auto t1 = Clock::now();
    matmul(pool, pi, x.data(), y.data(), c.T, scratch);
    const auto t2 = Clock::now();
    best_q = std::min(best_q, std::chrono::duration<double>(t1 - t0).count());
    best_i = std::min(best_i, std::chrono::duration<double>(t2 - t1).count());
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["us_q8_0"] = best_q * 1e6;
  state.counters["us_i8_ch"] = best_i * 1e6;
  state.counters["speedup"] = best_q / best_i;
}

[[maybe_unused]] const int kRegistered = [] {
  struct Shape {
    int64_t N, K;
  };
  // SmolLM2-135M (q/o, gate/up, down), SmolLM2-1.7B / Llama-3.2-1B-like (2048),
  // their MLP (8192 x 2048 and back).
  const Shape shapes[] = {{576, 576}, {1536, 576}, {576, 1536}, {2048, 2048}, {8192, 2048}, {2048, 8192}};
  for (const Shape& s : shapes)
    for (int64_t T : {1, 128, 512})
      for (DType type : {DType::q8_0, DType::i8_ch}) {
        const std::string name = fmt::format("Matmul/{}/N{}xK{}/T{}/t2", dtype_name(type), s.N, s.K, T);
        benchmark::RegisterBenchmark(name.c_str(), run_i8ch_case, I8ChCase{type, s.N, s.K, T, 2})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
  for (const Shape& s : shapes)
    for (int64_t T : {1, 128, 512}) {
      const std::string name = fmt::format("MatmulRatio/i8_ch_vs_q8_0/N{}xK{}/T{}/t2", s.N, s.K, T);
      benchmark::RegisterBenchmark(name.c_str(), run_ratio_case, I8ChCase{DType::i8_ch, s.N, s.K, T, 2})
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  return 0;
}();

}  // namespace
}  // namespace loom

// i8_ch (W8A8: per-channel int8 weights, per-token int8 activations) against
// q8_0 at the same SmolLM2 / Llama shapes, packed weights, 2 threads, wall time:
//   loom_bench --benchmark_filter='Matmul/(q8_0|i8_ch)/N'
// Names: Matmul/<type>/N<rows>xK<cols>/T<tokens>/t2. The weights are the same
// normal(0, 0.05) values, quantized by quantize_row_ref (q8_0) and with min-max
// scales and zero points (i8_ch). GFLOP/s counts 2 N K T.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
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
  return 0;
}();

}  // namespace
}  // namespace loom

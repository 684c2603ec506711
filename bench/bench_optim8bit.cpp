// Google Benchmark cases of one optimizer update of 4.88M parameters (the main
// job's LoRA r=16 on SmolLM2-135M) in tensors of 4608 elements: f32 AdamW
// (Backend::adamw_update) against the fused 8-bit step (adamw8bit_update:
// dequantize, update, absmax, table lookup), top-k's lazy AdamW (adamw_lazy_update), and the 8-bit
// quantize alone.
// One thread.
//   loom_bench --benchmark_filter=Optim
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "kernels/blockwise8.h"

namespace loom {
namespace {

constexpr size_t kTensor = 4608, kTensors = 1060;  // 4.88M parameters

struct Setup {
  ThreadPool pool{1};
  std::unique_ptr<Backend> be = make_backend(kCpu, pool);
  std::vector<float> p, g, m, v;
  std::vector<uint8_t> mq, vq;
  std::vector<float> ma, va;
  std::unique_ptr<Blockwise8Map> smap = std::make_unique<Blockwise8Map>(), umap = std::make_unique<Blockwise8Map>();
  Setup() {
    const size_t n = kTensor * kTensors;
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 0.01f);
    for (auto* a : {&p, &g, &m, &v}) a->resize(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g[i] = d(rng);
    }
    mq.resize(n);
    vq.resize(n);
    ma.resize(blockwise8_blocks(kTensor) * kTensors);
    va.resize(ma.size());
    build_blockwise8_map(*smap, true);
    build_blockwise8_map(*umap, false);
  }
};

AdamWUpdate f32_update() { return {0.99999f, 1e-3f, 0.1f, 0.999f, 0.001f, 0.03f, 1e-8f}; }

void OptimAdamWF32(benchmark::State& state) {
  Setup s;
  const AdamWUpdate u = f32_update();
  for (auto _ : state)
    for (size_t t = 0; t < kTensors; ++t) {
      const size_t o = t * kTensor;
      s.be->adamw_update(u, s.p.data() + o, s.g.data() + o, s.m.data() + o, s.v.data() + o, kTensor);
    }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(kTensor * kTensors));
}

// Top-k's lazy AdamW (dist.compression topk, ratio 0.1): each step a tenth of the entries arrive, each
// after a gap of about 9 steps (ten gradient arenas taken in turn).
void OptimAdamWLazyTopk(benchmark::State& state) {
  Setup s;
  const AdamWUpdate u = f32_update();
  const size_t n = s.g.size();
  std::vector<std::vector<float>> grads(10, std::vector<float>(n, 0.0f));
  std::mt19937 rng(5);
  for (size_t i = 0; i < n; ++i) grads[rng() % 10][i] = s.g[i];
  std::vector<float> gap(n, 0.0f);
  size_t step = 0;
  for (auto _ : state) {
    const std::vector<float>& g = grads[step++ % 10];
    for (size_t t = 0; t < kTensors; ++t) {
      const size_t o = t * kTensor;
      s.be->adamw_lazy_update({u, 0.9, 0.999}, s.p.data() + o, g.data() + o, s.m.data() + o, s.v.data() + o,
                              gap.data() + o, kTensor);
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(kTensor * kTensors));
}

void OptimAdamW8bit(benchmark::State& state) {
  Setup s;
  const Adam8bitUpdate u{0.99999f, 1e-3f, 0.9f, 0.1f, 0.999f, 0.001f, 0.03f, 1e-8f};
  const size_t nb = blockwise8_blocks(kTensor);
  for (auto _ : state)
    for (size_t t = 0; t < kTensors; ++t) {
      const size_t o = t * kTensor;
      const Adam8bitState st{s.mq.data() + o, s.ma.data() + t * nb, s.vq.data() + o, s.va.data() + t * nb,
                             s.smap.get(), s.umap.get()};
      s.be->adamw8bit_update(u, s.p.data() + o, s.g.data() + o, st, kTensor);
    }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(kTensor * kTensors));
}

void OptimQuantizeBlockwise(benchmark::State& state) {
  Setup s;
  for (auto _ : state) s.be->quantize_blockwise(*s.smap, s.g.data(), s.g.size(), s.mq.data(), s.ma.data());
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(s.g.size()));
}

BENCHMARK(OptimAdamWF32)->Unit(benchmark::kMillisecond);
BENCHMARK(OptimAdamWLazyTopk)->Unit(benchmark::kMillisecond);
BENCHMARK(OptimAdamW8bit)->Unit(benchmark::kMillisecond);
BENCHMARK(OptimQuantizeBlockwise)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace loom

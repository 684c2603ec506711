// TrainStep/<precision>/<fused|unfused>: one LoRA training micro-batch
// (forward + backward, no optimizer) of the default model (SmolLM2-135M Q4_1,
// LoRA r 8 on q,k,v,o,gate,up,down, dropout 0, backward bf16) over one row of
// 512 tokens, 2 threads: the fused q/k/v and gate/up A products against one
// product per adapter, at precision fp32 / bf16 / fp16. Wall time per step,
// and the process's CPU seconds per step (all threads).
//   loom_bench --benchmark_filter=TrainStep --benchmark_repetitions=3
// (skipped when models/SmolLM2-135M-Instruct.Q4_1.gguf is absent: scripts/fetch_model)
#include <benchmark/benchmark.h>

#include <ctime>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/model.h"
#include "train/lora_params.h"
#include "train/train_step.h"

namespace loom {
namespace {

const std::string kModel = std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

void train_step(benchmark::State& state, TrainPrecision p, bool fused) {
  if (!std::filesystem::exists(kModel)) {
    state.SkipWithError("models/SmolLM2-135M-Instruct.Q4_1.gguf not found (scripts/fetch_model)");
    return;
  }
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  auto model = Model::load(kModel, {.tokenizer = false, .pack = true, .backend = backend.get()});
  LoraConfig lc;
  lc.r = 8;
  lc.alpha = 16;
  const std::vector<std::string> all = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  lc.set_targets(all);
  LoraModel lora(model->config(), lc);
  TrainSession session(model->config(), model->weights(), lora, *backend, BackwardMode::bf16);
  session.set_precision(p);
  session.set_fused_lora(fused);
  const int64_t T = 512;
  Batch b;
  b.rows = 1;
  b.seq_len = T;
  std::mt19937 rng(1);
  for (int64_t t = 0; t < T; ++t) {
    b.tokens.push_back(static_cast<int32_t>(rng() % 1000));
    b.positions.push_back(static_cast<int32_t>(t));
    b.seq_start.push_back(0);
  }
  b.targets.assign(b.tokens.begin() + 1, b.tokens.end());
  b.targets.push_back(-100);
  b.target_tokens = T - 1;
  session.forward_backward(b, 1.0f / static_cast<float>(T));  // warm-up: buffers sized
  // The process's CPU time over all threads: on a shared, loaded machine a
  // steadier figure of the work than wall time.
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  const double c0 = cpu_now();
  for (auto _ : state) session.forward_backward(b, 1.0f / static_cast<float>(T));
  state.counters["process_cpu_s/step"] = (cpu_now() - c0) / static_cast<double>(state.iterations());
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

void reg() {
  for (const auto& [name, p] : {std::pair{"fp32", TrainPrecision::fp32}, {"bf16", TrainPrecision::bf16},
                                {"fp16", TrainPrecision::fp16}})
    for (bool fused : {true, false})
      benchmark::RegisterBenchmark((std::string("TrainStep/") + name + (fused ? "/fused" : "/unfused")).c_str(),
                                   [p, fused](benchmark::State& s) { train_step(s, p, fused); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(4.0);
}
const int registered = (reg(), 0);

}  // namespace
}  // namespace loom

// Google Benchmark cases of the server's per-row LoRA (kernels/cpu/lora_rows.h)
// at SmolLM2-135M's shapes, rank 8 (bench_serve.py's adapters) and 16
// (bench_lora4.py's): the q/k/v point (three targets over one x), gate/up
// (two) and down (one), for
//   decode16: 16 rows, each its own adapter (decode steps of 16 clients);
//   decode16x8: 16 rows, two per adapter (bench_lora4.py's 16 clients over 8);
//   prefill128: 128 rows of one adapter (a prefill chunk);
//   decode16cold: 16 rows, each its own adapter out of 64, each call another
//     layer's factors out of 30, where the cases above reread what the last
//     call left in cache; the kernel prefetches them (LoraRowsJob::
//     stream_factors, as the server asks when a step's weights and adapters
//     exceed the last-level cache), "_noprefetch" not. 64 adapters x 30 layers
//     of one point are 40-130 MB in bf16: in a large last-level cache (an
//     Emerald Rapids VM reports 260 MB) they stay there;
//   decode16dram: the same over 256 adapters (bf16 and int8, rank 8 only: 165-520 MB in bf16),
//     past such caches, as a serving step's factors are when the KV cache and
//     the base weights share the cache with them (bench/results/multi_lora.md);
// with f32 factors, "_bf16" kept in bf16 (`serve --lora-bits 16`: one block per
// adapter, in huge pages where the system gives them), "_int8" in int8 (`serve
// --lora-bits 8`, kernels/lora_i8.h, the same blocks) and, "_int4", factors
// kept in 4 bits as `serve --lora-bits 4` keeps them (read in place).
// Time per call, one thread (CPU time). The ".../t2" cases run the server's
// way: 2 threads (wall time), bf16 or int8 r=8 factors with stream_factors on, as the
// server asks whenever the weights and a step's adapters exceed the last-level
// cache: decode16x16 (16 rows of one adapter), prefill256 (a 256-row chunk of
// one adapter; "_noprefetch" without the stream) and decode16cold.
//   loom_bench --benchmark_filter=LoraRows
// BasePass/<base dtype>/{separate,fused}: the q/k/v base products and the
// three r=16 A factors (f32) over 128 rows, as two matmul_multi calls or one
// (model/decoder.h's LayerAdapters::base_pass).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "core/half.h"
#include "core/huge_page_buffer.h"
#include "core/thread_pool.h"
#include "kernels/cpu/lora_rows.h"
#include "kernels/cpu/matmul.h"
#include "kernels/int_quant.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

struct LoraCase {
  std::vector<int64_t> outs;  // one target per entry, all over x [T, in]
  int64_t in, rows, adapters, rank;
  int bits = 32;       // 32: f32 factors, 16: bf16, 8: int8, 4: 4-bit
  int64_t layers = 1;  // sets of factors the calls go through in turn
  bool stream = false;  // LoraRowsJob::stream_factors: prefetch the factors ahead
  int threads = 1;
};

void run_lora_rows(benchmark::State& state, LoraCase c) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
  auto fill = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
  };
  const auto n_jobs = static_cast<int64_t>(c.outs.size());
  const auto n_factors = static_cast<size_t>(c.layers * c.adapters * n_jobs);
  // f32 values of every factor (kept: f32 and 4-bit factors point into them or
  // are packed from them; bf16 ones are packed and dropped one at a time, so the
  // large cases never hold the whole set in f32).
  std::vector<std::vector<float>> as(n_factors), bs(n_factors);
  std::vector<LoraFactor> factors;  // [(layer * adapters + adapter) * n_jobs + job]
  factors.reserve(n_factors);
  std::vector<PackedInt4> packed;
  packed.reserve(2 * n_factors);  // the factors point into these
  // bf16 and int8: one block per adapter, every layer's factors in it, as `serve --lora-bits 16`
  // (or 8) keeps them (serve/loaded_adapter.cpp).
  std::vector<HugePageBuffer> blocks;
  auto align64 = [](size_t n) { return (n + 63) & ~size_t{63}; };
  size_t adapter_bytes = 0;
  for (int64_t out : c.outs)
    adapter_bytes += static_cast<size_t>(c.layers) *
                     (c.bits == 8 ? align64(lora_a8_bytes(c.rank, c.in)) + align64(lora_b8_bytes(out, c.rank))
                                  : (c.rank * c.in + lora_b16_elements(out, c.rank)) * sizeof(uint16_t));
  for (int64_t a = 0; (c.bits == 16 || c.bits == 8) && a < c.adapters; ++a)
    blocks.emplace_back(adapter_bytes);
  std::vector<size_t> filled(blocks.size(), 0);
  for (size_t i = 0; i < n_factors; ++i) {
    const int64_t out = c.outs[i % c.outs.size()];
    as[i] = fill(static_cast<size_t>(c.rank * c.in));
    bs[i] = fill(static_cast<size_t>(out * c.rank));
    factors.push_back({as[i].data(), bs[i].data(), c.rank, c.in, out, 0.5f, {}, {}});
    if (c.bits == 16) {
      const size_t ad = i / c.outs.size() % static_cast<size_t>(c.adapters);
      auto* h = reinterpret_cast<uint16_t*>(blocks[ad].data() + filled[ad]);
      LoraFactor& f = factors.back();
      f.a = f.b = nullptr;
      f.a16 = h;
      f.b16 = h + as[i].size();
      for (float e : as[i]) *h++ = fp32_to_bf16(e);
      pack_lora_b16(bs[i].data(), out, c.rank, h);
      filled[ad] += (as[i].size() + static_cast<size_t>(lora_b16_elements(out, c.rank))) * sizeof(uint16_t);
      for (std::vector<float>* v : {&as[i], &bs[i]})
        std::vector<float>().swap(*v);  // only the bf16 copy stays
      continue;
    }
    if (c.bits == 8) {
      const size_t ad = i / c.outs.size() % static_cast<size_t>(c.adapters);
      uint8_t* at = blocks[ad].data() + filled[ad];
      LoraFactor& f = factors.back();
      f.a = f.b = nullptr;
      pack_lora_a8(as[i].data(), c.rank, c.in, at);
      f.a8 = at;
      at += align64(lora_a8_bytes(c.rank, c.in));
      pack_lora_b8(bs[i].data(), out, c.rank, at);
      f.b8 = at;
      filled[ad] += align64(lora_a8_bytes(c.rank, c.in)) + align64(lora_b8_bytes(out, c.rank));
      for (std::vector<float>* v : {&as[i], &bs[i]})
        std::vector<float>().swap(*v);  // only the int8 copy stays
      continue;
    }
    if (c.bits != 4) continue;
    const PackedInt4& qa = packed.emplace_back(pack_int4_rows(as[i].data(), c.rank, c.in, fitting_int4_group(c.in, 128)));
    const PackedInt4& qb = packed.emplace_back(pack_int4_rows(bs[i].data(), out, c.rank, fitting_int4_group(c.rank, 128)));
    LoraFactor& f = factors.back();
    f.a = f.b = nullptr;
    f.a4 = {qa.codes.data(), qa.scales.data(), qa.group};
    f.b4 = {qb.codes.data(), qb.scales.data(), qb.group};
  }
  const int64_t T = c.rows;
  std::vector<float> x = fill(static_cast<size_t>(T * c.in));
  std::vector<std::vector<float>> ys;
  std::vector<int32_t> rows;
  std::vector<const LoraFactor*> per_row(static_cast<size_t>(n_jobs * T));
  for (int64_t t = 0; t < T; ++t) rows.push_back(static_cast<int32_t>(t));
  std::vector<LoraRowsJob> jobs;
  for (int64_t j = 0; j < n_jobs; ++j) ys.push_back(fill(static_cast<size_t>(T * c.outs[j])));
  for (int64_t j = 0; j < n_jobs; ++j)
    jobs.push_back({x.data(), c.in, ys[j].data(), c.outs[j], c.outs[j], per_row.data() + j * T, c.stream});
  // Call i: layer i % layers; rows of one adapter adjacent, as BatchForward sorts them (decode16cold:
  // each row the next of the 64 adapters).
  auto bind = [&](int64_t i) {
    const int64_t layer = i % c.layers, first = c.layers > 1 ? i * T : 0;
    for (int64_t j = 0; j < n_jobs; ++j)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t ad = c.layers > 1 ? (first + t) % c.adapters : t * c.adapters / T;
        per_row[static_cast<size_t>(j * T + t)] =
            &factors[static_cast<size_t>((layer * c.adapters + ad) * n_jobs + j)];
      }
  };
  std::vector<float> u(static_cast<size_t>(n_jobs * T * c.rank));
  ThreadPool pool(c.threads);
  LoraRowsScratch scratch;
  int64_t call = 0;
  bind(0);
  for (auto _ : state) {
    if (c.layers > 1) bind(call++);
    lora_rows(pool, jobs, rows, c.rank, u.data(), T, scratch);
    benchmark::DoNotOptimize(ys[0].data());
  }
  int64_t macs = 0;
  for (int64_t out : c.outs) macs += T * c.rank * (c.in + out);
  state.counters["GFLOP/s"] =
      benchmark::Counter(static_cast<double>(2 * macs), benchmark::Counter::kIsIterationInvariantRate);
}

struct BasePassCase {
  DType base;
  bool fused;
};

void run_base_pass(benchmark::State& state, BasePassCase c) {
  const int64_t H = 576, KV = 192, r = 16, T = 128;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  auto tensor = [&](DType type, int64_t N, int64_t K, std::vector<uint8_t>& bytes) {
    std::vector<float> f(static_cast<size_t>(N * K));
    for (auto& v : f) v = dist(rng);
    bytes.resize(dtype_row_bytes(type, K) * static_cast<size_t>(N));
    if (type == DType::f32)
      std::memcpy(bytes.data(), f.data(), bytes.size());
    else
      for (int64_t n = 0; n < N; ++n)
        quantize_row_ref(type, f.data() + n * K, bytes.data() + static_cast<size_t>(n) * dtype_row_bytes(type, K), K);
    return make_tensor(bytes.data(), type, {N, K});
  };
  std::vector<uint8_t> raw[6];
  const int64_t rows[6] = {H, KV, KV, r, r, r};
  std::vector<PackedWeight> w;
  for (int i = 0; i < 6; ++i) w.push_back(PackedWeight::pack(tensor(i < 3 ? c.base : DType::f32, rows[i], H, raw[i]), nullptr, "w"));
  std::vector<float> x(static_cast<size_t>(T * H), 0.5f), y(static_cast<size_t>(T * (H + 2 * KV + 3 * r)));
  std::vector<MatmulOut> outs;
  float* p = y.data();
  for (int i = 0; i < 6; ++i) {
    outs.push_back({&w[static_cast<size_t>(i)], p, rows[i]});
    p += T * rows[i];
  }
  ThreadPool pool(1);
  MatmulScratch scratch;
  const std::span<const MatmulOut> all(outs);
  for (auto _ : state) {
    if (c.fused) {
      matmul_multi(pool, all, x.data(), H, T, scratch);
    } else {
      matmul_multi(pool, all.first(3), x.data(), H, T, scratch);
      matmul_multi(pool, all.subspan(3), x.data(), H, T, scratch);
    }
    benchmark::DoNotOptimize(y.data());
  }
}

const bool registered = [] {
  for (DType base : {DType::f32, DType::bf16, DType::q4_1})
    for (bool fused : {false, true}) {
      const std::string name = fmt::format("BasePass/{}/{}/T128_qkv_r16/t1", dtype_name(base), fused ? "fused" : "separate");
      benchmark::RegisterBenchmark(name.c_str(), run_base_pass, BasePassCase{base, fused})->Unit(benchmark::kMicrosecond);
    }
  const int64_t H = 576, KV = 192, F = 1536;
  struct Point {
    const char* name;
    std::vector<int64_t> outs;
    int64_t in;
  };
  const Point points[] = {{"qkv", {H, KV, KV}, H}, {"gate_up", {F, F}, H}, {"down", {H}, F}};
  for (int64_t r : {8, 16})
    for (int bits : {32, 16, 8, 4})
      for (const Point& p : points)
        for (auto [shape, rows, adapters, layers, stream] :
             {std::tuple{"decode16", 16, 16, 1, false}, std::tuple{"decode16x8", 16, 8, 1, false},
              std::tuple{"prefill128", 128, 1, 1, false}, std::tuple{"decode16cold", 16, 64, 30, true},
              std::tuple{"decode16cold_noprefetch", 16, 64, 30, false},
              std::tuple{"decode16dram", 16, 256, 30, true},
              std::tuple{"decode16dram_noprefetch", 16, 256, 30, false}}) {
          if (std::string_view(shape).starts_with("decode16dram") && ((bits != 16 && bits != 8) || r != 8))
            continue;
          const char* suffix = bits == 4 ? "_int4" : bits == 8 ? "_int8" : bits == 16 ? "_bf16" : "";
          const std::string name = fmt::format("LoraRows/{}/{}_r{}{}/t1", p.name, shape, r, suffix);
          benchmark::RegisterBenchmark(name.c_str(), run_lora_rows,
                                       LoraCase{p.outs, p.in, rows, adapters, r, bits, layers, stream})
              ->Unit(benchmark::kMicrosecond);
        }
  for (int bits : {16, 8})
    for (const Point& p : points)
      for (auto [shape, rows, adapters, layers, stream] :
           {std::tuple{"decode16x16", 16, 1, 1, true}, std::tuple{"prefill256", 256, 1, 1, true},
            std::tuple{"prefill256_noprefetch", 256, 1, 1, false},
            std::tuple{"decode16cold", 16, 64, 30, true}}) {
        const std::string name =
            fmt::format("LoraRows/{}/{}_r8_{}/t2", p.name, shape, bits == 8 ? "int8" : "bf16");
        benchmark::RegisterBenchmark(name.c_str(), run_lora_rows,
                                     LoraCase{p.outs, p.in, rows, adapters, 8, bits, layers, stream, 2})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
  return true;
}();

}  // namespace
}  // namespace loom

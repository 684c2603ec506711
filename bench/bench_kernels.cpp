// Google Benchmark micro-benchmarks of the matmul kernels: matvec (decode) and
// T=512 matmul (prompt) per weight type, SmolLM2-135M shapes. Reports GFLOP/s
// (2*N*K*T) and weight GB/s; the time column is per call. Rates use CPU time for
// the 1-thread cases and wall time for the 2-thread ones.
//   loom_bench --benchmark_filter=Matmul/q4_1     (LOOM_CPU=avx2 for the AVX2 path)
// Also the training attention (forward with lse, backward) at the SmolLM2 shape,
// and the input gradients through frozen weights (BackwardInput/...: W^T packed
// as f16 for the matmul kernels vs bf16 tiles for AMX / AVX512-BF16 / AVX2).
// Dequant/<type>/{cpu,ref}: kernels/cpu/dequant.h against the scalar reference.
// PrefillAttention/<shape>/T512: the inference attention of a 512-row prompt;
// DecodeAttention/<shape>/ctx<n>[_cold]: one decoded row over n keys (cold:
// keys and values evicted from the caches before each call).
// Greedy/{argmax_first,max_element}/V49152: a greedy token from one row of
// SmolLM2's logits, kernels/cpu/logit_row.h's argmax against std::max_element;
// Logprobs/{logit_row,scalar}/V49152_top5: a row's log-sum-exp and its 5 best
// (a served token's logprobs) by logit_row.h, and by the scalar loops (a
// double exp per logit, a partial sort of every index) the server used before.
// Loss/{eval,eval_count}: the fused cross-entropy at SmolLM2's tied q8_0 output
// projection, without and with evaluation's token-accuracy count.
// Matmul/<type>/matvec_cold_576x1536/t2: decode over copies of one small matrix
//   (SmolLM2's ffn_down), 256 MiB together, each call the next, as a model's
//   layers come: every call starts cold, which the one long stream of
//   matvec_dram does not show.
// Matmul/<type>/matvec_dram_*[_huge]: decode over 256 MiB of weights packed on
// the heap or in huge pages (the CPU backend's HugePageArena).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "core/huge_page_buffer.h"
#include "core/thread_pool.h"
#include "kernels/cpu/dequant.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/logit_row.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_backward.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/quant_blocks.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

constexpr uint32_t kSeed = 42;

// Weight bytes of N x K random data of `type` (k-quants: random bits, sane scales).
std::vector<uint8_t> make_weights(DType type, int64_t N, int64_t K) {
  std::vector<uint8_t> w(dtype_row_bytes(type, K) * static_cast<size_t>(N));
  std::mt19937 rng(kSeed);
  if (quantize_ref_supported(type)) {
    std::normal_distribution<float> dist(0.0f, 0.05f);
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t r = 0; r < N; ++r) {
      for (auto& v : row) v = dist(rng);
      quantize_row_ref(type, row.data(), w.data() + static_cast<size_t>(r) * dtype_row_bytes(type, K), K);
    }
    return w;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  // Keep f16 scales finite and small: put 0x2000-ish halves where scales live.
  const size_t bb = dtype_traits(type).block_bytes;
  for (size_t off = 0; off < w.size(); off += bb) {
    uint8_t* b = w.data() + off;
    auto put = [&](size_t at) {
      b[at] = 0x00;
      b[at + 1] = 0x20;
    };
    switch (type) {
      case DType::q2_k:
        put(80);
        put(82);
        break;
      case DType::q3_k:
        put(108);
        break;
      case DType::q4_k:
      case DType::q5_k:
        put(0);
        put(2);
        break;
      case DType::q6_k:
        put(208);
        break;
      case DType::iq4_nl:
      case DType::iq4_xs:
      case DType::iq2_xxs:
      case DType::iq2_xs:
      case DType::iq2_s:
      case DType::iq3_xxs:
      case DType::iq3_s:
      case DType::iq1_s:
        put(0);
        break;
      case DType::iq1_m:
        set_iq1_m_d(b, 0x2000);
        break;
      default:
        break;
    }
  }
  return w;
}

struct Case {
  DType type;
  int64_t N, K, T;
  int threads;
  bool packed;
  bool huge_pages = false;  // packed into a HugePageArena, as the CPU backend packs a model's weights
};

void run_case(benchmark::State& state, Case c) {
  auto w = make_weights(c.type, c.N, c.K);
  const Tensor W = make_tensor(w.data(), c.type, {c.N, c.K});
  ThreadPool pool(c.threads);
  PackedWeight pw;
  HugePageArena arena;
  if (c.packed) pw = PackedWeight::pack(W, &pool, "bench", nullptr, c.huge_pages ? &arena : nullptr);
  std::vector<float> x(static_cast<size_t>(c.T * c.K)), y(static_cast<size_t>(c.T * c.N));
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  MatmulScratch scratch;
  for (auto _ : state) {
    if (c.packed)
      matmul(pool, pw, x.data(), y.data(), c.T, scratch);
    else
      matmul(pool, W, x.data(), y.data(), c.T, scratch);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * static_cast<double>(c.N) * static_cast<double>(c.K) * static_cast<double>(c.T);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["wGB/s"] = benchmark::Counter(static_cast<double>(W.nbytes()) * 1e-9,
                                               benchmark::Counter::kIsIterationInvariantRate);
}

// Decode over many small matrices in turn, as a model's layers are: `copies`
// packed copies of one [N, K] weight, each call the next, together past the
// last-level cache; each call starts cold, where matvec_dram's one 256 MiB
// matrix streams without a start.
void run_cold_case(benchmark::State& state, Case c, int copies) {
  auto w = make_weights(c.type, c.N, c.K);
  const Tensor W = make_tensor(w.data(), c.type, {c.N, c.K});
  ThreadPool pool(c.threads);
  HugePageArena arena;
  std::vector<PackedWeight> pws;
  for (int i = 0; i < copies; ++i) pws.push_back(PackedWeight::pack(W, &pool, "bench", nullptr, &arena));
  std::vector<float> x(static_cast<size_t>(c.K)), y(static_cast<size_t>(c.N));
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  MatmulScratch scratch;
  size_t next = 0;
  for (auto _ : state) {
    matmul(pool, pws[next], x.data(), y.data(), 1, scratch);
    next = (next + 1) % pws.size();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["wGB/s"] = benchmark::Counter(static_cast<double>(W.nbytes()) * 1e-9,
                                               benchmark::Counter::kIsIterationInvariantRate);
}

// Training attention at SmolLM2-135M's shape (9 heads, 3 kv heads, head_dim 64)
// over T packed rows cut into samples of `sample` rows. GFLOP/s counts the
// causal half of the dense work: 4 T*T/2*d*H (fwd), 10 T*T/2*d*H (bwd).
struct AttnBenchCase {
  int64_t T, sample;
  int threads;
  bool backward;
};

void run_attention(benchmark::State& state, AttnBenchCase c) {
  const AttentionShape s{9, 3, 64, 3 * 64};
  const int64_t qn = c.T * s.n_heads * s.head_dim, kn = c.T * s.kv_stride;
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto rnd = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = dist(rng);
    return x;
  };
  const auto q = rnd(qn), k = rnd(kn), v = rnd(kn), dout = rnd(qn);
  std::vector<float> out(static_cast<size_t>(qn)), lse(static_cast<size_t>(c.T * s.n_heads));
  std::vector<float> dq(static_cast<size_t>(qn)), dk(static_cast<size_t>(kn)), dv(static_cast<size_t>(kn));
  std::vector<int32_t> start(static_cast<size_t>(c.T));
  for (int64_t t = 0; t < c.T; ++t) start[static_cast<size_t>(t)] = static_cast<int32_t>(t / c.sample * c.sample);
  ThreadPool pool(c.threads);
  attention_forward_train(pool, out.data(), lse.data(), q.data(), k.data(), v.data(), s, c.T, start.data());
  for (auto _ : state) {
    if (c.backward)
      attention_backward(pool, dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                         out.data(), lse.data(), s, c.T, start.data());
    else
      attention_forward_train(pool, out.data(), lse.data(), q.data(), k.data(), v.data(), s, c.T, start.data());
    benchmark::ClobberMemory();
  }
  const double pairs = static_cast<double>(c.T / c.sample) * static_cast<double>(c.sample) *
                       static_cast<double>(c.sample + 1) / 2.0;
  const double flops = (c.backward ? 10.0 : 4.0) * pairs * static_cast<double>(s.head_dim * s.n_heads);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void register_attention() {
  for (bool bwd : {false, true})
    for (int64_t sample : {512, 1024})
      for (int threads : {1, 2}) {
        const std::string name =
            fmt::format("AttentionTrain/{}/T1024_s{}/t{}", bwd ? "backward" : "forward", sample, threads);
        auto* b = benchmark::RegisterBenchmark(name.c_str(), run_attention, AttnBenchCase{1024, sample, threads, bwd});
        b->Unit(benchmark::kMillisecond);
        if (threads > 1) b->UseRealTime();
      }
}

// dx [T, K] = dy [T, N] W [N, K] for a random Q4_1 W (SmolLM2's frozen weights)
// with W^T from pack_transposed. GFLOP/s counts 2 T N K.
struct BackwardCase {
  int64_t T, N, K;
  TransposedPrecision prec;
  Bf16Kernel kernel;
  int threads;
};

void run_backward_input(benchmark::State& state, BackwardCase c) {
  if (c.prec == TransposedPrecision::bf16 && !bf16_kernel_available(c.kernel)) {
    state.SkipWithError("bf16 kernel not available on this CPU");
    return;
  }
  auto w = make_weights(DType::q4_1, c.N, c.K);
  const Tensor W = make_tensor(w.data(), DType::q4_1, {c.N, c.K});
  ThreadPool pool(c.threads);
  const PackedWeight Wt = pack_transposed(pool, std::span<const Tensor>(&W, 1), c.prec);
  std::vector<float> dy(static_cast<size_t>(c.T * c.N)), dx(static_cast<size_t>(c.T * c.K));
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1e-4f);
  for (auto& v : dy) v = dist(rng);
  PackedBackwardScratch scratch;
  for (auto _ : state) {
    linear_backward_input_packed(pool, Wt, dy.data(), c.N, dx.data(), c.T, false, scratch, c.kernel);
    benchmark::DoNotOptimize(dx.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * static_cast<double>(c.T) * static_cast<double>(c.N) * static_cast<double>(c.K);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// SmolLM2-135M's backward products at T = 1024 (the loss projection per 64-row
// chunk): dy [T, N] W [N, K].
void register_backward_input() {
  struct Shape {
    const char* name;
    int64_t T, N, K;
  };
  const Shape shapes[] = {{"gate_up_T1024_N1536_K576", 1024, 1536, 576},
                          {"down_T1024_N576_K1536", 1024, 576, 1536},
                          {"q_o_T1024_N576_K576", 1024, 576, 576},
                          {"k_v_T1024_N192_K576", 1024, 192, 576},
                          {"loss_T64_N49152_K576", 64, 49152, 576}};
  struct Variant {
    const char* name;
    TransposedPrecision prec;
    Bf16Kernel kernel;
  };
  const Variant variants[] = {{"f16", TransposedPrecision::f16, Bf16Kernel::automatic},
                              {"bf16_amx", TransposedPrecision::bf16, Bf16Kernel::amx},
                              {"bf16_avx512", TransposedPrecision::bf16, Bf16Kernel::avx512},
                              {"bf16_avx2", TransposedPrecision::bf16, Bf16Kernel::avx2}};
  for (const Shape& sh : shapes)
    for (const Variant& v : variants)
      for (int threads : {1, 2}) {
        const std::string name = fmt::format("BackwardInput/{}/{}/t{}", sh.name, v.name, threads);
        auto* b = benchmark::RegisterBenchmark(name.c_str(), run_backward_input,
                                               BackwardCase{sh.T, sh.N, sh.K, v.prec, v.kernel, threads});
        b->Unit(benchmark::kMillisecond);
        if (threads > 1) b->UseRealTime();
      }
}

// One 1536 x 768 weight expanded to f32 row by row (load-time expansion, the
// exact backward's tiles): the production dequantizer vs the scalar reference.
// wGB/s counts the weight bytes read.
void run_dequant(benchmark::State& state, DType type, bool ref) {
  const int64_t N = 1536, K = 768;
  const auto w = make_weights(type, N, K);
  const size_t rb = dtype_row_bytes(type, K);
  std::vector<float> y(static_cast<size_t>(N * K));
  for (auto _ : state) {
    for (int64_t r = 0; r < N; ++r) {
      const uint8_t* src = w.data() + static_cast<size_t>(r) * rb;
      if (ref)
        dequantize_row_ref(type, src, y.data() + r * K, K);
      else
        dequantize_row(type, src, y.data() + r * K, K);
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["wGB/s"] =
      benchmark::Counter(static_cast<double>(w.size()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void register_dequant() {
  for (DType t : {DType::q4_1, DType::q4_0, DType::q8_0, DType::q4_k, DType::q6_k, DType::f16, DType::bf16})
    for (bool ref : {false, true}) {
      const std::string name = fmt::format("Dequant/{}/{}", dtype_name(t), ref ? "ref" : "cpu");
      benchmark::RegisterBenchmark(name.c_str(), run_dequant, t, ref)->Unit(benchmark::kMicrosecond);
    }
}

// 128 target rows through SmolLM2-135M's output projection (V 49152, H 576,
// q8_0), loss only, one thread; eval_count also counts argmax == target.
void run_loss(benchmark::State& state, bool count) {
  const int64_t V = 49152, H = 576, T = 128;
  auto w = make_weights(DType::q8_0, V, H);
  const Tensor W = make_tensor(w.data(), DType::q8_0, {V, H});
  ThreadPool pool(1);
  const PackedWeight Wp = PackedWeight::pack(W, &pool, "output");
  std::vector<float> h(static_cast<size_t>(T * H));
  std::vector<int32_t> labels(static_cast<size_t>(T));
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : h) v = dist(rng);
  for (auto& l : labels) l = static_cast<int32_t>(rng() % V);
  ChunkedLossArgs a;
  a.W = &W;
  a.W_packed = &Wp;
  a.h = h.data();
  a.labels = labels.data();
  a.T = T;
  a.count_correct = count;
  MatmulScratch scratch;
  LossScratch ls;
  for (auto _ : state) {
    const LossResult r = chunked_cross_entropy(pool, a, scratch, &ls);
    benchmark::DoNotOptimize(r);
  }
}

// Serving decode attention at SmolLM2-135M's shape (9 heads, 3 kv heads,
// head_dim 64): 16 rows, each its own sequence of `ctx` positions in blocks of
// 16, the block ids shuffled as a busy pool leaves them. GFLOP/s counts the
// scores and the weighted sum (4 d flops per head and position). On a Zen 4
// the AVX2 online-softmax kernel took ~300-400 us at ctx288_f16 (~1,400 cycles
// per tile of 16 positions and 3 heads, where the FMAs need ~400; a zmm version
// of the same loop was no faster); the AVX-512 two-pass kernel (scores, softmax,
// weighted sums, as the contiguous cache's) ~205 us (bench/README.md).
// One long row (rows = 1) is split into segments of `segment` positions
// (paged_attention.h); `unsplit` runs it as one unit per kv head, as before the split.
// chunk: the rows are one sequence's last `rows` positions of `ctx` (a prefill
// chunk), not `rows` sequences.
void run_paged_attention(benchmark::State& state, DType kv_dtype, int64_t ctx, bool cold, int64_t rows,
                         int threads, int64_t segment, bool chunk) {
  const AttentionShape s{9, 3, 64, 3 * 64};
  const int64_t n_seqs = chunk ? 1 : rows;
  const int64_t bs = 16, per_seq = (ctx + bs - 1) / bs, n_blocks = n_seqs * per_seq;
  const int64_t block_elems = bs * s.n_kv_heads * s.head_dim;
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const size_t elem = kv_dtype == DType::f16 ? 2 : 4;
  // In huge pages, as the server's KV pool is (serve/kv_pool.h).
  const size_t kv_bytes = static_cast<size_t>(n_blocks * block_elems) * elem;
  HugePageBuffer kb(kv_bytes), vb(kv_bytes);
  uint8_t* k = kb.data();
  uint8_t* v = vb.data();
  for (size_t i = 0; i < kv_bytes / elem; ++i) {
    const float a = dist(rng), b = dist(rng);
    if (elem == 2) {
      const uint16_t ha = fp32_to_fp16(a), hb = fp32_to_fp16(b);
      std::memcpy(&k[2 * i], &ha, 2);
      std::memcpy(&v[2 * i], &hb, 2);
    } else {
      std::memcpy(&k[4 * i], &a, 4);
      std::memcpy(&v[4 * i], &b, 4);
    }
  }
  std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
  for (int64_t i = 0; i < n_blocks; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<const int32_t*> tables(static_cast<size_t>(rows));
  std::vector<int32_t> pos(static_cast<size_t>(rows), static_cast<int32_t>(ctx - 1));
  double keys = 0;  // summed over the rows
  for (int64_t r = 0; r < rows; ++r) {
    tables[static_cast<size_t>(r)] = ids.data() + (chunk ? 0 : r) * per_seq;
    if (chunk) pos[static_cast<size_t>(r)] = static_cast<int32_t>(ctx - rows + r);
    keys += pos[static_cast<size_t>(r)] + 1;
  }
  std::vector<float> q(static_cast<size_t>(rows * s.n_heads * s.head_dim)), out(q.size());
  for (auto& x : q) x = dist(rng);
  const PagedKv kv{k, v, bs, kv_dtype};
  ThreadPool pool(threads);
  // cold: keys and values evicted before each call, as a serving step's layer
  // finds them after the other layers' weights streamed through the caches.
  // Evicted by reading (not writing) 96 MiB, as weights stream: no dirty lines
  // left to write back while the attention reads.
  std::vector<uint8_t> flush(cold ? size_t{96} << 20 : 0, 1);
  uint8_t sum = 0;
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      for (size_t i = 0; i < flush.size(); i += 64) sum = static_cast<uint8_t>(sum + flush[i]);
      state.ResumeTiming();
    }
    paged_attention(pool, s, kv, q.data(), out.data(), rows, pos.data(), tables.data(), segment);
    benchmark::DoNotOptimize(out.data());
  }
  benchmark::DoNotOptimize(sum);
  const double flops = 4.0 * static_cast<double>(s.n_heads * s.head_dim) * keys;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void register_paged_attention() {
  for (const DType kv : {DType::f16, DType::f32}) {
    const std::string name = fmt::format("PagedAttention/decode16_ctx288_{}/t1", dtype_name(kv));
    benchmark::RegisterBenchmark(name.c_str(), run_paged_attention, kv, int64_t{288}, false, int64_t{16}, 1,
                                 kPagedSegment, false)
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark("PagedAttention/decode16_ctx512_f16_cold/t1", run_paged_attention, DType::f16,
                               int64_t{512}, true, int64_t{16}, 1, kPagedSegment, false)
      ->Unit(benchmark::kMicrosecond);
  // A prefill chunk: positions 256..511 of one sequence (the second chunk of a
  // 512-token prompt at the default --max-batch-tokens), in cache.
  benchmark::RegisterBenchmark("PagedAttention/chunk256_ctx512_f16/t1", run_paged_attention, DType::f16,
                               int64_t{512}, false, int64_t{256}, 1, kPagedSegment, true)
      ->Unit(benchmark::kMicrosecond);
  // One sequence of 4,096 positions: in 8 segments x 3 kv heads (one and two
  // threads), and unsplit (3 units, one per kv head) on two.
  constexpr int64_t kUnsplit = int64_t{1} << 40;
  const std::tuple<const char*, int64_t, int> long_row[] = {
      {"", kPagedSegment, 1}, {"", kPagedSegment, 2}, {"_unsplit", kUnsplit, 2}};
  for (const auto& [suffix, segment, threads] : long_row) {
    const std::string name = fmt::format("PagedAttention/decode1_ctx4096_f16_cold{}/t{}", suffix, threads);
    benchmark::RegisterBenchmark(name.c_str(), run_paged_attention, DType::f16, int64_t{4096}, true,
                                 int64_t{1}, threads, segment, false)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
}

// Inference prefill attention (ops.h attention): T causal rows of one sequence
// at SmolLM2-135M's shape (9 heads, 3 kv heads) and Llama-3.2-1B's (32 heads,
// 8 kv heads), head_dim 64. GFLOP/s counts the causal scores and weighted sums
// (4 d flops per head and key).
void run_prefill_attention(benchmark::State& state, AttentionShape s, int64_t T, int threads) {
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(T * s.n_heads * s.head_dim)), out(q.size());
  std::vector<float> k(static_cast<size_t>(T * s.kv_stride)), v(k.size());
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = dist(rng);
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(t);
  ThreadPool pool(threads);
  for (auto _ : state) {
    attention(pool, s, q.data(), k.data(), v.data(), out.data(), T, pos.data(), nullptr);
    benchmark::DoNotOptimize(out.data());
  }
  const double pairs = static_cast<double>(T) * static_cast<double>(T + 1) / 2.0;
  const double flops = 4.0 * pairs * static_cast<double>(s.n_heads * s.head_dim);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Inference decode attention: one row at position ctx - 1 over a context of
// ctx keys (the last of T rows above, alone), as a decoded token runs it.
// cold: keys and values evicted before each call, as a decoded token finds a
// layer's cache after the other layers' weights and caches streamed through.
// dtype: the cache's elements, f32 or f16 (InferenceSession's default).
void run_decode_attention(benchmark::State& state, AttentionShape s, int64_t ctx, int threads, bool cold,
                          DType dtype) {
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(s.n_heads * s.head_dim)), out(q.size());
  for (auto& e : q) e = dist(rng);
  // In huge pages, as the model's KV cache is (CpuBackend::alloc).
  const size_t n = static_cast<size_t>(ctx * s.kv_stride);
  const bool f16 = dtype == DType::f16;
  const size_t bytes = n * (f16 ? sizeof(uint16_t) : sizeof(float));
  HugePageBuffer kb(bytes), vb(bytes);
  for (size_t i = 0; i < n; ++i)
    for (HugePageBuffer* b : {&kb, &vb}) {
      if (f16)
        reinterpret_cast<uint16_t*>(b->data())[i] = fp32_to_fp16(dist(rng));
      else
        reinterpret_cast<float*>(b->data())[i] = dist(rng);
    }
  const KvRows kv{kb.data(), vb.data(), dtype};
  const int32_t pos = static_cast<int32_t>(ctx - 1);
  ThreadPool pool(threads);
  // Evicted by reading (not writing) 96 MiB, as weights stream: no dirty lines
  // left to write back while the attention reads.
  std::vector<uint8_t> flush(cold ? size_t{96} << 20 : 0, 1);
  uint8_t sum = 0;
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      for (size_t i = 0; i < flush.size(); i += 64) sum = static_cast<uint8_t>(sum + flush[i]);
      state.ResumeTiming();
    }
    attention(pool, s, q.data(), kv, out.data(), 1, &pos, nullptr);
    benchmark::DoNotOptimize(out.data());
  }
  benchmark::DoNotOptimize(sum);
  const double flops = 4.0 * static_cast<double>(ctx * s.n_heads * s.head_dim);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void register_prefill_attention() {
  const std::pair<const char*, AttentionShape> shapes[] = {{"smollm2", {9, 3, 64, 3 * 64}},
                                                           {"llama1b", {32, 8, 64, 8 * 64}}};
  for (const auto& [name, s] : shapes)
    for (int threads : {1, 2}) {
      const std::string n = fmt::format("PrefillAttention/{}/T512/t{}", name, threads);
      auto* b = benchmark::RegisterBenchmark(n.c_str(), run_prefill_attention, s, int64_t{512}, threads);
      b->Unit(benchmark::kMillisecond);
      if (threads > 1) b->UseRealTime();
      for (const auto& [ctx, cold] :
           {std::pair{int64_t{16}, false}, std::pair{int64_t{64}, false}, std::pair{int64_t{128}, false},
            std::pair{int64_t{256}, true}, std::pair{int64_t{512}, false}, std::pair{int64_t{1024}, true},
            std::pair{int64_t{4096}, true}}) {
        for (DType dtype : {DType::f32, DType::f16}) {
          const std::string dn = fmt::format("DecodeAttention/{}/ctx{}{}/t{}{}", name, ctx,
                                             cold ? "_cold" : "", threads, dtype == DType::f16 ? "/f16" : "");
          auto* db =
              benchmark::RegisterBenchmark(dn.c_str(), run_decode_attention, s, ctx, threads, cold, dtype);
          db->Unit(benchmark::kMicrosecond);
          if (threads > 1) db->UseRealTime();
        }
      }
    }
}

void run_greedy(benchmark::State& state, bool simd) {
  std::vector<float> logits(49152);
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (float& v : logits) v = dist(rng);
  for (auto _ : state) {
    const int64_t id = simd ? argmax_first(logits.data(), static_cast<int64_t>(logits.size()))
                            : std::max_element(logits.begin(), logits.end()) - logits.begin();
    benchmark::DoNotOptimize(id);
  }
}

void run_logprobs(benchmark::State& state, bool simd) {
  std::vector<float> logits(49152);
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (float& v : logits) v = dist(rng);
  const auto V = static_cast<int64_t>(logits.size());
  constexpr int64_t k = 5;
  for (auto _ : state) {
    double lse;
    std::vector<int32_t> top(k);
    if (simd) {
      lse = logsumexp(logits.data(), V);
      top_k(logits.data(), V, k, top.data());
    } else {
      float mx = -INFINITY;
      for (float v : logits) mx = std::max(mx, v);
      double sum = 0;
      for (float v : logits) sum += std::exp(static_cast<double>(v - mx));
      lse = mx + std::log(sum);
      std::vector<int32_t> idx(logits.size());
      for (int64_t i = 0; i < V; ++i) idx[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      });
      std::copy(idx.begin(), idx.begin() + k, top.begin());
    }
    benchmark::DoNotOptimize(lse);
    benchmark::DoNotOptimize(top.data());
  }
}

void register_all() {
  benchmark::RegisterBenchmark("Logprobs/logit_row/V49152_top5", run_logprobs, true)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("Logprobs/scalar/V49152_top5", run_logprobs, false)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("Greedy/argmax_first/V49152", run_greedy, true)->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("Greedy/max_element/V49152", run_greedy, false)->Unit(benchmark::kMicrosecond);
  register_paged_attention();
  register_prefill_attention();
  register_dequant();
  benchmark::RegisterBenchmark("Loss/eval/T128_V49152_q8_0/t1", run_loss, false)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Loss/eval_count/T128_V49152_q8_0/t1", run_loss, true)->Unit(benchmark::kMillisecond);
  register_backward_input();
  register_attention();
  const DType types[] = {DType::q4_1,    DType::q8_0,   DType::f16,   DType::q4_k,    DType::q6_k,
                         DType::q4_0,    DType::q5_k,   DType::bf16,  DType::f32,     DType::q5_0,
                         DType::q5_1,    DType::q2_k,   DType::q3_k,  DType::iq4_nl,  DType::iq4_xs,
                         DType::iq2_xxs, DType::iq2_xs, DType::iq2_s, DType::iq3_xxs, DType::iq3_s,
                         DType::iq1_s,   DType::iq1_m};
  for (DType t : types) {
    // k-quants need K % 256 == 0: they run with K = 768 instead of 576.
    const int64_t K = dtype_block_size(t) == 256 ? 768 : 576;
    for (int threads : {1, 2}) {
      const Case cases[] = {
          {t, 1536, K, 1, threads, true}, {t, 49152, K, 1, threads, true}, {t, 1536, K, 512, threads, true}};
      const char* shapes[] = {"matvec_1536", "matvec_49152", "T512_1536"};
      for (int i = 0; i < 3; ++i) {
        const std::string bname = fmt::format("Matmul/{}/{}x{}/t{}", dtype_name(t), shapes[i], K, threads);
        auto* b = benchmark::RegisterBenchmark(bname.c_str(), run_case, cases[i]);
        b->Unit(benchmark::kMicrosecond);
        // One thread: CPU time (robust on a busy machine); two: wall time.
        if (threads > 1) b->UseRealTime();
      }
    }
    // Prompt tiles at Llama-3.2-1B's widths: K = 2048 (q/o/gate/up) and 8192
    // (down), where one panel plus a tile's activations no longer fit in L1.
    if (t == DType::q4_k || t == DType::q5_k || t == DType::q6_k || t == DType::q8_0 || t == DType::f16 ||
        t == DType::bf16 || t == DType::iq4_xs || t == DType::iq2_xxs || t == DType::iq3_s ||
        t == DType::iq1_m)
      for (const int64_t k1b : {int64_t{2048}, int64_t{8192}}) {
        const std::string pname = fmt::format("Matmul/{}/T512_2048x{}/t1", dtype_name(t), k1b);
        benchmark::RegisterBenchmark(pname.c_str(), run_case, Case{t, 2048, k1b, 512, 1, true})
            ->Unit(benchmark::kMillisecond);
      }
    // Decode from DRAM: 256 MiB of weights, more than any cache holds (the
    // matvec cases above fit in L2/L3 and flatter the kernels that stream worst);
    // on the heap (4 KiB pages where THP is "madvise") and in huge pages.
    const int64_t dram_K = 2048, dram_N = (int64_t{256} << 20) / static_cast<int64_t>(dtype_row_bytes(t, dram_K));
    for (const bool huge : {false, true}) {
      const std::string dname =
          fmt::format("Matmul/{}/matvec_dram_{}x{}{}/t2", dtype_name(t), dram_N, dram_K, huge ? "_huge" : "");
      benchmark::RegisterBenchmark(dname.c_str(), run_case, Case{t, dram_N, dram_K, 1, 2, true, huge})
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
    {  // SmolLM2's ffn_down, in copies of 256 MiB together
      const int64_t N = 576, K = 1536;
      const int copies = static_cast<int>((int64_t{256} << 20) / (N * static_cast<int64_t>(dtype_row_bytes(t, K))));
      const std::string cname = fmt::format("Matmul/{}/matvec_cold_{}x{}/t2", dtype_name(t), N, K);
      benchmark::RegisterBenchmark(cname.c_str(), run_cold_case, Case{t, N, K, 1, 2, true, true}, copies)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
    // Plain-Tensor weights (panels packed on the fly each call).
    const std::string uname = fmt::format("Matmul/{}/unpacked_matvec_1536x{}/t2", dtype_name(t), K);
    benchmark::RegisterBenchmark(uname.c_str(), run_case, Case{t, 1536, K, 1, 2, false})
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  loom::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

// Issue 13, "a sparse kernel where it pays": a 2:4 sparse product written here
// against loom's dense kernels (PackedWeight + matmul, what the CPU backend's
// prepare_weight / matmul run), at SmolLM2-135M and Llama-3.2-1B shapes, for
// decode (T = 1, a GEMV) and a small batch (T = 8), 2 threads, wall time:
//   loom_bench --benchmark_filter=Sparse --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
// Names: Sparse/<format>/N<rows>xK<cols>/T<tokens>/t2, formats:
//   dense_f16, dense_bf16, dense_q8_0, dense_q4_0, dense_q4_k  loom's kernels
//   s24_f16  2:4: per group of 4 inputs 2 f16 values + a 2-bit index each
//            (1.125 bytes/weight: K/2 f16 + K/16 bytes of indices per row)
//   s24_i8   the same with int8 values and one f32 scale per row (0.625 bytes/weight)
// The 2:4 kernels are AVX-512: per 32 inputs, 16 kept values and one uint32 of
// 16 2-bit indices; the indices become lane numbers (shift, mask, + 4*group) and
// _mm512_permutex2var_ps picks the matching x from two 16-wide registers, then
// one FMA. Activations stay f32. Counters: wGB/s (weight bytes read per second)
// and tok/s (T / time: tokens per second if this matrix were the whole model).
// Setup checks each sparse kernel against a scalar reference and the scalar
// reference against the dense double-precision product of the same zeroed
// matrix (1e-5 of max |y|), and aborts on a mismatch.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "core/thread_pool.h"
#include "kernels/cpu/matmul.h"
#include "kernels/ref/dequant_ref.h"

namespace loom {
namespace {

constexpr int kThreads = 2;

// ---- the 2:4 format

struct Sparse24 {
  int64_t N = 0, K = 0;
  bool int8 = false;
  std::vector<uint16_t> v16;   // [N, K/2] f16 kept values (int8 = false)
  std::vector<int8_t> v8;      // [N, K/2] int8 kept values (int8 = true)
  std::vector<float> scale;    // [N] (int8 = true)
  std::vector<uint32_t> idx;   // [N, K/32]: value j of a block in bits 2j..2j+1
  size_t nbytes() const {
    return (int8 ? v8.size() + scale.size() * 4 : v16.size() * 2) + idx.size() * 4;
  }
};

// Magnitude 2:4 pruning of w [N, K] in place (as loom prune --pattern 2:4), then
// the packed form; `w` is left holding exactly the values the format encodes.
Sparse24 make_sparse24(std::vector<float>& w, int64_t N, int64_t K, bool int8) {
  Sparse24 s;
  s.N = N;
  s.K = K;
  s.int8 = int8;
  const int64_t kh = K / 2, kb = K / 32;
  if (int8) {
    s.v8.resize(static_cast<size_t>(N * kh));
    s.scale.resize(static_cast<size_t>(N));
  } else {
    s.v16.resize(static_cast<size_t>(N * kh));
  }
  s.idx.assign(static_cast<size_t>(N * kb), 0);
  std::vector<float> kept(static_cast<size_t>(kh));
  for (int64_t n = 0; n < N; ++n) {
    float* row = w.data() + n * K;
    for (int64_t g = 0; g < K / 4; ++g) {
      float* q = row + 4 * g;
      int a = 0, b = 1;  // the two largest |q|, a < b
      for (int i = 0; i < 4; ++i)
        for (int j = i + 1; j < 4; ++j)
          if (std::fabs(q[i]) + std::fabs(q[j]) > std::fabs(q[a]) + std::fabs(q[b])) a = i, b = j;
      for (int i = 0; i < 4; ++i)
        if (i != a && i != b) q[i] = 0.0f;
      const int64_t j = 2 * g;  // value index within the row
      kept[static_cast<size_t>(j)] = q[a];
      kept[static_cast<size_t>(j + 1)] = q[b];
      uint32_t& word = s.idx[static_cast<size_t>(n * kb + j / 16)];
      word |= static_cast<uint32_t>(a) << (2 * (j % 16));
      word |= static_cast<uint32_t>(b) << (2 * ((j + 1) % 16));
    }
    if (int8) {
      float amax = 0.0f;
      for (float v : kept) amax = std::max(amax, std::fabs(v));
      const float sc = amax > 0 ? amax / 127.0f : 1.0f;
      s.scale[static_cast<size_t>(n)] = sc;
      for (int64_t j = 0; j < kh; ++j) {
        const int q = static_cast<int>(std::lround(kept[static_cast<size_t>(j)] / sc));
        s.v8[static_cast<size_t>(n * kh + j)] = static_cast<int8_t>(std::clamp(q, -127, 127));
      }
    } else {
      for (int64_t j = 0; j < kh; ++j) s.v16[static_cast<size_t>(n * kh + j)] = fp32_to_fp16(kept[static_cast<size_t>(j)]);
    }
    // Write back what the format holds, so the dense reference is the same matrix.
    std::fill(row, row + K, 0.0f);
    for (int64_t j = 0; j < kh; ++j) {
      const uint32_t word = s.idx[static_cast<size_t>(n * kb + j / 16)];
      const int64_t col = 4 * (j / 2) + ((word >> (2 * (j % 16))) & 3);
      row[col] = int8 ? s.v8[static_cast<size_t>(n * kh + j)] * s.scale[static_cast<size_t>(n)]
                      : fp16_to_fp32(s.v16[static_cast<size_t>(n * kh + j)]);
    }
  }
  return s;
}

// Scalar reference: y[t, n] = sum over kept values of v * x[t, col].
void sparse24_ref(const Sparse24& s, const float* x, float* y, int64_t T) {
  const int64_t kh = s.K / 2, kb = s.K / 32;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < s.N; ++n) {
      float acc = 0.0f;
      for (int64_t j = 0; j < kh; ++j) {
        const uint32_t word = s.idx[static_cast<size_t>(n * kb + j / 16)];
        const int64_t col = 4 * (j / 2) + ((word >> (2 * (j % 16))) & 3);
        const float v = s.int8 ? static_cast<float>(s.v8[static_cast<size_t>(n * kh + j)])
                               : fp16_to_fp32(s.v16[static_cast<size_t>(n * kh + j)]);
        acc += v * x[t * s.K + col];
      }
      y[t * s.N + n] = s.int8 ? acc * s.scale[static_cast<size_t>(n)] : acc;
    }
}

#define LOOM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

LOOM_AVX512 inline __m512i lanes_of(uint32_t word, __m512i shifts, __m512i base, __m512i three) {
  return _mm512_add_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts), three),
                          base);
}

template <bool kInt8>
LOOM_AVX512 inline __m512 values_of(const Sparse24& s, int64_t n, int64_t b) {
  const int64_t kh = s.K / 2;
  if constexpr (kInt8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.v8.data() + n * kh + 16 * b))));
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.v16.data() + n * kh + 16 * b)));
}

// Rows [n0, n1) of y = W x (T = 1), four rows at a time sharing the x loads.
template <bool kInt8>
LOOM_AVX512 void sparse24_gemv_rows(const Sparse24& s, const float* x, float* y, int64_t n0, int64_t n1) {
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i three = _mm512_set1_epi32(3);
  const int64_t kb = s.K / 32;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const uint32_t* id = s.idx.data() + n * kb;
    for (int64_t b = 0; b < kb; ++b) {
      const __m512 xa = _mm512_loadu_ps(x + 32 * b), xb = _mm512_loadu_ps(x + 32 * b + 16);
      acc0 = _mm512_fmadd_ps(values_of<kInt8>(s, n, b),
                             _mm512_permutex2var_ps(xa, lanes_of(id[b], shifts, base, three), xb), acc0);
      acc1 = _mm512_fmadd_ps(values_of<kInt8>(s, n + 1, b),
                             _mm512_permutex2var_ps(xa, lanes_of(id[kb + b], shifts, base, three), xb), acc1);
      acc2 = _mm512_fmadd_ps(values_of<kInt8>(s, n + 2, b),
                             _mm512_permutex2var_ps(xa, lanes_of(id[2 * kb + b], shifts, base, three), xb), acc2);
      acc3 = _mm512_fmadd_ps(values_of<kInt8>(s, n + 3, b),
                             _mm512_permutex2var_ps(xa, lanes_of(id[3 * kb + b], shifts, base, three), xb), acc3);
    }
    const __m512 accs[4] = {acc0, acc1, acc2, acc3};
    for (int r = 0; r < 4; ++r) {
      const float v = _mm512_reduce_add_ps(accs[r]);
      y[n + r] = kInt8 ? v * s.scale[static_cast<size_t>(n + r)] : v;
    }
  }
  for (; n < n1; ++n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; ++b) {
      const __m512 xa = _mm512_loadu_ps(x + 32 * b), xb = _mm512_loadu_ps(x + 32 * b + 16);
      acc = _mm512_fmadd_ps(values_of<kInt8>(s, n, b),
                            _mm512_permutex2var_ps(xa, lanes_of(s.idx[static_cast<size_t>(n * kb + b)], shifts, base, three), xb),
                            acc);
    }
    const float v = _mm512_reduce_add_ps(acc);
    y[n] = kInt8 ? v * s.scale[static_cast<size_t>(n)] : v;
  }
}

// Rows [n0, n1) for T = 8 rows of x, two weight rows at a time: each block's
// values and lanes are decoded once and used for all 8 activation rows.
template <bool kInt8>
LOOM_AVX512 void sparse24_gemm8_rows(const Sparse24& s, const float* x, float* y, int64_t n0, int64_t n1) {
  constexpr int T = 8;
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i three = _mm512_set1_epi32(3);
  const int64_t kb = s.K / 32, K = s.K;
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {  // two rows share each x load
    __m512 acc0[T], acc1[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; ++b) {
      const __m512 w0 = values_of<kInt8>(s, n, b), w1 = values_of<kInt8>(s, n + 1, b);
      const __m512i l0 = lanes_of(s.idx[static_cast<size_t>(n * kb + b)], shifts, base, three);
      const __m512i l1 = lanes_of(s.idx[static_cast<size_t>((n + 1) * kb + b)], shifts, base, three);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const float* xt = x + t * K + 32 * b;
        const __m512 xa = _mm512_loadu_ps(xt), xb = _mm512_loadu_ps(xt + 16);
        acc0[t] = _mm512_fmadd_ps(w0, _mm512_permutex2var_ps(xa, l0, xb), acc0[t]);
        acc1[t] = _mm512_fmadd_ps(w1, _mm512_permutex2var_ps(xa, l1, xb), acc1[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const float v0 = _mm512_reduce_add_ps(acc0[t]), v1 = _mm512_reduce_add_ps(acc1[t]);
      y[t * s.N + n] = kInt8 ? v0 * s.scale[static_cast<size_t>(n)] : v0;
      y[t * s.N + n + 1] = kInt8 ? v1 * s.scale[static_cast<size_t>(n + 1)] : v1;
    }
  }
  for (; n < n1; ++n) {
    __m512 acc[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; ++b) {
      const __m512 w = values_of<kInt8>(s, n, b);
      const __m512i l = lanes_of(s.idx[static_cast<size_t>(n * kb + b)], shifts, base, three);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const float* xt = x + t * K + 32 * b;
        acc[t] = _mm512_fmadd_ps(w, _mm512_permutex2var_ps(_mm512_loadu_ps(xt), l, _mm512_loadu_ps(xt + 16)), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const float v = _mm512_reduce_add_ps(acc[t]);
      y[t * s.N + n] = kInt8 ? v * s.scale[static_cast<size_t>(n)] : v;
    }
  }
}

void sparse24_matmul(ThreadPool& pool, const Sparse24& s, const float* x, float* y, int64_t T) {
  if (T == 1) {
    pool.parallel_for(s.N, [&](int64_t a, int64_t b) {
      s.int8 ? sparse24_gemv_rows<true>(s, x, y, a, b) : sparse24_gemv_rows<false>(s, x, y, a, b);
    }, 4);
  } else if (T == 8) {
    pool.parallel_for(s.N, [&](int64_t a, int64_t b) {
      s.int8 ? sparse24_gemm8_rows<true>(s, x, y, a, b) : sparse24_gemm8_rows<false>(s, x, y, a, b);
    }, 4);
  } else {
    std::fprintf(stderr, "bench_sparse: T must be 1 or 8\n");
    std::abort();
  }
}

// ---- data and checks

// n normal values (deterministic per seed): weights (stddev 0.05) and activations (1).
std::vector<float> random_normal(int64_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}
std::vector<float> random_matrix(int64_t N, int64_t K) { return random_normal(N * K, 42, 0.05f); }
std::vector<float> random_x(int64_t T, int64_t K) { return random_normal(T * K, 7, 1.0f); }

void check_close(const char* what, const std::vector<float>& got, const std::vector<double>& want) {
  double amax = 0.0, err = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    amax = std::max(amax, std::fabs(want[i]));
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  if (!(err <= 1e-5 * amax)) {
    std::fprintf(stderr, "bench_sparse: %s differs: max error %g, max |y| %g\n", what, err, amax);
    std::abort();
  }
}

// Kernel == scalar reference == dense double product of the zeroed matrix.
void check_sparse(ThreadPool& pool, const Sparse24& s, const std::vector<float>& wz, int64_t T) {
  const auto x = random_x(T, s.K);
  std::vector<double> dense(static_cast<size_t>(T * s.N));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < s.N; ++n) {
      double acc = 0.0;
      for (int64_t k = 0; k < s.K; ++k) acc += static_cast<double>(wz[static_cast<size_t>(n * s.K + k)]) * x[t * s.K + k];
      dense[static_cast<size_t>(t * s.N + n)] = acc;
    }
  std::vector<float> ref(dense.size()), got(dense.size());
  sparse24_ref(s, x.data(), ref.data(), T);
  check_close("scalar reference vs dense", ref, dense);
  sparse24_matmul(pool, s, x.data(), got.data(), T);
  check_close("AVX-512 kernel vs dense", got, dense);
}

struct SparseCase {
  std::string format;  // dense_<dtype> or s24_f16 / s24_i8
  int64_t N, K, T;
};

void set_counters(benchmark::State& state, size_t wbytes, int64_t T) {
  state.counters["wGB/s"] = benchmark::Counter(static_cast<double>(wbytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["wbytes"] = static_cast<double>(wbytes);
}

void run_sparse_case(benchmark::State& state, SparseCase c) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512");
    return;
  }
  ThreadPool pool(kThreads);
  auto w = random_matrix(c.N, c.K);
  const auto x = random_x(c.T, c.K);
  std::vector<float> y(static_cast<size_t>(c.T * c.N));
  if (c.format.rfind("s24_", 0) == 0) {
    const Sparse24 s = make_sparse24(w, c.N, c.K, c.format == "s24_i8");
    check_sparse(pool, s, w, c.T);
    for (auto _ : state) {
      sparse24_matmul(pool, s, x.data(), y.data(), c.T);
      benchmark::DoNotOptimize(y.data());
      benchmark::ClobberMemory();
    }
    set_counters(state, s.nbytes(), c.T);
    return;
  }
  // Dense: the same 2:4-zeroed matrix stored as the dtype (time does not depend on values).
  make_sparse24(w, c.N, c.K, false);
  const DType type = *dtype_from_name(c.format.substr(6));
  std::vector<uint8_t> bytes(static_cast<size_t>(c.N) * dtype_row_bytes(type, c.K));
  for (int64_t n = 0; n < c.N; ++n) {
    uint8_t* row = bytes.data() + static_cast<size_t>(n) * dtype_row_bytes(type, c.K);
    const float* src = w.data() + n * c.K;
    if (type == DType::f16 || type == DType::bf16) {
      auto* h = reinterpret_cast<uint16_t*>(row);
      for (int64_t k = 0; k < c.K; ++k) h[k] = type == DType::f16 ? fp32_to_fp16(src[k]) : fp32_to_bf16(src[k]);
    } else if (quantize_ref_supported(type)) {
      quantize_row_ref(type, src, row, c.K);
    } else {  // q4_k: no reference quantizer; random nibbles, small finite f16 scales
      std::mt19937 rng(static_cast<uint32_t>(n));
      const size_t rb = dtype_row_bytes(type, c.K), bb = dtype_traits(type).block_bytes;
      for (size_t i = 0; i < rb; ++i) row[i] = static_cast<uint8_t>(rng());
      for (size_t off = 0; off < rb; off += bb) row[off] = 0x00, row[off + 1] = 0x20, row[off + 2] = 0x00, row[off + 3] = 0x20;
    }
  }
  const Tensor W = make_tensor(bytes.data(), type, {c.N, c.K});
  const PackedWeight pw = PackedWeight::pack(W, &pool);
  MatmulScratch scratch;
  for (auto _ : state) {
    matmul(pool, pw, x.data(), y.data(), c.T, scratch);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, W.nbytes(), c.T);
}

[[maybe_unused]] const int kRegistered = [] {
  struct Shape {
    int64_t N, K;
  };
  // SmolLM2-135M (q/o, gate/up, down), Llama-3.2-1B (q/o, gate/up, down).
  const Shape shapes[] = {{576, 576}, {1536, 576}, {576, 1536}, {2048, 2048}, {8192, 2048}, {2048, 8192}};
  const char* formats[] = {"dense_f16", "dense_bf16", "dense_q8_0", "dense_q4_0", "dense_q4_k", "s24_f16", "s24_i8"};
  for (int64_t T : {1, 8})
    for (const Shape& s : shapes)
      for (const char* f : formats) {
        if (std::string(f) == "dense_q4_k" && s.K % 256 != 0) continue;  // 576: no q4_k
        const std::string name = fmt::format("Sparse/{}/N{}xK{}/T{}/t{}", f, s.N, s.K, T, kThreads);
        benchmark::RegisterBenchmark(name.c_str(), run_sparse_case, SparseCase{f, s.N, s.K, T})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
  return 0;
}();

}  // namespace
}  // namespace loom

// Training attention: packs K and V transposed, plans deterministic work units
// (longest first) and runs the AVX2 or AVX-512 tile kernels over the pool.
#include "kernels/cpu/attention_train.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <queue>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "kernels/cpu/attention_train_tiles.h"
#include "kernels/cpu/ops_backward.h"
#include "kernels/cpu/simd_avx2.h"

namespace loom {
namespace {

using attn::alloc_floats;
using attn::Buffer;
using attn::kBlock;
using attn::Sample;
using attn::Task;
using attn::TaskKind;

void check_packing(const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  LOOM_ASSERT(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0 && s.head_dim > 0);
  LOOM_ASSERT(s.kv_stride >= s.n_kv_heads * s.head_dim);
  if (!seq_start) return;
  for (int64_t t = 0; t < T; ++t) {
    // Samples are contiguous runs of rows: start <= t and starts never go back.
    LOOM_ASSERT(seq_start[t] >= 0 && seq_start[t] <= t);
    LOOM_ASSERT(t == 0 || seq_start[t] >= seq_start[t - 1]);
    LOOM_ASSERT(seq_start[t] == t || seq_start[t] == seq_start[t > 0 ? t - 1 : 0]);
  }
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t blocks(int64_t len) { return (len + kBlock - 1) / kBlock; }

// Samples in row order; each one's keys start at a column that is a multiple of
// the vector width W in the transposed K / V. Returns the total columns.
int64_t find_samples(std::vector<Sample>& out, int64_t T, const int32_t* seq_start, int64_t W) {
  int64_t col = 0;
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    if (seq_start)
      while (e < T && seq_start[e] == t) ++e;
    else
      e = T;
    out.push_back(Sample{t, e - t, col});
    col += round_up(e - t, W);
    t = e;
  }
  return col;
}

// out[j * ldo + i] = in[i * ldi + j] for an 8 x 8 block.
void transpose8x8(const float* in, int64_t ldi, float* out, int64_t ldo) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ldi);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// dst [G][d][ldt]: column samples[s].col + i holds row start + i of kv head g;
// the columns between samples are zero. Works in blocks of W rows (the source
// rows of a block stay in L1), 8 x 8 transposes where whole.
void pack_transposed(ThreadPool& pool, float* dst, const float* src, int64_t ld, int64_t GD,
                     const std::vector<Sample>& samples, int64_t ldt, int64_t W) {
  struct Block {
    int64_t row, col, n;
  };
  std::vector<Block> work;
  int64_t end = 0;
  for (const Sample& smp : samples) {
    for (int64_t i = 0; i < smp.len; i += W) work.push_back({smp.start + i, smp.col + i, std::min(W, smp.len - i)});
    end = smp.col + round_up(smp.len, W);
  }
  for (int64_t r = 0; r < GD; ++r) std::fill(dst + r * ldt + end, dst + (r + 1) * ldt, 0.0f);
  pool.parallel_for(static_cast<int64_t>(work.size()), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Block& blk = work[static_cast<size_t>(b)];
      const float* in = src + blk.row * ld;
      int64_t r = 0;
      if (blk.n == W && W % 8 == 0)
        for (; r + 8 <= GD; r += 8)
          for (int64_t i = 0; i < W; i += 8) transpose8x8(in + i * ld + r, ld, dst + r * ldt + blk.col + i, ldt);
      for (; r < GD; ++r) {
        float* out = dst + r * ldt + blk.col;
        for (int64_t i = 0; i < blk.n; ++i) out[i] = in[i * ld + r];
        for (int64_t i = blk.n; i < W; ++i) out[i] = 0.0f;
      }
    }
  });
}

// Zero-padded copy: dst row t, head h at dst + (t * heads + h) * dp.
void pack_padded(ThreadPool& pool, float* dst, const float* src, int64_t ld, int64_t T, int64_t heads, int64_t d,
                 int64_t dp) {
  pool.parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        float* o = dst + (t * heads + h) * dp;
        std::memcpy(o, src + t * ld + h * d, static_cast<size_t>(d) * sizeof(float));
        std::fill(o + d, o + dp, 0.0f);
      }
  });
}

const attn::TileKernels& kernels_for(AttnIsa isa) {
  if (isa == AttnIsa::avx512) {
    if (!attention_isa_supported(AttnIsa::avx512))
      fail(ErrorKind::unsupported, "attention: AVX-512 kernels requested on a CPU without AVX-512 F/BW/VL/VNNI");
    return attn::tile_kernels_avx512();
  }
  return attn::tile_kernels_avx2();
}

// An operand as the tile kernels read it: the caller's rows when the head
// dimension is a whole number of vectors, else a zero-padded copy kept in `keep`.
attn::Rows prepare_rows(ThreadPool& pool, Buffer& keep, const float* src, int64_t ld, int64_t T, int64_t heads,
                        int64_t d, int64_t dp) {
  if (dp == d) return attn::Rows{src, ld, d};
  keep = alloc_floats(T * heads * dp);
  pack_padded(pool, keep.get(), src, ld, T, heads, d, dp);
  return attn::Rows{keep.get(), heads * dp, dp};
}

void run(ThreadPool& pool, const attn::TileKernels& kern, const attn::Problem& p, const std::vector<Task>& tasks) {
  std::atomic<int64_t> next{0};
  pool.run([&](int, int) { kern.run(p, tasks.data(), static_cast<int64_t>(tasks.size()), next); });
}

// Relative costs of one tile: 5 GEMMs fused, 4 for dk/dv, 3 for dq, plus the
// exponentials (about one GEMM's worth).
constexpr double kFusedTile = 6, kDkdvTile = 5, kDqTile = 4;

struct PlannedTask {
  Task task;
  double cost;
};

// Makespan of handing `tasks` in order to whichever thread is free first (what
// the shared task counter does).
double list_schedule_makespan(const std::vector<PlannedTask>& tasks, int threads) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int i = 0; i < threads; ++i) free_at.push(0.0);
  double end = 0;
  for (const auto& t : tasks) {
    const double start = free_at.top();
    free_at.pop();
    free_at.push(start + t.cost);
    end = std::max(end, start + t.cost);
  }
  return end;
}

void sort_by_cost(std::vector<PlannedTask>& tasks) {
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PlannedTask& a, const PlannedTask& b) { return a.cost > b.cost; });
}

// Backward tasks: the m costliest (sample, kv head) units split, the others fused,
// m from the options or the one with the shortest simulated schedule.
std::vector<Task> plan_backward(const std::vector<Sample>& samples, int64_t G, int64_t group, int threads,
                                int64_t split_units) {
  std::vector<PlannedTask> units;
  for (size_t si = 0; si < samples.size(); ++si) {
    const int64_t nb = blocks(samples[si].len);
    for (int64_t g = 0; g < G; ++g)
      units.push_back({Task{TaskKind::fused, static_cast<int32_t>(si), static_cast<int32_t>(g), 0},
                       kFusedTile * static_cast<double>(group * nb * (nb + 1) / 2)});
  }
  sort_by_cost(units);
  const int64_t n = static_cast<int64_t>(units.size());
  auto tasks_with = [&](int64_t m) {
    std::vector<PlannedTask> tasks;
    for (int64_t u = 0; u < n; ++u) {
      const Task& t = units[static_cast<size_t>(u)].task;
      if (u >= m) {
        tasks.push_back(units[static_cast<size_t>(u)]);
        continue;
      }
      const int64_t nb = blocks(samples[static_cast<size_t>(t.sample)].len);
      for (int64_t b = 0; b < nb; ++b) {
        tasks.push_back({Task{TaskKind::dkdv, t.sample, t.head, static_cast<int32_t>(b)},
                         kDkdvTile * static_cast<double>(group * (nb - b))});
        for (int64_t h = t.head * group; h < (t.head + 1) * group; ++h)
          tasks.push_back({Task{TaskKind::dq, t.sample, static_cast<int32_t>(h), static_cast<int32_t>(b)},
                           kDqTile * static_cast<double>(b + 1)});
      }
    }
    sort_by_cost(tasks);
    return tasks;
  };
  int64_t m = std::min(split_units, n);
  if (split_units < 0) {
    m = 0;
    if (threads > 1) {
      double best = list_schedule_makespan(tasks_with(0), threads);
      // Splitting helps only when a few units dominate: try the costliest few.
      for (int64_t c = 1; c <= std::min<int64_t>(n, 4 * threads); ++c) {
        const double t = list_schedule_makespan(tasks_with(c), threads);
        if (t < best * 0.999) best = t, m = c;
      }
    }
  }
  std::vector<Task> out;
  for (const auto& pt : tasks_with(m)) out.push_back(pt.task);
  return out;
}

// What the forward and the backward share: the tile kernels, the samples, K^T
// per kv head, and the problem's dimensions.
struct Setup {
  const attn::TileKernels* kern = nullptr;
  std::vector<Sample> samples;
  Buffer kt;
  attn::Problem p;
};

Setup setup(ThreadPool& pool, const AttnTrainOptions& opt, const float* k, const AttentionShape& s, int64_t T,
            const int32_t* seq_start) {
  Setup st;
  st.kern = &kernels_for(opt.isa);
  const int width = st.kern->width;
  const int64_t d = s.head_dim, H = s.n_heads, G = s.n_kv_heads;
  const int64_t ldt = round_up(find_samples(st.samples, T, seq_start, width), 16);
  st.kt = alloc_floats(G * d * ldt);
  pack_transposed(pool, st.kt.get(), k, s.kv_stride, G * d, st.samples, ldt, width);
  attn::Problem& p = st.p;
  p.d = d, p.dp = round_up(d, width), p.H = H, p.group = H / G;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.samples = st.samples.data();
  p.kt = st.kt.get(), p.ldt = ldt;
  return st;
}

}  // namespace

namespace attn {
Buffer alloc_floats(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64 * 64;
  auto* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (!p) fail(ErrorKind::internal, "attention: cannot allocate {} bytes of scratch", bytes);
  return Buffer(p);
}
}  // namespace attn

bool attention_isa_supported(AttnIsa isa) {
  return isa == AttnIsa::avx2 || cpu_features().has_avx512_f32();
}

AttnIsa default_attention_isa() {
  return usable_cpu_features().has_avx512_f32() ? AttnIsa::avx512 : AttnIsa::avx2;
}

void attention_forward_train(ThreadPool& pool, const AttnTrainOptions& opt, float* out, float* lse, const float* q,
                             const float* k, const float* v, const AttentionShape& s, int64_t T,
                             const int32_t* seq_start) {
  check_packing(s, T, seq_start);
  if (T <= 0) return;
  Setup st = setup(pool, opt, k, s, T, seq_start);
  const attn::TileKernels& kern = *st.kern;
  const std::vector<Sample>& samples = st.samples;
  attn::Problem& p = st.p;
  const int64_t d = p.d, H = p.H, G = s.n_kv_heads, dp = p.dp;
  Buffer qpad, vpad;
  p.q = prepare_rows(pool, qpad, q, H * d, T, H, d, dp);
  p.v = prepare_rows(pool, vpad, v, s.kv_stride, T, G, d, dp);
  p.out = out, p.lse = lse;

  // One task per (sample, query head, query block); its cost is its key blocks.
  std::vector<PlannedTask> planned;
  for (size_t si = 0; si < samples.size(); ++si) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t b = 0; b < blocks(samples[si].len); ++b)
        planned.push_back({Task{TaskKind::forward, static_cast<int32_t>(si), static_cast<int32_t>(h),
                                static_cast<int32_t>(b)},
                           static_cast<double>(b + 1)});
  }
  sort_by_cost(planned);
  std::vector<Task> tasks;
  for (const auto& pt : planned) tasks.push_back(pt.task);
  run(pool, kern, p, tasks);
}

// With P = softmax(S), S = scale q k^T, O = P V and D = rowsum(dO * O):
//   dS = P * (dO V^T - D);  dq = scale dS k;  dk = scale dS^T q;  dv = P^T dO.
void attention_backward(ThreadPool& pool, const AttnTrainOptions& opt, float* dq, float* dk, float* dv,
                        const float* dout, const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  check_packing(s, T, seq_start);
  if (T <= 0) return;
  Setup st = setup(pool, opt, k, s, T, seq_start);
  const attn::TileKernels& kern = *st.kern;
  const std::vector<Sample>& samples = st.samples;
  attn::Problem& p = st.p;
  const int64_t d = p.d, H = p.H, G = s.n_kv_heads, dp = p.dp, ldt = p.ldt;

  Buffer vt = alloc_floats(G * d * ldt), D = alloc_floats(T * H);
  pack_transposed(pool, vt.get(), v, s.kv_stride, G * d, samples, ldt, kern.width);
  pool.parallel_for(T * H, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) D[u] = simd::dot(dout + u * d, out + u * d, d);
  }, 64);
  Buffer qpad, kpad, dopad;
  p.q = prepare_rows(pool, qpad, q, H * d, T, H, d, dp);
  p.k = prepare_rows(pool, kpad, k, s.kv_stride, T, G, d, dp);
  p.dout = prepare_rows(pool, dopad, dout, H * d, T, H, d, dp);
  p.vt = vt.get();
  p.lse_in = lse, p.D = D.get();
  p.dq = dq, p.dk = dk, p.dv = dv, p.kv_stride = s.kv_stride;
  run(pool, kern, p, plan_backward(samples, G, H / G, pool.size(), opt.split_units));
}

void attention_forward_train(ThreadPool& pool, float* out, float* lse, const float* q, const float* k,
                             const float* v, const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  attention_forward_train(pool, AttnTrainOptions{}, out, lse, q, k, v, s, T, seq_start);
}

void attention_backward(ThreadPool& pool, float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  attention_backward(pool, AttnTrainOptions{}, dq, dk, dv, dout, q, k, v, out, lse, s, T,
                     seq_start);
}

}  // namespace loom

// Training attention: packs K and V transposed, plans deterministic work units
// (longest first) and runs the AVX2 or AVX-512 tile kernels over the pool.
#include "kernels/cpu/attention_train.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "kernels/cpu/attention_train_tiles.h"
#include "kernels/cpu/ops_backward.h"
#include "kernels/cpu/simd_avx2.h"

namespace loom {
namespace {

using attn::kBlock;
using attn::PackBlock;
using attn::PlannedTask;
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
size_t lines(int64_t floats) { return scratch_lines(static_cast<size_t>(floats)); }

// Samples in row order and their columns in the transposed K / V (Sample::col);
// returns ldt, the transposed rows' stride.
int64_t find_samples(std::vector<Sample>& out, int64_t T, const int32_t* seq_start, int64_t W) {
  out.clear();
  int64_t col = 0, last = 0;
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    if (seq_start)
      while (e < T && seq_start[e] == t) ++e;
    else
      e = T;
    const int64_t len = e - t;
    if (len >= W) col = round_up(col, W);
    out.push_back(Sample{t, len, col});
    last = col;
    col += len >= W ? round_up(len, W) : len;
    t = e;
  }
  // A short last sample's tile reads W columns.
  return round_up(std::max(col, last + W), 16);
}

// The most columns find_samples can give T rows: each sample of W rows or more
// costs at most W - 1 columns of rounding and W - 1 of alignment gap before it.
int64_t max_ldt(int64_t T, int64_t W) { return round_up(T + T / W * (2 * W - 2) + W, 16); }

// out[j * ldo + i] = in[i * ldi + j] for an 8 x 8 block.
void transpose8x8(const float* in, int64_t ldi, float* out, int64_t ldo) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ldi);
  simd::transpose8(r);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + i * ldo, r[i]);
}

// Blocks of W rows of each sample; the last one of a sample also covers (and
// zeroes) the columns up to the next sample's first.
void plan_pack_blocks(std::vector<PackBlock>& out, const std::vector<Sample>& samples, int64_t W) {
  out.clear();
  for (size_t si = 0; si < samples.size(); ++si) {
    const Sample& smp = samples[si];
    const int64_t span_end =
        si + 1 < samples.size() ? samples[si + 1].col : smp.col + (smp.len >= W ? round_up(smp.len, W) : smp.len);
    for (int64_t i = 0; i < smp.len; i += W) {
      const int64_t n = std::min(W, smp.len - i);
      out.push_back({smp.start + i, smp.col + i, n, i + W < smp.len ? W : span_end - smp.col - i});
    }
  }
}

// dst [G][d][ldt]: column samples[s].col + i holds row start + i of kv head g;
// the other columns are zero. Works in blocks of W rows (the source rows of a
// block stay in L1), 8 x 8 transposes where whole.
void pack_transposed(ThreadPool& pool, float* dst, const float* src, int64_t ld, int64_t GD,
                     const std::vector<PackBlock>& work, int64_t ldt, int64_t W) {
  const int64_t end = work.empty() ? 0 : work.back().col + work.back().width;
  for (int64_t r = 0; r < GD; ++r) std::fill(dst + r * ldt + end, dst + (r + 1) * ldt, 0.0f);
  pool.parallel_for(static_cast<int64_t>(work.size()), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const PackBlock& blk = work[static_cast<size_t>(b)];
      const float* in = src + blk.row * ld;
      int64_t r = 0;
      if (blk.n == W && blk.width == W && W % 8 == 0)
        for (; r + 8 <= GD; r += 8)
          for (int64_t i = 0; i < W; i += 8) transpose8x8(in + i * ld + r, ld, dst + r * ldt + blk.col + i, ldt);
      for (; r < GD; ++r) {
        float* out = dst + r * ldt + blk.col;
        for (int64_t i = 0; i < blk.n; ++i) out[i] = in[i * ld + r];
        for (int64_t i = blk.n; i < blk.width; ++i) out[i] = 0.0f;
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

// Where a call's floats sit in the scratch (offsets in floats, whole 64-byte
// lines each): K^T, V^T and D (backward), the padded copies (when dp != d) and
// the threads' tile slabs.
struct FloatLayout {
  size_t kt = 0, vt = 0, D = 0, q = 0, k = 0, v = 0, dout = 0, tiles = 0, stride = 0, total = 0;
};

FloatLayout float_layout(const AttentionShape& s, int64_t T, int64_t ldt, int64_t W, int64_t dkdv_rows, int threads,
                         bool backward) {
  const int64_t d = s.head_dim, H = s.n_heads, G = s.n_kv_heads, dp = round_up(d, W);
  FloatLayout L;
  size_t at = 0;
  auto take = [&](int64_t n) {
    const size_t o = at;
    at += lines(n);
    return o;
  };
  L.kt = take(G * d * ldt);
  if (backward) {
    L.vt = take(G * d * ldt);
    L.D = take(T * H);
  }
  if (dp != d) {
    L.q = take(T * H * dp);
    if (backward) {
      L.k = take(T * G * dp);
      L.dout = take(T * H * dp);
    } else {
      L.v = take(T * G * dp);
    }
  }
  L.stride = static_cast<size_t>(attn::tile_floats(dp, W, backward ? dkdv_rows : 0));
  L.tiles = take(static_cast<int64_t>(L.stride) * threads);
  L.total = at;
  return L;
}

// An operand as the tile kernels read it: the caller's rows when the head
// dimension is a whole number of vectors, else a zero-padded copy in `pad`.
attn::Rows prepare_rows(ThreadPool& pool, float* pad, const float* src, int64_t ld, int64_t T, int64_t heads,
                        int64_t d, int64_t dp) {
  if (dp == d) return attn::Rows{src, ld, d};
  pack_padded(pool, pad, src, ld, T, heads, d, dp);
  return attn::Rows{pad, heads * dp, dp};
}

void run(ThreadPool& pool, const attn::TileKernels& kern, const attn::Problem& p, const std::vector<Task>& tasks,
         float* tiles, size_t stride) {
  std::atomic<int64_t> next{0};
  pool.run([&](int ti, int) {
    kern.run(p, tasks.data(), static_cast<int64_t>(tasks.size()), next, tiles + static_cast<size_t>(ti) * stride);
  });
}

// Relative costs of one tile: 5 GEMMs fused, 4 for dk/dv, 3 for dq, plus the
// exponentials (about one GEMM's worth).
constexpr double kFusedTile = 6, kDkdvTile = 5, kDqTile = 4;

// Makespan of handing `tasks` in order to whichever thread is free first (what
// the shared task counter does); `free_at` is a min-heap of the threads' times.
double list_schedule_makespan(const std::vector<PlannedTask>& tasks, int threads, std::vector<double>& free_at) {
  free_at.assign(static_cast<size_t>(threads), 0.0);
  double end = 0;
  for (const auto& t : tasks) {
    std::pop_heap(free_at.begin(), free_at.end(), std::greater<double>());
    const double start = free_at.back();
    free_at.back() = start + t.cost;
    std::push_heap(free_at.begin(), free_at.end(), std::greater<double>());
    end = std::max(end, start + t.cost);
  }
  return end;
}

// By cost, costliest first, ties in the order made (a stable sort, in place).
void sort_by_cost(std::vector<PlannedTask>& tasks) {
  std::sort(tasks.begin(), tasks.end(), [](const PlannedTask& a, const PlannedTask& b) {
    return a.cost > b.cost || (a.cost == b.cost && a.seq < b.seq);
  });
}

void add_task(std::vector<PlannedTask>& out, Task t, double cost) {
  out.push_back({t, cost, static_cast<int64_t>(out.size())});
}

// The backward's tasks with the m costliest units split into dk/dv and dq pieces.
void tasks_with(std::vector<PlannedTask>& tasks, const std::vector<PlannedTask>& units,
                const std::vector<Sample>& samples, int64_t group, int64_t m) {
  tasks.clear();
  const auto n = static_cast<int64_t>(units.size());
  for (int64_t u = 0; u < n; ++u) {
    const Task& t = units[static_cast<size_t>(u)].task;
    if (u >= m) {
      add_task(tasks, t, units[static_cast<size_t>(u)].cost);
      continue;
    }
    const int64_t nb = blocks(samples[static_cast<size_t>(t.sample)].len);
    for (int64_t b = 0; b < nb; ++b) {
      add_task(tasks, Task{TaskKind::dkdv, t.sample, t.head, static_cast<int32_t>(b)},
               kDkdvTile * static_cast<double>(group * (nb - b)));
      for (int64_t h = t.head * group; h < (t.head + 1) * group; ++h)
        add_task(tasks, Task{TaskKind::dq, t.sample, static_cast<int32_t>(h), static_cast<int32_t>(b)},
                 kDqTile * static_cast<double>(b + 1));
    }
  }
  sort_by_cost(tasks);
}

// Backward tasks into sc.tasks: the m costliest (sample, kv head) units split,
// the others fused, m from the options or the one with the shortest simulated schedule.
void plan_backward(AttnTrainScratch& sc, int64_t G, int64_t group, int threads, int64_t split_units) {
  const std::vector<Sample>& samples = sc.samples;
  std::vector<PlannedTask>& units = sc.units;
  units.clear();
  for (size_t si = 0; si < samples.size(); ++si) {
    const int64_t nb = blocks(samples[si].len);
    for (int64_t g = 0; g < G; ++g)
      add_task(units, Task{TaskKind::fused, static_cast<int32_t>(si), static_cast<int32_t>(g), 0},
               kFusedTile * static_cast<double>(group * nb * (nb + 1) / 2));
  }
  sort_by_cost(units);
  const auto n = static_cast<int64_t>(units.size());
  int64_t m = std::min(split_units, n);
  if (split_units < 0) {
    m = 0;
    if (threads > 1) {
      tasks_with(sc.trial, units, samples, group, 0);
      double best = list_schedule_makespan(sc.trial, threads, sc.free_at);
      // Splitting helps only when a few units dominate: try the costliest few.
      for (int64_t c = 1; c <= std::min<int64_t>(n, 4 * threads); ++c) {
        tasks_with(sc.trial, units, samples, group, c);
        const double t = list_schedule_makespan(sc.trial, threads, sc.free_at);
        if (t < best * 0.999) best = t, m = c;
      }
    }
  }
  tasks_with(sc.trial, units, samples, group, m);
  sc.tasks.clear();
  for (const auto& pt : sc.trial) sc.tasks.push_back(pt.task);
}

// Forward tasks: one per (sample, query head, query block), costliest (most key
// blocks) first, ties in (sample, head) order.
void plan_forward(AttnTrainScratch& sc, int64_t H) {
  sc.tasks.clear();
  int64_t most = 0;
  for (const Sample& smp : sc.samples) most = std::max(most, blocks(smp.len));
  for (int64_t b = most - 1; b >= 0; --b)
    for (size_t si = 0; si < sc.samples.size(); ++si) {
      if (b >= blocks(sc.samples[si].len)) continue;
      for (int64_t h = 0; h < H; ++h)
        sc.tasks.push_back(
            Task{TaskKind::forward, static_cast<int32_t>(si), static_cast<int32_t>(h), static_cast<int32_t>(b)});
    }
}

// What the forward and the backward share: the tile kernels, the samples, K^T
// per kv head in the scratch, and the problem's dimensions.
struct Setup {
  const attn::TileKernels* kern = nullptr;
  FloatLayout L;
  float* base = nullptr;
  attn::Problem p;
};

Setup setup(ThreadPool& pool, const AttnTrainOptions& opt, const float* k, const AttentionShape& s, int64_t T,
            const int32_t* seq_start, AttnTrainScratch& sc, bool backward) {
  Setup st;
  st.kern = &kernels_for(opt.isa);
  const int64_t W = st.kern->width;
  const int64_t d = s.head_dim, H = s.n_heads, G = s.n_kv_heads;
  const int64_t ldt = find_samples(sc.samples, T, seq_start, W);
  int64_t longest = 0;
  for (const Sample& smp : sc.samples) longest = std::max(longest, smp.len);
  st.L = float_layout(s, T, ldt, W, blocks(longest) * kBlock, pool.size(), backward);
  st.base = sc.floats.reserve(st.L.total);
  plan_pack_blocks(sc.blocks, sc.samples, W);
  pack_transposed(pool, st.base + st.L.kt, k, s.kv_stride, G * d, sc.blocks, ldt, W);
  attn::Problem& p = st.p;
  p.d = d, p.dp = round_up(d, W), p.H = H, p.group = H / G;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.samples = sc.samples.data();
  p.kt = st.base + st.L.kt, p.ldt = ldt;
  p.dkdv_rows = backward ? blocks(longest) * kBlock : 0;
  return st;
}

}  // namespace

size_t AttnTrainScratch::bytes() const {
  return samples.capacity() * sizeof(Sample) + blocks.capacity() * sizeof(PackBlock) +
         tasks.capacity() * sizeof(Task) + (units.capacity() + trial.capacity()) * sizeof(PlannedTask) +
         free_at.capacity() * sizeof(double) + floats.bytes();
}

size_t AttnTrainScratchSize::bytes() const {
  return samples * sizeof(Sample) + blocks * sizeof(PackBlock) + tasks * sizeof(Task) +
         (units + trial) * sizeof(PlannedTask) + free_at * sizeof(double) + floats * sizeof(float);
}

// The largest of every count over the ways T rows split into samples: at most T
// samples and T pack blocks, H tasks a row in the forward (one-row samples), G
// units a row in the backward, plus the pieces of the (at most 4 x threads)
// units split, each at most blocks(T) blocks of 1 + group pieces.
AttnTrainScratchSize attention_train_scratch_size(const AttentionShape& s, int64_t T, int threads, bool backward,
                                                  AttnIsa isa) {
  AttnTrainScratchSize z;
  if (T <= 0) return z;
  const int64_t W = kernels_for(isa).width, H = s.n_heads, G = s.n_kv_heads, group = H / G;
  z.samples = z.blocks = static_cast<size_t>(T);
  z.tasks = static_cast<size_t>(H * T);
  const int64_t ldt = max_ldt(T, W);
  z.floats = float_layout(s, T, ldt, W, 0, threads, false).total;
  if (backward) {
    z.units = static_cast<size_t>(G * T);
    const int64_t split = threads > 1 ? std::min<int64_t>(G * T, 4 * threads) : 0;
    z.trial = static_cast<size_t>(G * T + split * blocks(T) * (1 + group));
    z.tasks = std::max(z.tasks, z.trial);
    z.free_at = static_cast<size_t>(threads);
    z.floats = std::max(z.floats, float_layout(s, T, ldt, W, blocks(T) * kBlock, threads, true).total);
  }
  return z;
}

void attention_train_reserve(AttnTrainScratch& sc, const AttnTrainScratchSize& z) {
  sc.samples.reserve(z.samples);
  sc.blocks.reserve(z.blocks);
  sc.tasks.reserve(z.tasks);
  sc.units.reserve(z.units);
  sc.trial.reserve(z.trial);
  sc.free_at.reserve(z.free_at);
  sc.floats.reserve(z.floats);
}

void attention_forward_train(ThreadPool& pool, const AttnTrainOptions& opt, float* out, float* lse, const float* q,
                             const float* k, const float* v, const AttentionShape& s, int64_t T,
                             const int32_t* seq_start, AttnTrainScratch& sc) {
  check_packing(s, T, seq_start);
  if (T <= 0) return;
  Setup st = setup(pool, opt, k, s, T, seq_start, sc, false);
  attn::Problem& p = st.p;
  const int64_t d = p.d, H = p.H, G = s.n_kv_heads, dp = p.dp;
  p.q = prepare_rows(pool, st.base + st.L.q, q, H * d, T, H, d, dp);
  p.v = prepare_rows(pool, st.base + st.L.v, v, s.kv_stride, T, G, d, dp);
  p.out = out, p.lse = lse;
  plan_forward(sc, H);
  run(pool, *st.kern, p, sc.tasks, st.base + st.L.tiles, st.L.stride);
}

// With P = softmax(S), S = scale q k^T, O = P V and D = rowsum(dO * O):
//   dS = P * (dO V^T - D);  dq = scale dS k;  dk = scale dS^T q;  dv = P^T dO.
void attention_backward(ThreadPool& pool, const AttnTrainOptions& opt, float* dq, float* dk, float* dv,
                        const float* dout, const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& s, int64_t T, const int32_t* seq_start,
                        AttnTrainScratch& sc) {
  check_packing(s, T, seq_start);
  if (T <= 0) return;
  Setup st = setup(pool, opt, k, s, T, seq_start, sc, true);
  attn::Problem& p = st.p;
  const int64_t d = p.d, H = p.H, G = s.n_kv_heads, dp = p.dp, ldt = p.ldt;
  float* vt = st.base + st.L.vt;
  float* D = st.base + st.L.D;
  pack_transposed(pool, vt, v, s.kv_stride, G * d, sc.blocks, ldt, st.kern->width);
  pool.parallel_for(T * H, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) D[u] = simd::dot(dout + u * d, out + u * d, d);
  }, 64);
  p.q = prepare_rows(pool, st.base + st.L.q, q, H * d, T, H, d, dp);
  p.k = prepare_rows(pool, st.base + st.L.k, k, s.kv_stride, T, G, d, dp);
  p.dout = prepare_rows(pool, st.base + st.L.dout, dout, H * d, T, H, d, dp);
  p.vt = vt;
  p.lse_in = lse, p.D = D;
  p.dq = dq, p.dk = dk, p.dv = dv, p.kv_stride = s.kv_stride;
  plan_backward(sc, G, H / G, pool.size(), opt.split_units);
  run(pool, *st.kern, p, sc.tasks, st.base + st.L.tiles, st.L.stride);
}

void attention_forward_train(ThreadPool& pool, const AttnTrainOptions& opt, float* out, float* lse, const float* q,
                             const float* k, const float* v, const AttentionShape& s, int64_t T,
                             const int32_t* seq_start) {
  AttnTrainScratch sc;
  attention_forward_train(pool, opt, out, lse, q, k, v, s, T, seq_start, sc);
}

void attention_backward(ThreadPool& pool, const AttnTrainOptions& opt, float* dq, float* dk, float* dv,
                        const float* dout, const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  AttnTrainScratch sc;
  attention_backward(pool, opt, dq, dk, dv, dout, q, k, v, out, lse, s, T, seq_start, sc);
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

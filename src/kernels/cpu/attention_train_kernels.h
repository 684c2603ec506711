// Tile kernels of the training attention, written once over a vector-ISA traits
// type V and included by attention_train_avx2.cpp and attention_train_avx512f.cpp.
// Everything sits in an anonymous namespace so each ISA's instantiations stay in
// its own file (no ODR mixing of code built with different flags).
//
// A tile is (query block, key block, query head). Register-tiled GEMMs:
//   gemm_nt:  C[r][:]  = A[r][0..K) . Bt[0..K)[:]   (S = Q K^T, dP = dO V^T; Bt packed K^T / V^T)
//   gemm_acc: C[r][:] += sum_k A(r, k) B[k][:]       (O += P V, dQ += dS K and, with A read
//             transposed, dK += dS^T Q, dV += P^T dO)
// Each output element is one chain of FMAs over k in increasing order, whatever
// the register-tile shape, so results depend only on the tile grid, never on how
// work is split over threads.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <utility>

#include "kernels/cpu/attention_train_tiles.h"

namespace loom::attn {
namespace {  // see above

constexpr int kB = static_cast<int>(kBlock);
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

// 2^f on [-0.5, 0.5], relative error ~2e-9 (fitted, weighted least squares).
constexpr float kExp2C1 = 0.6931471824645996f, kExp2C2 = 0.24022647738456726f, kExp2C3 = 0.055503323674201965f,
                kExp2C4 = 0.00961843691766262f, kExp2C5 = 0.0013398875016719103f,
                kExp2C6 = 0.00015353360504377633f;

// The polynomial of the ISAs' exp2 (Horner, one FMA a term).
template <class V>
inline typename V::reg exp2_poly(typename V::reg f) {
  typename V::reg p = V::set1(kExp2C6);
  p = V::fma(p, f, V::set1(kExp2C5));
  p = V::fma(p, f, V::set1(kExp2C4));
  p = V::fma(p, f, V::set1(kExp2C3));
  p = V::fma(p, f, V::set1(kExp2C2));
  p = V::fma(p, f, V::set1(kExp2C1));
  return V::fma(p, f, V::set1(1.0f));
}

// C[r][0, NV*W) = sum_{k < K} a[r*lda + k] * bt[k*ldb + .], C rows kB apart.
template <class V, int R, int NV>
void gemm_nt(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t K, float* c) {
  using reg = typename V::reg;
  reg acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[r][j] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    reg b[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) b[j] = V::load(bt + k * ldb + j * V::W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const reg x = V::bcast(a + r * lda + k);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(x, b[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) V::store(c + r * kB + j * V::W, acc[r][j]);
}

// C[r*ldc + .] += sum_{k in [k0, k1)} a[r*RS + k*CS] * b[k*ldb + .]
template <class V, int R, int NV, int RS, int CS>
void gemm_acc(const float* a, const float* b, int64_t ldb, int64_t k0, int64_t k1, float* c, int64_t ldc) {
  using reg = typename V::reg;
  reg acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[r][j] = V::load(c + r * ldc + j * V::W);
  for (int64_t k = k0; k < k1; ++k) {
    reg bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = V::load(b + k * ldb + j * V::W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const reg x = V::bcast(a + r * RS + k * CS);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(x, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) V::store(c + r * ldc + j * V::W, acc[r][j]);
}

using NtFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);
using AccFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*, int64_t);

// Kernel tables indexed [(R - 1) * NMAX + (NV - 1)].
template <class V, size_t... I>
constexpr std::array<NtFn, sizeof...(I)> nt_table(std::index_sequence<I...>) {
  return {&gemm_nt<V, static_cast<int>(I) / V::NA + 1, static_cast<int>(I) % V::NA + 1>...};
}
template <class V, int RS, int CS, size_t... I>
constexpr std::array<AccFn, sizeof...(I)> acc_table(std::index_sequence<I...>) {
  return {&gemm_acc<V, static_cast<int>(I) / V::NB + 1, static_cast<int>(I) % V::NB + 1, RS, CS>...};
}

template <class V>
struct Tables {
  static constexpr auto nt = nt_table<V>(std::make_index_sequence<V::RA * V::NA>{});
  static constexpr auto rows = acc_table<V, kB, 1>(std::make_index_sequence<V::RB * V::NB>{});
  static constexpr auto cols = acc_table<V, 1, kB>(std::make_index_sequence<V::RB * V::NB>{});
};

// C[i][:] (rows kB apart) = A rows . Bt for i < nq, over the keys each row needs:
// all kB, or on the diagonal tile keys <= i (rounded up to whole vectors).
template <class V>
void tile_nt(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t K, float* c, int64_t nq, bool diag) {
  for (int64_t r0 = 0; r0 < nq; r0 += V::RA) {
    const int R = static_cast<int>(std::min<int64_t>(V::RA, nq - r0));
    const int64_t cols = diag ? r0 + R : kB;
    const int nvec = static_cast<int>((cols + V::W - 1) / V::W);
    for (int j0 = 0; j0 < nvec; j0 += V::NA) {
      const int nv = std::min(V::NA, nvec - j0);
      Tables<V>::nt[(R - 1) * V::NA + nv - 1](a + r0 * lda, lda, bt + j0 * V::W, ldb, K, c + r0 * kB + j0 * V::W);
    }
  }
}

// Column chunks of dp/W vectors: whole NB-vector chunks, then the rest.
template <class V, class F>
void for_column_chunks(int64_t dp, F&& f) {
  const int nvec = static_cast<int>(dp / V::W);
  for (int j0 = 0; j0 < nvec; j0 += V::NB) f(j0 * V::W, std::min(V::NB, nvec - j0));
}

// C[i][:] += sum_j A[i][j] B[j][:] over the tile's valid (i, j): rows are queries.
template <class V>
void tile_acc_rows(const float* a, const float* b, int64_t ldb, int64_t nq, int64_t nk, bool diag, float* c,
                   int64_t ldc, int64_t dp) {
  for (int64_t r0 = 0; r0 < nq; r0 += V::RB) {
    const int R = static_cast<int>(std::min<int64_t>(V::RB, nq - r0));
    const int64_t k1 = diag ? r0 + R : nk;
    for_column_chunks<V>(dp, [&](int64_t col, int nv) {
      Tables<V>::rows[(R - 1) * V::NB + nv - 1](a + r0 * kB, b + col, ldb, 0, k1, c + r0 * ldc + col, ldc);
    });
  }
}

// C[j][:] += sum_i A[i][j] B[i][:] over the tile's valid (i, j): rows are keys.
template <class V>
void tile_acc_cols(const float* a, const float* b, int64_t ldb, int64_t nq, int64_t nk, bool diag, float* c,
                   int64_t ldc, int64_t dp) {
  for (int64_t j0 = 0; j0 < nk; j0 += V::RB) {
    const int R = static_cast<int>(std::min<int64_t>(V::RB, nk - j0));
    const int64_t k0 = diag ? j0 : 0;
    for_column_chunks<V>(dp, [&](int64_t col, int nv) {
      Tables<V>::cols[(R - 1) * V::NB + nv - 1](a + j0, b + col, ldb, k0, nq, c + j0 * ldc + col, ldc);
    });
  }
}

// Keys of row i a tile lets through.
inline int64_t valid_keys(int64_t i, int64_t nk, bool diag) { return diag ? i + 1 : nk; }

// The forward's running max moves only when a row's scores exceed it by more than
// this (log2 units): probabilities stay below 2^kLazyMax, and most tiles skip the
// max reduction and the rescaling of the output rows.
constexpr float kLazyMax = 8.0f;

// Forward online-softmax step over one tile. s: raw scores in, probabilities
// 2^(s c - m) (zero where masked) out; the running max m (log2 units), the
// per-lane row sums lv (W floats a row) and the output rows o are updated.
template <class V>
void softmax_step(float* s, int64_t nq, int64_t nk, bool diag, float c, float* m, float* lv, float* o, int64_t dp) {
  using reg = typename V::reg;
  constexpr int nvec_all = kB / V::W;
  const reg vc = V::set1(c);
  const float inv_c = 1.0f / c;
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * kB;
    const int64_t nvalid = valid_keys(i, nk, diag);
    const int nvec = static_cast<int>((nvalid + V::W - 1) / V::W);
    reg mx = V::set1(-INFINITY);
    for (int j = 0; j < nvec; ++j)
      mx = V::max(mx, V::keep_first(V::load(row + j * V::W), static_cast<int>(nvalid - j * V::W), -INFINITY));
    if (V::any_greater(mx, (m[i] + kLazyMax) * inv_c)) {  // always on the first tile (m = -inf)
      const float m_new = V::hmax(mx) * c;                // c > 0: the max commutes with the scaling
      const reg va = V::set1(std::exp2(m[i] - m_new));
      V::store(lv + i * V::W, V::mul(V::load(lv + i * V::W), va));
      float* orow = o + i * dp;
      for (int64_t col = 0; col < dp; col += V::W) V::store(orow + col, V::mul(V::load(orow + col), va));
      m[i] = m_new;
    }
    const reg vm = V::set1(m[i]);
    reg sum = V::load(lv + i * V::W);
    for (int j = 0; j < nvec; ++j) {
      reg p = V::exp2(V::fmsub(V::load(row + j * V::W), vc, vm));
      p = V::keep_first(p, static_cast<int>(nvalid - j * V::W), 0.0f);
      V::store(row + j * V::W, p);
      sum = V::add(sum, p);
    }
    V::store(lv + i * V::W, sum);
    for (int j = nvec; j < nvec_all; ++j) V::store(row + j * V::W, V::zero());
  }
}

// Backward elementwise step over one tile: s holds raw scores in and P out; g
// holds dP = dO V^T in and scale * dS = scale * P * (dP - D) out (zero where masked).
// lse and D are read at stride ld (their [T, H] layout).
template <class V>
void grad_step(float* s, float* g, int64_t nq, int64_t nk, bool diag, float c, float scale, const float* lse,
               const float* D, int64_t ld) {
  using reg = typename V::reg;
  constexpr int nvec_all = kB / V::W;
  const reg vc = V::set1(c), vs = V::set1(scale);
  for (int64_t i = 0; i < nq; ++i) {
    float* srow = s + i * kB;
    float* grow = g + i * kB;
    const int64_t nvalid = valid_keys(i, nk, diag);
    const int nvec = static_cast<int>((nvalid + V::W - 1) / V::W);
    const reg vl = V::set1(lse[i * ld] * kLog2e), vd = V::set1(D[i * ld]);
    for (int j = 0; j < nvec; ++j) {
      reg p = V::exp2(V::fmsub(V::load(srow + j * V::W), vc, vl));
      p = V::keep_first(p, static_cast<int>(nvalid - j * V::W), 0.0f);
      V::store(srow + j * V::W, p);
      V::store(grow + j * V::W, V::mul(V::mul(p, V::sub(V::load(grow + j * V::W), vd)), vs));
    }
    for (int j = nvec; j < nvec_all; ++j) {
      V::store(srow + j * V::W, V::zero());
      V::store(grow + j * V::W, V::zero());
    }
  }
}

// dst[i * ld_dst + c] += src[i * dp + c] for c < d.
template <class V>
void add_rows(float* dst, int64_t ld_dst, const float* src, int64_t dp, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    float* o = dst + i * ld_dst;
    const float* x = src + i * dp;
    int64_t c = 0;
    for (; c + V::W <= d; c += V::W) V::store(o + c, V::add(V::load(o + c), V::load(x + c)));
    for (; c < d; ++c) o[c] += x[c];
  }
}

// One thread's scratch, carved out of its slab of tile_floats(dp, W, dkdv_rows):
// score and gradient tiles, a dp-wide row tile (forward O or a dq tile), per-lane
// row sums and dk/dv accumulators (a key block, or a whole sample when fused).
template <class V>
struct Workspace {
  float *s, *g, *rowt, *lv, *dk, *dv;
  int64_t dkdv_rows;
  float m[kB];

  Workspace(float* slab, int64_t dp, int64_t rows) : dkdv_rows(rows) {
    auto take = [&](int64_t n) {
      float* p = slab;
      slab += (n + 15) / 16 * 16;
      return p;
    };
    s = take(kBlock * kBlock);
    g = take(kBlock * kBlock);
    rowt = take(kBlock * dp);
    lv = take(kBlock * V::W);
    dk = take(rows * dp);
    dv = take(rows * dp);
  }
};

struct TileAt {
  const Sample* smp;
  int64_t qb, kb;
  int64_t qs() const { return smp->start + qb * kBlock; }
  int64_t ks() const { return smp->start + kb * kBlock; }
  int64_t nq() const { return std::min(kBlock, smp->len - qb * kBlock); }
  int64_t nk() const { return std::min(kBlock, smp->len - kb * kBlock); }
  bool diag() const { return qb == kb; }
};

template <class V>
void forward_task(const Problem& p, Workspace<V>& ws, const Task& t) {
  const Sample& smp = p.samples[t.sample];
  const int64_t h = t.head, g = h / p.group, d = p.d, dp = p.dp, qb = t.block;
  const float c = p.scale * kLog2e;
  const TileAt t0{&smp, qb, qb};
  const int64_t qs = t0.qs(), nq = t0.nq();
  float* o = ws.rowt;
  std::fill(o, o + nq * dp, 0.0f);
  std::fill(ws.m, ws.m + kB, -INFINITY);
  std::fill(ws.lv, ws.lv + kB * V::W, 0.0f);
  const float* kt = p.kt + g * d * p.ldt + smp.col;
  for (int64_t kb = 0; kb <= qb; ++kb) {
    const TileAt ta{&smp, qb, kb};
    tile_nt<V>(p.q.at(qs, h), p.q.ld, kt + kb * kBlock, p.ldt, d, ws.s, nq, ta.diag());
    softmax_step<V>(ws.s, nq, ta.nk(), ta.diag(), c, ws.m, ws.lv, o, dp);
    tile_acc_rows<V>(ws.s, p.v.at(ta.ks(), g), p.v.ld, nq, ta.nk(), ta.diag(), o, dp, dp);
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t row = qs + i;
    const float l = V::hsum(V::load(ws.lv + i * V::W));
    const float inv = 1.0f / l;
    float* dst = p.out + row * p.H * d + h * d;
    for (int64_t col = 0; col < d; ++col) dst[col] = o[i * dp + col] * inv;
    p.lse[row * p.H + h] = (ws.m[i] + std::log2(l)) * kLn2;
  }
}

// One backward tile of query head h: recomputes P and scale*dS, then adds dS K
// to dq_t (query rows of the tile, dp apart) and dS^T Q, P^T dO to dk_t, dv_t
// (key rows of the tile). Null targets are skipped.
template <class V>
void backward_tile(const Problem& p, Workspace<V>& ws, const TileAt& ta, int64_t h, float* dq_t, float* dk_t,
                   float* dv_t) {
  const Sample& smp = *ta.smp;
  const int64_t g = h / p.group, d = p.d, dp = p.dp, qs = ta.qs(), ks = ta.ks(), nq = ta.nq(), nk = ta.nk();
  const bool diag = ta.diag();
  const int64_t tcol = g * d * p.ldt + smp.col + ta.kb * kBlock;
  float* s = ws.s;
  float* gr = ws.g;
  tile_nt<V>(p.q.at(qs, h), p.q.ld, p.kt + tcol, p.ldt, d, s, nq, diag);
  tile_nt<V>(p.dout.at(qs, h), p.dout.ld, p.vt + tcol, p.ldt, d, gr, nq, diag);
  grad_step<V>(s, gr, nq, nk, diag, p.scale * kLog2e, p.scale, p.lse_in + qs * p.H + h, p.D + qs * p.H + h, p.H);
  if (dq_t) tile_acc_rows<V>(gr, p.k.at(ks, g), p.k.ld, nq, nk, diag, dq_t, dp, dp);
  if (dk_t) {
    tile_acc_cols<V>(gr, p.q.at(qs, h), p.q.ld, nq, nk, diag, dk_t, dp, dp);
    tile_acc_cols<V>(s, p.dout.at(qs, h), p.dout.ld, nq, nk, diag, dv_t, dp, dp);
  }
}

// dk/dv accumulate per key element over (query head of the group, query block)
// in that order, and dq per element over key blocks in increasing order, in both
// the fused and the split tasks: that is what makes them bit-identical.
template <class V>
void backward_fused(const Problem& p, Workspace<V>& ws, const Task& t) {
  const Sample& smp = p.samples[t.sample];
  const int64_t g = t.head, dp = p.dp, nb = (smp.len + kBlock - 1) / kBlock;
  // nb * kBlock <= ws.dkdv_rows: the driver sizes the slab for the longest sample.
  std::fill(ws.dk, ws.dk + smp.len * dp, 0.0f);
  std::fill(ws.dv, ws.dv + smp.len * dp, 0.0f);
  float* dq_t = ws.rowt;
  for (int64_t h = g * p.group; h < (g + 1) * p.group; ++h)
    for (int64_t qb = 0; qb < nb; ++qb) {
      const TileAt t0{&smp, qb, qb};
      std::fill(dq_t, dq_t + t0.nq() * dp, 0.0f);
      for (int64_t kb = 0; kb <= qb; ++kb)
        backward_tile<V>(p, ws, TileAt{&smp, qb, kb}, h, dq_t, ws.dk + kb * kBlock * dp,
                         ws.dv + kb * kBlock * dp);
      add_rows<V>(p.dq + t0.qs() * p.H * p.d + h * p.d, p.H * p.d, dq_t, dp, t0.nq(), p.d);
    }
  add_rows<V>(p.dk + smp.start * p.kv_stride + g * p.d, p.kv_stride, ws.dk, dp, smp.len, p.d);
  add_rows<V>(p.dv + smp.start * p.kv_stride + g * p.d, p.kv_stride, ws.dv, dp, smp.len, p.d);
}

template <class V>
void backward_dkdv(const Problem& p, Workspace<V>& ws, const Task& t) {
  const Sample& smp = p.samples[t.sample];
  const int64_t g = t.head, dp = p.dp, kb = t.block, nb = (smp.len + kBlock - 1) / kBlock;
  const TileAt t0{&smp, kb, kb};
  std::fill(ws.dk, ws.dk + t0.nk() * dp, 0.0f);
  std::fill(ws.dv, ws.dv + t0.nk() * dp, 0.0f);
  for (int64_t h = g * p.group; h < (g + 1) * p.group; ++h)
    for (int64_t qb = kb; qb < nb; ++qb)
      backward_tile<V>(p, ws, TileAt{&smp, qb, kb}, h, nullptr, ws.dk, ws.dv);
  add_rows<V>(p.dk + t0.ks() * p.kv_stride + g * p.d, p.kv_stride, ws.dk, dp, t0.nk(), p.d);
  add_rows<V>(p.dv + t0.ks() * p.kv_stride + g * p.d, p.kv_stride, ws.dv, dp, t0.nk(), p.d);
}

template <class V>
void backward_dq(const Problem& p, Workspace<V>& ws, const Task& t) {
  const Sample& smp = p.samples[t.sample];
  const int64_t h = t.head, dp = p.dp, qb = t.block;
  const TileAt t0{&smp, qb, qb};
  float* dq_t = ws.rowt;
  std::fill(dq_t, dq_t + t0.nq() * dp, 0.0f);
  for (int64_t kb = 0; kb <= qb; ++kb) backward_tile<V>(p, ws, TileAt{&smp, qb, kb}, h, dq_t, nullptr, nullptr);
  add_rows<V>(p.dq + t0.qs() * p.H * p.d + h * p.d, p.H * p.d, dq_t, dp, t0.nq(), p.d);
}

template <class V>
void run_tasks(const Problem& p, const Task* tasks, int64_t n_tasks, std::atomic<int64_t>& next, float* tiles) {
  Workspace<V> ws(tiles, p.dp, p.dkdv_rows);
  for (;;) {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_tasks) return;
    const Task& t = tasks[i];
    switch (t.kind) {
      case TaskKind::forward:
        forward_task<V>(p, ws, t);
        break;
      case TaskKind::fused:
        backward_fused<V>(p, ws, t);
        break;
      case TaskKind::dkdv:
        backward_dkdv<V>(p, ws, t);
        break;
      case TaskKind::dq:
        backward_dq<V>(p, ws, t);
        break;
    }
  }
}

}  // namespace
}  // namespace loom::attn

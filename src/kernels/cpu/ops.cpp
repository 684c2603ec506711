#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/attention_train.h"
#include "kernels/cpu/lane_sums.h"
#include "kernels/cpu/simd_avx2.h"

namespace loom {

void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * n;
    float* o = out + t * n;
    const float ss = simd::dot(xr, xr, n);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), _mm256_loadu_ps(w + i)));
    for (; i < n; ++i) o[i] = xr[i] * inv * w[i];
  }
}

void swiglu(float* out, const float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::exp_ps(_mm256_xor_ps(g, sign));  // exp(-g)
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add_inplace(float* y, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] += x[i];
}

void rope_rotate(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos, float direction) {
  const int64_t d = rope.head_dim, half = d / 2;
  std::vector<float> cs(static_cast<size_t>(d));  // cos | sin per pair
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      // angle in double: positions up to 1e5+ times small frequencies lose bits in float
      const double a = static_cast<double>(pos[t]) * rope.inv_freq[static_cast<size_t>(i)];
      cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(a));
      cs[static_cast<size_t>(half + i)] = direction * static_cast<float>(std::sin(a));
    }
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i0 = rope.interleaved ? 2 * i : i;
        const int64_t i1 = rope.interleaved ? 2 * i + 1 : i + half;
        const float c = cs[static_cast<size_t>(i)], s = cs[static_cast<size_t>(half + i)];
        const float x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * c - x1 * s;
        v[i1] = x0 * s + x1 * c;
      }
    }
  }
}

void rope_apply(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos) {
  rope_rotate(rope, x, T, n_heads, pos, 1.0f);
}

namespace {

// scores[p] = dot(q, k_p) * scale for 4 keys a stride apart, each exactly as
// simd::dot computes it (two accumulators over 16-wide steps of d, then hsum):
// one pass over q for four keys instead of four. d must be a multiple of 16.
// Keys (here and below, E) are f32 or f16 bits, widened exactly as loaded.
// The keys are rows p .. p + 3 of k (cpu::Strided or cpu::Gathered).
template <class Rows>
inline void dot4(const float* q, const Rows& k, int64_t p, int64_t d, float scale, float* scores) {
  __m256 a0[4], a1[4];
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
    for (int j = 0; j < 4; ++j) {
      a0[j] = _mm256_fmadd_ps(q0, simd::load8(k(p + j) + i), a0[j]);
      a1[j] = _mm256_fmadd_ps(q1, simd::load8(k(p + j) + i + 8), a1[j]);
    }
  }
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = _mm256_add_ps(a0[j], a1[j]);
  float sums[4];
  cpu::hsum4(v, sums);
  for (int j = 0; j < 4; ++j) scores[j] = sums[j] * scale;
}

// dot4 for R (2 or 3) heads of a GQA group at once (q: R consecutive heads'
// rows, d apart; scores[r * ss + j]): each K line is loaded once for the R
// heads, where R dot4 calls loaded it R times and the loop was bound by its
// loads (10 loads per 8 FMAs; here 10 per 12 with R = 3, 8 per 8 with R = 2).
// Keys two at a time (4 R chains in registers), each (head, key) the same
// chains and tree as dot4.
template <int R, class Rows>
inline void dot4_heads(const float* q, const Rows& k, int64_t p, int64_t d, float scale, float* scores,
                       int64_t ss) {
  __m256 v[R][4];
  for (int j0 = 0; j0 < 4; j0 += 2) {
    __m256 a0[R][2], a1[R][2];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j) a0[r][j] = a1[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16)
      for (int j = 0; j < 2; ++j) {
        const __m256 k0 = simd::load8(k(p + j0 + j) + i);
        const __m256 k1 = simd::load8(k(p + j0 + j) + i + 8);
        for (int r = 0; r < R; ++r) {
          a0[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + i), k0, a0[r][j]);
          a1[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + i + 8), k1, a1[r][j]);
        }
      }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j) v[r][j0 + j] = _mm256_add_ps(a0[r][j], a1[r][j]);
  }
  for (int r = 0; r < R; ++r) {
    float sums[4];
    cpu::hsum4(v[r], sums);
    for (int j = 0; j < 4; ++j) scores[r * ss + j] = sums[j] * scale;
  }
}

// o = sum_j (w_j * inv) v_j for d = 8 * N, the running sum kept in registers:
// per element the same fused multiply-adds, in the same order, as zeroing o
// and calling simd::axpy for every j.
template <int N, class Rows>
void weighted_sum(float* o, const float* w, float inv, const Rows& v, int64_t n) {
  __m256 acc[N];
  for (int c = 0; c < N; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 a = _mm256_set1_ps(w[j] * inv);
    const auto* vj = v(j);
    for (int c = 0; c < N; ++c) acc[c] = _mm256_fmadd_ps(a, simd::load8(vj + 8 * c), acc[c]);
  }
  for (int c = 0; c < N; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
}

// Replaces scores w[0, n) by exp(w - max) and returns their sum; the max goes
// to *max_out.
float softmax_exp(float* w, int64_t n, float* max_out) {
  // The maximum 8 lanes at a time (a scalar max chain cost ~3 cycles a key); any
  // order gives the same value, so the bits stay the AVX-512 path's.
  __m256 vmx = _mm256_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(w + p));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmx);
  float mx = lanes[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
  for (; p < n; ++p) mx = std::max(mx, w[p]);
  vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  p = 0;
  for (; p + 8 <= n; p += 8) {
    const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(w + p), vmx));
    _mm256_storeu_ps(w + p, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = simd::hsum(vsum);
  for (; p < n; ++p) {
    w[p] = std::exp(w[p] - mx);
    sum += w[p];
  }
  *max_out = mx;
  return sum;
}

// softmax_exp, returning 1 / the sum.
float softmax_weights(float* w, int64_t n) {
  float mx;
  return 1.0f / softmax_exp(w, n, &mx);
}

// Replaces scores w[0, n) by their softmax probabilities, w[j] * (1 / sum), in
// steps of 8 (w has room to a multiple of 8): the weights the multi-row
// weighted sums (weighted_sum_rows) take.
void softmax_in_place(float* w, int64_t n) {
  const __m256 inv = _mm256_set1_ps(softmax_weights(w, n));
  for (int64_t p = 0; p < n; p += 8) _mm256_storeu_ps(w + p, _mm256_mul_ps(_mm256_loadu_ps(w + p), inv));
}

// o = sum_j (w_j * inv) v_j over j < n, one row of any head_dim.
template <class Rows>
void weighted_sum_row(float* o, const float* w, float inv, const Rows& v, int64_t d, int64_t n) {
  switch (d) {
    case 64:
      return weighted_sum<8>(o, w, inv, v, n);
    case 128:
      return weighted_sum<16>(o, w, inv, v, n);
    case 32:
      return weighted_sum<4>(o, w, inv, v, n);
    default: break;
  }
  std::fill(o, o + d, 0.0f);
  for (int64_t j = 0; j < n; ++j) simd::axpy(o, w[j] * inv, v(j), d);
}

// Scores in w[0, n) to o: softmax, then the weighted sum of V.
template <class Rows>
void softmax_and_sum(float* w, const Rows& v, int64_t d, int64_t n, float* o) {
  weighted_sum_row(o, w, softmax_weights(w, n), v, d, n);
}

// One query row of one head: softmax(q K^T * scale) V over keys [0, n).
template <typename E>
void attend_row(const float* qv, const E* kb, const E* vb, int64_t stride, int64_t d, int64_t n, float scale,
                float* w, float* o) {
  int64_t p = 0;
  if (d % 16 == 0)
    for (; p + 4 <= n; p += 4) dot4(qv, cpu::Strided<E>{kb, stride}, p, d, scale, w + p);
  for (; p < n; ++p) w[p] = simd::dot(qv, kb + p * stride, d) * scale;
  softmax_and_sum(w, cpu::Strided<E>{vb, stride}, d, n, o);
}

// Keys per chunk of the AVX2 scores: the chunk's lane sums (8 per row and key,
// 16 KiB for two rows) stay in L1 between their two passes.
constexpr int64_t kScoreChunk = 256;

// Lane l's sum of dot4's two chains, v_l = a_l + a_{l+8} (a_j chaining q[i + j] *
// k[i + j] over i = 0, 16, .. in order), for R rows and the keys of nb blocks of
// 8 across the lanes: s[r * ss + key]. Chain by chain, with the row's q elements in
// registers for every block and each of the M rows of K^T read in order: the per
// block kernel before it broadcast q once per FMA and walked all d rows of K^T at
// once, and ran at ~40 GFLOP/s (AMD Zen 4).
template <int R, int M>
void lane_pair_sums(const float* q, const float* kt, int64_t ldk, int l, int64_t nb, float* s, int64_t ss) {
  constexpr int d = 16 * M;
  for (int half = 0; half < 2; ++half) {
    __m256 qv[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) qv[r][m] = _mm256_set1_ps(q[r * d + 16 * m + 8 * half + l]);
    const float* k0 = kt + (8 * half + l) * ldk;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int m = 0; m < M; ++m) {
        const __m256 kv = _mm256_loadu_ps(k0 + 16 * m * ldk + 8 * b);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(qv[r][m], kv, acc[r]);
      }
      for (int r = 0; r < R; ++r) {
        float* sr = s + r * ss + 8 * b;
        _mm256_storeu_ps(sr, half == 0 ? acc[r] : _mm256_add_ps(_mm256_loadu_ps(sr), acc[r]));
      }
    }
  }
}

// Scores of R rows for the keys [0, 8 nb) of a chunk from K^T (kt at the chunk's
// first key): the lane sums, then simd::hsum's tree ((v0 + v4) + (v2 + v6)) +
// ((v1 + v5) + (v3 + v7)) times the scale -- dot4's products, chains and tree.
template <int R, int M>
void scores_kt8(const float* q, const float* kt, int64_t ldk, float scale, int64_t nb, float* w, int64_t ws) {
  alignas(32) float lanes[8][R][kScoreChunk];
  for (int l = 0; l < 8; ++l) lane_pair_sums<R, M>(q, kt, ldk, l, nb, &lanes[l][0][0], kScoreChunk);
  const __m256 sc = _mm256_set1_ps(scale);
  const auto v = [&](int l, int r, int64_t b) { return _mm256_load_ps(&lanes[l][r][8 * b]); };
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 x =
          _mm256_add_ps(_mm256_add_ps(v(0, r, b), v(4, r, b)), _mm256_add_ps(v(2, r, b), v(6, r, b)));
      const __m256 y =
          _mm256_add_ps(_mm256_add_ps(v(1, r, b), v(5, r, b)), _mm256_add_ps(v(3, r, b), v(7, r, b)));
      _mm256_storeu_ps(w + r * ws + 8 * b, _mm256_mul_ps(_mm256_add_ps(x, y), sc));
    }
}

// All keys [0, n) of rows [r0, r0 + R), chunk by chunk.
template <int R, int M>
void scores_rows_kt8(const float* q, const float* kt, int64_t ldk, float scale, int64_t n, float* w,
                     int64_t ws) {
  for (int64_t c0 = 0; c0 < n; c0 += kScoreChunk) {
    const int64_t nb = (std::min(kScoreChunk, n - c0) + 7) / 8;
    scores_kt8<R, M>(q, kt + c0, ldk, scale, nb, w + c0, ws);
  }
}

// K/V rows ahead that a long decode row prefetches (decode_attention_keys_split).
constexpr int64_t kPrefetchRows = cpu::kDecodePrefetchRows;

// o[r][c0 .. c0 + 8 C) = sum_j a[r][j] v_j, for R rows of a group: one FMA
// chain per lane in j order, as weighted_sum and simd::axpy form them, with
// a[r][j] = w[r][j] * inv[r] already in a. Each V line is read once for the R
// rows: per row from L2 it cost more than the FMAs did. kPrefetch: V comes from
// memory (a long decode row), its lines are prefetched kPrefetchRows ahead.
template <int R, int C, bool kPrefetch = false, class Rows>
void weighted_sum_rows(const float* a, int64_t ws, const Rows& v, int64_t n, float* o, int64_t d,
                       int64_t c0) {
  using E = typename Rows::Elem;
  if (n <= 0) __builtin_unreachable();  // rows see their own key; lets GCC keep acc in registers
  __m256 acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const E* vj = v(j) + c0;
    if constexpr (kPrefetch)  // one request per 64 bytes of the row's columns (strided rows)
      for (int c = 0; c < C; c += 8 / static_cast<int>(sizeof(E)))
        __builtin_prefetch(v(j + kPrefetchRows) + c0 + 8 * c, 0, 3);
    __m256 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = simd::load8(vj + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 aj = _mm256_broadcast_ss(a + r * ws + j);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm256_fmadd_ps(aj, vv[c], acc[r * C + c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + r * d + c0 + 8 * c, acc[r * C + c]);
}

// Up to 4 rows: 8 C accumulators per row in sixteen registers, wider columns
// for fewer rows (independent chains: each is one FMA chain in j order, so the
// chains' count bounds the rate by the FMA's latency). Three rows take 3
// columns of 8 (9 chains; 2 columns left an AMD Zen 2's FMAs waiting on their
// 5-cycle latency): SmolLM2's prefill attention 1.05x there. Columns [c0, c1).
template <int R, bool kPrefetch = false, class Rows>
void weighted_sums(const float* a, int64_t ws, const Rows& v, int64_t n, float* o, int64_t d, int64_t c0,
                   int64_t c1) {
  constexpr int C = R == 1 ? 8 : R == 2 ? 4 : R == 3 ? 3 : 2;
  for (; c0 + 8 * C <= c1; c0 += 8 * C) weighted_sum_rows<R, C, kPrefetch>(a, ws, v, n, o, d, c0);
  for (; c0 + 16 <= c1; c0 += 16) weighted_sum_rows<R, 2, kPrefetch>(a, ws, v, n, o, d, c0);
  for (; c0 < c1; c0 += 8) weighted_sum_rows<R, 1, kPrefetch>(a, ws, v, n, o, d, c0);  // d: a multiple of 8
}

// Scores of R heads in w (rows ws apart) to a paged row's outputs: normalized
// (m == nullptr), or a segment's unnormalized sums with each head's max and sum
// of exponentials; V read once for the R heads.
template <int R, class Rows>
void finish_paged(float* w, int64_t ws, const Rows& v, int64_t d, int64_t n, float* o, float* m, float* l) {
  for (int r = 0; r < R; ++r) {
    if (m == nullptr)
      softmax_in_place(w + r * ws, n);
    else
      l[r] = softmax_exp(w + r * ws, n, &m[r]);
  }
  weighted_sums<R>(w, ws, v, n, o, d, 0, d);
}

template <int M>
void attend_rows_kt8(const float* q, int rows, const float* kt, int64_t ldk, const float* vb, int64_t stride,
                     int64_t n, float scale, float* w, int64_t ws, float* o) {
  constexpr int d = 16 * M;
  constexpr int kRows = M <= 4 ? 2 : 1;  // rows per pass: R M q registers of sixteen
  int r = 0;
  // A GQA group of 3 (SmolLM2) in one pass: each K^T line then serves 3 rows,
  // where the pass of 1 after one of 2 was bound by its loads. 12 q registers,
  // 3 sums and K: GCC keeps one q on the stack, a reload per block. AMD Zen 2,
  // one core: PrefillAttention/smollm2/T512 36 -> 43 GFLOP/s.
  if constexpr (M <= 4)
    if (rows == 3) {
      scores_rows_kt8<3, M>(q, kt, ldk, scale, n, w, ws);
      r = 3;
    }
  for (; r + kRows <= rows; r += kRows)
    scores_rows_kt8<kRows, M>(q + r * d, kt, ldk, scale, n, w + r * ws, ws);
  if (r < rows) scores_rows_kt8<1, M>(q + r * d, kt, ldk, scale, n, w + r * ws, ws);
  for (r = 0; r < rows; ++r) softmax_in_place(w + r * ws, n);
  cpu::visit_row_passes(rows, [&]<int R>(int r0) {
    weighted_sums<R>(w + r0 * ws, ws, cpu::Strided<float>{vb, stride}, n, o + r0 * d, d, 0, d);
  });
}

// The AVX2 counterpart of cpu::attend_rows_kt_avx512 (same arguments and bits).
void attend_rows_kt_avx2(const float* q, int rows, const float* kt, int64_t ldk, const float* vb,
                         int64_t stride, int64_t d, int64_t n, float scale, float* w, int64_t ws, float* o) {
  cpu::visit_head_blocks(
      d, [&]<int M>() { attend_rows_kt8<M>(q, rows, kt, ldk, vb, stride, n, scale, w, ws, o); });
}

// paged_rows_avx512's AVX2 counterpart (attention_rows.h): attend_row's
// arithmetic on rows located one by one, the group's heads two or three at a
// time on each K line (dot4_heads, the same bits as dot4) and each V line
// (weighted_sum_rows); the first pass prefetches key and value rows
// cpu::kPagedPrefetchRows ahead.
template <int R, typename E>
void paged_run(const float* q, const E* const* kr, const E* const* vr, int64_t d, int64_t n, float scale,
               float* w, int64_t ws, float* o, float* m, float* l, bool prefetch) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(E));
  int64_t p = 0;
  for (; p + 4 <= n; p += 4) {
    if (prefetch) cpu::prefetch_paged_rows4(kr, vr, p, row_bytes);
    const cpu::Gathered<E> k{kr};
    if constexpr (R == 1)
      dot4(q, k, p, d, scale, w + p);
    else
      dot4_heads<R>(q, k, p, d, scale, w + p, ws);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = p; j < n; ++j) w[r * ws + j] = simd::dot(q + r * d, kr[j], d) * scale;
  finish_paged<R>(w, ws, cpu::Gathered<E>{vr}, d, n, o, m, l);
}

template <typename E>
void paged_rows(const float* q, int rows, const E* const* kr, const E* const* vr, int64_t d, int64_t n,
                float scale, float* w, int64_t ws, float* o, float* m, float* l) {
  LOOM_ASSERT(d % 16 == 0);
  const int run = rows % 3 == 0 ? 3 : rows % 2 == 0 ? 2 : 1;
  for (int r0 = 0; r0 < rows; r0 += run) {
    float* mr = m ? m + r0 : nullptr;
    float* lr = m ? l + r0 : nullptr;
    const bool first = r0 == 0;
    if (run == 3)
      paged_run<3>(q + r0 * d, kr, vr, d, n, scale, w, ws, o + r0 * d, mr, lr, first);
    else if (run == 2)
      paged_run<2>(q + r0 * d, kr, vr, d, n, scale, w, ws, o + r0 * d, mr, lr, first);
    else
      paged_run<1>(q + r0 * d, kr, vr, d, n, scale, w, ws, o + r0 * d, mr, lr, first);
  }
}

// paged_rows on K^T (a prefill chunk's rows over the same keys): attend_rows_kt8's
// scores, the group's heads three (SmolLM2) or two at a time, then finished as
// paged_rows finishes them (the same bits: the K^T scores are dot4's).
template <int M, typename E>
void paged_rows_kt8(const float* q, int rows, const float* kt, int64_t ldk, const E* const* vr, int64_t n,
                    float scale, float* w, int64_t ws, float* o, float* m, float* l) {
  constexpr int d = 16 * M;
  const cpu::Gathered<E> v{vr};
  const auto pass = [&]<int R>(int r) {
    scores_rows_kt8<R, M>(q + r * d, kt, ldk, scale, n, w, ws);
    finish_paged<R>(w, ws, v, d, n, o + r * d, m ? m + r : nullptr, m ? l + r : nullptr);
  };
  constexpr int kRows = M <= 4 ? 2 : 1;  // as attend_rows_kt8
  int r = 0;
  if constexpr (M <= 4)
    for (; rows % 3 == 0 && r < rows; r += 3) pass.template operator()<3>(r);
  for (; r + kRows <= rows; r += kRows) pass.template operator()<kRows>(r);
  if (r < rows) pass.template operator()<1>(r);
}

// kt[e * ldk + p] = rows[p][e] widened to f32, for p < round_up(n, 8) and e < d
// (a multiple of 8): 8 x 8 blocks transposed in registers.
template <typename E>
void transpose_rows8(const E* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk) {
  for (int64_t p = 0; p < n; p += 8)
    for (int64_t e = 0; e < d; e += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = simd::load8(rows[p + i] + e);
      simd::transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (e + i) * ldk + p, r[i]);
    }
}

// kt[e * ldk + p] = k[p * stride + e] for p in [p0, p1), widened to f32.
template <typename E>
void transpose_keys(const E* k, int64_t stride, int64_t d, int64_t p0, int64_t p1, float* kt, int64_t ldk) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t e = 0; e < d; ++e) kt[e * ldk + p] = simd::load1(k + p * stride + e);
}

// Query heads per unit: the whole GQA group (K and V read once for all), or
// one head when too few (row, group) units would keep the threads busy.
int64_t heads_per_unit(const AttentionShape& s, int64_t T, int threads) {
  return T * s.n_kv_heads >= 4 * threads ? s.n_heads / s.n_kv_heads : 1;
}

// A decode row whose keys and values take at least this many bytes splits keys
// and value columns across the threads (decode_attention_keys_split) instead of
// heads. AMD Zen 2, 2 threads, SmolLM2 Q4_1 (`loom bench -p 0 -d D`): at 256
// keys (384 KiB a layer) the head split was as fast or faster (142-151 against
// 128-145 t/s; its one pass costs fewer waits), from 512 keys (768 KiB) the key
// split was faster: 95-113 -> 106-128 t/s, 1024 keys 93-96 -> 103-113.
constexpr int64_t kKeysSplitMinBytes = int64_t{512} << 10;

// Batches of at least this many rows read K transposed (attention_rows.h): the
// transpose costs about what one row's scores do.
constexpr int64_t kKeysTransposedMinT = 16;

// The batch path: per KV head, K^T of the keys any row reads, then the (row,
// heads) units on it, by the AVX-512 or the AVX2 kernel. f16 keys and values
// are widened into K^T and the group's V copy, so the kernels read f32 alone.
template <typename E>
void attention_keys_transposed(ThreadPool& pool, bool avx512, const AttentionShape& s, const float* q,
                               const E* v, float* out, int64_t T, const int32_t* pos,
                               const int32_t* seq_start, const E* k, int64_t max_span) {
  const auto attend_rows_kt = avx512 ? cpu::attend_rows_kt_avx512 : attend_rows_kt_avx2;
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  int64_t k0 = pos[0], k1 = 0;  // keys read: [k0, k1)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t first = seq_start ? seq_start[t] : 0;
    LOOM_ASSERT(first <= pos[t]);  // every row sees at least its own key (the kernels rely on n >= 1)
    k0 = std::min(k0, first);
    k1 = std::max<int64_t>(k1, pos[t] + 1);
  }
  const int64_t ldk = (k1 + 15) / 16 * 16 + 16;  // columns up to round_up(n, 16) past any first key
  std::vector<float> kt(static_cast<size_t>(d * ldk)), vg(static_cast<size_t>(k1 * d));
  const int64_t rows = heads_per_unit(s, T, pool.size()), per_g = group / rows;
  const int64_t wstride = max_span + 16;
  std::vector<std::vector<float>> w(static_cast<size_t>(pool.size()));
  for (int64_t g = 0; g < s.n_kv_heads; ++g) {
    pool.run([&](int ti, int tn) {
      const int64_t n = k1 - k0, a = k0 + n * ti / tn, b = k0 + n * (ti + 1) / tn;
      transpose_keys(k + g * d, s.kv_stride, d, a, b, kt.data(), ldk);
      for (int64_t p = a; p < b; ++p) simd::widen(vg.data() + p * d, v + p * s.kv_stride + g * d, d);
    });
    pool.run([&](int ti, int tn) {
      auto& wt = w[static_cast<size_t>(ti)];
      wt.resize(static_cast<size_t>(rows * wstride));
      for (int64_t u = ti; u < T * per_g; u += tn) {
        const int64_t t = u / per_g, h = g * group + (u % per_g) * rows;
        const int64_t first = seq_start ? seq_start[t] : 0, n = pos[t] - first + 1;
        attend_rows_kt(q + (t * s.n_heads + h) * d, static_cast<int>(rows), kt.data() + first, ldk,
                       vg.data() + first * d, d, d, n, scale, wt.data(), wstride,
                       out + (t * s.n_heads + h) * d);
      }
    });
  }
}

// The AVX2 score pass of decode_attention_keys_split over keys [p0, p1): a GQA
// group's heads in threes (SmolLM2) or twos (Llama 3's groups of 4), else one
// by one, each K line loaded once for them. The 4 rows kPrefetchRows ahead are
// prefetched a share per head (or three), between the dot products: in one
// burst per 4 rows (48 lines for SmolLM2) they overflowed the core's miss
// buffers. AMD Zen 2, 2 threads: DecodeAttention/smollm2/ctx4096_cold/t2
// 516-580 -> 407-487 us, and with dot4_heads<3> as well 527-543 -> 396-432
// (the previous binary alongside).
template <typename E>
void decode_scores_avx2(const AttentionShape& s, const float* q, const E* k, float scale, float* w,
                        int64_t ws, int64_t p0, int64_t p1, int64_t n) {
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads, H = s.n_heads, stride = s.kv_stride;
  const size_t lines = 4 * static_cast<size_t>(stride) * sizeof(E) / 64;
  const int64_t run = group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;
  int64_t p = p0;
  for (; p + 4 <= p1; p += 4) {
    const bool ahead_ok = p + kPrefetchRows + 4 <= n;
    const auto* ahead = ahead_ok ? reinterpret_cast<const char*>(k + (p + kPrefetchRows) * stride) : nullptr;
    for (int64_t h = 0; h < H; h += run) {
      if (ahead_ok)
        for (size_t b = lines * h / H; b < lines * (h + run) / H; ++b)
          __builtin_prefetch(ahead + 64 * b, 0, 3);
      const cpu::Strided<E> kh{k + (h / group) * d, stride};
      float* sp = w + h * ws + p;
      if (run == 3)
        dot4_heads<3>(q + h * d, kh, p, d, scale, sp, ws);
      else if (run == 2)
        dot4_heads<2>(q + h * d, kh, p, d, scale, sp, ws);
      else
        dot4(q + h * d, kh, p, d, scale, sp);
    }
  }
  for (; p < p1; ++p)
    for (int64_t h = 0; h < H; ++h)
      w[h * ws + p] = simd::dot(q + h * d, k + p * stride + (h / group) * d, d) * scale;
}

// One decode row's attention over a long context, parallel over keys and value
// columns instead of heads: each K and V row then comes from memory once for
// all the heads that read it (a GQA group's heads share its rows), in long
// sequential runs, where one head per thread read each group's rows once per
// head, in 256-byte pieces. Every score, softmax and weighted-sum lane takes the
// same operations in the same order as attend_row, so the bits are the same.
// Three passes: the scores (keys split across the threads, every head on each
// K row while it is in L1), each head's softmax, then the weighted sums (value
// columns split across the threads). Both streams are prefetched kPrefetchRows ahead.
// Each pass runs the AVX2 kernels or the AVX-512 ones (attention_rows.h: a
// group's heads 4 at a time in 32 zmm registers, value columns 16 at a time).
// On AVX-512 such rows had taken the group-per-unit path, each thread reading
// whole K/V heads: AMD Zen 4, 2 threads, DecodeAttention/llama1b/ctx4096_cold/t2
// 1576-1588 -> 1034-1057 us, smollm2 536-610 -> 337-342 (the previous binary
// alongside); a 256 KiB threshold instead of 512 measured within the noise
// there (SmolLM2 tg64 @ d192, d320).
template <typename E>
void decode_attention_keys_split(ThreadPool& pool, bool avx512, const AttentionShape& s, const float* q,
                                 const E* k, const E* v, float* out, int64_t n) {
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads, H = s.n_heads, stride = s.kv_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t ws = n + 16;  // the softmaxes run in steps of 8 (AVX2) or 16 (AVX-512) into the padding
  const auto w = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(H * ws));
  pool.run([&](int ti, int tn) {
    const int64_t quads = n / 4;
    const int64_t p0 = 4 * (quads * ti / tn), p1 = ti + 1 == tn ? n : 4 * (quads * (ti + 1) / tn);
    if (avx512)
      cpu::decode_scores_avx512(q, H, group, k, stride, d, scale, w.get(), ws, p0, p1, n);
    else
      decode_scores_avx2(s, q, k, scale, w.get(), ws, p0, p1, n);
  });
  pool.run([&](int ti, int tn) {
    for (int64_t h = ti; h < H; h += tn)
      avx512 ? cpu::decode_softmax_avx512(w.get() + h * ws, n) : softmax_in_place(w.get() + h * ws, n);
  });
  pool.run([&](int ti, int tn) {
    const int64_t lanes = avx512 ? 16 : 8, blocks = d / lanes;
    const int64_t c0 = lanes * (blocks * ti / tn), c1 = lanes * (blocks * (ti + 1) / tn);
    if (c0 == c1) return;
    for (int64_t g = 0; g < s.n_kv_heads; ++g) {
      float* wg = w.get() + g * group * ws;
      if (avx512) {
        cpu::decode_weighted_sums_avx512(wg, static_cast<int>(group), ws, v + g * d, stride, n,
                                         out + g * group * d, d, c0, c1);
        continue;
      }
      cpu::visit_row_passes(static_cast<int>(group), [&]<int R>(int r0) {
        weighted_sums<R, true>(wg + r0 * ws, ws, cpu::Strided<E>{v + g * d, stride}, n,
                               out + (g * group + r0) * d, d, c0, c1);
      });
    }
  });
}

// Each (query row, head) is one unit with a fixed order of operations, so the
// result does not depend on the thread count or on the other rows. Units are
// dealt to threads round-robin: causal rows grow with the position, and
// contiguous ranges would leave the last thread the most work.
template <typename E>
void attention_rows(ThreadPool& pool, const AttentionShape& s, const float* q, const E* k, const E* v,
                    float* out, int64_t T, const int32_t* pos, const int32_t* seq_start) {
  LOOM_ASSERT(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0);
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  int32_t max_span = 0;
  for (int64_t t = 0; t < T; ++t) max_span = std::max(max_span, pos[t] - (seq_start ? seq_start[t] : 0) + 1);
  const bool avx512 = default_attention_isa() == AttnIsa::avx512;
  if (T >= kKeysTransposedMinT && cpu::attend_rows_kt_supports(d))
    return attention_keys_transposed(pool, avx512, s, q, v, out, T, pos, seq_start, k, max_span);
  // One decode row, both ISAs: its bits are attend_row's whichever path runs
  // (attention_rows.h), so the choice is speed alone.
  // The row's size is counted in f32 bytes whatever the store holds: an f16 row
  // splits from the same key count. AMD Zen 4, 2 threads, SmolLM2 Q4_K_M tg64 @
  // d512 with an f16 cache (384 KiB a layer) under `loom bench --profile`, 3
  // rounds: attention 49-65 us a call on the head split, 26-41 split by keys.
  if (T == 1 && pool.size() > 1 && d % 16 == 0 &&
      int64_t{max_span} * s.kv_stride * int64_t{2 * sizeof(float)} >= kKeysSplitMinBytes) {
    const int64_t first = seq_start ? seq_start[0] : 0;
    return decode_attention_keys_split(pool, avx512 && cpu::attend_rows_avx512_supports(d), s, q,
                                       k + first * s.kv_stride, v + first * s.kv_stride, out,
                                       pos[0] - first + 1);
  }
  if (avx512 && cpu::attend_rows_avx512_supports(d)) {
    const int64_t rows = heads_per_unit(s, T, pool.size()), per_t = s.n_heads / rows;
    const int64_t wstride = max_span + 16;
    pool.run([&](int ti, int tn) {
      std::vector<float> w(static_cast<size_t>(rows * wstride));
      for (int64_t u = ti; u < T * per_t; u += tn) {
        const int64_t t = u / per_t, h = (u % per_t) * rows, g = h / group;
        const int64_t first = seq_start ? seq_start[t] : 0, n = pos[t] - first + 1;
        cpu::attend_rows_avx512(q + (t * s.n_heads + h) * d, static_cast<int>(rows), k + first * s.kv_stride + g * d,
                                v + first * s.kv_stride + g * d, s.kv_stride, d, n, scale, w.data(), wstride,
                                out + (t * s.n_heads + h) * d);
      }
    });
    return;
  }
  // A single row's heads go to the threads in contiguous ranges: a GQA group's
  // heads then read its keys and values on one thread, the second and third from
  // cache, where dealing heads round-robin had every thread fetch every group.
  const int64_t units = T * s.n_heads;
  const bool one_row = T == 1;
  pool.run([&](int ti, int tn) {
    std::vector<float> w(static_cast<size_t>(max_span) + 8);
    const int64_t u0 = one_row ? units * ti / tn : ti, u1 = one_row ? units * (ti + 1) / tn : units;
    const int64_t step = one_row ? 1 : tn;
    for (int64_t u = u0; u < u1; u += step) {
      const int64_t t = u / s.n_heads, h = u % s.n_heads, g = h / group;
      const int64_t first = seq_start ? seq_start[t] : 0, n = pos[t] - first + 1;
      attend_row(q + (t * s.n_heads + h) * d, k + first * s.kv_stride + g * d, v + first * s.kv_stride + g * d,
                 s.kv_stride, d, n, scale, w.data(), out + (t * s.n_heads + h) * d);
    }
  });
}

}  // namespace

void attention(ThreadPool& pool, const AttentionShape& s, const float* q, const KvRows& kv, float* out,
               int64_t T, const int32_t* pos, const int32_t* seq_start) {
  LOOM_ASSERT(kv.dtype == DType::f32 || kv.dtype == DType::f16);
  if (kv.dtype == DType::f16)
    return attention_rows(pool, s, q, static_cast<const uint16_t*>(kv.k), static_cast<const uint16_t*>(kv.v),
                          out, T, pos, seq_start);
  attention_rows(pool, s, q, static_cast<const float*>(kv.k), static_cast<const float*>(kv.v), out, T, pos,
                 seq_start);
}

namespace cpu {
void paged_rows_avx2(const float* q, int rows, const float* const* kr, const float* const* vr, int64_t d,
                     int64_t n, float scale, float* w, int64_t wstride, float* o, float* m, float* l) {
  paged_rows(q, rows, kr, vr, d, n, scale, w, wstride, o, m, l);
}
void paged_rows_avx2(const float* q, int rows, const uint16_t* const* kr, const uint16_t* const* vr,
                     int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                     float* l) {
  paged_rows(q, rows, kr, vr, d, n, scale, w, wstride, o, m, l);
}
void paged_rows_kt_avx2(const float* q, int rows, const float* kt, int64_t ldk, const float* const* vr,
                        int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                        float* l) {
  visit_head_blocks(d,
                    [&]<int M>() { paged_rows_kt8<M>(q, rows, kt, ldk, vr, n, scale, w, wstride, o, m, l); });
}
void paged_rows_kt_avx2(const float* q, int rows, const float* kt, int64_t ldk, const uint16_t* const* vr,
                        int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                        float* l) {
  visit_head_blocks(d,
                    [&]<int M>() { paged_rows_kt8<M>(q, rows, kt, ldk, vr, n, scale, w, wstride, o, m, l); });
}
void transpose_rows_avx2(const float* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk) {
  transpose_rows8(rows, n, d, kt, ldk);
}
void transpose_rows_avx2(const uint16_t* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk) {
  transpose_rows8(rows, n, d, kt, ldk);
}
}  // namespace cpu

void store_f16(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(dst + i),
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);  // the F16C rounding: nearest even
}

}  // namespace loom

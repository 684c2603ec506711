// AVX-512 F attention rows (attention_rows.h). Hand-written: the per-lane
// arithmetic must match ops.cpp's AVX2 loop exactly, which no library gives.
// A zmm lane pair (i, i + 8) is what the AVX2 loop keeps in its two ymm
// accumulators, so one 16-wide FMA chain folded lo + hi is the same sum.
// GCC 12's _mm512_castps512_ps256 extracts with an undefined pass-through
// operand, which -W(maybe-)uninitialized reports (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cmath>
#include <initializer_list>

#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/exp_poly.h"
#include "kernels/cpu/lane_sums.h"

namespace loom::cpu {
namespace {

// 16 keys or values as f32: f32, or IEEE half bits widened exactly.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// lo + hi halves: the AVX2 loop's acc0 + acc1.
inline __m256 fold(__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

// simd::exp_ps on 16 lanes: the same operations per lane.
inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kMinX)), _mm512_set1_ps(kMaxX));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), x);
  __m512 p = _mm512_set1_ps(kP0);
  for (const float c : {kP1, kP2, kP3, kP4, kP5}) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Scores of keys p .. p + 3 for R rows: w[r][p + j] = dot(q_r, k_{p+j}) * scale.
template <int R, class Rows>
inline void scores4(const float* q, int64_t d, const Rows& k, float scale, float* w, int64_t ws, int64_t p) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const typename Rows::Elem* kr[4];
  for (int j = 0; j < 4; ++j) kr[j] = k(p + j);
  for (int64_t i = 0; i < d; i += 16) {
    __m512 kk[4];
    for (int j = 0; j < 4; ++j) kk[j] = load16(kr[j] + i);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * d + i);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(qv, kk[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = fold(acc[r][j]);
    float s[4];
    hsum4(v, s);
    for (int j = 0; j < 4; ++j) w[r * ws + p + j] = s[j] * scale;
  }
}

// One key (the n % 4 tail): simd::dot's arithmetic.
template <int R, class Rows>
inline void scores1(const float* q, int64_t d, const Rows& k, float scale, float* w, int64_t ws, int64_t p) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const typename Rows::Elem* kp = k(p);
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 kk = load16(kp + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * d + i), kk, acc[r]);
  }
  for (int r = 0; r < R; ++r) w[r * ws + p] = hsum(fold(acc[r])) * scale;
}

// Replaces scores by exp(score - max) in place and returns their sum, taken in
// 8-lane steps then hsum then the scalar tail, as the AVX2 loop does; the max
// goes to *max_out.
inline float softmax_exp(float* w, int64_t n, float* max_out) {
  __m512 vmx = _mm512_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(w + p));
  const __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(vmx), _mm512_extractf32x8_ps(vmx, 1));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; p < n; ++p) mx = w[p] > mx ? w[p] : mx;
  const __m512 m = _mm512_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  p = 0;
  for (; p + 16 <= n; p += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(w + p), m));
    _mm512_storeu_ps(w + p, e);
    vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
    vsum = _mm256_add_ps(vsum, _mm512_extractf32x8_ps(e, 1));
  }
  if (p + 8 <= n) {  // lanes 8..15 read the padding and are dropped
    const __m256 e = _mm512_castps512_ps256(exp16(_mm512_sub_ps(_mm512_loadu_ps(w + p), m)));
    _mm256_storeu_ps(w + p, e);
    vsum = _mm256_add_ps(vsum, e);
    p += 8;
  }
  float sum = hsum(vsum);
  for (; p < n; ++p) {
    w[p] = std::exp(w[p] - mx);
    sum += w[p];
  }
  *max_out = mx;
  return sum;
}

// softmax_exp, returning 1 / the sum (the AVX2 loop's factor).
inline float softmax_weights(float* w, int64_t n) {
  float mx;
  return 1.0f / softmax_exp(w, n, &mx);
}

// o[r][c0 .. c0 + 16 C) = sum_j a[r][j] v_j, one FMA chain per lane in j order;
// a[r][j] = w[r][j] * inv[r], already in w (normalize).
// kPrefetch (strided rows only): rows kDecodePrefetchRows ahead are requested.
template <int R, int C, bool kPrefetch = false, class Rows>
inline void weighted_sum(const float* a, int64_t ws, const Rows& v, int64_t n, float* o, int64_t d,
                         int64_t c0) {
  using E = typename Rows::Elem;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const E* vj = v(j) + c0;
    if constexpr (kPrefetch)  // one request per 64 bytes of the row's columns
      for (int c = 0; c < C; c += 4 / static_cast<int>(sizeof(E)))
        _mm_prefetch(reinterpret_cast<const char*>(vj + kDecodePrefetchRows * v.stride + 16 * c),
                     _MM_HINT_T0);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vj + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 aj = _mm512_set1_ps(a[r * ws + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(aj, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * d + c0 + 16 * c, acc[r][c]);
}

// w[0 .. n) *= inv (the products the AVX2 loop forms per key), 16 lanes at a
// time into the padding.
inline void normalize(float* w, int64_t n, float inv) {
  const __m512 m = _mm512_set1_ps(inv);
  for (int64_t p = 0; p < n; p += 16) _mm512_storeu_ps(w + p, _mm512_mul_ps(_mm512_loadu_ps(w + p), m));
}

// o[r] = sum_j w[r][j] v_j for R rows of weights, 64 columns a pass.
template <int R, class Rows>
void weighted_sums(const float* w, int64_t ws, const Rows& v, int64_t d, int64_t n, float* o) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    switch ((d - c0) / 16) {
      case 1:
        weighted_sum<R, 1>(w, ws, v, n, o, d, c0);
        break;
      case 2:
        weighted_sum<R, 2>(w, ws, v, n, o, d, c0);
        break;
      case 3:
        weighted_sum<R, 3>(w, ws, v, n, o, d, c0);
        break;
      default:
        weighted_sum<R, 4>(w, ws, v, n, o, d, c0);
        break;
    }
  }
}

// Scores in w (R rows of n) to outputs: softmax, then the weighted sums of V.
template <int R, class Rows>
void softmax_and_sum(float* w, int64_t ws, const Rows& v, int64_t d, int64_t n, float* o) {
  for (int r = 0; r < R; ++r) normalize(w + r * ws, n, softmax_weights(w + r * ws, n));
  weighted_sums<R>(w, ws, v, d, n, o);
}

template <int R, class Rows>
void scores(const float* q, int64_t d, const Rows& k, int64_t n, float scale, float* w, int64_t ws) {
  int64_t p = 0;
  for (; p + 4 <= n; p += 4) scores4<R>(q, d, k, scale, w, ws, p);
  for (; p < n; ++p) scores1<R>(q, d, k, scale, w, ws, p);
}

template <int R, class Rows>
void attend_chunk(const float* q, const Rows& k, const Rows& v, int64_t d, int64_t n, float scale, float* w,
                  int64_t ws, float* o) {
  scores<R>(q, d, k, n, scale, w, ws);
  softmax_and_sum<R>(w, ws, v, d, n, o);
}

// The lane pair (l, l + 8) of scores4's zmm chains for R rows and B blocks of
// 16 keys, the keys across the lanes (head_dim 16 M, unrolled so that every
// chain stays in a register): A_l + A_{l+8}, where A_j chains q[i + j] * k[i + j]
// over i = 0, 16, .. in order. That is lane l of fold(). Added into v when
// `add` (v + pair: the hsum tree's first level), else stored in v.
template <int R, int B, int M>
[[gnu::always_inline]] inline void lane_pair(const float* q, const float* kt, int64_t ldk, int l, bool add,
                                             __m512 (&v)[R][B]) {
  constexpr int d = 16 * M;
  // A compiler barrier: GCC 12 otherwise hoists the next pair's loads into this
  // one's chains and spills them (three rows over two blocks: 2.9 -> 2.6 ms for
  // PrefillAttention/smollm2/T512/t1 with it, Zen 5). No instruction is emitted.
  asm volatile("" ::: "memory");
  __m512 a[R][B], b[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) a[r][j] = b[r][j] = _mm512_setzero_ps();
  for (int i = 0; i < d; i += 16) {
    const float* ka = kt + (i + l) * ldk;
    const float* kb = kt + (i + 8 + l) * ldk;
    __m512 kva[B], kvb[B];
    for (int j = 0; j < B; ++j) {
      kva[j] = _mm512_loadu_ps(ka + 16 * j);
      kvb[j] = _mm512_loadu_ps(kb + 16 * j);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 qa = _mm512_set1_ps(q[r * d + i + l]), qb = _mm512_set1_ps(q[r * d + i + 8 + l]);
      for (int j = 0; j < B; ++j) {
        a[r][j] = _mm512_fmadd_ps(qa, kva[j], a[r][j]);
        b[r][j] = _mm512_fmadd_ps(qb, kvb[j], b[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) {
      const __m512 pair = _mm512_add_ps(a[r][j], b[r][j]);
      v[r][j] = add ? _mm512_add_ps(v[r][j], pair) : pair;
    }
}

template <int R, int B>
[[gnu::always_inline]] inline void add_into(__m512 (&x)[R][B], const __m512 (&y)[R][B]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) x[r][j] = _mm512_add_ps(x[r][j], y[r][j]);
}

// v = lane pair la + lane pair lb.
template <int R, int B, int M>
[[gnu::always_inline]] inline void lane_pairs(const float* q, const float* kt, int64_t ldk, int la, int lb,
                                              __m512 (&v)[R][B]) {
  lane_pair<R, B, M>(q, kt, ldk, la, false, v);
  lane_pair<R, B, M>(q, kt, ldk, lb, true, v);
}

// Scores of keys p .. p + 16 B for R rows from K^T: the same products, chains
// and hsum tree ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) as scores4,
// with no horizontal sum per key. kt points at key p's column. The left half
// of the tree waits in w's own slots while the right half is summed, so that
// the registers hold at most 4 R B sums and the pair being chained (with
// R B = 6, three rows over two blocks, 30 of the 32; keeping the left half
// too spilled the chains to the stack).
template <int R, int B, int M>
inline void scores_kt(const float* q, const float* kt, int64_t ldk, float scale, float* w, int64_t ws,
                      int64_t p) {
  __m512 x[R][B], t[R][B];
  lane_pairs<R, B, M>(q, kt, ldk, 0, 4, x);  // (l0 + l4) + (l2 + l6)
  lane_pairs<R, B, M>(q, kt, ldk, 2, 6, t);
  add_into(x, t);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) _mm512_storeu_ps(w + r * ws + p + 16 * j, x[r][j]);
  lane_pairs<R, B, M>(q, kt, ldk, 1, 5, x);  // (l1 + l5) + (l3 + l7)
  lane_pairs<R, B, M>(q, kt, ldk, 3, 7, t);
  add_into(x, t);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) {
      float* at = w + r * ws + p + 16 * j;
      _mm512_storeu_ps(at, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(at), x[r][j]), sc));
    }
}

// Scores of keys [0, n) from K^T: two blocks of keys a pass (each q value
// broadcast once for both) up to three rows; four rows take one block.
template <int R, int M>
void scores_from_kt(const float* q, const float* kt, int64_t ldk, int64_t n, float scale, float* w,
                    int64_t ws) {
  int64_t p = 0;
  if constexpr (R <= 3)
    for (; p + 32 <= n; p += 32) scores_kt<R, 2, M>(q, kt + p, ldk, scale, w, ws, p);
  for (; p < n; p += 16) scores_kt<R, 1, M>(q, kt + p, ldk, scale, w, ws, p);
}

template <int R, int M>
void attend_chunk_kt(const float* q, const float* kt, int64_t ldk, const float* vb, int64_t stride, int64_t n,
                     float scale, float* w, int64_t ws, float* o) {
  scores_from_kt<R, M>(q, kt, ldk, n, scale, w, ws);
  softmax_and_sum<R>(w, ws, Strided<float>{vb, stride}, 16 * M, n, o);
}

// Scores in w to a paged row's outputs: normalized (m == nullptr), or a
// segment's unnormalized sums with each row's max and sum of exponentials.
template <int R, class Rows>
void finish_paged(float* w, int64_t ws, const Rows& v, int64_t d, int64_t n, float* o, float* m, float* l) {
  if (m == nullptr) return softmax_and_sum<R>(w, ws, v, d, n, o);
  for (int r = 0; r < R; ++r) l[r] = softmax_exp(w + r * ws, n, &m[r]);
  weighted_sums<R>(w, ws, v, d, n, o);
}

template <typename E>
void attend_rows(const float* q, int rows, const E* kb, const E* vb, int64_t stride, int64_t d, int64_t n,
                 float scale, float* w, int64_t wstride, float* o) {
  visit_row_passes(rows, [&]<int R>(int r0) {
    attend_chunk<R>(q + r0 * d, Strided<E>{kb, stride}, Strided<E>{vb, stride}, d, n, scale, w, wstride,
                    o + r0 * d);
  });
}

template <typename E>
void decode_scores(const float* q, int64_t n_heads, int64_t group, const E* k, int64_t stride, int64_t d,
                   float scale, float* w, int64_t ws, int64_t p0, int64_t p1, int64_t n) {
  // The next 4 rows' lines are requested a share per pass between the products,
  // not in one burst per 4 keys (which overflowed the miss buffers on AVX2).
  const int64_t lines = 4 * stride * static_cast<int64_t>(sizeof(E)) / 64;
  const int64_t passes = n_heads / group * ((group + 3) / 4);
  int64_t p = p0;
  for (; p + 4 <= p1; p += 4) {
    const char* ahead = p + kDecodePrefetchRows + 4 <= n
                            ? reinterpret_cast<const char*>(k + (p + kDecodePrefetchRows) * stride)
                            : nullptr;
    int64_t pass = 0;
    for (int64_t g = 0; g < n_heads / group; ++g)
      visit_row_passes(static_cast<int>(group), [&]<int R>(int r0) {
        if (ahead)
          for (int64_t b = lines * pass / passes; b < lines * (pass + 1) / passes; ++b)
            _mm_prefetch(ahead + 64 * b, _MM_HINT_T0);
        ++pass;
        const int64_t h = g * group + r0;
        scores4<R>(q + h * d, d, Strided<E>{k + g * d, stride}, scale, w + h * ws, ws, p);
      });
  }
  for (; p < p1; ++p)
    for (int64_t g = 0; g < n_heads / group; ++g)
      visit_row_passes(static_cast<int>(group), [&]<int R>(int r0) {
        const int64_t h = g * group + r0;
        scores1<R>(q + h * d, d, Strided<E>{k + g * d, stride}, scale, w + h * ws, ws, p);
      });
}

template <typename E>
void decode_weighted_sums(const float* a, int rows, int64_t ws, const E* v, int64_t stride, int64_t n,
                          float* o, int64_t d, int64_t c0, int64_t c1) {
  visit_row_passes(rows, [&]<int R>(int r0) {
    const float* ar = a + r0 * ws;
    float* orow = o + r0 * d;
    int64_t c = c0;
    // Each V line is read once for the R rows; up to 4 x 4 sums and 4 V lines in 32 registers.
    const Strided<E> vr{v, stride};
    for (; c + 64 <= c1; c += 64) weighted_sum<R, 4, true>(ar, ws, vr, n, orow, d, c);
    if (c + 32 <= c1) weighted_sum<R, 2, true>(ar, ws, vr, n, orow, d, c), c += 32;
    if (c + 16 <= c1) weighted_sum<R, 1, true>(ar, ws, vr, n, orow, d, c);
  });
}

// The scores of a paged row's first pass of heads, requesting the key and value
// rows kPagedPrefetchRows ahead.
template <int R, typename E>
void paged_scores(const float* q, int64_t d, const Gathered<E>& k, const Gathered<E>& v, int64_t n,
                  float scale, float* w, int64_t ws) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(E));
  int64_t p = 0;
  for (; p + 4 <= n; p += 4) {
    prefetch_paged_rows4(k.rows, v.rows, p, row_bytes);
    scores4<R>(q, d, k, scale, w, ws, p);
  }
  for (; p < n; ++p) scores1<R>(q, d, k, scale, w, ws, p);
}

template <typename E>
void paged_rows(const float* q, int rows, const E* const* kr, const E* const* vr, int64_t d, int64_t n,
                float scale, float* w, int64_t wstride, float* o, float* m, float* l) {
  const Gathered<E> k{kr}, v{vr};
  visit_row_passes(rows, [&]<int R>(int r0) {
    if (r0 == 0)
      paged_scores<R>(q, d, k, v, n, scale, w, wstride);
    else
      scores<R>(q + r0 * d, d, k, n, scale, w, wstride);
    finish_paged<R>(w, wstride, v, d, n, o + r0 * d, m ? m + r0 : nullptr, m ? l + r0 : nullptr);
  });
}

template <typename E>
void paged_rows_kt(const float* q, int rows, const float* kt, int64_t ldk, const E* const* vr, int64_t d,
                   int64_t n, float scale, float* w, int64_t wstride, float* o, float* m, float* l) {
  const Gathered<E> v{vr};
  visit_head_blocks(d, [&]<int M>() {
    visit_row_passes(rows, [&]<int R>(int r0) {
      scores_from_kt<R, M>(q + r0 * d, kt, ldk, n, scale, w, wstride);
      finish_paged<R>(w, wstride, v, d, n, o + r0 * d, m ? m + r0 : nullptr, m ? l + r0 : nullptr);
    });
  });
}

// 16 x 16 floats transposed in registers: x[i] lane j -> x[j] lane i.
inline void transpose16(__m512 (&x)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // Lanes of 4 now hold 4 x 4 blocks transposed; gather the blocks.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    x[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}

template <typename E>
void transpose_rows(const E* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk) {
  for (int64_t p = 0; p < n; p += 16)
    for (int64_t e = 0; e < d; e += 16) {
      __m512 x[16];
      for (int j = 0; j < 16; ++j) x[j] = load16(rows[p + j] + e);
      transpose16(x);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (e + i) * ldk + p, x[i]);
    }
}

}  // namespace

void paged_rows_avx512(const float* q, int rows, const float* const* kr, const float* const* vr, int64_t d,
                       int64_t n, float scale, float* w, int64_t wstride, float* o, float* m, float* l) {
  paged_rows(q, rows, kr, vr, d, n, scale, w, wstride, o, m, l);
}
void paged_rows_avx512(const float* q, int rows, const uint16_t* const* kr, const uint16_t* const* vr,
                       int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                       float* l) {
  paged_rows(q, rows, kr, vr, d, n, scale, w, wstride, o, m, l);
}

void paged_rows_kt_avx512(const float* q, int rows, const float* kt, int64_t ldk, const float* const* vr,
                          int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                          float* l) {
  paged_rows_kt(q, rows, kt, ldk, vr, d, n, scale, w, wstride, o, m, l);
}
void paged_rows_kt_avx512(const float* q, int rows, const float* kt, int64_t ldk, const uint16_t* const* vr,
                          int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o, float* m,
                          float* l) {
  paged_rows_kt(q, rows, kt, ldk, vr, d, n, scale, w, wstride, o, m, l);
}

void transpose_rows_avx512(const float* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk) {
  transpose_rows(rows, n, d, kt, ldk);
}
void transpose_rows_avx512(const uint16_t* const* rows, int64_t n, int64_t d, float* kt, int64_t ldk) {
  transpose_rows(rows, n, d, kt, ldk);
}

void attend_rows_kt_avx512(const float* q, int rows, const float* kt, int64_t ldk, const float* vb,
                           int64_t stride, int64_t d, int64_t n, float scale, float* w, int64_t wstride,
                           float* o) {
  visit_head_blocks(d, [&]<int M>() {
    visit_row_passes(rows, [&]<int R>(int r0) {
      attend_chunk_kt<R, M>(q + r0 * d, kt, ldk, vb, stride, n, scale, w, wstride, o + r0 * d);
    });
  });
}

void attend_rows_avx512(const float* q, int rows, const float* kb, const float* vb, int64_t stride, int64_t d,
                        int64_t n, float scale, float* w, int64_t wstride, float* o) {
  attend_rows(q, rows, kb, vb, stride, d, n, scale, w, wstride, o);
}
void attend_rows_avx512(const float* q, int rows, const uint16_t* kb, const uint16_t* vb, int64_t stride,
                        int64_t d, int64_t n, float scale, float* w, int64_t wstride, float* o) {
  attend_rows(q, rows, kb, vb, stride, d, n, scale, w, wstride, o);
}

void decode_scores_avx512(const float* q, int64_t n_heads, int64_t group, const float* k, int64_t stride,
                          int64_t d, float scale, float* w, int64_t ws, int64_t p0, int64_t p1, int64_t n) {
  decode_scores(q, n_heads, group, k, stride, d, scale, w, ws, p0, p1, n);
}
void decode_scores_avx512(const float* q, int64_t n_heads, int64_t group, const uint16_t* k, int64_t stride,
                          int64_t d, float scale, float* w, int64_t ws, int64_t p0, int64_t p1, int64_t n) {
  decode_scores(q, n_heads, group, k, stride, d, scale, w, ws, p0, p1, n);
}

void decode_softmax_avx512(float* w, int64_t n) { normalize(w, n, softmax_weights(w, n)); }

void decode_weighted_sums_avx512(const float* a, int rows, int64_t ws, const float* v, int64_t stride,
                                 int64_t n, float* o, int64_t d, int64_t c0, int64_t c1) {
  decode_weighted_sums(a, rows, ws, v, stride, n, o, d, c0, c1);
}
void decode_weighted_sums_avx512(const float* a, int rows, int64_t ws, const uint16_t* v, int64_t stride,
                                 int64_t n, float* o, int64_t d, int64_t c0, int64_t c1) {
  decode_weighted_sums(a, rows, ws, v, stride, n, o, d, c0, c1);
}

}  // namespace loom::cpu

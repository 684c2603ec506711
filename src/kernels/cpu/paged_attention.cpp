// AVX2 paged attention: one (row, kv head) unit reads each key and value row
// once for all query heads of its group, with an online softmax over tiles of
// 16 positions, so no buffer grows with the context length.
#include "kernels/cpu/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/simd_rows.h"

namespace loom {

namespace {

constexpr int64_t kTile = 16;      // positions per softmax tile (two AVX2 vectors of scores)
constexpr int64_t kMaxGroup = 64;  // query heads per kv head handled by one unit

// o[i] = o[i] * corr + sum_j w[j] * v[j][i] for i < d, j < n; fixed order per element.
template <int NV, typename E>
inline void accumulate_chunk(float* o, float corr, const float* w, const E* const* v, int64_t n, int64_t c) {
  __m256 acc[NV];
  const __m256 vc = _mm256_set1_ps(corr);
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(o + c + 8 * i), vc);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    const E* vj = v[j] + c;
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(wj, simd::load8(vj + 8 * i), acc[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o + c + 8 * i, acc[i]);
}

template <typename E>
void accumulate(float* o, float corr, const float* w, const E* const* v, int64_t n, int64_t d) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) accumulate_chunk<8, E>(o, corr, w, v, n, c);
  if (c + 32 <= d) {
    accumulate_chunk<4, E>(o, corr, w, v, n, c);
    c += 32;
  }
  if (c + 16 <= d) {
    accumulate_chunk<2, E>(o, corr, w, v, n, c);
    c += 16;
  }
  if (c + 8 <= d) {
    accumulate_chunk<1, E>(o, corr, w, v, n, c);
    c += 8;
  }
  for (; c < d; ++c) {
    float acc = o[c] * corr;
    for (int64_t j = 0; j < n; ++j) acc = std::fma(w[j], simd::load1(v[j] + c), acc);
    o[c] = acc;
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// dst[i] = float(src[i]) for IEEE half bits.
inline void widen_row(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, simd::load8(src + i));
  for (; i < n; ++i) dst[i] = simd::load1(src + i);
}

struct Unit {
  const AttentionShape& s;
  const PagedKv& kv;
  int64_t group;
  float scale;
};

// Softmax state of one query head: running max and sum of exp(score - max).
struct HeadState {
  float m = -INFINITY;
  float l = 0.0f;
};

// One tile of nt (<= kTile) positions for the G query heads of a unit: scores,
// the online-softmax update, and o = o * corr + sum_j w_j v_j. kr has kTile
// valid pointers (padded); lanes at or past nt are dead.
template <typename R>
void attend_tile(const float* qg, float* og, HeadState* st, int64_t G, int64_t d, float scale,
                 const R* const* kr, const R* const* vr, int64_t nt) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
  const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nt)), lane));
  const __m256 live1 =
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nt) - 8), lane));
  alignas(32) float w[kTile];
  for (int64_t h = 0; h < G; ++h) {
    const float* qh = qg + h * d;
    const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(simd::dot8(qh, kr, d), vscale), live0);
    const __m256 s1 =
        nt > 8 ? _mm256_blendv_ps(ninf, _mm256_mul_ps(simd::dot8(qh, kr + 8, d), vscale), live1) : ninf;
    HeadState& hs = st[h];
    const float mn = std::max(hs.m, hmax(_mm256_max_ps(s0, s1)));
    // exp(m_old - m_new) rescales what earlier tiles accumulated; 0 on the first.
    const float corr = hs.m == -INFINITY ? 0.0f
                       : hs.m == mn      ? 1.0f
                                         : _mm256_cvtss_f32(simd::exp_ps(_mm256_set1_ps(hs.m - mn)));
    hs.m = mn;
    const __m256 vmn = _mm256_set1_ps(mn);
    const __m256 e0 = _mm256_and_ps(simd::exp_ps(_mm256_sub_ps(s0, vmn)), live0);
    const __m256 e1 = _mm256_and_ps(simd::exp_ps(_mm256_sub_ps(s1, vmn)), live1);
    _mm256_store_ps(w, e0);
    _mm256_store_ps(w + 8, e1);
    hs.l = hs.l * corr + simd::hsum(_mm256_add_ps(e0, e1));
    accumulate(og + h * d, corr, w, vr, nt, d);
  }
}

constexpr int64_t kMaxConvertDim = 256;  // head_dim up to which f16 tiles are widened once

// Query heads [g * group, (g + 1) * group) of row t; E is the storage type.
template <typename E>
void attend_unit(const Unit& u, const float* q, float* out, int64_t t, int64_t g, int32_t pos,
                 const int32_t* table) {
  const int64_t d = u.s.head_dim, G = u.group, bs = u.kv.block_size, n_kv = u.s.n_kv_heads;
  const int64_t n = static_cast<int64_t>(pos) + 1;
  const float* qg = q + (t * u.s.n_heads + g * G) * d;
  float* og = out + (t * u.s.n_heads + g * G) * d;
  std::fill(og, og + G * d, 0.0f);
  HeadState st[kMaxGroup];

  const E* kr[kTile];
  const E* vr[kTile];
  const E* kbase = static_cast<const E*>(u.kv.k);
  const E* vbase = static_cast<const E*>(u.kv.v);
  // f16 rows are widened to f32 once per tile rather than once per query head
  // (exact, so the result is the same either way).
  constexpr bool widen = std::is_same_v<E, uint16_t>;
  alignas(32) float kf[widen ? kTile * kMaxConvertDim : 1];
  alignas(32) float vf[widen ? kTile * kMaxConvertDim : 1];
  const float* kfr[kTile];
  const float* vfr[kTile];
  int64_t block = 0, slot = 0;  // of position p0
  for (int64_t p0 = 0; p0 < n; p0 += kTile) {
    const int64_t nt = std::min(kTile, n - p0);
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t at = ((static_cast<int64_t>(table[block]) * n_kv + g) * bs + slot) * d;
      kr[j] = kbase + at;
      vr[j] = vbase + at;
      if (++slot == bs) {
        slot = 0;
        ++block;
      }
    }
    for (int64_t j = nt; j < kTile; ++j) kr[j] = kr[0];  // padding rows; their scores are dropped
    if constexpr (widen) {
      if (d <= kMaxConvertDim) {
        for (int64_t j = 0; j < nt; ++j) {
          widen_row(kf + j * d, kr[j], d);
          widen_row(vf + j * d, vr[j], d);
          kfr[j] = kf + j * d;
          vfr[j] = vf + j * d;
        }
        for (int64_t j = nt; j < kTile; ++j) kfr[j] = kfr[0];
        attend_tile(qg, og, st, G, d, u.scale, kfr, vfr, nt);
        continue;
      }
    }
    attend_tile(qg, og, st, G, d, u.scale, kr, vr, nt);
  }
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.0f / st[h].l;
    float* o = og + h * d;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

}  // namespace

void paged_attention(ThreadPool& pool, const AttentionShape& s, const PagedKv& kv, const float* q, float* out,
                     int64_t T, const int32_t* pos, const int32_t* const* tables) {
  LOOM_ASSERT(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0 && kv.block_size > 0);
  const Unit u{s, kv, s.n_heads / s.n_kv_heads, 1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  LOOM_ASSERT(u.group <= kMaxGroup && (kv.dtype == DType::f32 || kv.dtype == DType::f16));
  const bool f16 = kv.dtype == DType::f16;
  const int64_t units = T * s.n_kv_heads;
  if (units <= 0) return;
  // Units differ in cost (context lengths differ), so threads take them one by
  // one; which thread computes a unit does not change its result.
  std::atomic<int64_t> next{0};
  pool.run([&](int, int) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < units;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t t = i / s.n_kv_heads, g = i % s.n_kv_heads;
      if (f16)
        attend_unit<uint16_t>(u, q, out, t, g, pos[t], tables[t]);
      else
        attend_unit<float>(u, q, out, t, g, pos[t], tables[t]);
    }
  });
}

}  // namespace loom

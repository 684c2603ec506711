#include "kernels/cpu/logit_row.h"

#include <immintrin.h>

#include <cmath>

#include "core/error.h"
#include "kernels/cpu/simd_avx2.h"

namespace loom {

int64_t argmax_first(const float* x, int64_t n) {
  // Four independent 8-lane maxima (chunk c of every 32 in accumulator c): one
  // compare-and-blend chain per 8 values would bound the loop by its latency.
  constexpr int kAcc = 4;
  LOOM_ASSERT(n < (int64_t{1} << 31));  // 32-bit lane indices
  __m256 best[kAcc];
  __m256i at[kAcc], idx[kAcc];
  for (int c = 0; c < kAcc; ++c) {
    best[c] = _mm256_set1_ps(-INFINITY);
    at[c] = _mm256_set1_epi32(-1);
    idx[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
  }
  const __m256i step = _mm256_set1_epi32(8 * kAcc);
  int64_t i = 0;
  for (; i + 8 * kAcc <= n; i += 8 * kAcc)
    for (int c = 0; c < kAcc; ++c) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
      const __m256 gt = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);  // NaN: false
      best[c] = _mm256_blendv_ps(best[c], v, gt);
      at[c] = _mm256_blendv_epi8(at[c], idx[c], _mm256_castps_si256(gt));
      idx[c] = _mm256_add_epi32(idx[c], step);
    }
  // Merge the lanes by value, then by index (each lane holds its first maximum).
  float mx = -INFINITY;
  int64_t arg = -1;
  for (int c = 0; c < kAcc; ++c) {
    alignas(32) float bv[8];
    alignas(32) int32_t bi[8];
    _mm256_store_ps(bv, best[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi), at[c]);
    for (int l = 0; l < 8; ++l)
      if (bi[l] >= 0 && (bv[l] > mx || (bv[l] == mx && bi[l] < arg))) mx = bv[l], arg = bi[l];
  }
  for (; i < n; ++i)
    if (x[i] > mx) mx = x[i], arg = i;
  return arg < 0 ? 0 : arg;
}

double logsumexp(const float* x, int64_t n) {
  LOOM_ASSERT(n >= 1);
  const float mx = x[argmax_first(x, n)];
  if (mx == -INFINITY || std::isnan(mx)) return mx;
  const __m256 m = _mm256_set1_ps(mx);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    // A NaN lane adds exp_ps's lower clamp, e^-87 (its max_ps keeps the bound).
    const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i)
    if (!std::isnan(x[i])) sum += std::exp(static_cast<double>(x[i] - mx));
  return static_cast<double>(mx) + std::log(sum);
}

namespace {
// a ranks before b: larger, then lower index; NaN after every number.
bool ranks_before(float a, int64_t ia, float b, int64_t ib) {
  if (std::isnan(a) || std::isnan(b)) return !std::isnan(a) || (std::isnan(b) && ia < ib);
  return a > b || (a == b && ia < ib);
}
}  // namespace

void top_k(const float* x, int64_t n, int64_t k, int32_t* out) {
  LOOM_ASSERT(k >= 0 && k <= n && n < (int64_t{1} << 31));
  if (k == 0) return;
  // out holds the best so far in rank order; later indices never beat an equal value.
  int64_t kept = 0;
  auto offer = [&](int64_t i) {
    int64_t at;
    if (kept < k)
      at = kept++;
    else if (ranks_before(x[i], i, x[out[k - 1]], out[k - 1]))
      at = k - 1;
    else
      return;
    for (; at > 0 && ranks_before(x[i], i, x[out[at - 1]], out[at - 1]); --at) out[at] = out[at - 1];
    out[at] = static_cast<int32_t>(i);
  };
  int64_t i = 0;
  for (; i < k; ++i) offer(i);
  // Past the first k only a value above the k-th kept can enter (NaN never does).
  for (; i + 8 <= n; i += 8) {
    const float kth = x[out[k - 1]];
    const __m256 t = _mm256_set1_ps(std::isnan(kth) ? -INFINITY : kth);
    unsigned mask =
        static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_GT_OQ)));
    if (std::isnan(kth))  // a NaN kept: any number beats it, -inf too
      mask |= static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ)));
    for (; mask != 0; mask &= mask - 1) offer(i + __builtin_ctz(mask));
  }
  for (; i < n; ++i) offer(i);
}

}  // namespace loom

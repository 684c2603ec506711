// AVX2/FMA instantiation of the training attention tile kernels (the baseline).
#include <immintrin.h>

#include "kernels/cpu/attention_train_kernels.h"

namespace loom::attn {
namespace {

struct Avx2 {
  using reg = __m256;
  static constexpr int W = 8;
  // Register tiles: R rows x N vectors of accumulators (12 of 16 ymm registers).
  static constexpr int RA = 6, NA = 2, RB = 6, NB = 2;

  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fmsub(reg a, reg b, reg c) { return _mm256_fmsub_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static bool any_greater(reg x, float y) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(y), _CMP_GT_OQ)) != 0;
  }
  // Lanes >= n replaced by fill.
  static reg keep_first(reg x, int n, float fill) {
    if (n >= W) return x;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(keep));
  }
  static float hsum(reg v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
  }
  static float hmax(reg v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_max_ss(lo, _mm_movehdup_ps(lo)));
  }
  // 2^x for x <= ~2^8: x = n + f, |f| <= 1/2; below -126 the result is 2^-126, not 0
  // (callers zero masked lanes explicitly).
  static reg exp2(reg x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = _mm256_sub_ps(x, n);
    const reg p = exp2_poly<Avx2>(f);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};

}  // namespace

const TileKernels& tile_kernels_avx2() {
  static const TileKernels k{Avx2::W, &run_tasks<Avx2>};
  return k;
}

}  // namespace loom::attn

// AVX-512 (F only: Skylake-X and later) instantiation of the training attention
// tile kernels (chosen at run time by CpuFeatures::has_avx512_f32).
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (a known false positive in
// their undefined pass-through operands).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/cpu/attention_train_kernels.h"

namespace loom::attn {
namespace {

struct Avx512 {
  using reg = __m512;
  static constexpr int W = 16;
  // Register tiles: R rows x N vectors of accumulators (24 of 32 zmm registers).
  static constexpr int RA = 6, NA = 4, RB = 6, NB = 4;

  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg fmsub(reg a, reg b, reg c) { return _mm512_fmsub_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static bool any_greater(reg x, float y) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(y), _CMP_GT_OQ) != 0; }
  // Lanes >= n replaced by fill.
  static reg keep_first(reg x, int n, float fill) {
    if (n >= W) return x;
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
    return _mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), x);
  }
  static float hsum(reg v) { return _mm512_reduce_add_ps(v); }
  static float hmax(reg v) { return _mm512_reduce_max_ps(v); }
  // 2^x for finite x <= ~2^8 (callers zero masked lanes): x = n + f, |f| <= 1/2,
  // scalef applies 2^n and underflows to 0.
  static reg exp2(reg x) {
    const reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = _mm512_sub_ps(x, n);
    const reg p = exp2_poly<Avx512>(f);
    return _mm512_scalef_ps(p, n);
  }
};

}  // namespace

const TileKernels& tile_kernels_avx512() {
  static const TileKernels k{Avx512::W, &run_tasks<Avx512>};
  return k;
}

}  // namespace loom::attn

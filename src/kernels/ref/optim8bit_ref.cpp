// torch / bitsandbytes round every product: no fused multiply-add but the explicit ones.
#pragma GCC optimize("fp-contract=off")

#include "kernels/ref/optim8bit_ref.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::ref {

namespace {

// bnb: am = -inf; am = std::max(am, |x|) (a NaN never wins); then max(0, am).
float block_absmax(const float* x, size_t n) {
  float am = -INFINITY;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (am < a) am = a;
  }
  return 0.0f > am ? 0.0f : am;
}

}  // namespace

void quantize_blockwise(const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes, float* absmax) {
  for (size_t b = 0; b * kBlockwise8Block < n; ++b) {
    const size_t lo = b * kBlockwise8Block, len = std::min(kBlockwise8Block, n - lo);
    const float am = block_absmax(x + lo, len);
    absmax[b] = am;
    if (am == 0.0f) {  // bnb writes code 0 for a block of zeros
      std::fill_n(codes + lo, len, uint8_t{0});
      continue;
    }
    const float scale = 1.0f / am;
    for (size_t i = lo; i < lo + len; ++i) codes[i] = map.lut[blockwise8_lut_index(x[i] * scale)];
  }
}

void dequantize_blockwise(const Blockwise8Map& map, const uint8_t* codes, const float* absmax, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = map.code[codes[i]] * absmax[i / kBlockwise8Block];
}

void adamw8bit_update(const Adam8bitUpdate& u, float* p, const float* g, const Adam8bitState& s, size_t n) {
  std::vector<float> m(n), v(n);
  dequantize_blockwise(*s.m_map, s.m, s.m_absmax, n, m.data());
  dequantize_blockwise(*s.v_map, s.v, s.v_absmax, n, v.data());
  const float neg_step = -u.step_size;
  for (size_t i = 0; i < n; ++i) {
    // torch: exp_avg.mul_(b1).add_(g, alpha=w1) (a fused multiply-add), exp_avg_sq.mul_(b2).addcmul_(g, g, value=w2).
    const float mi = m[i] * u.b1;
    m[i] = std::fma(g[i], u.w1, mi);
    const float vi = v[i] * u.b2;
    const float wg = u.w2 * g[i];
    v[i] = std::fma(wg, g[i], vi);
    const float sq = std::sqrt(v[i]);
    const float denom = sq / u.bc2_sqrt + u.eps;
    const float kept = p[i] * u.keep;  // decoupled weight decay
    const float num = neg_step * m[i];
    const float upd = num / denom;
    p[i] = kept + upd;  // addcdiv_(m, denom, value=-lr/bc1)
  }
  quantize_blockwise(*s.m_map, m.data(), n, s.m, s.m_absmax);
  quantize_blockwise(*s.v_map, v.data(), n, s.v, s.v_absmax);
}

}  // namespace loom::ref

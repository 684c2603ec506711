// The IQ4_NL and IQ4_XS row quantizers (ggml's quantize_iq4_nl, quantize_iq4_xs
// and their quantize_row_iq4_nl_impl): per group of 32, the scale that best fits
// the codebook kIq4Values by weighted least squares over 15 trial scales; IQ4_XS
// then rounds its 8 group scales to 6-bit multiples of one f16 superblock scale
// and re-picks the codes. Byte-identical to llama-quantize (quantize_impl.h).

// As in quantize_search.cpp: ggml's products and sums are not fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/half.h"
#include "kernels/quant_blocks.h"
#include "kernels/quantize_impl.h"

namespace loom::quant {
namespace {

constexpr int kGroup = 32;
constexpr int kTrials = 7;  // trial scales on each side of the largest value's (ggml's ntry)

// The codebook as floats (exact).
constexpr float kValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr bool same_codebook() {
  for (int i = 0; i < 16; ++i)
    if (kValues[i] != kIq4Values[i]) return false;
  return true;
}
static_assert(same_codebook());

// ggml's best_index_int8: the codebook index whose value is nearest to v (a tie
// takes the larger value). ggml bisects; counting the values at or below v
// finds the same upper neighbour without its branches (the whole quantizer 1.7x
// as fast: every value is looked up 16 times), and the choice between the two
// neighbours is ggml's float comparison.
int nearest_code(float v) {
  if (v <= kValues[0]) return 0;
  if (!(v < kValues[15])) return 15;  // also NaN (0 x inf of a denormal scale), where ggml's bisection ends
  int hi = 1;  // the first value above v: kValues[hi - 1] <= v < kValues[hi]
  for (int k = 1; k < 15; ++k) hi += v >= kValues[k] ? 1 : 0;
  return v - kValues[hi - 1] < kValues[hi] - v ? hi - 1 : hi;
}

// The weighted sums of one trial, the codes of x * inv_scale: sum w q x and sum w q^2.
struct Fit {
  float sum_qx = 0, sum_q2 = 0;
};
Fit fit_codes(const float* x, const float* w, float inv_scale) {
  Fit f;
  for (int j = 0; j < kGroup; ++j) {
    const float q = kValues[nearest_code(inv_scale * x[j])];
    f.sum_qx += w[j] * q * x[j];
    f.sum_q2 += w[j] * q * q;
  }
  return f;
}

// The scale of one group of 32 (0 for a group of zeros). ggml also keeps the
// first trial's codes, which every caller then re-picks for the final scale.
float fit_group(const float* x, const float* w) {
  float amax = 0, max = 0;
  for (int j = 0; j < kGroup; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  if (amax < kGroupMaxEps) return 0;
  const float first = -max / kValues[0];
  Fit f = fit_codes(x, w, 1 / first);
  float d = f.sum_q2 > 0 ? f.sum_qx / f.sum_q2 : 0.f;
  float best = d * f.sum_qx;
  for (int t = -kTrials; t <= kTrials; ++t) {
    f = fit_codes(x, w, as_float(t + kIq4Values[0]) / max);
    if (f.sum_q2 > 0 && f.sum_qx * f.sum_qx > best * f.sum_q2) {
      d = f.sum_qx / f.sum_q2;
      best = d * f.sum_qx;
    }
  }
  return d;
}

// Weights of a group: the importance (qw * sqrt(sigma2 + x^2)) or x^2.
void group_weights(const float* x, const float* importance, float sigma2, float* w) {
  for (int j = 0; j < kGroup; ++j)
    w[j] = importance ? importance[j] * std::sqrt(sigma2 + x[j] * x[j]) : x[j] * x[j];
}

// 2 / n times the sum of squares of the n values (ggml's sigma2 for the importance weights).
float spread(const float* x, int n) {
  float s = 0;
  for (int j = 0; j < n; ++j) s += x[j] * x[j];
  return s * (2.f / as_float(n));
}

// The qs of a group for its final scale: the codes of x * inv_scale, byte j =
// code j | code j + 16 << 4.
void pack_codes(const float* x, float inv_scale, uint8_t* qs) {
  for (int j = 0; j < 16; ++j)
    qs[j] = static_cast<uint8_t>(nearest_code(inv_scale * x[j]) | (nearest_code(inv_scale * x[j + 16]) << 4));
}

}  // namespace

void quantize_row_iq4_nl(const float* x, void* dst, int64_t n, const float* importance) {
  for (int64_t ib = 0; ib < n / kGroup; ++ib, x += kGroup) {
    const float* qw = importance ? importance + kGroup * ib : nullptr;
    float w[kGroup];
    group_weights(x, qw, spread(x, kGroup), w);
    const float d = fit_group(x, w);
    BlockIQ4_NL b;
    b.d = fp32_to_fp16(d);
    pack_codes(x, d ? 1 / d : 0, b.qs);
    store_block(dst, ib, b);
  }
}

void quantize_row_iq4_xs(const float* x, void* dst, int64_t n, const float* importance) {
  constexpr int kGroups = QK_K / kGroup;
  for (int64_t isb = 0; isb < n / QK_K; ++isb, x += QK_K) {
    const float* qw = importance ? importance + QK_K * isb : nullptr;
    const float sigma2 = spread(x, QK_K);
    float scales[kGroups];
    float max_scale = 0, amax_scale = 0;
    for (int g = 0; g < kGroups; ++g) {
      float w[kGroup];
      group_weights(x + kGroup * g, qw ? qw + kGroup * g : nullptr, sigma2, w);
      scales[g] = fit_group(x + kGroup * g, w);
      if (std::fabs(scales[g]) > amax_scale) {
        amax_scale = std::fabs(scales[g]);
        max_scale = scales[g];
      }
    }
    BlockIQ4_XS b{};
    const float d = -max_scale / 32;
    b.d = fp32_to_fp16(d);
    const float inv_d = d ? 1 / d : 0.f;
    for (int g = 0; g < kGroups; ++g) {
      const int l = std::clamp(nearest_int(inv_d * scales[g]), -32, 31);
      const float dl = d * as_float(l);
      pack_codes(x + kGroup * g, dl ? 1 / dl : 0.f, b.qs + 16 * g);
      const int u = l + 32;
      b.scales_l[g / 2] = static_cast<uint8_t>(b.scales_l[g / 2] | ((u & 0x0f) << (4 * (g % 2))));
      b.scales_h = static_cast<uint16_t>(b.scales_h | ((u >> 4) << (2 * g)));
    }
    store_block(dst, isb, b);
  }
}

}  // namespace loom::quant

// The IQ2_XXS, IQ2_XS and IQ2_S row quantizers (ggml's quantize_row_iq2_xxs_impl,
// quantize_row_iq2_xs_impl and quantize_row_iq2_s_impl, with iq2xs_init_impl's
// tables): IQ3's search (quantize_iq3.cpp) on grids of 8-value entries with
// levels 0..2 (values 1, 3, 5), per group of 32 (IQ2_XXS) or 16 (IQ2_XS, IQ2_S).
// IQ2_XXS starts from make_qp_quants' scale and re-rounds every entry at the best
// one; IQ2_XS and IQ2_S re-round only the entries that were off the grid. ggml
// asserts an importance vector for IQ2_XXS and IQ2_XS (quantize_rows refuses
// their rows without one); IQ2_S weighs by sigma2 / 4 + x^2 without it.
// Byte-identical to llama-quantize (quantize_impl.h).

// As in quantize_search.cpp: ggml's products and sums are not fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "kernels/iq_grids.h"
#include "kernels/quantize_grid.h"
#include "kernels/quantize_impl.h"

namespace loom::quant {
namespace {

constexpr int kSuper = 256;
constexpr int kMaxQ = 3;           // levels 0..2 of a grid value 2l + 1
constexpr int kLattice = 43692;    // ggml's kmap_size: every 8 levels of 2 bits up to 0xAAAA, + 2
constexpr float kSGroupEps = 1e-8f;  // ggml's GROUP_MAX_EPS_IQ2_S

// The dequantization grids' bytes 8, 25, 43 are levels 0, 1, 2.
int level_of(uint8_t v) { return v == 0x08 ? 0 : v == 0x19 ? 1 : 2; }

// Built at first use (a fraction of a second for IQ2_S's 1,024 entries), once per grid.
const GridTables& tables_xxs() {
  static const GridTables t = make_grid_tables(kIq2xxsGrid, 256, 8, 2, kLattice, 2, level_of);
  return t;
}
const GridTables& tables_xs() {
  static const GridTables t = make_grid_tables(kIq2xsGrid, 512, 8, 2, kLattice, 2, level_of);
  return t;
}
const GridTables& tables_s() {
  static const GridTables t = make_grid_tables(kIq2sGrid, 1024, 8, 2, kLattice, 1, level_of);
  return t;
}

// Entry e's levels at id (0..2), the best neighbour at `scale` off the grid.
bool round_entry(const GridTables& t, const float* xval, const float* waux, float id, float scale, int8_t* L) {
  return round_to_grid(t, xval, waux, id, scale, kMaxQ - 1, L);
}

float superblock_sumx2(const float* xbl) { return sum_of_squares(xbl, kSuper); }

// ---- IQ2_XXS: groups of 32, d then per group a u32 of 4 entries and a u32 of
// 4 x 7 sign bits with the 4-bit scale << 28 ----
constexpr size_t kXxsBlock = 2 + 64;

void quantize_superblock_iq2_xxs(const float* xbl, const float* qw, uint8_t* out) {
  const GridTables& t = tables_xxs();
  uint32_t q2[16] = {};
  float scales[8];
  float max_scale = 0;
  const float sigma2 = superblock_sumx2(xbl) / kSuper;
  for (int ib = 0; ib < 8; ++ib) {
    const float* xb = xbl + 32 * ib;
    float weight[32], waux[32], xval[32];
    for (int i = 0; i < 32; ++i) weight[i] = qw[32 * ib + i] * std::sqrt(sigma2 + xb[i] * xb[i]);
    for (int i = 0; i < 32; ++i) waux[i] = std::sqrt(weight[i]);
    uint8_t signs[4];
    for (int k = 0; k < 4; ++k) signs[k] = split_signs(xb + 8 * k, weight + 8 * k, true, xval + 8 * k);
    const float max = max_of(xval, 32);
    if (max < kGroupMaxEps) {
      scales[ib] = 0;
      continue;
    }
    int8_t L[32];
    float scale = fit_positive(32, kMaxQ + 1, xval, weight, reinterpret_cast<uint8_t*>(L));
    const float eff_max = scale * kMaxQ;
    if (eff_max <= 0) {
      scales[ib] = 0;
      continue;
    }
    float best = 0;
    for (int is = -6; is <= 6; ++is) {
      const float id = (2 * kMaxQ - 1 + as_float(is) * 0.1f) / eff_max;
      const float this_scale = 1 / id;
      int8_t Laux[32];
      for (int k = 0; k < 4; ++k) round_entry(t, xval + 8 * k, waux + 8 * k, id, this_scale, Laux + 8 * k);
      const auto [sumqx, sumq2] = fit_sums(32, weight, xval, Laux);
      if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
        scale = sumqx / sumq2;
        best = scale * sumqx;
        std::memcpy(L, Laux, 32);
      }
    }
    if (scale > 0) {  // every entry again at the best scale
      const float id = 1 / scale;
      for (int k = 0; k < 4; ++k) round_entry(t, xval + 8 * k, waux + 8 * k, id, scale, L + 8 * k);
      const auto [sumqx, sumq2] = fit_sums(32, weight, xval, L);
      if (sumq2 > 0) scale = sumqx / sumq2;
    }
    if (scale < 0) {
      scale = -scale;
      for (auto& s : signs) s = static_cast<uint8_t>(~s & 127);
    }
    for (int k = 0; k < 4; ++k) {
      q2[2 * ib] |= static_cast<uint32_t>(t.entry_of(L + 8 * k)) << (8 * k);
      q2[2 * ib + 1] |= static_cast<uint32_t>(signs[k]) << (7 * k);
    }
    scales[ib] = scale;
    max_scale = max_scale > scale ? max_scale : scale;
  }
  std::memset(out, 0, kXxsBlock);
  if (max_scale == 0) return;
  const float d = max_scale / 31;
  const uint16_t dh = fp32_to_fp16(d);
  const float id = 1 / d;
  for (int ib = 0; ib < 8; ++ib) q2[2 * ib + 1] |= static_cast<uint32_t>(scale_code(id, scales[ib], 15)) << 28;
  std::memcpy(out, &dh, 2);
  std::memcpy(out + 2, q2, sizeof(q2));
}

// ---- IQ2_XS and IQ2_S: groups of 16 (two entries), IQ3_XS-like search ----

// The search of one group of 16 magnitudes: trial inverse scales (5 + 0.1 is) / max
// for is in [-9, 9], the best kept; the entries that were off the grid then
// rounded again at it and the scale refitted. Returns the scale (L: the levels).
float search_group16(const GridTables& t, const float* xval, const float* weight, const float* waux, float max,
                     int8_t* L) {
  std::memset(L, 0, 16);
  float best = 0;
  float scale = max / (2 * kMaxQ - 1);
  bool on_grid[2] = {true, true};
  for (int is = -9; is <= 9; ++is) {
    const float id = (2 * kMaxQ - 1 + as_float(is) * 0.1f) / max;
    const float this_scale = 1 / id;
    int8_t Laux[16];
    bool on_grid_aux[2];
    for (int k = 0; k < 2; ++k)
      on_grid_aux[k] = round_entry(t, xval + 8 * k, waux + 8 * k, id, this_scale, Laux + 8 * k);
    const auto [sumqx, sumq2] = fit_sums(16, weight, xval, Laux);
    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
      scale = sumqx / sumq2;
      best = scale * sumqx;
      std::memcpy(L, Laux, 16);
      on_grid[0] = on_grid_aux[0];
      on_grid[1] = on_grid_aux[1];
    }
  }
  if ((!on_grid[0] || !on_grid[1]) && scale > 0) {
    const float id = 1 / scale;
    for (int k = 0; k < 2; ++k)
      if (!on_grid[k]) round_entry(t, xval + 8 * k, waux + 8 * k, id, scale, L + 8 * k);
    const auto [sumqx, sumq2] = fit_sums(16, weight, xval, L);
    if (sumq2 > 0) scale = sumqx / sumq2;
  }
  return scale;
}

// IQ2_XS: d, 32 u16 (an entry's 9-bit index | its 7 sign bits << 9), 8 bytes of
// two 4-bit scales. IQ2_S: d, 32 low index bytes, 32 sign bytes, 8 bytes of the
// index bits 8..9 (2 bits an entry), 8 bytes of two 4-bit scales. Besides the
// layout IQ2_S differs in sigma2 (doubled), its weights without importance
// (sigma2 / 4 + x^2), its 8 free sign bits, its group epsilon and the f16 d's fudge.
constexpr size_t kXsBlock = 2 + 64 + 8;
constexpr size_t kSBlock = 2 + 64 + 8 + 8;

template <bool kS>
void quantize_superblock_iq2_16(const float* xbl, const float* qw, uint8_t* out) {
  const GridTables& t = kS ? tables_s() : tables_xs();
  std::memset(out, 0, kS ? kSBlock : kXsBlock);
  float scales[16];
  float max_scale = 0;
  const float sigma2 = (kS ? 2 * superblock_sumx2(xbl) : superblock_sumx2(xbl)) / kSuper;
  for (int ib = 0; ib < 16; ++ib) {
    const float* xb = xbl + 16 * ib;
    float weight[16], waux[16], xval[16];
    for (int i = 0; i < 16; ++i)
      weight[i] = qw ? qw[16 * ib + i] * std::sqrt(sigma2 + xb[i] * xb[i]) : 0.25f * sigma2 + xb[i] * xb[i];
    for (int i = 0; i < 16; ++i) waux[i] = std::sqrt(weight[i]);
    uint8_t signs[2];
    for (int k = 0; k < 2; ++k) signs[k] = split_signs(xb + 8 * k, weight + 8 * k, !kS, xval + 8 * k);
    const float max = max_of(xval, 16);
    if (max < (kS ? kSGroupEps : kGroupMaxEps)) {
      scales[ib] = 0;
      continue;
    }
    int8_t L[16];
    float scale = search_group16(t, xval, weight, waux, max, L);
    if (scale < 0) {
      scale = -scale;
      for (auto& s : signs) s = static_cast<uint8_t>(kS ? ~s : ~s & 127);
    }
    for (int k = 0; k < 2; ++k) {
      const int e = t.entry_of(L + 8 * k), i8 = 2 * ib + k;
      if constexpr (kS) {
        uint8_t* qh = out + 66 + i8 / 4;
        out[2 + i8] = static_cast<uint8_t>(e & 255);
        *qh = static_cast<uint8_t>(*qh | ((e >> 8) << (2 * (i8 % 4))));
        out[2 + 32 + i8] = signs[k];
      } else {
        const auto v = static_cast<uint16_t>(e | (signs[k] << 9));
        std::memcpy(out + 2 + 2 * i8, &v, 2);
      }
    }
    scales[ib] = scale;
    max_scale = max_scale > scale ? max_scale : scale;
  }
  if (max_scale == 0) {
    if constexpr (!kS) std::memset(out, 0, kXsBlock);  // (ggml clears IQ2_XS's codes then; IQ2_S keeps them)
    return;
  }
  const float d = max_scale / 31;
  const uint16_t dh = fp32_to_fp16(kS ? d * 0.9875f : d);
  std::memcpy(out, &dh, 2);
  const float id = 1 / d;
  uint8_t* packed_scales = out + (kS ? 74 : 66);
  for (int ib = 0; ib < 16; ib += 2)
    packed_scales[ib / 2] =
        static_cast<uint8_t>(scale_code(id, scales[ib], 15) | (scale_code(id, scales[ib + 1], 15) << 4));
}

}  // namespace

void quantize_row_iq2_xxs(const float* x, void* dst, int64_t n, const float* importance) {
  LOOM_ASSERT(importance != nullptr);  // (quantize_rows refuses these rows without one)
  quantize_superblocks<kXxsBlock, quantize_superblock_iq2_xxs>(x, dst, n, importance);
}

void quantize_row_iq2_xs(const float* x, void* dst, int64_t n, const float* importance) {
  LOOM_ASSERT(importance != nullptr);
  quantize_superblocks<kXsBlock, quantize_superblock_iq2_16<false>>(x, dst, n, importance);
}

void quantize_row_iq2_s(const float* x, void* dst, int64_t n, const float* importance) {
  quantize_superblocks<kSBlock, quantize_superblock_iq2_16<true>>(x, dst, n, importance);
}

}  // namespace loom::quant

// The IQ1_S and IQ1_M row quantizers (ggml's quantize_row_iq1_s_impl and
// quantize_row_iq1_m_impl, on iq2xs_init_impl's tables of the 2,048-entry
// ternary grid). Each weight is -1, 0 or +1 shifted by +-1/8 (one shift per 32
// weights in IQ1_S, per 8 in IQ1_M), so per group the best split of the sorted
// values into the three levels is found exhaustively from prefix sums; groups of
// 8 whose levels are not a grid entry take the nearest entries' best one, and the
// group scales round to 3 bits of one f16 scale. Byte-identical to llama-quantize
// (quantize_impl.h), given the order glibc's qsort (a merge sort for these short
// arrays) leaves equal values in: kept here with a stable sort.

// As in quantize_search.cpp: ggml's products and sums are not fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "core/half.h"
#include "kernels/iq_grids.h"
#include "kernels/quantize_grid.h"
#include "kernels/quantize_impl.h"

namespace loom::quant {
namespace {

constexpr int kSuper = 256;
constexpr int kLattice = 43692;  // ggml's kmap_size (quantize_iq2.cpp)
constexpr float kDelta = 0.125f;  // IQ1S_DELTA, IQ1M_DELTA
constexpr float kPlus[3] = {-1 + kDelta, kDelta, 1 + kDelta};     // the levels with shift +1/8
constexpr float kMinus[3] = {-1 - kDelta, -kDelta, 1 - kDelta};  // ... and -1/8

// kIq1sGrid's bytes are g = -1, 0, 1 (as int8): level g + 1.
int level_of(uint8_t v) { return static_cast<int8_t>(v) + 1; }

// Built at first use (about a second: 2,048 entries for each of 43,692 points).
const GridTables& tables() {
  static const GridTables t = make_grid_tables(kIq1sGrid, 2048, 8, 2, kLattice, 3, level_of);
  return t;
}

// iq1_find_best_neighbour2: of the off-grid point u's neighbours, the entry whose
// shifted levels xg at `scale` fit x best (weighted squared error); writes its
// levels. With no finite error (NaN weights) the first neighbour.
int best_shifted_neighbour(const GridTables& t, int u, const float* x, const float* weight, float scale,
                           const float* xg, int8_t* L) {
  // An entry's values 2 l + 1 (1, 3, 5) select xg[l], bit for bit.
  const LaneInts xg_bits[3] = {LaneInts{} + std::bit_cast<int32_t>(xg[0]), LaneInts{} + std::bit_cast<int32_t>(xg[1]),
                               LaneInts{} + std::bit_cast<int32_t>(xg[2])};
  const int best = least_error_neighbour(t, u, [&](const int8_t* block) {
    LaneFloats d2 = {};
    for (int i = 0; i < 8; ++i) {
      const LaneFloats v = lane_values(block + kLanes * i);
      const LaneInts bits = ((v == 1.0f) & xg_bits[0]) | ((v == 3.0f) & xg_bits[1]) | ((v == 5.0f) & xg_bits[2]);
      const LaneFloats q = std::bit_cast<LaneFloats>(bits);
      const LaneFloats diff = scale * q - x[i];
      d2 += weight[i] * diff * diff;
    }
    return d2;
  });
  const int8_t* pg = t.values_of(best);
  for (int i = 0; i < 8; ++i) L[i] = static_cast<int8_t>((pg[i] - 1) / 2);
  return best;
}

// The group's indices in ascending order of value, equal values in index order.
void sorted_order(const float* xb, int n, int* order) {
  std::iota(order, order + n, 0);
  std::stable_sort(order, order + n, [&](int a, int b) { return xb[a] < xb[b]; });
}

// Levels from a split of the sorted order: below i1 level 0, below i2 level 1, then 2.
void levels_of_split(const int* order, int n, int i1, int i2, int8_t* L) {
  for (int j = 0; j < n; ++j) L[order[j]] = static_cast<int8_t>(j < i1 ? 0 : j < i2 ? 1 : 2);
}

// Each group of 8 as a grid entry (its best shifted neighbour off the grid, xgs[k]
// the shifted levels of group k); false if any was off.
bool entries_of(const GridTables& t, const float* xb, const float* weight, float scale, const float* const* xgs,
                int groups, int8_t* L, uint16_t* index) {
  bool all_on_grid = true;
  for (int k = 0; k < groups; ++k) {
    const int u = t.point_of(L + 8 * k);
    int e = t.entry[static_cast<size_t>(u)];
    if (e < 0) {
      all_on_grid = false;
      e = best_shifted_neighbour(t, u, xb + 8 * k, weight + 8 * k, scale, xgs[k], L + 8 * k);
    }
    index[k] = static_cast<uint16_t>(e);
  }
  return all_on_grid;
}

// The least-squares scale of the chosen entries (kept when not positive).
float refit_scale(const GridTables& t, const float* xb, const float* weight, const float* const* xgs, int groups,
                  const uint16_t* index, float scale) {
  float sumqx = 0, sumq2 = 0;
  for (int k = 0; k < groups; ++k) {
    const int8_t* pg = t.values_of(index[k]);
    for (int j = 0; j < 8; ++j) {
      const float w = weight[8 * k + j];
      const float q = xgs[k][(pg[j] - 1) / 2];
      sumqx += w * q * xb[8 * k + j];
      sumq2 += w * q * q;
    }
  }
  return sumqx > 0 && sumq2 > 0 ? sumqx / sumq2 : scale;
}

float superblock_sigma2(const float* xbl) { return 2 * sum_of_squares(xbl, kSuper) / kSuper; }

float abs_max(const float* xb, int n) {
  float max = std::fabs(xb[0]);
  for (int i = 1; i < n; ++i) max = max > std::fabs(xb[i]) ? max : std::fabs(xb[i]);
  return max;
}

// ---- IQ1_S: groups of 32, one shift each. Block: d, 32 low index bytes, 8 u16
// of 4 x 3 high index bits | the 3-bit scale << 12 | the negative shift << 15 ----
constexpr size_t kSBlock = 2 + 32 + 16;

void quantize_superblock_iq1_s(const float* xbl, const float* qw, uint8_t* out) {
  const GridTables& t = tables();
  std::memset(out, 0, kSBlock);
  uint8_t* qs = out + 2;
  uint16_t qh[8] = {};
  float scales[8];
  int shifts[8];
  float max_scale = 0;
  const float sigma2 = superblock_sigma2(xbl);
  for (int ib = 0; ib < 8; ++ib) {
    const float* xb = xbl + 32 * ib;
    float weight[32];
    for (int i = 0; i < 32; ++i) weight[i] = qw[32 * ib + i] * std::sqrt(sigma2 + xb[i] * xb[i]);
    const float max = abs_max(xb, 32);
    if (max < 1e-12f) {  // GROUP_MAX_EPS_IQ1_S
      scales[ib] = 0;
      shifts[ib] = 1;
      continue;
    }
    int order[32];
    sorted_order(xb, 32, order);
    float sumx[33], sumw[33];
    sumx[0] = sumw[0] = 0;
    for (int j = 0; j < 32; ++j) {
      const int i = order[j];
      sumx[j + 1] = sumx[j] + weight[i] * xb[i];
      sumw[j + 1] = sumw[j] + weight[i];
    }
    // Every split (i1 <= i2) with either shift: the weighted least-squares scale of
    // the three groups, the best score sumqx^2 / sumq2 kept.
    float best_score = -FLT_MAX, scale = max;
    int besti1 = -1, besti2 = -1, best_shift = 0;
    for (int i1 = 0; i1 <= 32; ++i1) {
      for (int i2 = i1; i2 <= 32; ++i2) {
        for (int shift : {1, -1}) {
          const float* v = shift == 1 ? kPlus : kMinus;
          const float sumqx = (sumx[i1] - sumx[0]) * v[0] + (sumx[i2] - sumx[i1]) * v[1] + (sumx[32] - sumx[i2]) * v[2];
          const float sumq2 = (sumw[i1] - sumw[0]) * v[0] * v[0] + (sumw[i2] - sumw[i1]) * v[1] * v[1] +
                              (sumw[32] - sumw[i2]) * v[2] * v[2];
          if (sumq2 > 0 && sumqx * sumqx > best_score * sumq2) {
            scale = sumqx / sumq2;
            best_score = scale * sumqx;
            besti1 = i1;
            besti2 = i2;
            best_shift = shift;
          }
        }
      }
    }
    if (besti1 < 0 || besti2 < 0 || best_shift == 0) {
      scales[ib] = 0;
      shifts[ib] = 1;
      continue;
    }
    int8_t L[32];
    levels_of_split(order, 32, besti1, besti2, L);
    if (scale < 0) {
      for (auto& l : L) l = static_cast<int8_t>(2 - l);
      scale = -scale;
      best_shift = -best_shift;
    }
    const float* xx = best_shift == 1 ? kPlus : kMinus;
    const float* const xgs[4] = {xx, xx, xx, xx};
    uint16_t index[4];
    if (!entries_of(t, xb, weight, scale, xgs, 4, L, index)) scale = refit_scale(t, xb, weight, xgs, 4, index, scale);
    uint16_t h = 0;
    for (int k = 0; k < 4; ++k) {
      qs[4 * ib + k] = static_cast<uint8_t>(index[k] & 255);
      h = static_cast<uint16_t>(h | ((index[k] >> 8) << (3 * k)));
    }
    qh[ib] = h;
    scales[ib] = scale;
    shifts[ib] = best_shift;
    max_scale = max_scale > scale ? max_scale : scale;
  }
  if (max_scale != 0) {
    const float d = max_scale / 15;
    const uint16_t dh = fp32_to_fp16(d * 1.125f);
    std::memcpy(out, &dh, 2);
    const float id = 1 / d;
    for (int ib = 0; ib < 8; ++ib) {
      int l = scale_code(id, scales[ib], 7);
      if (shifts[ib] == -1) l |= 8;
      qh[ib] = static_cast<uint16_t>(qh[ib] | (l << 12));
    }
  }
  std::memcpy(out + 34, qh, sizeof(qh));
}

// ---- IQ1_M: groups of 16, a shift per 8. Block: 32 low index bytes, 16 bytes of
// two (3 high index bits | negative shift << 3), 4 u16 of 4 x 3-bit scales whose
// top nibbles hold the f16 d ----
constexpr size_t kMBlock = 32 + 16 + 8;

void quantize_superblock_iq1_m(const float* xbl, const float* qw, uint8_t* out) {
  const GridTables& t = tables();
  std::memset(out, 0, kMBlock);
  uint8_t* qs = out;
  uint8_t* qh = out + 32;
  uint16_t sc[4] = {};
  float scales[16];
  int shifts[16];  // 0: +, +; 1: +, -; 2: -, +; 3: -, - (the two groups of 8)
  float max_scale = 0;
  const float sigma2 = superblock_sigma2(xbl);
  auto weights_of = [&](int ib, float* weight) {
    const float* xb = xbl + 16 * ib;
    for (int i = 0; i < 16; ++i)
      weight[i] = qw ? qw[16 * ib + i] * std::sqrt(sigma2 + xb[i] * xb[i]) : xb[i] * xb[i];
  };
  auto shifted_levels = [](int shift, int k) {
    return (k == 0 ? shift < 2 : shift % 2 == 0) ? kPlus : kMinus;
  };
  for (int ib = 0; ib < 16; ++ib) {
    const float* xb = xbl + 16 * ib;
    float weight[16];
    weights_of(ib, weight);
    const float max = abs_max(xb, 16);
    if (max < 1e-7f) {  // GROUP_MAX_EPS_IQ1_M
      scales[ib] = 0;
      shifts[ib] = 0;
      continue;
    }
    int order[16];
    sorted_order(xb, 16, order);
    // Prefix sums per half (each half of 8 takes its own shift); with
    // v0 - v1 = v1 - v2 = -1 a split's sum of v x is T v2 - px[i1] - px[i2].
    float px[2][17], pw[2][17];
    px[0][0] = px[1][0] = 0;
    pw[0][0] = pw[1][0] = 0;
    for (int j = 0; j < 16; ++j) {
      const int i = order[j];
      const int h = i < 8 ? 0 : 1;
      px[h][j + 1] = px[h][j] + weight[i] * xb[i];
      px[1 - h][j + 1] = px[1 - h][j];
      pw[h][j + 1] = pw[h][j] + weight[i];
      pw[1 - h][j + 1] = pw[1 - h][j];
    }
    const float txs[2] = {px[0][16], px[1][16]};
    const float tws[2] = {pw[0][16], pw[1][16]};
    const float p2 = kPlus[2], m2 = kMinus[2];
    const float cp1 = kPlus[0] * kPlus[0] - kPlus[1] * kPlus[1];
    const float cp2 = kPlus[1] * kPlus[1] - kPlus[2] * kPlus[2];
    const float cm1 = kMinus[0] * kMinus[0] - kMinus[1] * kMinus[1];
    const float cm2 = kMinus[1] * kMinus[1] - kMinus[2] * kMinus[2];
    float best_score = -FLT_MAX, scale = max;
    int besti1 = -1, besti2 = -1, best_k = -1;
    for (int i1 = 0; i1 <= 16; ++i1) {
      for (int i2 = i1; i2 <= 16; ++i2) {
        float qx_p[2], qx_m[2], q2_p[2], q2_m[2];
        for (int h = 0; h < 2; ++h) {
          const float sx = px[h][i1] + px[h][i2];
          qx_p[h] = txs[h] * p2 - sx;
          qx_m[h] = txs[h] * m2 - sx;
          q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
          q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
        }
        const float sumqx[4] = {qx_p[0] + qx_p[1], qx_p[0] + qx_m[1], qx_m[0] + qx_p[1], qx_m[0] + qx_m[1]};
        const float sumq2[4] = {q2_p[0] + q2_p[1], q2_p[0] + q2_m[1], q2_m[0] + q2_p[1], q2_m[0] + q2_m[1]};
        for (int k = 0; k < 4; ++k) {
          if (sumq2[k] > 0 && sumqx[k] * sumqx[k] > best_score * sumq2[k]) {
            scale = sumqx[k] / sumq2[k];
            best_score = scale * sumqx[k];
            besti1 = i1;
            besti2 = i2;
            best_k = k;
          }
        }
      }
    }
    if (besti1 < 0 || besti2 < 0 || best_k < 0) {
      scales[ib] = 0;
      shifts[ib] = 0;
      continue;
    }
    int8_t L[16];
    levels_of_split(order, 16, besti1, besti2, L);
    if (scale < 0) {
      for (auto& l : L) l = static_cast<int8_t>(2 - l);
      scale = -scale;
      best_k = 3 - best_k;
    }
    const float* const xgs[2] = {shifted_levels(best_k, 0), shifted_levels(best_k, 1)};
    uint16_t index[2];
    if (!entries_of(t, xb, weight, scale, xgs, 2, L, index)) scale = refit_scale(t, xb, weight, xgs, 2, index, scale);
    qs[2 * ib] = static_cast<uint8_t>(index[0] & 255);
    qs[2 * ib + 1] = static_cast<uint8_t>(index[1] & 255);
    qh[ib] = static_cast<uint8_t>((index[0] >> 8) | ((index[1] >> 8) << 4));
    scales[ib] = scale;
    shifts[ib] = best_k;
    max_scale = max_scale > scale ? max_scale : scale;
  }
  if (max_scale == 0) return;
  // The 3-bit scales, then d refitted over the whole superblock with them.
  constexpr uint8_t kShiftMasks[4] = {0x00, 0x80, 0x08, 0x88};
  float d = max_scale / 15;
  const float id = 1 / d;
  float sumqx = 0, sumq2 = 0;
  for (int ib = 0; ib < 16; ++ib) {
    const int l = scale_code(id, scales[ib], 7);
    sc[ib / 4] = static_cast<uint16_t>(sc[ib / 4] | (l << (3 * (ib % 4))));
    qh[ib] = static_cast<uint8_t>(qh[ib] | kShiftMasks[shifts[ib]]);
    const float* xb = xbl + 16 * ib;
    float weight[16];
    weights_of(ib, weight);
    for (int k = 0; k < 2; ++k) {
      const float* xx = shifted_levels(shifts[ib], k);
      const int e = qs[2 * ib + k] + ((qh[ib] << (8 - 4 * k)) & 0x700);
      const int8_t* pg = t.values_of(e);
      for (int j = 0; j < 8; ++j) {
        const float w = weight[8 * k + j];
        const float q = xx[(pg[j] - 1) / 2] * as_float(2 * l + 1);
        sumqx += w * q * xb[8 * k + j];
        sumq2 += w * q * q;
      }
    }
  }
  if (sumq2 > 0) d = sumqx / sumq2;
  const uint16_t dh = fp32_to_fp16(d * 1.1125f);
  sc[0] = static_cast<uint16_t>(sc[0] | ((dh & 0x000f) << 12));
  sc[1] = static_cast<uint16_t>(sc[1] | ((dh & 0x00f0) << 8));
  sc[2] = static_cast<uint16_t>(sc[2] | ((dh & 0x0f00) << 4));
  sc[3] = static_cast<uint16_t>(sc[3] | (dh & 0xf000));
  std::memcpy(out + 48, sc, sizeof(sc));
}

}  // namespace

void quantize_row_iq1_s(const float* x, void* dst, int64_t n, const float* importance) {
  LOOM_ASSERT(importance != nullptr);  // (quantize_rows refuses these rows without one)
  quantize_superblocks<kSBlock, quantize_superblock_iq1_s>(x, dst, n, importance);
}

void quantize_row_iq1_m(const float* x, void* dst, int64_t n, const float* importance) {
  quantize_superblocks<kMBlock, quantize_superblock_iq1_m>(x, dst, n, importance);
}

}  // namespace loom::quant

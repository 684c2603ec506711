// The IQ3_XXS and IQ3_S row quantizers (ggml's quantize_row_iq3_xxs_impl and
// quantize_row_iq3_s_impl, with the search tables of iq3xs_init_impl). Per group
// of 32 the signs go apart (IQ3_XXS: an even count per 8, the cheapest weight
// flipped), and the magnitudes take the grid of 4-value entries (levels 2l + 1,
// l = 0..7) at the scale that fits best by weighted least squares over trial
// scales; a group of 4 whose rounded levels are not a grid entry takes the
// nearest entries' best one (the neighbour lists below). The group scales then
// round to 4 bits of one f16 superblock scale. Byte-identical to llama-quantize
// (quantize_impl.h): ggml's float operations in ggml's order, its quirks kept.

// As in quantize_search.cpp: ggml's products and sums are not fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/half.h"
#include "kernels/iq_grids.h"
#include "kernels/quantize_grid.h"
#include "kernels/quantize_impl.h"

namespace loom::quant {
namespace {

constexpr int kSuper = 256;
constexpr int kGroup = 32;
constexpr int kMaxQ = 8;               // levels 0..7 of a grid value 2l + 1
constexpr int kLattice = 1 << 12;      // 4 levels of 3 bits: every point a group of 4 may round to
constexpr float kXxsGroupEps = 1e-8f;  // ggml's GROUP_MAX_EPS_IQ3_XXS

// Each dequantization grid byte's level: IQ3_XXS stores 8l + 4 (but 62 for
// l = 7), IQ3_S the value 2l + 1 itself.
int level_xxs(uint8_t v) { return (v - 4) / 8; }
int level_s(uint8_t v) { return (v - 1) / 2; }

// Built at first use (milliseconds), once per grid.
const GridTables& tables_xxs() {
  static const GridTables t = make_grid_tables(kIq3xxsGrid, 256, 4, 3, kLattice, 2, level_xxs);
  return t;
}
const GridTables& tables_s() {
  static const GridTables t = make_grid_tables(kIq3sGrid, 512, 4, 3, kLattice, 3, level_s);
  return t;
}

// Levels of each group of 4 at the inverse scale id (0..7), off-grid groups
// replaced by their best neighbour at `scale`; on_grid[k] says which were on the grid.
void levels_at(const GridTables& t, const float* xval, const float* waux, float id, float scale, int8_t* L,
               bool* on_grid) {
  for (int k = 0; k < kGroup / 4; ++k)
    on_grid[k] = round_to_grid(t, xval + 4 * k, waux + 4 * k, id, scale, kMaxQ - 1, L + 4 * k);
}

// A group's weights: importance * sqrt(sigma2 + x^2), or x^2 without importance;
// waux their square roots.
// Group ib of a superblock (both types): its weights (and their roots), the
// magnitudes and sign bits of its four groups of 8 (`even_count`: IQ3_XXS's
// parity flip, split_signs), and the largest magnitude, returned.
float group_magnitudes(const float* xbl, const float* qw, float sigma2, int ib, bool even_count, float* weight,
                       float* waux, float* xval, uint8_t* signs) {
  const float* xb = xbl + kGroup * ib;
  if (qw != nullptr) qw += kGroup * ib;
  for (int i = 0; i < kGroup; ++i) weight[i] = qw ? qw[i] * std::sqrt(sigma2 + xb[i] * xb[i]) : xb[i] * xb[i];
  for (int i = 0; i < kGroup; ++i) waux[i] = std::sqrt(weight[i]);
  for (int k = 0; k < 4; ++k) signs[k] = split_signs(xb + 8 * k, weight + 8 * k, even_count, xval + 8 * k);
  return max_of(xval, kGroup);
}

float superblock_sigma2(const float* xbl) { return 2 * sum_of_squares(xbl, kSuper) / kSuper; }

// The scale search of one group of magnitudes (both types): trial inverse scales
// (2 kMaxQ - 1 + 0.2 is) / max for is in [-is_max, is_max], the best kept; then,
// if some group of 4 was off the grid, every such group (all of them, with
// `redo_all`: IQ3_S) re-rounded at the best scale and the scale refitted.
// Returns the scale; L holds the levels, on the grid.
float search_group(const GridTables& t, const float* xval, const float* weight, const float* waux, float max,
                   int is_max, bool on_grid_start, bool redo_all, int8_t* L) {
  float best = 0;
  float scale = max / (2 * kMaxQ - 1);
  bool on_grid[kGroup / 4], on_grid_aux[kGroup / 4];
  std::fill(on_grid, on_grid + kGroup / 4, on_grid_start);
  std::memset(L, 0, kGroup);  // kept if no trial fits (all weights zero)
  int8_t Laux[kGroup];
  for (int is = -is_max; is <= is_max; ++is) {
    const float id = (2 * kMaxQ - 1 + as_float(is) * 0.2f) / max;
    const float this_scale = 1 / id;
    levels_at(t, xval, waux, id, this_scale, Laux, on_grid_aux);
    const auto [sumqx, sumq2] = fit_sums(kGroup, weight, xval, Laux);
    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
      scale = sumqx / sumq2;
      best = scale * sumqx;
      std::memcpy(L, Laux, kGroup);
      std::copy(on_grid_aux, on_grid_aux + kGroup / 4, on_grid);
    }
  }
  const bool any_off = std::find(on_grid, on_grid + kGroup / 4, false) != on_grid + kGroup / 4;
  if (any_off && scale > 0) {
    const float id = 1 / scale;
    for (int k = 0; k < kGroup / 4; ++k) {
      if (!on_grid[k] || redo_all) round_to_grid(t, xval + 4 * k, waux + 4 * k, id, scale, kMaxQ - 1, L + 4 * k);
    }
    const auto [sumqx, sumq2] = fit_sums(kGroup, weight, xval, L);
    if (sumq2 > 0) scale = sumqx / sumq2;
  }
  return scale;
}

// block_iq3_xxs: d, then 64 grid entries (8 a group), then per group a u32 of
// 4 x 7 sign bits (the 8th of each 8 by even parity) and the 4-bit scale << 28.
constexpr size_t kXxsBlock = 2 + 64 + 32;

void quantize_superblock_iq3_xxs(const float* xbl, const float* qw, uint8_t* out) {
  const GridTables& t = tables_xxs();
  uint8_t q3[64 + 32] = {};
  uint32_t scales_and_signs[kSuper / kGroup] = {};
  float scales[kSuper / kGroup];
  float max_scale = 0;
  const float sigma2 = superblock_sigma2(xbl);
  for (int ib = 0; ib < kSuper / kGroup; ++ib) {
    float weight[kGroup], waux[kGroup], xval[kGroup];
    uint8_t block_signs[4];
    const float max = group_magnitudes(xbl, qw, sigma2, ib, true, weight, waux, xval, block_signs);
    if (max < kXxsGroupEps) {
      scales[ib] = 0;
      continue;
    }
    int8_t L[kGroup];
    float scale = search_group(t, xval, weight, waux, max, 15, true, false, L);
    if (scale < 0) {  // (never, says ggml) the codes are unsigned: flip the signs instead
      scale = -scale;
      for (auto& s : block_signs) s = static_cast<uint8_t>(~s & 127);
    }
    for (int k = 0; k < 8; ++k) q3[8 * ib + k] = static_cast<uint8_t>(t.entry_of(L + 4 * k));
    scales_and_signs[ib] = block_signs[0] | (block_signs[1] << 7) | (block_signs[2] << 14) |
                           (static_cast<uint32_t>(block_signs[3]) << 21);
    scales[ib] = scale;
    max_scale = max_scale > scale ? max_scale : scale;
  }
  std::memset(out, 0, kXxsBlock);
  if (max_scale == 0) return;
  const float d = max_scale / 31;
  const uint16_t dh = fp32_to_fp16(d * 1.0125f);
  const float id = 1 / d;
  for (int ib = 0; ib < kSuper / kGroup; ++ib)
    scales_and_signs[ib] |= static_cast<uint32_t>(scale_code(id, scales[ib], 15)) << 28;
  std::memcpy(q3 + 64, scales_and_signs, sizeof(scales_and_signs));
  std::memcpy(out, &dh, 2);
  std::memcpy(out + 2, q3, sizeof(q3));
}

// block_iq3_s: d, 64 low index bytes, 8 bytes of index bit 8 (bit k of byte ib:
// group ib's entry k), 32 sign bytes, 4 bytes of two 4-bit group scales.
constexpr size_t kSBlock = 2 + 64 + 8 + 32 + 4;

void quantize_superblock_iq3_s(const float* xbl, const float* qw, uint8_t* out) {
  const GridTables& t = tables_s();
  std::memset(out, 0, kSBlock);
  uint8_t* qs = out + 2;
  uint8_t* qh = out + 66;
  uint8_t* signs = out + 74;
  uint8_t* packed_scales = out + 106;
  float scales[kSuper / kGroup];
  float max_scale = 0;
  const float sigma2 = superblock_sigma2(xbl);
  for (int ib = 0; ib < kSuper / kGroup; ++ib) {
    float weight[kGroup], waux[kGroup], xval[kGroup];
    uint8_t block_signs[4];
    const float max = group_magnitudes(xbl, qw, sigma2, ib, false, weight, waux, xval, block_signs);
    if (max == 0) {
      // ggml moves on without advancing its qs and signs pointers: the next
      // group's entries and signs land in this group's slots (and the last
      // slots stay zero). Kept for identical files.
      scales[ib] = 0;
      continue;
    }
    int8_t L[kGroup];
    float scale = search_group(t, xval, weight, waux, max, 9, false, true, L);
    if (scale < 0) {
      scale = -scale;
      for (auto& s : block_signs) s = static_cast<uint8_t>(~s);
    }
    for (int k = 0; k < 8; ++k) {
      const int e = t.entry_of(L + 4 * k);
      qs[k] = static_cast<uint8_t>(e & 255);
      qh[(ib * 8 + k) / 8] = static_cast<uint8_t>(qh[(ib * 8 + k) / 8] | ((e >> 8) << ((ib * 8 + k) % 8)));
    }
    qs += 8;
    std::memcpy(signs, block_signs, 4);
    signs += 4;
    scales[ib] = scale;
    max_scale = max_scale > scale ? max_scale : scale;
  }
  if (max_scale == 0) return;
  const float d = max_scale / 31;
  const uint16_t dh = fp32_to_fp16(d * 1.033f);
  std::memcpy(out, &dh, 2);
  const float id = 1 / d;
  for (int ib = 0; ib < kSuper / kGroup; ib += 2)
    packed_scales[ib / 2] = static_cast<uint8_t>(scale_code(id, scales[ib], 15) | (scale_code(id, scales[ib + 1], 15) << 4));
}

}  // namespace

void quantize_row_iq3_xxs(const float* x, void* dst, int64_t n, const float* importance) {
  quantize_superblocks<kXxsBlock, quantize_superblock_iq3_xxs>(x, dst, n, importance);
}

void quantize_row_iq3_s(const float* x, void* dst, int64_t n, const float* importance) {
  quantize_superblocks<kSBlock, quantize_superblock_iq3_s>(x, dst, n, importance);
}

}  // namespace loom::quant

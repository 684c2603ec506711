// Internal to kernels/quantize_iq*.cpp: the search tables of ggml's grid
// quantizers (iq2xs_init_impl, iq3xs_init_impl) and their nearest-entry search
// (iq2_find_best_neighbour, iq3_find_best_neighbour). A grid entry is `values`
// levels l (its values 2l + 1); a lattice point packs one level per `bits` bits,
// value i lowest; a point off the grid lists the entries at its `nwant` smallest
// squared distances, nearest first, ties by entry (ggml's qsort order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/quantize_impl.h"

namespace loom::quant {

struct GridTables {
  int values = 0;                   // per entry: 4 (IQ3) or 8 (IQ2)
  int bits = 0;                     // per level in a lattice point: 3 or 2
  std::vector<int8_t> grid;         // entry e's values 2l + 1 at [values * e]
  std::vector<int> entry;           // per lattice point: its entry, or -1 off the grid
  std::vector<int> neighbours_at;   // off the grid: where its list starts in `neighbours`
  std::vector<uint16_t> neighbours;  // per list: the count, then the entries
  // Per list, its entries' values in blocks of 8 entries, value-major: block b's
  // value i of entry 8b + l at [lanes_at[u] + 8 (values b + i) + l] (0 past the
  // list's end), so best_neighbour errors 8 entries at a time from plain loads.
  std::vector<int> lanes_at;
  std::vector<int8_t> lanes;

  const int8_t* values_of(int e) const { return grid.data() + static_cast<size_t>(values) * e; }
  // The lattice point of `values` levels.
  int point_of(const int8_t* L) const {
    int u = 0;
    for (int i = 0; i < values; ++i) u |= L[i] << (bits * i);
    return u;
  }
  // The grid entry of levels the search left on the grid.
  int entry_of(const int8_t* L) const;
};

// The tables of a dequantization grid (kernels/iq_grids.h: `size` entries of
// `values` bytes, byte i the value of weight i), each byte's level given by
// `level_of`; `lattice` points (ggml's kmap_size).
GridTables make_grid_tables(const void* dequant_grid, int size, int values, int bits, int lattice, int nwant,
                            int (*level_of)(uint8_t));

// Of the off-grid point u's neighbours, the entry whose values at `scale` fit
// xval best (sum weight (scale q - x)^2, the first of equals; the first one when
// no error is a number); writes its levels to L and returns it.
int best_neighbour(const GridTables& t, int u, const float* xval, const float* weight, float scale, int8_t* L);

// Of the off-grid point u's neighbours, the entry of least error (the first of
// equals; the first one when no error compares, as with NaN weights). `errors`
// gives 8 entries' errors from their block of t.lanes (values-major).
template <class Errors>
int least_error_neighbour(const GridTables& t, int u, Errors errors) {
  const uint16_t* list = t.neighbours.data() + t.neighbours_at[static_cast<size_t>(u)];
  const int8_t* block = t.lanes.data() + t.lanes_at[static_cast<size_t>(u)];
  const int n = list[0];
  float best_d2 = std::numeric_limits<float>::max();
  int best = list[1];
  for (int j0 = 0; j0 < n; j0 += kLanes, block += kLanes * t.values) {
    const LaneFloats d2 = errors(block);
    if (!any_lane(d2 < best_d2)) continue;  // the usual block: none better (NaN never is)
    for (int l = 0; l < kLanes && j0 + l < n; ++l)
      if (d2[l] < best_d2) {
        best_d2 = d2[l];
        best = list[1 + j0 + l];
      }
  }
  return best;
}

// Rounds one entry's magnitudes to levels at the inverse scale id (each
// nearest_int(0.5 (id x - 1)) clamped to 0..max_level), replaced by the best
// neighbour at `scale` when off the grid; returns whether they were on it.
bool round_to_grid(const GridTables& t, const float* xval, const float* waux, float id, float scale, int max_level,
                   int8_t* L);

// A row of superblocks of 256 values, each quantized by kSuperblock(x, importance
// or null, out) into kBlock bytes.
template <size_t kBlock, void (*kSuperblock)(const float*, const float*, uint8_t*)>
void quantize_superblocks(const float* x, void* dst, int64_t n, const float* importance) {
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t ibl = 0; ibl < n / 256; ++ibl)
    kSuperblock(x + 256 * ibl, importance ? importance + 256 * ibl : nullptr, out + static_cast<size_t>(ibl) * kBlock);
}

// Steps the grid quantizers share, in ggml's float operations and order:
// sum x^2 over n values,
float sum_of_squares(const float* x, int n);
// the largest of n values (ggml's MAX fold),
float max_of(const float* x, int n);
// sum w x q and sum w q^2 over n values with q = 2 L + 1,
std::pair<float, float> fit_sums(int n, const float* weight, const float* xval, const int8_t* L);
// the magnitudes of 8 values and their sign bits (bit i: x[i] < 0); with
// `even_count`, the sign of the value of least weight x^2 flipped to make the
// count even, and 7 bits returned (the 8th is implied),
uint8_t split_signs(const float* x, const float* weight, bool even_count, float* xval);
// and a group scale's code of max_code + 1 steps of the superblock scale 1 / id.
int scale_code(float id, float scale, int max_code);

}  // namespace loom::quant

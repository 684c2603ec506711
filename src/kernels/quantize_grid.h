// Internal to kernels/quantize_iq*.cpp: the search tables of ggml's grid
// quantizers (iq2xs_init_impl, iq3xs_init_impl) and their nearest-entry search
// (iq2_find_best_neighbour, iq3_find_best_neighbour). A grid entry is `values`
// levels l (its values 2l + 1); a lattice point packs one level per `bits` bits,
// value i lowest; a point off the grid lists the entries at its `nwant` smallest
// squared distances, nearest first, ties by entry (ggml's qsort order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::quant {

struct GridTables {
  int values = 0;                   // per entry: 4 (IQ3) or 8 (IQ2)
  int bits = 0;                     // per level in a lattice point: 3 or 2
  std::vector<int8_t> grid;         // entry e's values 2l + 1 at [values * e]
  std::vector<int> entry;           // per lattice point: its entry, or -1 off the grid
  std::vector<int> neighbours_at;   // off the grid: where its list starts in `neighbours`
  std::vector<uint16_t> neighbours;  // per list: the count, then the entries

  const int8_t* values_of(int e) const { return grid.data() + static_cast<size_t>(values) * e; }
  // The lattice point of `values` levels.
  int point_of(const int8_t* L) const {
    int u = 0;
    for (int i = 0; i < values; ++i) u |= L[i] << (bits * i);
    return u;
  }
};

// The tables of a dequantization grid (kernels/iq_grids.h: `size` entries of
// `values` bytes, byte i the value of weight i), each byte's level given by
// `level_of`; `lattice` points (ggml's kmap_size).
GridTables make_grid_tables(const void* dequant_grid, int size, int values, int bits, int lattice, int nwant,
                            int (*level_of)(uint8_t));

// Of the off-grid point u's neighbours, the entry whose values at `scale` fit
// xval best (sum weight (scale q - x)^2, the first of equals); writes its levels
// to L and returns it.
int best_neighbour(const GridTables& t, int u, const float* xval, const float* weight, float scale, int8_t* L);

}  // namespace loom::quant

// The grid quantizers' search tables (quantize_grid.h).

// As in quantize_search.cpp: ggml's products and sums are not fused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/quantize_grid.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/quantize_impl.h"

namespace loom::quant {
namespace {

void add_lanes(GridTables& t, int u, const uint16_t* list) {
  const int n = list[0];
  t.lanes_at[static_cast<size_t>(u)] = static_cast<int>(t.lanes.size());
  for (int j0 = 0; j0 < n; j0 += kLanes)
    for (int i = 0; i < t.values; ++i)
      for (int l = 0; l < kLanes; ++l)
        t.lanes.push_back(j0 + l < n ? t.values_of(list[1 + j0 + l])[i] : int8_t{0});
}

}  // namespace

GridTables make_grid_tables(const void* dequant_grid, int size, int values, int bits, int lattice, int nwant,
                            int (*level_of)(uint8_t)) {
  GridTables t;
  t.values = values;
  t.bits = bits;
  t.grid.resize(static_cast<size_t>(size * values));
  t.entry.assign(static_cast<size_t>(lattice), -1);
  t.neighbours_at.assign(static_cast<size_t>(lattice), -1);
  t.lanes_at.assign(static_cast<size_t>(lattice), -1);
  const auto* bytes = static_cast<const uint8_t*>(dequant_grid);
  for (int e = 0; e < size; ++e) {
    int8_t levels[8];
    for (int i = 0; i < values; ++i) {
      levels[i] = static_cast<int8_t>(level_of(bytes[static_cast<size_t>(e * values + i)]));
      t.grid[static_cast<size_t>(e * values + i)] = static_cast<int8_t>(2 * levels[i] + 1);
    }
    t.entry[static_cast<size_t>(t.point_of(levels))] = e;
  }
  // Squared distances are small integers: bucket the entries by distance instead
  // of sorting them (the same order as ggml's qsort by distance, then entry).
  const int mask = (1 << bits) - 1;
  std::vector<int> d2(static_cast<size_t>(size));
  std::vector<int> count;
  for (int u = 0; u < lattice; ++u) {
    if (t.entry[static_cast<size_t>(u)] >= 0) continue;
    int max_d2 = 0;
    for (int e = 0; e < size; ++e) {
      int s = 0;
      for (int i = 0; i < values; ++i) {
        const int d = t.grid[static_cast<size_t>(e * values + i)] - (2 * ((u >> (bits * i)) & mask) + 1);
        s += d * d;
      }
      d2[static_cast<size_t>(e)] = s;
      max_d2 = s > max_d2 ? s : max_d2;
    }
    count.assign(static_cast<size_t>(max_d2) + 1, 0);
    for (int e = 0; e < size; ++e) ++count[static_cast<size_t>(d2[static_cast<size_t>(e)])];
    t.neighbours_at[static_cast<size_t>(u)] = static_cast<int>(t.neighbours.size());
    const size_t count_at = t.neighbours.size();
    t.neighbours.push_back(0);
    int distinct = 0;
    for (int d = 0; d <= max_d2 && distinct < nwant; ++d) {
      if (count[static_cast<size_t>(d)] == 0) continue;
      ++distinct;
      for (int e = 0; e < size; ++e)
        if (d2[static_cast<size_t>(e)] == d) t.neighbours.push_back(static_cast<uint16_t>(e));
    }
    t.neighbours[count_at] = static_cast<uint16_t>(t.neighbours.size() - count_at - 1);
    add_lanes(t, u, t.neighbours.data() + count_at);
  }
  return t;
}

int best_neighbour(const GridTables& t, int u, const float* xval, const float* weight, float scale, int8_t* L) {
  const int best = least_error_neighbour(t, u, [&](const int8_t* block) {
    LaneFloats d2 = {};
    for (int i = 0; i < t.values; ++i) {
      const LaneFloats diff = scale * lane_values(block + kLanes * i) - xval[i];
      d2 += weight[i] * diff * diff;
    }
    return d2;
  });
  const int8_t* pg = t.values_of(best);
  for (int i = 0; i < t.values; ++i) L[i] = static_cast<int8_t>((pg[i] - 1) / 2);
  return best;
}

int GridTables::entry_of(const int8_t* L) const {
  const int e = entry[static_cast<size_t>(point_of(L))];
  LOOM_ASSERT(e >= 0);
  return e;
}

bool round_to_grid(const GridTables& t, const float* xval, const float* waux, float id, float scale, int max_level,
                   int8_t* L) {
  for (int i = 0; i < t.values; ++i)
    L[i] = static_cast<int8_t>(std::clamp(nearest_int(0.5f * (id * xval[i] - 1)), 0, max_level));
  const int u = t.point_of(L);
  if (t.entry[static_cast<size_t>(u)] >= 0) return true;
  best_neighbour(t, u, xval, waux, scale, L);
  return false;
}

float sum_of_squares(const float* x, int n) {
  float s = 0;
  for (int i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

float max_of(const float* x, int n) {
  float max = x[0];
  for (int i = 1; i < n; ++i) max = max > x[i] ? max : x[i];
  return max;
}

std::pair<float, float> fit_sums(int n, const float* weight, const float* xval, const int8_t* L) {
  float sumqx = 0, sumq2 = 0;
  for (int i = 0; i < n; ++i) {
    const float w = weight[i];
    const float q = as_float(2 * L[i] + 1);
    sumqx += w * xval[i] * q;
    sumq2 += w * q * q;
  }
  return {sumqx, sumq2};
}

uint8_t split_signs(const float* x, const float* weight, bool even_count, float* xval) {
  uint8_t s = 0;
  int nflip = 0;
  for (int i = 0; i < 8; ++i) {
    if (x[i] >= 0) {
      xval[i] = x[i];
    } else {
      xval[i] = -x[i];
      ++nflip;
      s = static_cast<uint8_t>(s | (1 << i));
    }
  }
  if (!even_count) return s;
  if (nflip % 2) {
    int imin = 0;
    float min = weight[imin] * x[imin] * x[imin];
    for (int i = 1; i < 8; ++i) {
      const float ax = weight[i] * x[i] * x[i];
      if (ax < min) {
        min = ax;
        imin = i;
      }
    }
    xval[imin] = -xval[imin];
    s = static_cast<uint8_t>(s ^ (1 << imin));
  }
  return s & 127;
}

int scale_code(float id, float scale, int max_code) {
  return std::clamp(nearest_int(0.5f * (id * scale - 1)), 0, max_code);
}

}  // namespace loom::quant

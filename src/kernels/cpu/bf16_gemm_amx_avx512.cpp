// AMX-BF16 kernel of the bf16 input-gradient product (bf16_gemm.h): 2 x 2
// result tiles (32 rows x 32 output columns) in tmm0-3, dy tiles in tmm4-5, W^T
// tiles in tmm6-7; one TDPBF16PS per result tile and step of 32 n.
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/cpu/bf16_gemm.h"

#include "kernels/cpu/amx_tiles.h"

namespace loom::cpu {
namespace {

using TileConfig = AmxTileConfig;
inline void compiler_barrier() { amx_compiler_barrier(); }

void configure_tiles() { amx_configure_16x64(); }

void write_dx(const Bf16Work& w, const float* buf, int64_t tt, int64_t p) {
  amx_write_dx_tile(w.dx, w.ldx, w.T, w.K, w.accumulate, buf, tt, p);
}

// Result tile C (a tmm number) of t-tile tt and panel p: start or finish a chunk.
#define LOOM_BF16_START(C, tt, p)           \
  do {                                      \
    if (first)                              \
      _tile_zero(C);                        \
    else                                    \
      _tile_loadd(C, c_tile(w, tt, p), 64); \
  } while (0)
// A whole tile of an overwritten dx is stored directly.
#define LOOM_BF16_FINISH(C, tt, p)                                               \
  do {                                                                           \
    if (!last) {                                                                 \
      _tile_stored(C, c_tile(w, tt, p), 64);                                     \
    } else if (!w.accumulate && 16 * (tt) + 16 <= w.T && 16 * (p) + 16 <= w.K) { \
      _tile_stored(C, w.dx + 16 * (tt)*w.ldx + 16 * (p), w.ldx * sizeof(float)); \
    } else {                                                                     \
      _tile_stored(C, buf, 64);                                                  \
      compiler_barrier();                                                        \
      write_dx(w, buf, tt, p);                                                   \
    }                                                                            \
  } while (0)

// TT t-tiles x PP panels (each 1 or 2) from (tt, p) over steps [s0, s1).
template <int TT, int PP>
void micro(const Bf16Work& w, int64_t tt, int64_t p, int64_t s0, int64_t s1, bool first, bool last) {
  alignas(64) float buf[256];
  LOOM_BF16_START(0, tt, p);
  if constexpr (PP == 2) LOOM_BF16_START(1, tt, p + 1);
  if constexpr (TT == 2) LOOM_BF16_START(2, tt + 1, p);
  if constexpr (TT == 2 && PP == 2) LOOM_BF16_START(3, tt + 1, p + 1);
  const uint8_t* a0 = a_tile(w, tt, 0);
  [[maybe_unused]] const uint8_t* a1 = a0 + static_cast<size_t>(w.n_steps) * kBf16TileBytes;
  const uint8_t* b0 = b_tile(w, p, 0);
  [[maybe_unused]] const uint8_t* b1 = b0 + w.pstride;
  const size_t off = static_cast<size_t>(s0) * kBf16TileBytes;
  amx_bf16_dot_steps<TT, PP>(a0 + off, a1 + off, b0 + off, b1 + off, s1 - s0);
  LOOM_BF16_FINISH(0, tt, p);
  if constexpr (PP == 2) LOOM_BF16_FINISH(1, tt, p + 1);
  if constexpr (TT == 2) LOOM_BF16_FINISH(2, tt + 1, p);
  if constexpr (TT == 2 && PP == 2) LOOM_BF16_FINISH(3, tt + 1, p + 1);
}

struct AmxImpl {
  static void block(const Bf16Work& w, int64_t tt0, int64_t tt1, int64_t p0, int64_t p1, int64_t s0,
                    int64_t s1, bool first, bool last) {
    for (int64_t p = p0; p < p1; p += 2) {
      const bool pp2 = p + 1 < p1;
      for (int64_t tt = tt0; tt < tt1; tt += 2) {
        const bool tt2 = tt + 1 < tt1;
        if (tt2 && pp2)
          micro<2, 2>(w, tt, p, s0, s1, first, last);
        else if (tt2)
          micro<2, 1>(w, tt, p, s0, s1, first, last);
        else if (pp2)
          micro<1, 2>(w, tt, p, s0, s1, first, last);
        else
          micro<1, 1>(w, tt, p, s0, s1, first, last);
      }
    }
  }
};

}  // namespace

void bf16_work_amx(const Bf16Work& w) {
  configure_tiles();
  compiler_barrier();  // the dy / W^T tiles were written with plain stores
  drive_bf16<AmxImpl>(w);
  _tile_release();
}

}  // namespace loom::cpu

// Tile drivers shared by the AVX2 and AVX-512 panel kernels: walk a range of
// panels x tokens in register tiles of P panels x C tokens. The per-lane
// arithmetic of a tile never depends on P or C, so the choice of tile shapes
// (and of thread split) cannot change any result. Included by files compiled
// with different ISA flags: their Impl types live in anonymous namespaces, so
// every instantiation is local to its file (no ODR mixing of ISAs).
#pragma once

#include <cstdint>

#include "kernels/cpu/panel.h"

namespace loom::cpu {
namespace {  // see above: keeps each ISA's instantiations in its own file

struct TileArgs {
  const uint8_t* pan;  // first panel of the tile
  size_t pstride;
  const uint8_t* act;  // first token's act row
  size_t astride;
  int64_t K;
  float* y;  // y of (first token, first row of first panel)
  int64_t ldy;
  int64_t nv;  // valid rows counted from the first panel (may exceed 16*P)
};

template <class Impl, int P, int C>
inline void dispatch_c(int cn, const TileArgs& ta) {
  if constexpr (C >= 1) {
    if (cn == C) {
      Impl::template run<P, C>(ta);
      return;
    }
    dispatch_c<Impl, P, C - 1>(cn, ta);
  }
}

template <class Impl, int P, int C>
inline void dispatch_pc(int pn, int cn, const TileArgs& ta) {
  if constexpr (P >= 1) {
    if (pn == P) {
      dispatch_c<Impl, P, C>(cn, ta);
      return;
    }
    dispatch_pc<Impl, P - 1, C>(pn, cn, ta);
  }
}

inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// Impl provides run<P, C>(const TileArgs&) and the tile sizes kP1 (panels per
// tile when T == 1), kPB and kCB (panels and tokens per tile when T > 1).
// Loops panels outermost so a panel group stays in L1 while all tokens stream by.
template <class Impl>
void drive_tiles(const KernelArgs& a) {
  const bool decode = a.T == 1;
  const int PT = decode ? Impl::kP1 : Impl::kPB;
  const int CT = decode ? 1 : Impl::kCB;
  for (int64_t p = 0; p < a.n_panels; p += PT) {
    const int pn = static_cast<int>(min_i64(PT, a.n_panels - p));
    for (int64_t t = 0; t < a.T; t += CT) {
      const int cn = static_cast<int>(min_i64(CT, a.T - t));
      TileArgs ta{
          a.panels + p * a.panel_stride,    a.panel_stride, a.act + t * a.act_stride,  a.act_stride, a.K,
          a.y + t * a.ldy + p * kPanelRows, a.ldy,          a.n_valid - p * kPanelRows};
      if (decode)
        dispatch_pc<Impl, Impl::kP1, 1>(pn, 1, ta);
      else
        dispatch_pc<Impl, Impl::kPB, Impl::kCB>(pn, cn, ta);
    }
  }
}

}  // namespace
}  // namespace loom::cpu

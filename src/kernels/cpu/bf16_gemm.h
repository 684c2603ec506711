// bf16 products dx [T, K] (+)= dy [T, N] W [N, K] for input gradients through
// frozen weights: layouts and the kernels' interface (driver: bf16_gemm.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

// Forward declarations only: this header is also included by files built with
// AVX-512 / AMX flags, which must not instantiate inline code shared with others.
namespace loom {
class ThreadPool;
class PackedWeight;
class MatmulScratch;
enum class Bf16Kernel;
}  // namespace loom

namespace loom::cpu {

// Both operands come in 1 KB tiles shaped for one AMX TDPBF16PS (16 x 16 f32 +=
// 16 x 32 bf16 . 32 x 16 bf16); the AVX-512 and AVX2 kernels read the same bytes.
//
// W^T (PackedLayout::bf16_pairs, K rows of N): panels of 16 rows k (one output
// column each, the "lanes") by N padded to a multiple of 32 (zeros). Step s of a
// panel (n = 32s .. 32s+31) is 16 pair rows of 64 bytes: pair row j holds, for
// lane r = 0..15, W^T[k0 + r][32s + 2j] then W^T[k0 + r][32s + 2j + 1] (the
// "VNNI" order: a pair row is one zmm of 16 lanes x 2 bf16).
//
// dy: t-tiles of 16 rows (rows >= T are zeros); tile (tt, s) is 16 rows of 32
// bf16 (dy[16 tt + r][32 s + c], zeros past N), 64 bytes a row.
constexpr int64_t kBf16Step = 32;        // n per tile step
constexpr size_t kBf16TileBytes = 1024;  // one operand tile, and one 16 x 16 f32 result tile

namespace {  // (inline helpers stay local to each file: see the note above)
inline int64_t bf16_steps(int64_t N) { return (N + kBf16Step - 1) / kBf16Step; }
// Bytes of one W^T panel: N padded to a step, 16 lanes x 2 bytes.
inline size_t bf16_panel_bytes(int64_t N) { return static_cast<size_t>(bf16_steps(N)) * kBf16TileBytes; }
}  // namespace

// dy rows of t-tiles [tt0, tt1) as tiles (tt, 0 .. n_steps - 1) at dst + ((tt -
// tt0) * n_steps + s) KB, rounded by round_to_bf16; rows >= T and columns >= N
// are zeros. Two versions with identical results: AVX2 and AVX-512 (BF16).
using PackDyFn = void (*)(const float* dy, int64_t ldy, int64_t N, int64_t T, int64_t tt0, int64_t tt1,
                          int64_t n_steps, uint8_t* dst);
void pack_dy_tiles_avx2(const float* dy, int64_t ldy, int64_t N, int64_t T, int64_t tt0, int64_t tt1,
                        int64_t n_steps, uint8_t* dst);
void pack_dy_tiles_avx512(const float* dy, int64_t ldy, int64_t N, int64_t T, int64_t tt0, int64_t tt1,
                          int64_t n_steps, uint8_t* dst);

// One thread's share of a product: a rectangle of t-tiles x panels, and how the
// reduction over the steps is cut into chunks (so that a chunk of W^T is reused
// from cache by many t-tiles). Every output element is one chain over steps
// 0, 1, ... whatever the rectangle and chunking: between chunks the partial sums
// rest exactly in `cbuf`; results therefore do not depend on the thread count.
struct Bf16Work {
  // dy tiles: tile (tt, s) at a + ((tt - a_tt0) * n_steps + s) * 1 KB. With
  // dy != nullptr the thread packs each t-group itself into `a` (its own buffer of
  // tgroup * n_steps tiles) just before using it, so the tiles are still in L2.
  const uint8_t* a = nullptr;
  int64_t a_tt0 = 0;
  const float* dy = nullptr;
  int64_t ldy = 0, N = 0;
  PackDyFn pack = nullptr;
  const uint8_t* b = nullptr;  // W^T: step s of panel p at b + p * pstride + s * 1 KB
  size_t pstride = 0;
  int64_t n_steps = 0;
  int64_t chunk = 0;   // steps per chunk (the last may be shorter)
  int64_t tgroup = 0;  // t-tiles per group: a group's dy chunk stays in L2 across panels
  int64_t tt0 = 0, tt1 = 0, p0 = 0, p1 = 0;  // the rectangle (tile and panel ranges)
  float* cbuf = nullptr;  // partial sums: 16 x 16 f32 tile (tt, p) at cbuf + (tt * n_panels + p) * 256
  int64_t n_panels = 0;
  float* dx = nullptr;  // [T, K] rows ldx floats apart
  int64_t ldx = 0, T = 0, K = 0;
  bool accumulate = false;
};

// The three kernels; each runs one thread's Bf16Work. amx needs AMX-BF16 and the
// granted tile state, avx512 needs AVX-512 F/BW/VL + BF16, avx2 runs everywhere
// (bf16 -> f32 by a shift, then f32 FMA).
void bf16_work_amx(const Bf16Work& w);
void bf16_work_avx512(const Bf16Work& w);
void bf16_work_avx2(const Bf16Work& w);

// Which kernel runs a Bf16Kernel request: automatic picks amx, avx512, avx2 in
// that order as the CPU, the OS and LOOM_CPU (avx2 / avx512 disable AMX) allow; a
// forced kernel the CPU lacks throws loom::Error(unsupported).
Bf16Kernel resolve_bf16_kernel(Bf16Kernel k);

// dx [T, K] (+)= bf16(dy) [T, N] Wt^T for Wt (K x N) of PackedLayout::bf16_pairs;
// dy rows ldy floats apart. Scratch slots: 0 all dy tiles (few rows), 1 partial
// sums (N > 2048), 2 + i thread i's dy tiles (many rows).
void bf16_gemm(ThreadPool& pool, Bf16Kernel kernel, const PackedWeight& Wt, const float* dy, int64_t ldy,
               float* dx, int64_t T, bool accumulate, MatmulScratch& scratch);

// Fills W^T rows [k0, k0 + rows) (whole panels: k0 % 16 == 0, and rows a multiple
// of 16 unless the range ends at K) from f32 rows `ld` floats apart, rounded by
// round_to_bf16.
void store_bf16_pairs(PackedWeight& Wt, int64_t k0, int64_t rows, const float* wt, int64_t ld);

// Rounds floats to bf16 as vcvtneps2bf16 does: to nearest even (fp32_to_bf16 of
// core/half.h, NaN included), except that f32 subnormals become signed zeros (as
// the AMX and vdpbf16ps products would treat them anyway, so that all three
// kernels see the same operands).
uint16_t round_to_bf16(float x);
void round_to_bf16(const float* x, uint16_t* dst, int64_t n);
// The same rounding, each value kept as the float it rounds to (bf16 bits << 16):
// the activations of the kernels that emulate vdpbf16ps with f32 FMAs.
void round_to_bf16_as_f32(const float* x, float* dst, int64_t n);

// Loop nest shared by the kernels (each Impl in its own file's anonymous
// namespace). Impl::block(w, tt0, tt1, p0, p1, s0, s1, first, last) computes a
// sub-rectangle over steps [s0, s1): first starts from zero (else from cbuf),
// last writes dx (else cbuf).
namespace {  // keeps each ISA's instantiation in its own file
inline const uint8_t* a_tile(const Bf16Work& w, int64_t tt, int64_t s) {
  return w.a + static_cast<size_t>((tt - w.a_tt0) * w.n_steps + s) * kBf16TileBytes;
}
inline const uint8_t* b_tile(const Bf16Work& w, int64_t p, int64_t s) {
  return w.b + static_cast<size_t>(p) * w.pstride + static_cast<size_t>(s) * kBf16TileBytes;
}
inline float* c_tile(const Bf16Work& w, int64_t tt, int64_t p) {
  return w.cbuf + (tt * w.n_panels + p) * 256;
}

template <class Impl>
void drive_bf16(const Bf16Work& work) {
  Bf16Work w = work;
  for (int64_t g0 = w.tt0; g0 < w.tt1; g0 += w.tgroup) {
    const int64_t g1 = g0 + w.tgroup < w.tt1 ? g0 + w.tgroup : w.tt1;
    if (w.dy != nullptr) {
      w.pack(w.dy, w.ldy, w.N, w.T, g0, g1, w.n_steps, const_cast<uint8_t*>(w.a));
      w.a_tt0 = g0;
    }
    for (int64_t s0 = 0; s0 < w.n_steps; s0 += w.chunk) {
      const int64_t s1 = s0 + w.chunk < w.n_steps ? s0 + w.chunk : w.n_steps;
      Impl::block(w, g0, g1, w.p0, w.p1, s0, s1, s0 == 0, s1 == w.n_steps);
    }
  }
}
}  // namespace

}  // namespace loom::cpu

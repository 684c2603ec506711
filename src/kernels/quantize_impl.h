// Internal to kernels/quantize*.cpp: the scale searches of ggml's weight
// quantizers (ggml-quants.c) and the per-type row quantizers quantize.cpp
// dispatches to.
//
// Bit-exactness with llama.cpp is the point, so every function here repeats
// ggml's float arithmetic operation for operation: the same products and sums
// in the same order, each rounded to float (the files that include this build
// with fp-contract off: an FMA would round once and move some codes), the same
// half-to-even rounding (nearest_int) and the same integer truncations (codes
// that ggml stores in uint8_t or int8_t wrap here too). ggml's names are given
// next to each function so the two can be read side by side.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace loom::quant {

// ggml's GROUP_MAX_EPS: a group whose largest magnitude is below it is all zero.
constexpr float kGroupMaxEps = 1e-15f;
// The longest group any search sees (q4_K/q5_K sub-blocks, q4_1/q5_1 blocks).
constexpr int kMaxGroup = 32;

// An int code or count as ggml's C converts it in float arithmetic.
inline float as_float(int v) { return static_cast<float>(v); }

// Stores block i of a row at any alignment (callers' buffers need not be aligned to the block struct).
template <typename Block>
void store_block(void* dst, int64_t i, const Block& b) {
  std::memcpy(static_cast<uint8_t*>(dst) + static_cast<size_t>(i) * sizeof(Block), &b, sizeof(Block));
}

// ggml's nearest_int: rounds half to even by adding 1.5 * 2^23 and reading the
// mantissa. Exact for |v| < 2^22; beyond that (never for the finite inputs the
// quantizers produce) it returns ggml's same wrapped value rather than clamping.
inline int nearest_int(float v) {
  const float biased = v + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &biased, sizeof(bits));
  return (bits & 0x007fffff) - 0x00400000;
}

// Eight lanes of float and int32 (GCC / clang vector extensions): searches
// that score several candidates at once, each lane with the scalar code's
// operations in its order (the quantizer files keep fp-contract off, so none
// is fused), so the same bits.
constexpr int kLanes = 8;
using LaneFloats = float __attribute__((vector_size(4 * kLanes)));
using LaneInts = int32_t __attribute__((vector_size(4 * kLanes)));

// Eight int8 values as floats (exact): each byte shifted to the top of its
// lane and back, arithmetically (GCC 12 converts an int8 vector lane by lane
// through scalar registers; this is two variable shifts and a conversion).
inline LaneFloats lane_values(const int8_t* p) {
  uint32_t half[2];
  std::memcpy(half, p, sizeof half);
  const auto lo = static_cast<int32_t>(half[0]), hi = static_cast<int32_t>(half[1]);
  const LaneInts words = {lo, lo, lo, lo, hi, hi, hi, hi};
  const LaneInts up = {24, 16, 8, 0, 24, 16, 8, 0};
  return __builtin_convertvector((words << up) >> 24, LaneFloats);
}

// Whether any lane of a comparison's result is set.
inline bool any_lane(LaneInts m) {
  uint64_t w[4];
  std::memcpy(w, &m, sizeof w);
  return (w[0] | w[1] | w[2] | w[3]) != 0;
}

// ggml's nearest_int in each lane.
inline LaneInts nearest_int(LaneFloats v) {
  const LaneInts bits = std::bit_cast<LaneInts>(v + 12582912.0f);
  return (bits & 0x007fffff) - 0x00400000;
}

// ggml's make_qx_quants with rmse_type 1: symmetric codes L[i] in [0, 2 nmax)
// for x ~ scale * (L[i] - nmax). Starts from the largest magnitude mapped to
// -nmax, then tries 18 nearby scales and keeps the one with the best weighted
// least-squares fit. `weights` null means x^2. Returns the scale.
float fit_symmetric(int n, int nmax, const float* x, const float* weights, int8_t* L);

// ggml's make_q3_quants with do_rmse (q3_K without importance): the symmetric
// start of fit_symmetric, then up to 5 rounds of changing single codes while
// that improves the x^2-weighted fit.
float fit_symmetric_refined(int n, int nmax, const float* x, int8_t* L);

// The scale grid of fit_affine: iscale = (rmin + rdelta * k + nmax) / (max - min), k = 0..nstep.
struct AffineGrid {
  float rmin;
  float rdelta;
  int nstep;
  bool use_mad;  // weigh absolute instead of squared errors
};

// ggml's make_qkx2_quants / make_qkx3_quants (identical when weights are given):
// codes L[i] in [0, nmax] for x ~ scale * L[i] - *neg_min, min <= 0. Tries each
// scale of `grid` and a least-squares (scale, min) for its codes; keeps the one
// with the smallest weighted error. Returns the scale.
float fit_affine(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* neg_min,
                 const AffineGrid& grid);

// ggml's make_qp_quants: codes L[i] in [0, nmax] for non-negative x (the
// sub-block scales or mins of a k-quant block), x ~ scale * L[i], weighted by
// `weights`. Tries 9 scales, then refines single codes. Returns the scale.
float fit_positive(int n, int nmax, const float* x, const float* weights, uint8_t* L);

// Row quantizers: `n` floats (a multiple of the block size) at x into blocks at
// dst (any alignment). The _weighted ones take the row's importance weights.
void quantize_row_q2_k(const float* x, void* dst, int64_t n);
void quantize_row_q3_k(const float* x, void* dst, int64_t n);
void quantize_row_q4_k(const float* x, void* dst, int64_t n);
void quantize_row_q5_k(const float* x, void* dst, int64_t n);
void quantize_row_q6_k(const float* x, void* dst, int64_t n);
void quantize_row_q2_k_weighted(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_q3_k_weighted(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_q4_k_weighted(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_q5_k_weighted(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_q6_k_weighted(const float* x, void* dst, int64_t n, const float* importance);
// IQ4_NL / IQ4_XS (quantize_iq4.cpp): importance null or the row's weights.
void quantize_row_iq4_nl(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_iq4_xs(const float* x, void* dst, int64_t n, const float* importance);
// IQ3_XXS / IQ3_S (quantize_iq3.cpp): importance null or the row's weights.
void quantize_row_iq3_xxs(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_iq3_s(const float* x, void* dst, int64_t n, const float* importance);
// IQ2_XXS / IQ2_XS (importance required) / IQ2_S (quantize_iq2.cpp).
void quantize_row_iq2_xxs(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_iq2_xs(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_iq2_s(const float* x, void* dst, int64_t n, const float* importance);
// IQ1_S (importance required) / IQ1_M (quantize_iq1.cpp).
void quantize_row_iq1_s(const float* x, void* dst, int64_t n, const float* importance);
void quantize_row_iq1_m(const float* x, void* dst, int64_t n, const float* importance);
// MXFP4 / NVFP4 / Q1_0 / Q2_0 / TQ1_0 / TQ2_0 (quantize_plain.cpp): ggml's reference quantizers,
// which an importance matrix does not change.
void quantize_row_mxfp4(const float* x, void* dst, int64_t n);
void quantize_row_nvfp4(const float* x, void* dst, int64_t n);
void quantize_row_q1_0(const float* x, void* dst, int64_t n);
void quantize_row_q2_0(const float* x, void* dst, int64_t n);
void quantize_row_tq1_0(const float* x, void* dst, int64_t n);
void quantize_row_tq2_0(const float* x, void* dst, int64_t n);

}  // namespace loom::quant

// The scale searches of ggml's weight quantizers (ggml-quants.c), repeating
// ggml's float arithmetic exactly (see quantize_impl.h). Products are written
// left to right as in ggml's C: w * x * l is (w * x) * l, each rounded.

// ggml-quants.c is C built without FMA, so nothing there is fused; loom builds
// with FMA available and GCC contracts C++ by default, hence contraction off.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <iterator>

#include "core/error.h"
#include "kernels/quantize_impl.h"

namespace loom::quant {
namespace {

// The signed value of largest magnitude (the first on ties) and that magnitude.
inline float signed_absmax(int n, const float* x, float& amax) {
  float max = 0.0f;
  amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  return max;
}

// Weighted sums of x * l and l * l over symmetric codes l = clamp(round(iscale * x)),
// the two statistics every candidate scale of fit_symmetric is judged by.
struct SymmetricSums {
  float sumlx = 0.0f;
  float suml2 = 0.0f;
};

inline int symmetric_code(float iscale, float x, int nmax) {
  return std::clamp(nearest_int(iscale * x), -nmax, nmax - 1);
}

SymmetricSums symmetric_sums(int n, int nmax, const float* x, const float* weights, float iscale) {
  SymmetricSums s;
  for (int i = 0; i < n; ++i) {
    const float l = as_float(symmetric_code(iscale, x[i], nmax));
    const float w = weights ? weights[i] : x[i] * x[i];
    s.sumlx += w * x[i] * l;
    s.suml2 += w * l * l;
  }
  return s;
}

// symmetric_sums for 8 inverse scales at once, each lane the scalar operations.
struct SymmetricLanes {
  LaneFloats sumlx = {}, suml2 = {};
};
SymmetricLanes symmetric_sums(int n, int nmax, const float* x, const float* weights, LaneFloats iscale) {
  SymmetricLanes s;
  for (int i = 0; i < n; ++i) {
    LaneInts c = nearest_int(iscale * x[i]);
    const LaneInts low = c < -nmax, high = c > nmax - 1;  // clamp to [-nmax, nmax - 1]
    c = (c & ~(low | high)) | (-nmax & low) | ((nmax - 1) & high);
    const LaneFloats l = __builtin_convertvector(c, LaneFloats);
    const float w = weights ? weights[i] : x[i] * x[i];
    s.sumlx += w * x[i] * l;
    s.suml2 += w * l * l;
  }
  return s;
}

void set_symmetric_codes(int n, int nmax, const float* x, float iscale, int8_t* L) {
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(nmax + symmetric_code(iscale, x[i], nmax));
}

// Weighted error of x ~ scale * L + min (min <= 0): squared or absolute.
float affine_error(int n, const float* x, const float* weights, const uint8_t* L, float scale, float min,
                   bool use_mad) {
  float err = 0.0f;
  for (int i = 0; i < n; ++i) {
    float diff = scale * as_float(L[i]) + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    err += weights[i] * diff;
  }
  return err;
}

// Candidates is0 .. is0 + 7 of fit_affine's grid from the current min, lane l
// candidate is0 + l: its codes, the least-squares (scale, min) for them
// (valid where D > 0) and its weighted error, in ggml's operations and order.
struct AffineCandidates {
  LaneInts codes[kMaxGroup];
  LaneFloats D, scale, min, err;
};

AffineCandidates score_affine(int n, int nmax, const float* x, const float* weights, float sum_w, float sum_x,
                              float min, float max, const AffineGrid& grid, int is0) {
  AffineCandidates c;
  LaneFloats is;
  for (int l = 0; l < kLanes; ++l) is[l] = as_float(is0 + l);
  const LaneFloats iscale = (grid.rmin + grid.rdelta * is + as_float(nmax)) / (max - min);
  LaneFloats sum_l = {}, sum_l2 = {}, sum_xl = {};
  LaneFloats q[kMaxGroup];
  for (int i = 0; i < n; ++i) {
    LaneInts l = nearest_int(iscale * (x[i] - min));
    l &= ~(l < 0);                                 // clamp to [0, nmax]
    const LaneInts over = l > nmax;
    l = (l & ~over) | (nmax & over);
    c.codes[i] = l;
    q[i] = __builtin_convertvector(l, LaneFloats);
    const float w = weights[i];
    sum_l += w * q[i];
    sum_l2 += w * q[i] * q[i];
    sum_xl += w * q[i] * x[i];
  }
  c.D = sum_w * sum_l2 - sum_l * sum_l;
  LaneFloats this_scale = (sum_w * sum_xl - sum_x * sum_l) / c.D;
  LaneFloats this_min = (sum_l2 * sum_x - sum_l * sum_xl) / c.D;
  const LaneInts positive = this_min > 0.0f;  // then min 0 and the scale alone
  const LaneFloats alone = sum_xl / sum_l2;
  this_min = std::bit_cast<LaneFloats>(std::bit_cast<LaneInts>(this_min) & ~positive);
  this_scale = std::bit_cast<LaneFloats>((std::bit_cast<LaneInts>(this_scale) & ~positive) |
                                         (std::bit_cast<LaneInts>(alone) & positive));
  LaneFloats err = {};
  for (int i = 0; i < n; ++i) {
    LaneFloats diff = this_scale * q[i] + this_min - x[i];
    diff = grid.use_mad ? std::bit_cast<LaneFloats>(std::bit_cast<LaneInts>(diff) & 0x7fffffff) : diff * diff;
    err += weights[i] * diff;
  }
  c.scale = this_scale;
  c.min = this_min;
  c.err = err;
  return c;
}

}  // namespace

float fit_symmetric(int n, int nmax, const float* x, const float* weights, int8_t* L) {
  float amax;
  const float max = signed_absmax(n, x, amax);
  if (amax < kGroupMaxEps) {
    std::fill(L, L + n, int8_t{0});
    return 0.0f;
  }
  // The first candidate maps the largest magnitude to -nmax (its sign is the
  // scale's, so the code range [-nmax, nmax) holds it exactly).
  float iscale = as_float(-nmax) / max;
  SymmetricSums s = symmetric_sums(n, nmax, x, weights, iscale);
  set_symmetric_codes(n, nmax, x, iscale, L);
  float scale = s.suml2 != 0.0f ? s.sumlx / s.suml2 : 0.0f;
  float best = scale * s.sumlx;  // the fit's explained energy, sumlx^2 / suml2: larger is better
  // The 18 scales around it (is = -9..9 but 0), 8 at a time in lanes, taken in order.
  constexpr int kSteps[] = {-9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  constexpr int kCount = static_cast<int>(std::size(kSteps));
  float best_iscale = iscale;
  bool taken = false;  // a later scale won: the codes are set from it at the end
  for (int k0 = 0; k0 < kCount; k0 += kLanes) {
    LaneFloats is = {};
    for (int l = 0; l < kLanes && k0 + l < kCount; ++l) is[l] = as_float(kSteps[k0 + l]);
    const LaneFloats iscales = -(as_float(nmax) + 0.1f * is) / max;
    const SymmetricLanes c = symmetric_sums(n, nmax, x, weights, iscales);
    for (int l = 0; l < kLanes && k0 + l < kCount; ++l)
      if (c.suml2[l] > 0 && c.sumlx[l] * c.sumlx[l] > best * c.suml2[l]) {
        best_iscale = iscales[l];
        taken = true;
        scale = c.sumlx[l] / c.suml2[l];
        best = scale * c.sumlx[l];
      }
  }
  if (taken) set_symmetric_codes(n, nmax, x, best_iscale, L);
  return scale;
}

float fit_symmetric_refined(int n, int nmax, const float* x, int8_t* L) {
  float amax;
  const float max = signed_absmax(n, x, amax);
  if (amax < kGroupMaxEps) {
    std::fill(L, L + n, int8_t{0});
    return 0.0f;
  }
  const float iscale = as_float(-nmax) / max;
  float sumlx = 0.0f, suml2 = 0.0f;
  for (int i = 0; i < n; ++i) {
    const int l = symmetric_code(iscale, x[i], nmax);
    L[i] = static_cast<int8_t>(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * as_float(l);
    suml2 += w * as_float(l) * as_float(l);
  }
  // Move one code at a time to the value the fit without it asks for; keep the
  // move if the explained energy sumlx^2 / suml2 grows.
  for (int round = 0; round < 5; ++round) {
    int n_changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * as_float(L[i]);
      if (!(slx > 0)) continue;
      float sl2 = suml2 - w * as_float(L[i]) * as_float(L[i]);
      const int new_l = std::clamp(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
      if (new_l == L[i]) continue;
      slx += w * x[i] * as_float(new_l);
      sl2 += w * as_float(new_l) * as_float(new_l);
      if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = static_cast<int8_t>(new_l);
        sumlx = slx;
        suml2 = sl2;
        ++n_changed;
      }
    }
    if (n_changed == 0) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(L[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

float fit_affine(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* neg_min,
                 const AffineGrid& grid) {
  LOOM_ASSERT(n <= kMaxGroup);
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;  // the offset only ever lowers: x = scale * L + min
  if (max == min) {
    std::fill(L, L + n, uint8_t{0});
    *neg_min = -min;
    return 0.0f;
  }
  auto code = [&](float iscale, int i) { return std::clamp(nearest_int(iscale * (x[i] - min)), 0, nmax); };

  // The plain min/max mapping is the candidate to beat.
  float iscale = as_float(nmax) / (max - min);
  float scale = 1 / iscale;
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(code(iscale, i));
  float best_error = affine_error(n, x, weights, L, scale, min, grid.use_mad);
  if (grid.nstep < 1) {
    *neg_min = -min;
    return scale;
  }
  // The grid's candidates 8 at a time, each lane one candidate scored as ggml
  // scores it, then taken in ggml's order. A taken candidate moves min, which
  // the later candidates' codes depend on: the lanes after it are then scored
  // again from the new min.
  for (int is0 = 0; is0 <= grid.nstep;) {
    const AffineCandidates c = score_affine(n, nmax, x, weights, sum_w, sum_x, min, max, grid, is0);
    int next = is0 + kLanes;
    for (int l = 0; l < kLanes && is0 + l <= grid.nstep; ++l) {
      if (!(c.D[l] > 0) || !(c.err[l] < best_error)) continue;
      for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(c.codes[i][l]);
      best_error = c.err[l];
      scale = c.scale[l];
      const bool moved = std::bit_cast<uint32_t>(c.min[l]) != std::bit_cast<uint32_t>(min);
      min = c.min[l];
      if (moved) {
        next = is0 + l + 1;
        break;
      }
    }
    is0 = next;
  }
  *neg_min = -min;
  return scale;
}

float fit_positive(int n, int nmax, const float* x, const float* weights, uint8_t* L) {
  float max = 0;
  for (int i = 0; i < n; ++i) max = max > x[i] ? max : x[i];  // ggml's MAX (a NaN wins, as there)
  if (max < kGroupMaxEps) {
    std::fill(L, L + n, uint8_t{0});
    return 0.0f;
  }
  // Pick the best of 9 scales around max -> nmax by weighted squared error.
  // (Codes are clamped above only: a negative x, which ggml never passes,
  // would wrap in the uint8_t codes just as it does there.)
  float iscale = as_float(nmax) / max;
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(nearest_int(iscale * x[i]));
  const float scale = 1 / iscale;
  float best_mse = 0;
  for (int i = 0; i < n; ++i) {
    const float diff = x[i] - scale * as_float(L[i]);
    best_mse += weights[i] * diff * diff;
  }
  for (int is = -4; is <= 4; ++is) {
    if (is == 0) continue;
    const float iscale_is = (0.1f * as_float(is) + as_float(nmax)) / max;
    const float scale_is = 1 / iscale_is;
    float mse = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::min(nmax, nearest_int(iscale_is * x[i]));
      const float diff = x[i] - scale_is * as_float(l);
      mse += weights[i] * diff * diff;
    }
    if (mse < best_mse) {
      best_mse = mse;
      iscale = iscale_is;
    }
  }
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::min(nmax, nearest_int(iscale * x[i]));
    L[i] = static_cast<uint8_t>(l);
    const float w = weights[i];
    sumlx += w * x[i] * as_float(l);
    suml2 += w * as_float(l) * as_float(l);
  }
  // Move single codes to where the fit without them points while that helps.
  for (int round = 0; round < 5; ++round) {
    int n_changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = weights[i];
      float slx = sumlx - w * x[i] * as_float(L[i]);
      float sl2 = suml2 - w * as_float(L[i]) * as_float(L[i]);
      if (!(slx > 0 && sl2 > 0)) continue;
      const int new_l = std::min(nmax, nearest_int(x[i] * sl2 / slx));
      if (new_l == L[i]) continue;
      slx += w * x[i] * as_float(new_l);
      sl2 += w * as_float(new_l) * as_float(new_l);
      if (slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = static_cast<uint8_t>(new_l);
        sumlx = slx;
        suml2 = sl2;
        ++n_changed;
      }
    }
    if (n_changed == 0) break;
  }
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

}  // namespace loom::quant

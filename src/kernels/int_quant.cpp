#include "kernels/int_quant.h"

#include <algorithm>
#include <numeric>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace loom {
namespace {

// torch.finfo(float32).eps: compressed-tensors' stand-in for a zero scale.
constexpr float kScaleEps = std::numeric_limits<float>::epsilon();

// numpy's default (linear) quantile of sorted values.
float quantile(const std::vector<float>& sorted, double q) {
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto i = static_cast<size_t>(pos);
  const double f = pos - static_cast<double>(i);
  if (i + 1 >= sorted.size()) return sorted.back();
  return static_cast<float>(sorted[i] + f * (static_cast<double>(sorted[i + 1]) - sorted[i]));
}

// Squared error of quantizing x[0..n) with (scale, zero).
double squared_error(const float* x, int64_t n, float scale, float zero, const IntQuantSpec& spec) {
  double e = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float q = static_cast<float>(int_quantize_value(x[i], scale, zero, spec));
    const double d = static_cast<double>(x[i]) - static_cast<double>((q - zero) * scale);
    e += d * d;
  }
  return e;
}

// The parameters of one set of values x[0, n) (a tensor, a row or a group);
// `sorted` is scratch for the percentile range, the only one that reorders them
// (the others read x in place: a 4-bit adapter's reload packs ~150k groups of 8).
void params_of(const float* x, int64_t n, const IntQuantSpec& spec, std::vector<float>& sorted, float& scale,
               float& zero) {
  float lo = *std::min_element(x, x + n);
  float hi = *std::max_element(x, x + n);
  if (spec.range == RangeMethod::percentile) {
    sorted.assign(x, x + n);
    std::sort(sorted.begin(), sorted.end());
    lo = quantile(sorted, (100.0 - spec.percentile) / 100.0);
    hi = quantile(sorted, spec.percentile / 100.0);
  }
  int_quant_params_of(spec, lo, hi, scale, zero);
  if (spec.range != RangeMethod::mse) return;
  double best = squared_error(x, n, scale, zero, spec);
  const int steps = static_cast<int>(spec.mse_max_shrink * spec.mse_grid);
  for (int i = 1; i <= steps; ++i) {
    const float shrink = 1.0f - static_cast<float>(i) / static_cast<float>(spec.mse_grid);
    float s, z;
    int_quant_params_of(spec, shrink * lo, shrink * hi, s, z);
    const double e = squared_error(x, n, s, z, spec);
    if (e < best) {
      best = e;
      scale = s;
      zero = z;
    }
  }
}

}  // namespace

void check_int_quant_spec(const IntQuantSpec& spec, int64_t cols, std::string_view what) {
  if (spec.bits != 8 && spec.bits != 4)
    fail(ErrorKind::invalid_input, "{}: {} bits; loom quantizes to 8 or 4", what, spec.bits);
  if (spec.group > 0 && cols % spec.group != 0)
    fail(ErrorKind::invalid_input, "{}: rows of {} values do not split into groups of {}", what, cols, spec.group);
  if (spec.range == RangeMethod::percentile && !(spec.percentile > 50 && spec.percentile <= 100))
    fail(ErrorKind::invalid_input, "{}: percentile {} is not in (50, 100]", what, spec.percentile);
}

void int_quant_params_of(const IntQuantSpec& spec, float lo, float hi, float& scale, float& zero) {
  lo = std::min(lo, 0.0f);
  hi = std::max(hi, 0.0f);
  const auto range = static_cast<float>(spec.qmax() - spec.qmin());
  if (spec.symmetric) {
    scale = std::max(std::fabs(lo), std::fabs(hi)) / (range / 2);
    zero = 0;
  } else {
    scale = (hi - lo) / range;
    // An all-zero set has no range: compressed-tensors' 0/0 zero point is undefined there.
    zero = scale > 0 ? std::nearbyint(std::clamp(static_cast<float>(spec.qmin()) - lo / scale,
                                                 static_cast<float>(spec.qmin()), static_cast<float>(spec.qmax())))
                     : 0.0f;
  }
  if (scale == 0) scale = kScaleEps;
}

int8_t int_quantize_value(float x, float scale, float zero, const IntQuantSpec& spec) {
  float v = x / scale + zero;
  v = std::clamp(v, static_cast<float>(spec.qmin()), static_cast<float>(spec.qmax()));
  return static_cast<int8_t>(std::nearbyint(v));  // the default rounding mode: half to even, as torch.round
}

IntQuantParams choose_int_quant_params(const float* w, int64_t rows, int64_t cols, const IntQuantSpec& spec) {
  IntQuantParams p;
  const int64_t sets = spec.group < 0 ? 1 : spec.group == 0 ? rows : rows * (cols / spec.group);
  p.scale.reserve(static_cast<size_t>(sets));
  p.zero.reserve(static_cast<size_t>(sets));
  std::vector<float> sorted;
  auto add = [&](const float* x, int64_t n) {
    float s, z;
    params_of(x, n, spec, sorted, s, z);
    p.scale.push_back(s);
    p.zero.push_back(z);
  };
  if (spec.group < 0) {
    add(w, rows * cols);
  } else if (spec.group == 0) {
    for (int64_t r = 0; r < rows; ++r) add(w + r * cols, cols);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < cols / spec.group; ++g) add(w + r * cols + g * spec.group, spec.group);
  }
  return p;
}

std::vector<int8_t> int_quantize(const float* w, int64_t rows, int64_t cols, const IntQuantSpec& spec,
                                 const IntQuantParams& p) {
  std::vector<int8_t> q(static_cast<size_t>(rows * cols));
  // A run of columns with one (scale, zero) at a time, so the inner loop has no
  // index arithmetic and vectorizes; each value is int_quantize_value's.
  const int64_t run = spec.group > 0 ? spec.group : cols;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += run) {
      const int64_t i = int_quant_param_index(spec, cols, r, c0);
      const float scale = p.scale[static_cast<size_t>(i)], zero = p.zero[static_cast<size_t>(i)];
      const float* x = w + r * cols + c0;
      int8_t* out = q.data() + r * cols + c0;
      for (int64_t c = 0; c < std::min(run, cols - c0); ++c)
        out[c] = int_quantize_value(x[c], scale, zero, spec);
    }
  return q;
}

std::vector<float> int_dequantize(const int8_t* q, int64_t rows, int64_t cols, const IntQuantSpec& spec,
                                  const IntQuantParams& p) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = int_quant_param_index(spec, cols, r, c);
      x[static_cast<size_t>(r * cols + c)] = (static_cast<float>(q[r * cols + c]) - p.zero[i]) * p.scale[i];
    }
  return x;
}

int64_t fitting_int4_group(int64_t cols, int64_t wanted) {
  if (wanted > 0 && cols % wanted == 0) return wanted;
  for (int64_t g = wanted / 32 * 32; g >= 32; g -= 32)
    if (cols % g == 0) return g;
  return cols;
}

PackedInt4 pack_int4_rows(const float* w, int64_t rows, int64_t cols, int64_t group) {
  LOOM_ASSERT(cols % 2 == 0 && group > 0 && cols % group == 0);
  IntQuantSpec spec;
  spec.bits = 4;
  spec.group = group;
  const IntQuantParams p = choose_int_quant_params(w, rows, cols, spec);
  const std::vector<int8_t> q = int_quantize(w, rows, cols, spec, p);
  PackedInt4 out;
  out.rows = rows;
  out.cols = cols;
  out.group = group;
  out.scales = p.scale;
  out.codes.resize(static_cast<size_t>(rows * cols / 2));
  for (size_t i = 0; i < out.codes.size(); ++i)
    out.codes[i] = static_cast<uint8_t>((q[2 * i] + 8) | ((q[2 * i + 1] + 8) << 4));
  return out;
}

void int_fake_quantize(const float* w, int64_t rows, int64_t cols, const IntQuantSpec& spec, float* out) {
  if (spec.group < 0) {  // one range for the whole tensor
    const IntQuantParams p = choose_int_quant_params(w, rows, cols, spec);
    for (int64_t i = 0; i < rows * cols; ++i)
      out[i] = (static_cast<float>(int_quantize_value(w[i], p.scale[0], p.zero[0], spec)) - p.zero[0]) * p.scale[0];
    return;
  }
  // Group by group (QAT runs this on every matrix every step): the same
  // parameters and operations as int_quantize then int_dequantize, in one pass.
  const int64_t n = spec.group > 0 ? spec.group : cols;
  std::vector<float> sorted;
  for (int64_t at = 0; at < rows * cols; at += n) {
    float s, z;
    params_of(w + at, n, spec, sorted, s, z);
    for (int64_t i = at; i < at + n; ++i)
      out[i] = (static_cast<float>(int_quantize_value(w[i], s, z, spec)) - z) * s;
  }
}

int64_t fitting_common_group(int64_t requested, std::initializer_list<int64_t> widths) {
  int64_t g = 0;
  for (int64_t w : widths) g = std::gcd(g, w);
  if (g % requested == 0) return requested;
  for (int64_t c = requested / 32 * 32; c >= 32; c -= 32)
    if (g % c == 0) return c;
  return 0;
}

void unpack_int4_rows(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols, int64_t group,
                      float* out) {
  const int64_t groups = cols / group;
  // Group by group with the scale fixed, so the inner loop over bytes vectorizes.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[r * groups + g];
      const uint8_t* b = codes + (r * cols + g * group) / 2;
      float* o = out + r * cols + g * group;
      for (int64_t i = 0; i < group / 2; ++i) {
        o[2 * i] = static_cast<float>((b[i] & 0xF) - 8) * s;
        o[2 * i + 1] = static_cast<float>((b[i] >> 4) - 8) * s;
      }
    }
}

RangeMethod range_method_from_name(std::string_view name) {
  if (name == "minmax") return RangeMethod::minmax;
  if (name == "percentile") return RangeMethod::percentile;
  if (name == "mse") return RangeMethod::mse;
  fail(ErrorKind::invalid_input, "range '{}': expected minmax, percentile or mse", name);
}

const char* range_method_name(RangeMethod m) {
  switch (m) {
    case RangeMethod::minmax: return "minmax";
    case RangeMethod::percentile: return "percentile";
    case RangeMethod::mse: return "mse";
  }
  return "?";
}

}  // namespace loom

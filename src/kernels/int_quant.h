// Integer weight quantization with the conventions of compressed-tensors (the
// format vLLM and llm-compressor use, and loom writes): a range [min, max]
// that always holds 0, per tensor, per output channel (row) or per group of
// `group` columns of a row; symmetric: scale = max|x| / ((qmax - qmin) / 2),
// zero 0; asymmetric: scale = (max - min) / (qmax - qmin), zero =
// round(qmin - min / scale) clamped to [qmin, qmax]; q = clamp(round(x / scale
// + zero)) with rounding half to even; x' = (q - zero) * scale. int8 codes are
// in [-128, 127], int4 codes in [-8, 7].
//
// The range comes from the values' min and max, a percentile of them, or a
// search over shrunk ranges that keeps the one with the least squared error
// of the dequantized values (the MSE observer of llm-compressor, with an L2
// norm).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

enum class RangeMethod { minmax, percentile, mse };

struct IntQuantSpec {
  int bits = 8;              // 8 or 4
  bool symmetric = true;
  // 0: one scale per row (channel); -1: one for the whole tensor; > 0: per
  // group of this many columns of a row (cols must be a multiple).
  int64_t group = 0;
  RangeMethod range = RangeMethod::minmax;
  double percentile = 99.99;  // RangeMethod::percentile: the upper percentile (and 100 - p the lower)
  int mse_grid = 100;         // RangeMethod::mse: shrink factors 1, 1 - 1/grid, ... down to 1 - max_shrink
  double mse_max_shrink = 0.8;

  int qmin() const { return -(1 << (bits - 1)); }
  int qmax() const { return (1 << (bits - 1)) - 1; }
  int64_t groups_per_row(int64_t cols) const { return group > 0 ? cols / group : 1; }
};

// Scales and zero points, one per (row, group) in row-major order; a
// per-tensor spec holds one.
struct IntQuantParams {
  std::vector<float> scale;
  std::vector<float> zero;  // integers, stored as floats
};

// Checks a spec against a matrix width; throws invalid_input naming `what`.
void check_int_quant_spec(const IntQuantSpec& spec, int64_t cols, std::string_view what);

// The scale and zero point of the range [lo, hi] (widened to hold 0).
void int_quant_params_of(const IntQuantSpec& spec, float lo, float hi, float& scale, float& zero);

// Chooses the parameters of a row-major rows x cols matrix.
IntQuantParams choose_int_quant_params(const float* w, int64_t rows, int64_t cols, const IntQuantSpec& spec);

// The (row, group) parameter index of element (r, c).
inline int64_t int_quant_param_index(const IntQuantSpec& spec, int64_t cols, int64_t r, int64_t c) {
  if (spec.group < 0) return 0;
  if (spec.group == 0) return r;
  return r * (cols / spec.group) + c / spec.group;
}

// q = clamp(round_half_even(x / scale + zero), qmin, qmax).
int8_t int_quantize_value(float x, float scale, float zero, const IntQuantSpec& spec);

// Codes of the whole matrix.
std::vector<int8_t> int_quantize(const float* w, int64_t rows, int64_t cols, const IntQuantSpec& spec,
                                 const IntQuantParams& p);
// (q - zero) * scale of every element.
std::vector<float> int_dequantize(const int8_t* q, int64_t rows, int64_t cols, const IntQuantSpec& spec,
                                  const IntQuantParams& p);

// out = int_dequantize(int_quantize(w)) with the parameters chosen for w: the
// values a quantized export holds (quantization-aware training's forward).
void int_fake_quantize(const float* w, int64_t rows, int64_t cols, const IntQuantSpec& spec, float* out);

// The group size one model uses for all its matrices: `requested` when it
// divides every width, else the largest multiple of 32 below it that does
// (SmolLM2's 576 takes 96 for 128); 0 when none does.
int64_t fitting_common_group(int64_t requested, std::initializer_list<int64_t> widths);

// 4-bit symmetric storage of a row-major matrix, e.g. a LoRA factor the server
// keeps in 4 bits: codes (code + 8) two to a byte, element 2i in the low
// nibble, one f32 scale per group of `group` columns of a row, chosen with the
// rule above (min-max range, scale = max|x| / 7.5).
struct PackedInt4 {
  std::vector<uint8_t> codes;  // rows * cols / 2
  std::vector<float> scales;   // rows * (cols / group)
  int64_t rows = 0, cols = 0, group = 0;
  size_t bytes() const { return codes.size() + scales.size() * sizeof(float); }
};
// The group size for rows of `cols`: `wanted` when it divides them, else the
// largest multiple of 32 below it that does, else the whole row.
int64_t fitting_int4_group(int64_t cols, int64_t wanted);
PackedInt4 pack_int4_rows(const float* w, int64_t rows, int64_t cols, int64_t group);  // cols even
// out [rows x cols] = (code - 8) * scale.
void unpack_int4_rows(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols, int64_t group,
                      float* out);

// "minmax" | "percentile" | "mse".
RangeMethod range_method_from_name(std::string_view name);
const char* range_method_name(RangeMethod m);

}  // namespace loom

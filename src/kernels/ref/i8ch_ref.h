// i8_ch: int8 weights with one scale and one zero point per output channel
// (row), multiplied by int8 activations quantized per token ("W8A8", as in
// SmoothQuant serving). The scalar definitions every i8_ch kernel is tested
// against.
//
// A row of K columns in memory (DType::i8_ch, rows back to back, no alignment):
//   float scale;   f32
//   float zero;    an integer in [-128, 127] held as f32 (0: symmetric)
//   int8  q[K];    the codes
// Element k = scale * (float(q[k]) - zero): the subtraction is exact, so one
// f32 rounding (dequantize_row_i8ch_ref).
//
// Products y = x W^T (matmul_i8ch_ref):
//  * each row x_t of the activations is quantized as a whole (per token,
//    dynamic), by quantize_row_q8_0_ref's rule over the row instead of blocks of
//    32: amax = max_k |x_k| (NaNs skipped), s = amax / 127 (f32),
//    id = s != 0 ? 1 / s : 0, qx_k = round half away from zero (x_k * id),
//    clamped to [-127, 127], NaN -> 0 (for finite x, |x_k * id| <= 127 +
//    ~1e-5 anyway); xsum = sum_k qx_k;
//  * acc = sum_k q[k] qx_k - zero * xsum, exactly, in int32 (|acc| <=
//    K * 127 * 255 < 2^31 for K <= kI8ChMaxCols);
//  * y[t][o] = float(acc) * (scale_o * s_t): float(acc) rounds to nearest even,
//    then two f32 products, the scale product first. One float multiply per
//    output besides that one (q8_0 needs an FMA per 32-block).
// Every SIMD kernel (AVX-512 VNNI, AVX2) computes acc with exact integer
// arithmetic in its own order and then exactly these float operations, so its
// results are bit-identical to matmul_i8ch_ref at any thread count and batch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom {

constexpr size_t kI8ChHeaderBytes = 8;  // f32 scale, f32 zero
// The widest row the exact int32 accumulation allows (K * 127 * 255 < 2^31);
// matmul refuses wider i8_ch weights.
constexpr int64_t kI8ChMaxCols = 65536;

struct I8ChHeader {
  float scale;
  float zero;
};
static_assert(sizeof(I8ChHeader) == kI8ChHeaderBytes);

// The header of the row at `row` (any alignment).
I8ChHeader i8ch_header(const void* row);
// Whether a header is one the kernels accept: zero an integer in [-128, 127]
// (scale may be any float; non-finite scales give non-finite outputs).
bool i8ch_header_valid(const I8ChHeader& h);

// dst[k] = scale * (float(q[k]) - zero) for the n columns of one row.
void dequantize_row_i8ch_ref(const void* row, float* dst, int64_t n);

// One activation row quantized as above: qx[k] for k < n, returns s (the f32
// scale), writes sum_k qx[k] to *sum.
float quantize_act_row_i8ch_ref(const float* x, int64_t n, int8_t* qx, int32_t* sum);

// y[t * N + o] for t < T, o < N: W is N i8_ch rows of K columns, x is T x K.
void matmul_i8ch_ref(const uint8_t* W, int64_t N, int64_t K, const float* x, int64_t T, float* y);

}  // namespace loom

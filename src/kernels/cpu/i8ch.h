// i8_ch weights on the CPU (kernels/ref/i8ch_ref.h defines the format and the
// arithmetic): row dequantization, the matmul panels, the activation rows and
// the panel kernels.
//
// Any width K from 1 to kI8ChMaxCols works (real models: 576, 1536, 2048,
// 8192, 14336, ...); the panels and act rows are padded to whole 4-byte words
// with codes that add nothing.
//
// Panel (16 rows; i8ch_panel_bytes(K) = 192 + 64 * ceil(K / 4)):
//   f32   scale[16] @0
//   int32 zero[16]  @64    the rows' zero points
//   int32 corr[16]  @128   -128 * sum_k q[r][k]   (for the VNNI offset, below)
//   words @192: word o = 64 bytes, bytes 4r..4r+3 = q[r][4o..4o+3] (s8; 0 past K)
// Act row (one per token; i8ch_act_row_bytes(K) = 64 + K rounded up to 64):
//   f32 s @0, int32 xsum @4 (zeros to 64), then u8 qx[k] + 128 @64 (128, i.e.
//   qx = 0, past K), so a 4-byte word of it broadcast is vpdpbusd's u8 operand.
//
// Integer dot, exact in int32 (acc = sum_k q qx - zero * xsum):
//  - AVX-512 VNNI: vpdpbusd(u8 = qx + 128, s8 = q) adds qx q + 128 q, so each
//    accumulator starts at corr - zero * xsum;
//  - AVX2: ggml's sign trick (mul_sum_i8_pairs): vpmaddubsw(|q| as u8,
//    sign(qx, q) as s8) = qx q in int16 pairs, at most 2 * 128 * 127 = 32512
//    (qx is never -128, q may be: |-128| = 128 as u8), so nothing saturates;
//    vpmaddwd with ones widens to int32; the accumulator starts at -zero * xsum.
// Then y = float(acc) * (scale * s), as matmul_i8ch_ref.
// No AMX-INT8 kernel: Isa::amx runs the AVX-512 kernel (no AMX machine to test
// one on).
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom::cpu {

struct KernelArgs;

constexpr size_t kI8ChPanelHeader = 192;
constexpr size_t kI8ChActHeader = 64;

inline int64_t i8ch_words(int64_t K) { return (K + 3) / 4; }
inline size_t i8ch_panel_bytes(int64_t K) { return kI8ChPanelHeader + 64 * static_cast<size_t>(i8ch_words(K)); }
inline size_t i8ch_act_row_bytes(int64_t K) { return kI8ChActHeader + static_cast<size_t>((K + 63) / 64 * 64); }

// Bit-identical to dequantize_row_i8ch_ref: `row` is a row's start (header).
void dequantize_row_i8ch(const void* row, float* dst, int64_t n);
// Columns [c0, c0 + n) of the row at `row`.
void dequantize_i8ch_cols(const void* row, int64_t c0, float* dst, int64_t n);

// `nrows` (<= 16) i8_ch rows of K columns into one panel (missing rows: zeros).
void pack_i8ch_panel(const uint8_t* const* rows, int nrows, int64_t K, uint8_t* dst);

// One token's act row (quantize_act_row_i8ch_ref's codes, scale and sum): AVX2,
// or the AVX-512 F/BW/VL version where usable_cpu_features().has_avx512_f32()
// (the same float operations, so the same bytes).
void quantize_act_row_i8ch(const float* x, int64_t K, uint8_t* dst);
void quantize_act_row_i8ch_avx2(const float* x, int64_t K, uint8_t* dst);
void quantize_act_row_i8ch_avx512(const float* x, int64_t K, uint8_t* dst);

void i8ch_panel_kernel_avx2(const KernelArgs& a);
void i8ch_panel_kernel_avx512(const KernelArgs& a);

}  // namespace loom::cpu

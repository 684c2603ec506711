// Weight quantization into the GGUF formats, byte-identical to llama.cpp's
// (ggml_quantize_chunk, what llama-quantize writes): round-to-nearest for the
// 32-element formats and ggml's scale searches for the k-quants, iq4_nl / iq4_xs
// and the iq1 / iq2 / iq3 grids; with an importance matrix, ggml's weighted searches for
// all of them but q8_0.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/thread_pool.h"

namespace loom {

// Types quantize_rows can produce: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k,
// q6_k, iq4_nl, iq4_xs, iq3_xxs, iq3_s, iq2_xxs, iq2_xs, iq2_s, iq1_s, iq1_m, mxfp4, nvfp4, q1_0, q2_0,
// tq1_0, tq2_0.
bool quantize_supported(DType type);
// Types whose rows quantize_rows quantizes only with an importance vector
// (iq2_xxs, iq2_xs, iq1_s: ggml's quantizers assert one).
bool quantize_requires_importance(DType type);

// Quantizes `nrows` rows of `n_per_row` floats (n_per_row a multiple of the type's block size) into `dst`
// (nrows * dtype_row_bytes(type, n_per_row) bytes), exactly as ggml_quantize_chunk(type, src, dst, 0, nrows,
// n_per_row, importance) does: `importance` is null or n_per_row non-negative weights (an importance
// matrix's row for this tensor), which selects ggml's weighted search. Rows are independent and are split
// over `pool`'s threads (results do not depend on the thread count).
// Throws Error(unsupported) for another type, Error(invalid_input) for a bad n_per_row or nrows, no
// importance for a quantize_requires_importance type, or (grid types, whose searches need numbers) a
// non-finite value or a negative or non-finite importance.
void quantize_rows(ThreadPool& pool, DType type, const float* src, void* dst, int64_t nrows,
                   int64_t n_per_row, const float* importance);

// i8_ch rows (loom's own per-channel int8 type, kernels/ref/i8ch_ref.h) with the
// caller's per-row scales and zero points (min-max, percentile, MSE search:
// the caller's choice). Row r of `w` (`cols` floats) becomes the header
// {scales[r], zeros[r]} and the codes q = clamp(round(w / scale + zero),
// -128, 127): w / scale and + zero are f32 operations, round is half away
// from zero (std::round); NaN results (0/0, NaN weights) give q = zero
// (value 0), a zero scale gives q = zero for every weight. `zeros` may be null
// (all 0: symmetric). `out` holds rows * dtype_row_bytes(DType::i8_ch, cols)
// bytes. Throws Error(invalid_input) for cols < 1, rows < 0, a zero point that
// is not an integer in [-128, 127] or a non-finite scale (naming the row).
void quantize_rows_i8_ch(const float* w, int64_t rows, int64_t cols, const float* scales, const float* zeros,
                         uint8_t* out);

}  // namespace loom

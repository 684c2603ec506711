// Production dequantization of weight rows to f32 (embedding gathers, load-time
// expansion, the backward's weight tiles): AVX2 on the x86-64-v3 baseline.
// Bit-identical to the scalar reference dequantize_row_ref
// (kernels/ref/dequant_ref.h), which the tests check on every type, except for
// NaN payloads: F16C quiets signalling NaNs of f16 values.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace loom {

// Converts `n` elements of `type` at `src` to float. Handles every DType
// (plain, integer and block types). `n` must be a multiple of the block size.
// `src` and `dst` need no particular alignment. For a type with a row header
// (i8_ch) `src` is the start of a row and n at most its columns.
void dequantize_row(DType type, const void* src, float* dst, int64_t n);

// Columns [c0, c0 + n) of the row that starts at `row` (c0 and n multiples of
// the block size): the same values as those columns of dequantize_row on the
// whole row, for readers of column slices (the backward's tiles). Unlike
// dequantize_row(type, row + dtype_row_bytes(type, c0), ...), it is right for
// types with a row header too.
void dequantize_row_cols(DType type, const void* row, int64_t c0, float* dst, int64_t n);

}  // namespace loom

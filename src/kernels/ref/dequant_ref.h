// Scalar reference (de)quantization of the GGUF block formats. These define
// loom's numerics: they match ggml's reference C code and gguf-py bit for bit,
// and every vectorised kernel is tested against them.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace loom {

// Converts `n` elements of `type` at `src` to float. Handles every DType
// (plain, integer and block types). `n` must be a multiple of the block size.
// `src` and `dst` need no particular alignment. For a type with a row header
// (i8_ch) `src` is the start of a row and n at most its columns.
void dequantize_row_ref(DType type, const void* src, float* dst, int64_t n);

// Activation quantizers, rounding exactly like ggml's *_ref functions:
// q8_0 and q8_1 round half away from zero (roundf), q8_K rounds half to even.
// Unlike ggml, an all-zero q8_K block also gets zero bsums.
void quantize_row_q8_0_ref(const float* x, void* dst, int64_t n);
void quantize_row_q8_1_ref(const float* x, void* dst, int64_t n);
void quantize_row_q8_k_ref(const float* x, void* dst, int64_t n);

// Round-to-nearest weight quantizers (ggml's quantize_row_*_ref, byte-identical
// to gguf-py's quantize) for producing test data and simple conversions.
bool quantize_ref_supported(DType type);
// Throws loom::Error(unsupported) for a type without a reference quantizer
// (the k-quants need ggml's search-based quantizers, which loom lacks).
void quantize_row_ref(DType type, const float* src, void* dst, int64_t n);

}  // namespace loom

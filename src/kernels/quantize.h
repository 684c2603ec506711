// Weight quantization into the GGUF formats, byte-identical to llama.cpp's
// (ggml_quantize_chunk, what llama-quantize writes): round-to-nearest for the
// 32-element formats and ggml's scale searches for the k-quants; with an
// importance matrix, ggml's weighted searches for all of them but q8_0.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/thread_pool.h"

namespace loom {

// Types quantize_rows can produce: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k,
// q6_k.
bool quantize_supported(DType type);

// Quantizes `nrows` rows of `n_per_row` floats (n_per_row a multiple of the type's block size) into `dst`
// (nrows * dtype_row_bytes(type, n_per_row) bytes), exactly as ggml_quantize_chunk(type, src, dst, 0, nrows,
// n_per_row, importance) does: `importance` is null or n_per_row non-negative weights (an importance
// matrix's row for this tensor), which selects ggml's weighted search. Rows are independent and are split
// over `pool`'s threads (results do not depend on the thread count).
// Throws Error(unsupported) for another type, Error(invalid_input) for a bad n_per_row or nrows.
void quantize_rows(ThreadPool& pool, DType type, const float* src, void* dst, int64_t nrows,
                   int64_t n_per_row, const float* importance);

}  // namespace loom

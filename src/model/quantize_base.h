// Load-time quantization of a model's frozen linear weights (QLoRA's
// `quantize_base`): q/k/v/o/gate/up/down of every layer go from their stored
// f32 / f16 / bf16 to q8_0, q4_0 or nf4 before the backend prepares them. The
// embedding and the output projection keep their type (a gather reads only the
// batch's rows of the one, and the other is the chunked loss's single product
// whose error every logit sees), norms stay f32.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/tensor.h"
#include "model/weights.h"

namespace loom {

// The targets quantize_base accepts: q8_0, q4_0, nf4.
bool quantize_base_supported(DType target);

// Quantizes a rows x cols matrix of f32 / f16 / bf16 into `dst`
// (rows * dtype_row_bytes(target, cols) bytes), one row expanded to f32 at a
// time: q8_0 and q4_0 with ggml's quantize_row_*_ref (what llama-quantize
// writes for an f16 source without an importance matrix), nf4 as
// bitsandbytes' quantize_4bit with double quantization (kernels/ref/nf4_ref.h).
void quantize_matrix(const Tensor& src, DType target, uint8_t* dst);

// Replaces every layer matrix of `w` by its quantized copy, held in
// w.owned_bytes, one tensor at a time. With `release_source` (the sources are
// read-only file mappings) each source's whole pages are dropped from memory
// after its copy is made, so the f16/bf16 weights are never resident as a
// whole. Throws invalid_input naming `source` and the tensor when a matrix is
// not f32 / f16 / bf16, or its width is not a multiple of the block size.
void quantize_base_weights(ModelWeights& w, DType target, const std::string& source, bool release_source);

}  // namespace loom

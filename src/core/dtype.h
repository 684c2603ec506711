// Element types of tensors. Numbering follows GGUF's ggml_type ids so that a
// GGUF tensor's type maps 1:1; safetensors dtypes map onto the same enum.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace loom {

enum class DType : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
  nvfp4 = 40,
  q1_0 = 41,
  q2_0 = 42,
  // loom's own types, outside GGUF's id range (never read from or written to a
  // GGUF file): nf4 = bitsandbytes' 4-bit NormalFloat in blocks of 64 with the
  // (double-quantized) absmax expanded to f32 (kernels/ref/nf4_ref.h);
  // i8_ch = int8 codes with one f32 scale and zero point per row (output
  // channel), for W8A8 products (kernels/ref/i8ch_ref.h).
  nf4 = 1000,
  i8_ch = 1001,
};

struct DTypeTraits {
  DType type;
  const char* name;      // "f32", "q4_k", ... (lower case, like gguf-py)
  int64_t block_size;    // elements per block (1 for plain types)
  size_t block_bytes;    // bytes per block
  bool quantized;
  // Bytes in front of each row's first block (i8_ch: its f32 scale and zero
  // point); 0 for every GGUF type. A row is the header, then its blocks.
  size_t row_header_bytes = 0;
};

// Returns nullopt for ids that loom does not know (e.g. q4_2) and for
// loom's own types (nf4, i8_ch), which no GGUF file may carry; callers
// turn that into an "unsupported tensor type" error naming the tensor.
std::optional<DTypeTraits> dtype_traits_of_id(uint32_t ggml_type_id);
const DTypeTraits& dtype_traits(DType type);

inline const char* dtype_name(DType t) { return dtype_traits(t).name; }
inline int64_t dtype_block_size(DType t) { return dtype_traits(t).block_size; }
inline bool dtype_is_quantized(DType t) { return dtype_traits(t).quantized; }

// Bytes for one row of `n` elements: the row header (if the type has one) plus
// n / block_size blocks; n must be a multiple of the block size (checked by
// callers that read files, asserted here). dtype_row_bytes(t, k) is also where
// column k's block starts inside a row; a type with a row header cannot be
// dequantized from there alone (dequantize_row_cols, kernels/cpu/dequant.h).
size_t dtype_row_bytes(DType t, int64_t n);
inline size_t dtype_row_header_bytes(DType t) { return dtype_traits(t).row_header_bytes; }

// Parses names such as "f16", "Q4_K", "bf16" (case-insensitive).
std::optional<DType> dtype_from_name(std::string_view name);

}  // namespace loom

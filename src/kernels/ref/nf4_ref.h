// NF4: bitsandbytes' 4-bit NormalFloat (QLoRA), the scalar definitions every
// NF4 kernel is tested against. A loom nf4 block holds 64 elements:
//   float d;        the block's absmax as bitsandbytes' dequantize_4bit uses it
//                   (after double quantization: nested_code[qabsmax] *
//                   nested_absmax + offset, in f32);
//   uint8 qs[32];   the 4-bit codes, element 2i in the high nibble of qs[i] and
//                   element 2i+1 in the low one (bitsandbytes' byte order).
// Element k = kNf4Code[code_k] * d, an f32 product: bit for bit what
// bitsandbytes.functional.dequantize_4bit returns in f32. Storage is 4.5 bits
// per weight (bitsandbytes keeps the 8-bit absmax codes: 4.13).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom {

constexpr int64_t kNf4Block = 64;        // elements per block
constexpr int64_t kNf4NestedBlock = 256;  // absmax values per nested (double-quantization) block

struct BlockNF4 {
  float d;
  uint8_t qs[32];
};
static_assert(sizeof(BlockNF4) == 36);

// bitsandbytes' NF4 code table (get_4bit_type("nf4")), ascending.
extern const float kNf4Code[16];
// bitsandbytes' signed dynamic map (create_dynamic_map(signed=True)), ascending:
// the code of the 8-bit absmax values of double quantization.
extern const float kDynamicSignedMap[256];

// dst[k] = kNf4Code[code_k] * d for n elements (a multiple of 64).
void dequantize_row_nf4_ref(const void* src, float* dst, int64_t n);

// The 4-bit codes of one block of 64 as bitsandbytes' quantize_4bit computes
// them: absmax = max |x|, scaled = clamp(x * (1 / max(absmax, 1e-38)), -1, 1),
// code = the first midpoint between code-table neighbours >= scaled
// (torch.bucketize). Writes qs and returns the block's absmax.
float quantize_block_nf4(const float* x, uint8_t* qs);

// Double quantization of a tensor's block absmaxes (bitsandbytes'
// compress_statistics): offset = their mean, then absmax - offset quantized in
// blocks of 256 with the signed dynamic map (nearest code, ties to the lower;
// bitsandbytes' approximate binary search picks a neighbour of the nearest in
// about 1 of 2000 values) and an f32 absmax per 256. The mean is torch's: its f32 sum on one thread
// (the 8-lane cascade of SumKernel.cpp) divided by n in f32. (With several
// threads torch splits sums of >= 32768 blocks, 2M weights, between them, and
// its own offset then depends on its thread count.)
struct Nf4DoubleQuant {
  float offset = 0;
  std::vector<uint8_t> qabsmax;       // one per block
  std::vector<float> nested_absmax;   // one per 256 blocks
};
Nf4DoubleQuant double_quantize_absmax(const float* absmax, int64_t n_blocks);
// absmax of block i: kDynamicSignedMap / `nested_code`[qabsmax[i]] * nested_absmax[i / 256] + offset,
// two f32 operations (bitsandbytes' dequantize_blockwise, then += offset).
float dequantize_absmax(const float* nested_code, uint8_t q, float nested_absmax, float offset);

// Quantizes a whole tensor of n elements (row-major, n a multiple of 64) into
// loom nf4 blocks with double quantization, as bitsandbytes' quantize_4bit(...,
// blocksize=64, compress_statistics=True, quant_type="nf4") followed by its
// dequantization of the absmax. `row` supplies rows of `cols` floats on demand
// (so a bf16 source is expanded one row at a time).
template <class RowFn>
void quantize_tensor_nf4(int64_t rows, int64_t cols, RowFn&& row, BlockNF4* out);

// y[t, n] = sum over blocks b of fma(s_b, d_b, acc) with
// s_b = fma chain over the block's k of (kNf4Code[code] * 1) x[t, k]:
//   s = 0; for k in block: s = fma(kNf4Code[code_k], x_k, s); acc = fma(s, d, acc)
// The one order every nf4 matmul kernel follows (bit-identical).
void matmul_nf4_ref(const BlockNF4* W, int64_t N, int64_t K, const float* x, int64_t T, float* y);

// ---- implementation of the template ----
void nf4_finish_double_quant(BlockNF4* blocks, int64_t n_blocks);

template <class RowFn>
void quantize_tensor_nf4(int64_t rows, int64_t cols, RowFn&& row, BlockNF4* out) {
  const int64_t per_row = cols / kNf4Block;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = row(r);
    for (int64_t b = 0; b < per_row; ++b) {
      BlockNF4& blk = out[r * per_row + b];
      blk.d = quantize_block_nf4(x + b * kNf4Block, blk.qs);
    }
  }
  nf4_finish_double_quant(out, rows * per_row);
}

}  // namespace loom

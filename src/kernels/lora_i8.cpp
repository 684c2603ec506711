#include "kernels/lora_i8.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "kernels/int_quant.h"

namespace loom {
namespace {

// rows x cols (row-major) as one int8 scale per row, then the codes: the rule of int_quant.h.
void pack_rows(const float* w, int64_t rows, int64_t cols, float* scales, int8_t* codes) {
  IntQuantSpec spec;  // 8 bits, symmetric, a scale per row, min-max range
  const IntQuantParams p = choose_int_quant_params(w, rows, cols, spec);
  const std::vector<int8_t> q = int_quantize(w, rows, cols, spec, p);
  std::memcpy(scales, p.scale.data(), p.scale.size() * sizeof(float));
  std::memcpy(codes, q.data(), q.size());
}

}  // namespace

void pack_lora_a8(const float* a, int64_t rank, int64_t in, uint8_t* dst) {
  LOOM_ASSERT(reinterpret_cast<uintptr_t>(dst) % alignof(float) == 0);
  pack_rows(a, rank, in, reinterpret_cast<float*>(dst),
            reinterpret_cast<int8_t*>(dst) + rank * sizeof(float));
}

void pack_lora_b8(const float* b, int64_t out, int64_t rank, uint8_t* dst) {
  LOOM_ASSERT(reinterpret_cast<uintptr_t>(dst) % alignof(float) == 0);
  std::memset(dst, 0, lora_b8_scale_bytes(out, rank));  // the scales' padding
  std::vector<float> block;
  for (int64_t q = 0; q * kLoraBlockCols < out; ++q) {
    const int64_t c0 = q * kLoraBlockCols, w = lora_b16_block_width(out, q), cols = std::min(w, out - c0);
    block.assign(static_cast<size_t>(rank * w), 0.0f);  // the padding: zeros change no range
    for (int64_t j = 0; j < rank; ++j)
      for (int64_t n = 0; n < cols; ++n) block[static_cast<size_t>(j * w + n)] = b[(c0 + n) * rank + j];
    pack_rows(block.data(), rank, w, reinterpret_cast<float*>(dst) + q * rank,
              reinterpret_cast<int8_t*>(dst + lora_b8_codes_offset(out, rank, q)));
  }
}

void unpack_lora_a8(const uint8_t* a8, int64_t rank, int64_t in, float* a) {
  const float* s = lora_a8_scales(a8);
  const int8_t* c = lora_a8_codes(a8, rank);
  for (int64_t j = 0; j < rank; ++j)
    for (int64_t i = 0; i < in; ++i) a[j * in + i] = static_cast<float>(c[j * in + i]) * s[j];
}

void unpack_lora_b8(const uint8_t* b8, int64_t out, int64_t rank, float* b) {
  for (int64_t q = 0; q * kLoraBlockCols < out; ++q) {
    const int64_t c0 = q * kLoraBlockCols, w = lora_b16_block_width(out, q), cols = std::min(w, out - c0);
    const float* s = lora_b8_scales(b8, rank, q);
    const int8_t* c = lora_b8_codes(b8, out, rank, q);
    for (int64_t j = 0; j < rank; ++j)
      for (int64_t n = 0; n < cols; ++n) b[(c0 + n) * rank + j] = static_cast<float>(c[j * w + n]) * s[j];
  }
}

}  // namespace loom

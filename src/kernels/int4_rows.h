// A row-major matrix kept in 4 bits and read in place by the kernels (the
// server's LoRA factors under --lora-bits 4). The layout is kernels/int_quant.h's
// PackedInt4: codes (code + 8) two to a byte, element 2i of a row in the low
// nibble, one f32 scale per group of `group` columns of a row; element (r, c)
// stands for float(code - 8) * scales[r * (cols / group) + c / group], one
// float multiply, so every reader dequantizes to the same bits as
// unpack_int4_rows. A view: whoever packed the matrix owns the memory.
#pragma once

#include <cstdint>

namespace loom {

struct Int4Rows {
  const uint8_t* codes = nullptr;  // rows * cols / 2 (cols even)
  const float* scales = nullptr;   // rows * (cols / group)
  int64_t group = 0;               // divides cols
  bool empty() const { return codes == nullptr; }
};

}  // namespace loom

// quantize_rows_i8_ch (kernels/quantize.h): i8_ch rows from f32 weights and the
// caller's per-row scales and zero points.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/quantize.h"
#include "kernels/ref/i8ch_ref.h"

namespace loom {

void quantize_rows_i8_ch(const float* w, int64_t rows, int64_t cols, const float* scales, const float* zeros,
                         uint8_t* out) {
  if (cols < 1 || rows < 0)
    fail(ErrorKind::invalid_input, "quantize_rows_i8_ch: bad shape {} x {}", rows, cols);
  const size_t row_bytes = dtype_row_bytes(DType::i8_ch, cols);
  for (int64_t r = 0; r < rows; ++r) {
    const I8ChHeader h{scales[r], zeros != nullptr ? zeros[r] : 0.0f};
    if (!i8ch_header_valid(h))
      fail(ErrorKind::invalid_input, "quantize_rows_i8_ch: row {} has zero point {}, not an integer in [-128, 127]",
           r, h.zero);
    if (!std::isfinite(h.scale))
      fail(ErrorKind::invalid_input, "quantize_rows_i8_ch: row {} has scale {}", r, h.scale);
    uint8_t* dst = out + static_cast<size_t>(r) * row_bytes;
    std::memcpy(dst, &h, sizeof h);
    auto* q = reinterpret_cast<int8_t*>(dst + kI8ChHeaderBytes);
    const float* x = w + r * cols;
    const auto zq = static_cast<int8_t>(h.zero);
    if (h.scale == 0.0f) {
      std::fill_n(q, cols, zq);
      continue;
    }
    for (int64_t k = 0; k < cols; ++k) {
      const float v = x[k] / h.scale + h.zero;
      q[k] = std::isnan(v) ? zq : static_cast<int8_t>(std::clamp(std::round(v), -128.0f, 127.0f));
    }
  }
}

}  // namespace loom

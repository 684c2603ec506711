// Scalar i8_ch definitions (see i8ch_ref.h). Every float operation is written
// out one by one: no FMA contraction.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "kernels/ref/i8ch_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace loom {

I8ChHeader i8ch_header(const void* row) {
  I8ChHeader h;
  std::memcpy(&h, row, sizeof h);
  return h;
}

bool i8ch_header_valid(const I8ChHeader& h) {
  return h.zero >= -128.0f && h.zero <= 127.0f && std::nearbyint(h.zero) == h.zero;
}

void dequantize_row_i8ch_ref(const void* row, float* dst, int64_t n) {
  const I8ChHeader h = i8ch_header(row);
  const auto* q = static_cast<const int8_t*>(row) + kI8ChHeaderBytes;
  for (int64_t k = 0; k < n; ++k) dst[k] = h.scale * (static_cast<float>(q[k]) - h.zero);
}

float quantize_act_row_i8ch_ref(const float* x, int64_t n, int8_t* qx, int32_t* sum) {
  float amax = 0.0f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));  // NaN skipped
  const float s = amax / 127.0f;
  const float id = s != 0.0f ? 1.0f / s : 0.0f;
  int32_t total = 0;
  for (int64_t k = 0; k < n; ++k) {
    const float v = x[k] * id;
    const int8_t q = std::isnan(v) ? 0 : static_cast<int8_t>(std::clamp(std::round(v), -127.0f, 127.0f));
    qx[k] = q;
    total += q;
  }
  *sum = total;
  return s;
}

void matmul_i8ch_ref(const uint8_t* W, int64_t N, int64_t K, const float* x, int64_t T, float* y) {
  LOOM_ASSERT(K >= 1 && K <= kI8ChMaxCols);
  const size_t row_bytes = kI8ChHeaderBytes + static_cast<size_t>(K);
  std::vector<int8_t> qx(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    int32_t xsum = 0;
    const float s = quantize_act_row_i8ch_ref(x + t * K, K, qx.data(), &xsum);
    for (int64_t o = 0; o < N; ++o) {
      const uint8_t* row = W + static_cast<size_t>(o) * row_bytes;
      const I8ChHeader h = i8ch_header(row);
      LOOM_ASSERT(i8ch_header_valid(h));
      const auto* q = reinterpret_cast<const int8_t*>(row + kI8ChHeaderBytes);
      int64_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<int64_t>(q[k]) * qx[static_cast<size_t>(k)];
      acc -= static_cast<int64_t>(h.zero) * xsum;
      LOOM_ASSERT(acc >= INT32_MIN && acc <= INT32_MAX);
      const float p = h.scale * s;
      y[t * N + o] = static_cast<float>(static_cast<int32_t>(acc)) * p;
    }
  }
}

}  // namespace loom

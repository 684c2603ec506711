#include "core/finite_scan.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace loom {

FiniteScan scan_finite(const float* v, int64_t n) {
  // |v| as bits orders as |v| does; NaN and Inf are the patterns from 0x7f800000 up.
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, v + i, sizeof u);
    max_bits = std::max(max_bits, u & 0x7fffffffu);
  }
  FiniteScan s;
  if (max_bits >= 0x7f800000u) {
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(v[i])) {
        s.first_non_finite = i;
        break;
      }
    return s;
  }
  std::memcpy(&s.max_abs, &max_bits, sizeof s.max_abs);
  return s;
}

}  // namespace loom

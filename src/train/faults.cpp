// The non-finite check (faults.h).
#include "train/faults.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace loom {

namespace {

// True when [p, p + n) holds a NaN or inf: the largest |x| bit pattern is at
// least the exponent-all-ones pattern. An integer max, so it vectorizes.
bool block_has_non_finite(const float* p, size_t n) {
  uint32_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, p + i, sizeof b);
    m = std::max(m, b & 0x7fffffffu);
  }
  return m >= 0x7f800000u;
}

// The first non-finite index of [b, e), or SIZE_MAX.
size_t scan(const float* a, size_t b, size_t e) {
  constexpr size_t kBlock = 4096;
  for (size_t i = b; i < e; i += kBlock) {
    const size_t n = std::min(kBlock, e - i);
    if (!block_has_non_finite(a + i, n)) continue;
    for (size_t j = i; j < i + n; ++j)
      if (!std::isfinite(a[j])) return j;
  }
  return SIZE_MAX;
}

}  // namespace

std::optional<size_t> first_non_finite(std::span<const float> a, ThreadPool* pool) {
  const size_t n = a.size();
  if (!pool || pool->size() == 1 || n < (size_t{1} << 20)) {
    const size_t i = scan(a.data(), 0, n);
    return i != SIZE_MAX ? std::optional<size_t>(i) : std::nullopt;
  }
  std::atomic<size_t> first{n};
  pool->parallel_for(static_cast<int64_t>(n), [&](int64_t b, int64_t e) {
    const size_t i = scan(a.data(), static_cast<size_t>(b), static_cast<size_t>(e));
    size_t cur = first.load();
    while (i < cur && !first.compare_exchange_weak(cur, i)) {
    }
  }, 4096);
  const size_t i = first.load();
  return i < n ? std::optional<size_t>(i) : std::nullopt;
}

}  // namespace loom

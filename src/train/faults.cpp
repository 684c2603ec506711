// The non-finite check (faults.h).
#include "train/faults.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "core/finite_scan.h"

namespace loom {

namespace {

// The first non-finite index of [b, e), or SIZE_MAX: blocks of 4096 scanned
// branch-free (core/finite_scan.h), a block with a bad value once more for its index.
size_t scan(const float* a, size_t b, size_t e) {
  constexpr size_t kBlock = 4096;
  for (size_t i = b; i < e; i += kBlock) {
    const size_t n = std::min(kBlock, e - i);
    if (const int64_t j = scan_finite(a + i, static_cast<int64_t>(n)).first_non_finite; j >= 0)
      return i + static_cast<size_t>(j);
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

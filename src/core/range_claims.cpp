#include "core/range_claims.h"

#include "core/error.h"

namespace loom {

void RangeClaims::reset(int64_t n, int parts, int64_t chunk) {
  LOOM_ASSERT(n >= 0 && n < (int64_t{1} << 32) && parts >= 1 && chunk >= 1);
  if (parts > capacity_) {
    parts_ = std::make_unique<Part[]>(static_cast<size_t>(parts));
    capacity_ = parts;
  }
  n_parts_ = parts;
  chunk_ = static_cast<uint64_t>(chunk);
  for (int i = 0; i < parts; ++i)
    parts_[i].front_back.store(
        pack(static_cast<uint64_t>(n * i / parts), static_cast<uint64_t>(n * (i + 1) / parts)),
        std::memory_order_relaxed);
}

bool RangeClaims::take_front(Part& p, int64_t* begin, int64_t* end) {
  uint64_t v = p.front_back.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t front = v & 0xffffffffu, back = v >> 32;
    if (front >= back) return false;
    const uint64_t to = back - front > chunk_ ? front + chunk_ : back;
    if (p.front_back.compare_exchange_weak(v, pack(to, back), std::memory_order_relaxed)) {
      *begin = static_cast<int64_t>(front);
      *end = static_cast<int64_t>(to);
      return true;
    }
  }
}

bool RangeClaims::take_back(Part& p, int64_t* begin, int64_t* end) {
  uint64_t v = p.front_back.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t front = v & 0xffffffffu, back = v >> 32;
    if (front >= back) return false;
    const uint64_t from = back - front > chunk_ ? back - chunk_ : front;
    if (p.front_back.compare_exchange_weak(v, pack(front, from), std::memory_order_relaxed)) {
      *begin = static_cast<int64_t>(from);
      *end = static_cast<int64_t>(back);
      return true;
    }
  }
}

bool RangeClaims::next(int part, int64_t* begin, int64_t* end) {
  LOOM_ASSERT(part >= 0 && part < n_parts_);
  if (take_front(parts_[part], begin, end)) return true;
  for (int k = 1; k < n_parts_; ++k)
    if (take_back(parts_[(part + k) % n_parts_], begin, end)) return true;
  return false;
}

}  // namespace loom

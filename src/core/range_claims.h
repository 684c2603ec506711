// Work stealing over an index range for one fork-join op. [0, n) is split into
// one contiguous part per worker; a worker takes its own part chunk by chunk
// from the front and, once it is empty, takes chunks from the back of the
// others'. On a quiet machine this is the even static split (a worker's claims
// touch only its own cache line, and nothing is stolen); a worker slowed by a
// busy sibling vCPU, or running on an efficiency core, loses the tail of its
// part to the others instead of holding the op up. Which worker runs an index
// must not change results (the caller's contract).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace loom {

class RangeClaims {
 public:
  // On the calling thread, before any worker calls next(): n < 2^32 indices,
  // `parts` workers, chunks of `chunk` indices (>= 1).
  void reset(int64_t n, int parts, int64_t chunk);
  // The next chunk for worker `part`, as [*begin, *end); false when no index is
  // left in any part.
  bool next(int part, int64_t* begin, int64_t* end);

 private:
  struct alignas(64) Part {
    std::atomic<uint64_t> front_back{0};  // front in the low 32 bits, back in the high
  };
  static uint64_t pack(uint64_t front, uint64_t back) { return front | back << 32; }
  bool take_front(Part& p, int64_t* begin, int64_t* end);
  bool take_back(Part& p, int64_t* begin, int64_t* end);

  std::unique_ptr<Part[]> parts_;
  int capacity_ = 0, n_parts_ = 0;
  uint64_t chunk_ = 1;
};

}  // namespace loom

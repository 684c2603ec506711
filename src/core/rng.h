// Counter-based random numbers: the n-th draw of a stream is a pure function
// of (seed, n), so a run resumed from a checkpoint that stores n continues
// bit-exactly.
#pragma once

#include <cstdint>

namespace loom {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class CounterRng {
 public:
  explicit CounterRng(uint64_t seed, uint64_t counter = 0) : key_(splitmix64(seed)), counter_(counter) {}
  uint64_t next_u64() { return splitmix64(key_ ^ splitmix64(counter_++)); }
  // Uniform in [0, 1) with 53 random bits.
  double next_double() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  uint64_t counter() const { return counter_; }

 private:
  uint64_t key_;
  uint64_t counter_;
};

}  // namespace loom

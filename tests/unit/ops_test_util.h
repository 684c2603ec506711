// Random inputs for the row-wise operator tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace loom::test_util {

// n normal samples of standard deviation `scale`, the same for the same seed.
inline std::vector<float> random_vec(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace loom::test_util

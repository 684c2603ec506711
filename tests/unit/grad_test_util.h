// Helpers for gradient tests: double-precision finite differences and
// f32-vs-double comparisons on random inputs with fixed seeds.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace loom::testing {

inline std::vector<double> random_doubles(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline std::vector<float> to_f32(const std::vector<double>& v) { return {v.begin(), v.end()}; }
inline std::vector<double> to_f64(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Checks analytic gradient `g` of loss() w.r.t. `p` by central differences on
// up to max_checks evenly spread elements: |fd - g| <= tol * max(|g|, 1e-2).
inline void expect_fd_gradient(const std::function<double()>& loss, std::vector<double>& p,
                               const std::vector<double>& g, const char* what, double tol = 1e-6,
                               size_t max_checks = 400) {
  ASSERT_EQ(p.size(), g.size()) << what;
  const size_t step = std::max<size_t>(1, p.size() / max_checks);
  for (size_t i = 0; i < p.size(); i += step) {
    const double keep = p[i], h = 1e-5 * std::max(1.0, std::fabs(keep));
    p[i] = keep + h;
    const double lp = loss();
    p[i] = keep - h;
    const double lm = loss();
    p[i] = keep;
    const double fd = (lp - lm) / (2 * h);
    ASSERT_LE(std::fabs(fd - g[i]), tol * std::max(std::fabs(g[i]), 1e-2))
        << what << "[" << i << "]: finite difference " << fd << " vs analytic " << g[i];
  }
}

// |a - b| <= rtol * (|b| + max|b|/10): f32 results against a double reference,
// relative to the element and to the overall magnitude (cancellation).
inline void expect_near_ref(const std::vector<float>& a, const std::vector<double>& b, double rtol,
                            const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double mx = 0;
  for (double x : b) mx = std::max(mx, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_LE(std::fabs(a[i] - b[i]), rtol * (std::fabs(b[i]) + 0.1 * mx + 1e-30))
        << what << "[" << i << "]: " << a[i] << " vs reference " << b[i];
}

// sum_i c[i] y[i]: a scalar loss whose gradient w.r.t. y is c.
inline double weighted_sum(const std::vector<double>& c, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += c[i] * y[i];
  return s;
}

}  // namespace loom::testing

#include "kernels/ref/ops_ref.h"

#include <cmath>
#include <vector>

namespace loom::ref {

void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[t * n + i]) * x[t * n + i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[t * n + i] = static_cast<float>(x[t * n + i] * inv * w[i]);
  }
}

void swiglu(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    out[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
  }
}

void rope_apply(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos) {
  const int64_t d = rope.head_dim, half = d / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(pos[t]) * rope.inv_freq[static_cast<size_t>(i)];
        const int64_t i0 = rope.interleaved ? 2 * i : i;
        const int64_t i1 = rope.interleaved ? 2 * i + 1 : i + half;
        const double x0 = v[i0], x1 = v[i1];
        v[i0] = static_cast<float>(x0 * std::cos(a) - x1 * std::sin(a));
        v[i1] = static_cast<float>(x0 * std::sin(a) + x1 * std::cos(a));
      }
    }
}

void attention(const AttentionShape& s, const float* q, const float* k, const float* v, float* out, int64_t T,
               const int32_t* pos, const int32_t* seq_start) {
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < s.n_heads; ++h) {
      const float* qv = q + (t * s.n_heads + h) * d;
      const int64_t g = h / group, first = seq_start ? seq_start[t] : 0, last = pos[t];
      std::vector<double> w(static_cast<size_t>(last - first + 1));
      double mx = -INFINITY;
      for (int64_t p = first; p <= last; ++p) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(qv[i]) * k[p * s.kv_stride + g * d + i];
        w[static_cast<size_t>(p - first)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      double sum = 0;
      for (auto& x : w) { x = std::exp(x - mx); sum += x; }
      float* o = out + (t * s.n_heads + h) * d;
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0;
        for (int64_t p = first; p <= last; ++p) acc += w[static_cast<size_t>(p - first)] * v[p * s.kv_stride + g * d + i];
        o[i] = static_cast<float>(acc / sum);
      }
    }
}

}  // namespace loom::ref

#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/simd_avx2.h"

namespace loom {

void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * n;
    float* o = out + t * n;
    const float ss = simd::dot(xr, xr, n);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), _mm256_loadu_ps(w + i)));
    for (; i < n; ++i) o[i] = xr[i] * inv * w[i];
  }
}

void swiglu(float* out, const float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::exp_ps(_mm256_xor_ps(g, sign));  // exp(-g)
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add_inplace(float* y, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] += x[i];
}

void rope_rotate(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos, float direction) {
  const int64_t d = rope.head_dim, half = d / 2;
  std::vector<float> cs(static_cast<size_t>(d));  // cos | sin per pair
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      // angle in double: positions up to 1e5+ times small frequencies lose bits in float
      const double a = static_cast<double>(pos[t]) * rope.inv_freq[static_cast<size_t>(i)];
      cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(a));
      cs[static_cast<size_t>(half + i)] = direction * static_cast<float>(std::sin(a));
    }
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i0 = rope.interleaved ? 2 * i : i;
        const int64_t i1 = rope.interleaved ? 2 * i + 1 : i + half;
        const float c = cs[static_cast<size_t>(i)], s = cs[static_cast<size_t>(half + i)];
        const float x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * c - x1 * s;
        v[i1] = x0 * s + x1 * c;
      }
    }
  }
}

void rope_apply(const RopeTable& rope, float* x, int64_t T, int64_t n_heads, const int32_t* pos) {
  rope_rotate(rope, x, T, n_heads, pos, 1.0f);
}

void attention(ThreadPool& pool, const AttentionShape& s, const float* q, const float* k, const float* v,
               float* out, int64_t T, const int32_t* pos, const int32_t* seq_start) {
  LOOM_ASSERT(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0);
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  int32_t max_span = 0;
  for (int64_t t = 0; t < T; ++t) max_span = std::max(max_span, pos[t] - (seq_start ? seq_start[t] : 0) + 1);
  const int64_t units = T * s.n_heads;
  pool.run([&](int ti, int tn) {
    std::vector<float> w(static_cast<size_t>(max_span) + 8);
    const int64_t chunk = (units + tn - 1) / tn;
    const int64_t ub = chunk * ti, ue = std::min(units, ub + chunk);
    for (int64_t u = ub; u < ue; ++u) {
      const int64_t t = u / s.n_heads, h = u % s.n_heads, g = h / group;
      const float* qv = q + (t * s.n_heads + h) * d;
      const int64_t first = seq_start ? seq_start[t] : 0, n = pos[t] - first + 1;
      const float* kb = k + first * s.kv_stride + g * d;
      const float* vb = v + first * s.kv_stride + g * d;
      float mx = -INFINITY;
      for (int64_t p = 0; p < n; ++p) {
        const float sc = simd::dot(qv, kb + p * s.kv_stride, d) * scale;
        w[static_cast<size_t>(p)] = sc;
        mx = std::max(mx, sc);
      }
      const __m256 vmx = _mm256_set1_ps(mx);
      __m256 vsum = _mm256_setzero_ps();
      int64_t p = 0;
      for (; p + 8 <= n; p += 8) {
        const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(&w[static_cast<size_t>(p)]), vmx));
        _mm256_storeu_ps(&w[static_cast<size_t>(p)], e);
        vsum = _mm256_add_ps(vsum, e);
      }
      float sum = simd::hsum(vsum);
      for (; p < n; ++p) {
        w[static_cast<size_t>(p)] = std::exp(w[static_cast<size_t>(p)] - mx);
        sum += w[static_cast<size_t>(p)];
      }
      float* o = out + (t * s.n_heads + h) * d;
      std::fill(o, o + d, 0.0f);
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < n; ++j) simd::axpy(o, w[static_cast<size_t>(j)] * inv, vb + j * s.kv_stride, d);
    }
  });
}

}  // namespace loom

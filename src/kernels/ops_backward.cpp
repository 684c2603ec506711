// Training forwards and backward passes of the row-wise decoder operators (AVX2).
#include "kernels/ops_backward.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/simd_avx2.h"

namespace loom {

void rmsnorm_forward_train(float* out, float* rstd, const float* x, const float* w, int64_t T, int64_t n,
                           float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * n;
    float* o = out + t * n;
    const float ss = simd::dot(xr, xr, n);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    rstd[t] = inv;
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), _mm256_loadu_ps(w + i)));
    for (; i < n; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// y = x r w with r = (mean(x^2) + eps)^-1/2, so dr/dx_i = -r^3 x_i / n and
// dx_i = r w_i dy_i - (r^3 / n) x_i sum_j dy_j w_j x_j.
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                      int64_t T, int64_t n) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * n;
    const float* dy = dout + t * n;
    float* d = dx + t * n;
    const float r = rstd[t];
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_loadu_ps(w + i)), _mm256_loadu_ps(xr + i),
                            acc);
    float S = simd::hsum(acc);
    for (; i < n; ++i) S += dy[i] * w[i] * xr[i];
    const float c = -r * r * r * S / static_cast<float>(n);
    const __m256 vr = _mm256_set1_ps(r), vc = _mm256_set1_ps(c);
    i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 g = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_loadu_ps(w + i)), vr);
      g = _mm256_fmadd_ps(vc, _mm256_loadu_ps(xr + i), g);
      _mm256_storeu_ps(d + i, _mm256_add_ps(_mm256_loadu_ps(d + i), g));
    }
    for (; i < n; ++i) d[i] += dy[i] * w[i] * r + c * xr[i];
  }
  if (!dw) return;
  // Rows in order, so each dw element sees one fixed summation sequence.
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * n;
    const float* dy = dout + t * n;
    const __m256 vr = _mm256_set1_ps(rstd[t]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dw + i, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_loadu_ps(xr + i)), vr,
                                               _mm256_loadu_ps(dw + i)));
    for (; i < n; ++i) dw[i] += dy[i] * xr[i] * rstd[t];
  }
}

void rope_backward(const RopeTable& rope, float* d, int64_t T, int64_t n_heads, const int32_t* pos) {
  rope_rotate(rope, d, T, n_heads, pos, -1.0f);  // the rotation is orthogonal: backward = inverse
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i), dy = _mm256_loadu_ps(dout + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, simd::exp_ps(_mm256_xor_ps(g, sign))));
    const __m256 silu = _mm256_mul_ps(g, sig);
    // silu'(g) = sig * (1 + g * (1 - sig))
    const __m256 dsilu = _mm256_mul_ps(sig, _mm256_fmadd_ps(g, _mm256_sub_ps(one, sig), one));
    _mm256_storeu_ps(dgate + i, _mm256_mul_ps(_mm256_mul_ps(dy, u), dsilu));
    _mm256_storeu_ps(dup + i, _mm256_mul_ps(dy, silu));
  }
  for (; i < n; ++i) {
    const float g = gate[i], u = up[i], dy = dout[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    dgate[i] = dy * u * (sig * (1.0f + g * (1.0f - sig)));
    dup[i] = dy * g * sig;
  }
}

namespace {

int64_t row_start(const int32_t* seq_start, int64_t t) { return seq_start ? seq_start[t] : 0; }

void check_packing(const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  LOOM_ASSERT(s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0 && s.head_dim > 0);
  LOOM_ASSERT(s.kv_stride >= s.n_kv_heads * s.head_dim);
  if (!seq_start) return;
  for (int64_t t = 0; t < T; ++t) {
    // Samples are contiguous runs of rows: start <= t and starts never go back.
    LOOM_ASSERT(seq_start[t] >= 0 && seq_start[t] <= t);
    LOOM_ASSERT(t == 0 || seq_start[t] >= seq_start[t - 1]);
    LOOM_ASSERT(seq_start[t] == t || seq_start[t] == seq_start[t > 0 ? t - 1 : 0]);
  }
}

int64_t max_span(int64_t T, const int32_t* seq_start) {
  int64_t m = 0;
  for (int64_t t = 0; t < T; ++t) m = std::max(m, t - row_start(seq_start, t) + 1);
  return m;
}

}  // namespace

void attention_forward_train(ThreadPool& pool, float* out, float* lse, const float* q, const float* k,
                             const float* v, const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  check_packing(s, T, seq_start);
  const int64_t d = s.head_dim, H = s.n_heads, group = s.n_heads / s.n_kv_heads, ldq = H * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t span = max_span(T, seq_start), units = T * H;
  pool.run([&](int ti, int tn) {
    std::vector<float> w(static_cast<size_t>(span) + 8);
    // Strided units: later rows have longer spans, so this balances the threads.
    for (int64_t u = ti; u < units; u += tn) {
      const int64_t t = u / H, h = u % H, g = h / group;
      const float* qv = q + t * ldq + h * d;
      const int64_t first = row_start(seq_start, t), n = t - first + 1;
      const float* kb = k + first * s.kv_stride + g * d;
      const float* vb = v + first * s.kv_stride + g * d;
      float mx = -INFINITY;
      for (int64_t p = 0; p < n; ++p) {
        const float sc = simd::dot(qv, kb + p * s.kv_stride, d) * scale;
        w[static_cast<size_t>(p)] = sc;
        mx = std::max(mx, sc);
      }
      float sum = 0;
      for (int64_t p = 0; p < n; ++p) {
        w[static_cast<size_t>(p)] = std::exp(w[static_cast<size_t>(p)] - mx);
        sum += w[static_cast<size_t>(p)];
      }
      float* o = out + t * ldq + h * d;
      std::fill(o, o + d, 0.0f);
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < n; ++j) simd::axpy(o, w[static_cast<size_t>(j)] * inv, vb + j * s.kv_stride, d);
      lse[u] = mx + std::log(sum);
    }
  });
}

// With P = softmax(S), S = scale q k^T, O = P V and D = rowsum(dO * O):
//   dS = P * (dO V^T - D);  dq = scale dS k;  dk = scale dS^T q;  dv = P^T dO.
void attention_backward(ThreadPool& pool, float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  check_packing(s, T, seq_start);
  const int64_t d = s.head_dim, H = s.n_heads, G = s.n_kv_heads, group = H / G, ldq = H * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> D(static_cast<size_t>(T * H));
  for (int64_t u = 0; u < T * H; ++u) D[static_cast<size_t>(u)] = simd::dot(dout + u * d, out + u * d, d);

  // Pass 1: dq, one unit per (query row, head).
  pool.run([&](int ti, int tn) {
    for (int64_t u = ti; u < T * H; u += tn) {
      const int64_t t = u / H, h = u % H, g = h / group;
      const float* qv = q + t * ldq + h * d;
      const float* dy = dout + t * ldq + h * d;
      float* dqv = dq + t * ldq + h * d;
      const float l = lse[u], Du = D[static_cast<size_t>(u)];
      for (int64_t j = row_start(seq_start, t); j <= t; ++j) {
        const float* kj = k + j * s.kv_stride + g * d;
        const float p = std::exp(simd::dot(qv, kj, d) * scale - l);
        const float ds = p * (simd::dot(dy, v + j * s.kv_stride + g * d, d) - Du);
        simd::axpy(dqv, scale * ds, kj, d);
      }
    }
  });

  // Pass 2: dk and dv, one unit per (key row, kv head); sums over the later query
  // rows of the same sample and the group's query heads, in a fixed order.
  pool.run([&](int ti, int tn) {
    std::vector<float> ak(static_cast<size_t>(d)), av(static_cast<size_t>(d));
    for (int64_t u = ti; u < T * G; u += tn) {
      const int64_t j = u / G, g = u % G;
      const float* kj = k + j * s.kv_stride + g * d;
      const float* vj = v + j * s.kv_stride + g * d;
      std::fill(ak.begin(), ak.end(), 0.0f);
      std::fill(av.begin(), av.end(), 0.0f);
      for (int64_t t = j; t < T && row_start(seq_start, t) <= j; ++t)
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qv = q + t * ldq + h * d;
          const float* dy = dout + t * ldq + h * d;
          const float p = std::exp(simd::dot(qv, kj, d) * scale - lse[t * H + h]);
          const float ds = p * (simd::dot(dy, vj, d) - D[static_cast<size_t>(t * H + h)]);
          simd::axpy(ak.data(), scale * ds, qv, d);
          simd::axpy(av.data(), p, dy, d);
        }
      simd::axpy(dk + j * s.kv_stride + g * d, 1.0f, ak.data(), d);
      simd::axpy(dv + j * s.kv_stride + g * d, 1.0f, av.data(), d);
    }
  });
}

void embedding_backward(ThreadPool& pool, float* dW, const float* dout, const int32_t* tokens, int64_t T,
                        int64_t vocab, int64_t H) {
  for (int64_t t = 0; t < T; ++t)
    if (tokens[t] < 0 || tokens[t] >= vocab)
      fail(ErrorKind::invalid_input, "embedding_backward: token {} at row {} outside the vocabulary of {}",
           tokens[t], t, vocab);
  // Threads split the columns; rows are added in order, so repeated tokens sum
  // deterministically.
  pool.parallel_for(H, [&](int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < T; ++t)
      simd::axpy(dW + tokens[t] * H + c0, 1.0f, dout + t * H + c0, c1 - c0);
  }, 16);
}

}  // namespace loom

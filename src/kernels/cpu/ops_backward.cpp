// Training forwards and backward passes of the row-wise decoder operators (AVX2).
#include "kernels/cpu/ops_backward.h"

#include <cmath>

#include "core/error.h"
#include "kernels/cpu/simd_avx2.h"

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

// attention_forward_train and attention_backward: kernels/cpu/attention_train.cpp.

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

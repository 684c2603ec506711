// Chunked cross-entropy fused with the output projection (see loss.h).
#include "kernels/cpu/loss.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/simd_avx2.h"

namespace loom {

namespace {

// Whether z[label] is the largest of z[0, V) with no equal value before it
// (torch.argmax's first-index rule); mx = the largest value.
bool label_is_argmax(const float* z, int32_t label, float mx) {
  if (!(z[label] == mx)) return false;
  for (int32_t c = 0; c < label; ++c)
    if (z[c] == mx) return false;
  return true;
}

}  // namespace

size_t LossScratch::bytes() const {
  return rows.capacity() * sizeof(int64_t) + (hc.capacity() + logits.capacity() + dhc.capacity()) * sizeof(float) +
         row_loss.capacity() * sizeof(double) + row_correct.capacity() + (bwd.dy.capacity() + bwd.prod.capacity()) *
         sizeof(float) + bwd.matmul.bytes();
}

LossResult chunked_cross_entropy(ThreadPool& pool, const ChunkedLossArgs& a, MatmulScratch& scratch,
                                 LossScratch* reuse) {
  LossScratch local;
  LossScratch& ls = reuse ? *reuse : local;
  LOOM_ASSERT(a.W && a.h && a.labels && a.chunk_rows > 0);
  const Tensor& W = *a.W;
  const int64_t V = W.rows(), H = W.cols();
  if (a.W_packed) LOOM_ASSERT(a.W_packed->rows() == V && a.W_packed->cols() == H);
  if (a.dW && W.dtype != DType::f32)
    fail(ErrorKind::invalid_input, "chunked_cross_entropy: output projection gradient needs an f32 weight, got {}",
         dtype_name(W.dtype));
  // Only unmasked rows are projected: prompt tokens cost nothing.
  std::vector<int64_t>& rows = ls.rows;
  rows.clear();
  rows.reserve(static_cast<size_t>(a.T));  // once for the largest batch, not grown by doubling
  for (int64_t t = 0; t < a.T; ++t) {
    const int32_t l = a.labels[t];
    if (l == -100) continue;
    if (l < 0 || l >= V)
      fail(ErrorKind::invalid_input, "chunked_cross_entropy: label {} at row {} outside the vocabulary of {}", l, t, V);
    rows.push_back(t);
  }
  LossResult res;
  res.n_tokens = static_cast<int64_t>(rows.size());
  const int64_t C = std::min<int64_t>(a.chunk_rows, std::max<int64_t>(1, res.n_tokens));
  // Sized (resize keeps the memory of a larger earlier call), every element written before it is read.
  std::vector<float>&hc = ls.hc, &logits = ls.logits, &dhc = ls.dhc;
  hc.resize(static_cast<size_t>(C * H));
  logits.resize(static_cast<size_t>(C * V));
  if (a.dh) dhc.resize(static_cast<size_t>(C * H));
  std::vector<double>& row_loss = ls.row_loss;
  row_loss.resize(static_cast<size_t>(C));
  std::vector<uint8_t>& row_correct = ls.row_correct;
  if (a.count_correct) row_correct.resize(static_cast<size_t>(C));
  PackedBackwardScratch& bwd = ls.bwd;
  for (int64_t r0 = 0; r0 < res.n_tokens; r0 += C) {
    const int64_t n = std::min(C, res.n_tokens - r0);
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(a.h + rows[static_cast<size_t>(r0 + i)] * H, H, hc.begin() + i * H);
    if (a.W_packed)
      matmul(pool, *a.W_packed, hc.data(), logits.data(), n, scratch);
    else
      matmul(pool, W, hc.data(), logits.data(), n, scratch);
    // Softmax per row, in place: logits become dlogits = (p - onehot) * grad_scale.
    pool.parallel_for(n, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float* z = logits.data() + i * V;
        const int32_t label = a.labels[rows[static_cast<size_t>(r0 + i)]];
        float mx = -INFINITY;
        for (int64_t c = 0; c < V; ++c) mx = std::max(mx, z[c]);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vs = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= V; c += 8) {
          const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(z + c), vmx));
          vs = _mm256_add_ps(vs, e);
        }
        double sum = simd::hsum(vs);
        for (; c < V; ++c) sum += std::exp(z[c] - mx);
        const double lse = mx + std::log(sum);
        row_loss[static_cast<size_t>(i)] = lse - z[label];
        if (a.count_correct) row_correct[static_cast<size_t>(i)] = label_is_argmax(z, label, mx);
        if (!a.dh && !a.dW) continue;
        const float flse = static_cast<float>(lse);
        const __m256 vl = _mm256_set1_ps(flse), vg = _mm256_set1_ps(a.grad_scale);
        c = 0;
        for (; c + 8 <= V; c += 8)
          _mm256_storeu_ps(z + c, _mm256_mul_ps(simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(z + c), vl)), vg));
        for (; c < V; ++c) z[c] = std::exp(z[c] - flse) * a.grad_scale;
        z[label] -= a.grad_scale;
      }
    });
    for (int64_t i = 0; i < n; ++i) res.loss_sum += row_loss[static_cast<size_t>(i)];
    if (a.count_correct)
      for (int64_t i = 0; i < n; ++i) res.n_correct += row_correct[static_cast<size_t>(i)];
    if (a.dh) {
      if (a.Wt_packed && a.Wt_packed->empty()) {
        linear_backward_input_bf16_direct(pool, W, logits.data(), V, dhc.data(), n, false, bwd);
      } else if (a.Wt_packed) {
        linear_backward_input_packed(pool, *a.Wt_packed, logits.data(), V, dhc.data(), n, false, bwd);
      } else {
        std::fill(dhc.begin(), dhc.begin() + n * H, 0.0f);
        linear_backward_input(pool, W, logits.data(), dhc.data(), n);
      }
      for (int64_t i = 0; i < n; ++i)
        simd::axpy(a.dh + rows[static_cast<size_t>(r0 + i)] * H, 1.0f, dhc.data() + i * H, H);
    }
    if (a.dW && a.dW_scratch) linear_backward_weight(pool, logits.data(), hc.data(), a.dW, n, V, H, *a.dW_scratch);
    else if (a.dW) linear_backward_weight(pool, logits.data(), hc.data(), a.dW, n, V, H);
  }
  return res;
}

}  // namespace loom

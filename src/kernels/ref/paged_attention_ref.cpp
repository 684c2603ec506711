// Scalar paged attention in double (the yardstick for kernels/cpu/paged_attention.cpp).
#include "kernels/ref/paged_attention_ref.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/half.h"

namespace loom::ref {

namespace {

double elem(const PagedKv& kv, const void* base, int64_t i) {
  if (kv.dtype == DType::f16) return fp16_to_fp32(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

}  // namespace

void paged_attention(const AttentionShape& s, const PagedKv& kv, const float* q, float* out, int64_t T,
                     const int32_t* pos, const int32_t* const* tables) {
  const int64_t d = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = pos[t] + 1;
    for (int64_t h = 0; h < s.n_heads; ++h) {
      const float* qv = q + (t * s.n_heads + h) * d;
      // where kv head g of each position starts
      std::vector<int64_t> at(static_cast<size_t>(n));
      for (int64_t p = 0; p < n; ++p)
        at[static_cast<size_t>(p)] =
            ((tables[t][p / kv.block_size] * s.n_kv_heads + h / group) * kv.block_size + p % kv.block_size) *
            d;
      std::vector<double> w(static_cast<size_t>(n));
      double mx = -INFINITY;
      for (int64_t p = 0; p < n; ++p) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i)
          dot += static_cast<double>(qv[i]) * elem(kv, kv.k, at[static_cast<size_t>(p)] + i);
        w[static_cast<size_t>(p)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      double sum = 0;
      for (auto& x : w) {
        x = std::exp(x - mx);
        sum += x;
      }
      float* o = out + (t * s.n_heads + h) * d;
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0;
        for (int64_t p = 0; p < n; ++p)
          acc += w[static_cast<size_t>(p)] * elem(kv, kv.v, at[static_cast<size_t>(p)] + i);
        o[i] = static_cast<float>(acc / sum);
      }
    }
  }
}

}  // namespace loom::ref

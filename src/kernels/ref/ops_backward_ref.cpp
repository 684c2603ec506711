// Scalar double-precision training operators: the yardstick for the fast backward kernels.
#include "kernels/ref/ops_backward_ref.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::ref {

void rmsnorm_forward(double* out, double* rstd, const double* x, const double* w, int64_t T, int64_t n,
                     double eps) {
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += x[t * n + i] * x[t * n + i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    rstd[t] = r;
    for (int64_t i = 0; i < n; ++i) out[t * n + i] = x[t * n + i] * r * w[i];
  }
}

void rmsnorm_backward(double* dx, double* dw, const double* dout, const double* x, const double* w,
                      const double* rstd, int64_t T, int64_t n) {
  for (int64_t t = 0; t < T; ++t) {
    const double r = rstd[t];
    double S = 0;
    for (int64_t i = 0; i < n; ++i) S += dout[t * n + i] * w[i] * x[t * n + i];
    for (int64_t i = 0; i < n; ++i) {
      dx[t * n + i] += r * w[i] * dout[t * n + i] - r * r * r / static_cast<double>(n) * S * x[t * n + i];
      if (dw) dw[i] += dout[t * n + i] * x[t * n + i] * r;
    }
  }
}

namespace {

void rotate(const RopeTable& rope, double* x, int64_t T, int64_t n_heads, const int32_t* pos, double sign) {
  const int64_t d = rope.head_dim, half = d / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < n_heads; ++h) {
      double* v = x + (t * n_heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const double a = sign * static_cast<double>(pos[t]) * rope.inv_freq[static_cast<size_t>(i)];
        const int64_t i0 = rope.interleaved ? 2 * i : i;
        const int64_t i1 = rope.interleaved ? 2 * i + 1 : i + half;
        const double x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * std::cos(a) - x1 * std::sin(a);
        v[i1] = x0 * std::sin(a) + x1 * std::cos(a);
      }
    }
}

int64_t first_row(const int32_t* seq_start, int64_t t) { return seq_start ? seq_start[t] : 0; }

}  // namespace

void rope_forward(const RopeTable& rope, double* x, int64_t T, int64_t n_heads, const int32_t* pos) {
  rotate(rope, x, T, n_heads, pos, 1.0);
}
void rope_backward(const RopeTable& rope, double* d, int64_t T, int64_t n_heads, const int32_t* pos) {
  rotate(rope, d, T, n_heads, pos, -1.0);
}

void swiglu_forward(double* out, const double* gate, const double* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
}

void swiglu_backward(double* dgate, double* dup, const double* dout, const double* gate, const double* up,
                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i], u = up[i], sig = 1.0 / (1.0 + std::exp(-g));
    dgate[i] = dout[i] * u * (sig + g * sig * (1.0 - sig));
    dup[i] = dout[i] * g * sig;
  }
}

void attention_forward(double* out, double* lse, const double* q, const double* k, const double* v,
                       const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  const int64_t d = s.head_dim, H = s.n_heads, group = H / s.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double* qv = q + (t * H + h) * d;
      const int64_t g = h / group, first = first_row(seq_start, t);
      std::vector<double> w(static_cast<size_t>(t - first + 1));
      double mx = -INFINITY;
      for (int64_t j = first; j <= t; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * k[j * s.kv_stride + g * d + i];
        w[static_cast<size_t>(j - first)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      double sum = 0;
      for (auto& x : w) { x = std::exp(x - mx); sum += x; }
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0;
        for (int64_t j = first; j <= t; ++j) acc += w[static_cast<size_t>(j - first)] * v[j * s.kv_stride + g * d + i];
        out[(t * H + h) * d + i] = acc / sum;
      }
      if (lse) lse[t * H + h] = mx + std::log(sum);
    }
}

void attention_backward(double* dq, double* dk, double* dv, const double* dout, const double* q, const double* k,
                        const double* v, const AttentionShape& s, int64_t T, const int32_t* seq_start) {
  const int64_t d = s.head_dim, H = s.n_heads, group = H / s.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double* qv = q + (t * H + h) * d;
      const double* dy = dout + (t * H + h) * d;
      const int64_t g = h / group, first = first_row(seq_start, t), n = t - first + 1;
      std::vector<double> p(static_cast<size_t>(n)), dp(static_cast<size_t>(n));
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * k[(first + j) * s.kv_stride + g * d + i];
        p[static_cast<size_t>(j)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      double sum = 0;
      for (auto& x : p) { x = std::exp(x - mx); sum += x; }
      for (auto& x : p) x /= sum;
      // dP_j = dy . v_j;  dS_j = P_j (dP_j - sum_l P_l dP_l)
      double pdp = 0;
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += dy[i] * v[(first + j) * s.kv_stride + g * d + i];
        dp[static_cast<size_t>(j)] = dot;
        pdp += p[static_cast<size_t>(j)] * dot;
      }
      for (int64_t j = 0; j < n; ++j) {
        const double pj = p[static_cast<size_t>(j)], ds = pj * (dp[static_cast<size_t>(j)] - pdp);
        const int64_t off = (first + j) * s.kv_stride + g * d;
        for (int64_t i = 0; i < d; ++i) {
          dq[(t * H + h) * d + i] += scale * ds * k[off + i];
          dk[off + i] += scale * ds * qv[i];
          dv[off + i] += pj * dy[i];
        }
      }
    }
}

void embedding_backward(double* dW, const double* dout, const int32_t* tokens, int64_t T, int64_t H) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) dW[tokens[t] * H + i] += dout[t * H + i];
}

void linear_forward(double* y, const double* x, const double* W, const double* b, int64_t T, int64_t N, int64_t K) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double acc = b ? b[n] : 0.0;
      for (int64_t kk = 0; kk < K; ++kk) acc += x[t * K + kk] * W[n * K + kk];
      y[t * N + n] = acc;
    }
}

void linear_backward(double* dx, double* dW, double* db, const double* dy, const double* x, const double* W,
                     int64_t T, int64_t N, int64_t K) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      const double g = dy[t * N + n];
      if (db) db[n] += g;
      for (int64_t kk = 0; kk < K; ++kk) {
        if (dx) dx[t * K + kk] += g * W[n * K + kk];
        if (dW) dW[n * K + kk] += g * x[t * K + kk];
      }
    }
}

double cross_entropy(double* dh, double* dW, int64_t* count, const double* h, const double* W,
                     const int32_t* labels, int64_t T, int64_t V, int64_t H, double grad_scale,
                     int64_t* correct) {
  double total = 0;
  int64_t cnt = 0, right = 0;
  std::vector<double> z(static_cast<size_t>(V));
  for (int64_t t = 0; t < T; ++t) {
    if (labels[t] == -100) continue;
    ++cnt;
    linear_forward(z.data(), h + t * H, W, nullptr, 1, V, H);
    const auto top = std::max_element(z.begin(), z.end());  // the first largest: torch.argmax
    const double mx = *top;
    right += top - z.begin() == labels[t];
    double sum = 0;
    for (double x : z) sum += std::exp(x - mx);
    const double lse = mx + std::log(sum);
    total += lse - z[static_cast<size_t>(labels[t])];
    for (int64_t c = 0; c < V; ++c) z[static_cast<size_t>(c)] = std::exp(z[static_cast<size_t>(c)] - lse);
    z[static_cast<size_t>(labels[t])] -= 1.0;
    for (auto& x : z) x *= grad_scale;
    linear_backward(dh ? dh + t * H : nullptr, dW, nullptr, z.data(), h + t * H, W, 1, V, H);
  }
  if (count) *count = cnt;
  if (correct) *correct = right;
  return total;
}

}  // namespace loom::ref

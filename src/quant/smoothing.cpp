#include "quant/smoothing.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/dequant.h"

namespace loom {
namespace {

constexpr float kMinSmoothScale = 1e-5f;  // llm-compressor's MINIMUM_SMOOTHING_SCALE

float* data_of(Tensor& t) { return static_cast<float*>(t.data); }

// One smoothing: a vector (a norm's weight, or the rows of the previous linear)
// divided by s, and the columns of the balanced weights multiplied by s.
struct Mapping {
  std::string name;
  std::vector<Tensor*> balance;
  float* smooth_vector = nullptr;  // a norm weight [width]
  Tensor* smooth_rows = nullptr;   // or the rows of a linear: rows j of it scale by 1 / s_j
  AdapterPoint input;
};

// The four smoothings of a layer (v -> o only when every head has its own K/V).
std::vector<Mapping> layer_mappings(LayerWeights& L, const ModelConfig& c) {
  std::vector<Mapping> m;
  m.push_back({"attn_norm -> q,k,v", {&L.wq, &L.wk, &L.wv}, const_cast<float*>(L.attn_norm), nullptr,
               AdapterPoint::qkv});
  if (c.n_heads == c.n_kv_heads && L.bv == nullptr)
    m.push_back({"v -> o", {&L.wo}, nullptr, &L.wv, AdapterPoint::o});
  m.push_back({"ffn_norm -> gate,up", {&L.w_gate, &L.w_up}, const_cast<float*>(L.ffn_norm), nullptr,
               AdapterPoint::gate_up});
  m.push_back({"up -> down", {&L.w_down}, nullptr, &L.w_up, AdapterPoint::down});
  return m;
}

void fold(const Mapping& m, const std::vector<float>& s) {
  const auto width = static_cast<int64_t>(s.size());
  for (Tensor* t : m.balance) {
    float* w = data_of(*t);
    for (int64_t r = 0; r < t->rows(); ++r)
      for (int64_t j = 0; j < width; ++j) w[r * width + j] *= s[static_cast<size_t>(j)];
  }
  if (m.smooth_vector != nullptr)
    for (int64_t j = 0; j < width; ++j) m.smooth_vector[j] /= s[static_cast<size_t>(j)];
  if (m.smooth_rows != nullptr) {
    float* w = data_of(*m.smooth_rows);
    const int64_t cols = m.smooth_rows->cols();
    for (int64_t j = 0; j < width; ++j)
      for (int64_t k = 0; k < cols; ++k) w[j * cols + k] /= s[static_cast<size_t>(j)];
  }
}

void report_scales(const SmoothCallback& report, SmoothReport r, const std::vector<float>& s) {
  if (!report) return;
  r.scale_min = *std::min_element(s.begin(), s.end());
  r.scale_max = *std::max_element(s.begin(), s.end());
  report(r);
}

// AWQ's w_mean: per input column, the mean over every balanced row of |w| / (max |w| of its group + 1e-6).
std::vector<float> normalized_weight_means(const Mapping& m, const IntQuantSpec& spec, int64_t width) {
  std::vector<double> sum(static_cast<size_t>(width), 0.0);
  int64_t rows = 0;
  for (const Tensor* t : m.balance) {
    const auto* w = static_cast<const float*>(t->data);
    const int64_t g = spec.group > 0 ? spec.group : width;
    for (int64_t r = 0; r < t->rows(); ++r) {
      for (int64_t c0 = 0; c0 < width; c0 += g) {
        float mx = 0;
        for (int64_t c = c0; c < c0 + g; ++c) mx = std::max(mx, std::fabs(w[r * width + c]));
        for (int64_t c = c0; c < c0 + g; ++c) sum[static_cast<size_t>(c)] += std::fabs(w[r * width + c]) / (mx + 1e-6f);
      }
    }
    rows += t->rows();
  }
  std::vector<float> mean(static_cast<size_t>(width));
  for (int64_t j = 0; j < width; ++j) mean[static_cast<size_t>(j)] = static_cast<float>(sum[static_cast<size_t>(j)] / rows);
  return mean;
}

// Q(W s) / s of one weight, f32 row-major.
std::vector<float> fake_quantized(const Tensor& t, const std::vector<float>& s, const IntQuantSpec& spec) {
  const int64_t rows = t.rows(), cols = t.cols();
  const auto* w = static_cast<const float*>(t.data);
  std::vector<float> ws(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) ws[static_cast<size_t>(r * cols + j)] = w[r * cols + j] * s[static_cast<size_t>(j)];
  const IntQuantParams p = choose_int_quant_params(ws.data(), rows, cols, spec);
  const auto q = int_quantize(ws.data(), rows, cols, spec, p);
  std::vector<float> out = int_dequantize(q.data(), rows, cols, spec, p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) out[static_cast<size_t>(r * cols + j)] /= s[static_cast<size_t>(j)];
  return out;
}

// Squared error of the balanced layers' outputs over the sampled rows X, with
// the weights replaced by Q(W s) / s, against the reference outputs.
double awq_loss(Backend& be, Workspace& ws, const Mapping& m, const std::vector<float>& s, const IntQuantSpec& spec,
                const ChannelStats& x, const std::vector<std::vector<float>>& ref) {
  const int64_t n = x.sample_rows();
  double loss = 0;
  size_t count = 0;
  std::vector<float> y;
  for (size_t i = 0; i < m.balance.size(); ++i) {
    const Tensor& t = *m.balance[i];
    std::vector<float> wq = fake_quantized(t, s, spec);
    const Tensor view = make_tensor(wq.data(), DType::f32, {t.rows(), t.cols()});
    y.resize(static_cast<size_t>(n * t.rows()));
    be.matmul_dense(ws, view, x.samples.data(), y.data(), n);
    for (size_t k = 0; k < y.size(); ++k) {
      const double d = static_cast<double>(y[k]) - ref[i][k];
      loss += d * d;
    }
    count += y.size();
  }
  return loss / static_cast<double>(count);
}

// SmoothQuant's s_j = range_j^alpha / (2 max_i |W_ij|)^(1 - alpha), at least 1e-5.
std::vector<float> smoothquant_scales(const Mapping& m, const ChannelStats& x, double alpha) {
  const int64_t width = x.width;
  std::vector<float> s(static_cast<size_t>(width));
  for (int64_t j = 0; j < width; ++j) {
    const float range = x.max[static_cast<size_t>(j)] - x.min[static_cast<size_t>(j)];
    float wmax = 0;
    for (const Tensor* t : m.balance) {
      const auto* d = static_cast<const float*>(t->data);
      for (int64_t r = 0; r < t->rows(); ++r) wmax = std::max(wmax, std::fabs(d[r * width + j]));
    }
    wmax *= 2.0f;
    const float sj = wmax > 0 ? static_cast<float>(std::pow(range, alpha) / std::pow(wmax, 1 - alpha)) : range;
    s[static_cast<size_t>(j)] = std::max(sj, kMinSmoothScale);
  }
  return s;
}

// Squared error of the smoothed W8A8 products over the sampled rows: x / s
// quantized per row to int8 (amax / 127, as i8_ch's activations), W s per
// row to int8 (symmetric, compressed-tensors' rule), against the f32 product.
double w8a8_loss(Backend& be, Workspace& ws, const Mapping& m, const std::vector<float>& s, const ChannelStats& x,
                 const std::vector<std::vector<float>>& ref) {
  const int64_t n = x.sample_rows(), width = x.width;
  std::vector<float> xq(x.samples.size());
  for (int64_t r = 0; r < n; ++r) {
    const float* src = x.samples.data() + r * width;
    float* dst = xq.data() + r * width;
    float amax = 0;
    for (int64_t j = 0; j < width; ++j) amax = std::max(amax, std::fabs(src[j] / s[static_cast<size_t>(j)]));
    const float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
    for (int64_t j = 0; j < width; ++j) dst[j] = std::round(src[j] / s[static_cast<size_t>(j)] * id) * d;
  }
  IntQuantSpec spec;  // int8, per channel, symmetric
  double loss = 0;
  size_t count = 0;
  std::vector<float> y;
  for (size_t i = 0; i < m.balance.size(); ++i) {
    const Tensor& t = *m.balance[i];
    std::vector<float> ws_(static_cast<size_t>(t.numel()));
    const auto* w = static_cast<const float*>(t.data);
    for (int64_t r = 0; r < t.rows(); ++r)
      for (int64_t j = 0; j < width; ++j) ws_[static_cast<size_t>(r * width + j)] = w[r * width + j] * s[static_cast<size_t>(j)];
    const IntQuantParams p = choose_int_quant_params(ws_.data(), t.rows(), width, spec);
    const auto q = int_quantize(ws_.data(), t.rows(), width, spec, p);
    std::vector<float> wq = int_dequantize(q.data(), t.rows(), width, spec, p);
    const Tensor view = make_tensor(wq.data(), DType::f32, {t.rows(), width});
    y.resize(static_cast<size_t>(n * t.rows()));
    be.matmul_dense(ws, view, xq.data(), y.data(), n);
    for (size_t k = 0; k < y.size(); ++k) {
      const double d = static_cast<double>(y[k]) - ref[i][k];
      loss += d * d;
    }
    count += y.size();
  }
  return loss / static_cast<double>(count);
}

}  // namespace

void make_weights_mutable(ModelWeights& w, const ModelConfig& c) {
  auto copy_matrix = [&w](Tensor& t) {
    auto& buf = w.owned.emplace_back(static_cast<size_t>(t.numel()));
    for (int64_t r = 0; r < t.rows(); ++r) dequantize_row(t.dtype, t.row_ptr(r), buf.data() + r * t.cols(), t.cols());
    t.data = buf.data();
    t.dtype = DType::f32;
  };
  auto copy_vector = [&w](const float*& v, int64_t n) {
    if (v == nullptr) return;
    w.owned.emplace_back(v, v + n);
    v = w.owned.back().data();
  };
  for (auto& L : w.layers) {
    for (Tensor* t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) copy_matrix(*t);
    copy_vector(L.attn_norm, c.hidden);
    copy_vector(L.ffn_norm, c.hidden);
  }
}

void apply_smoothquant(ModelWeights& w, const ModelConfig& c, const CalibrationStats& stats, double alpha,
                       const SmoothCallback& report) {
  if (!(alpha >= 0 && alpha <= 1)) fail(ErrorKind::invalid_input, "--alpha {}: must be in [0, 1]", alpha);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    for (const Mapping& m : layer_mappings(w.layers[l], c)) {
      const std::vector<float> s = smoothquant_scales(m, stats.at(static_cast<int64_t>(l), m.input), alpha);
      fold(m, s);
      report_scales(report, {static_cast<int64_t>(l), m.name, alpha}, s);
    }
  }
}

void apply_smoothquant_search(Backend& be, ModelWeights& w, const ModelConfig& c, const CalibrationStats& stats,
                              const std::vector<double>& alphas, const SmoothCallback& report) {
  auto ws = be.make_workspace();
  for (size_t l = 0; l < w.layers.size(); ++l) {
    for (const Mapping& m : layer_mappings(w.layers[l], c)) {
      const ChannelStats& x = stats.at(static_cast<int64_t>(l), m.input);
      if (x.sample_rows() == 0) fail(ErrorKind::invalid_input, "--alpha auto needs sampled calibration rows");
      std::vector<std::vector<float>> ref;
      for (const Tensor* t : m.balance) {
        ref.emplace_back(static_cast<size_t>(x.sample_rows() * t->rows()));
        be.matmul_dense(*ws, *t, x.samples.data(), ref.back().data(), x.sample_rows());
      }
      double best = std::numeric_limits<double>::infinity(), best_alpha = alphas.front();
      std::vector<float> best_s;
      for (double a : alphas) {
        std::vector<float> s = smoothquant_scales(m, x, a);
        const double e = w8a8_loss(be, *ws, m, s, x, ref);
        if (e < best) {
          best = e;
          best_alpha = a;
          best_s = std::move(s);
        }
      }
      fold(m, best_s);
      SmoothReport rep{static_cast<int64_t>(l), m.name, best_alpha, 0, best};
      report_scales(report, rep, best_s);
    }
  }
}

void apply_awq(Backend& be, ModelWeights& w, const ModelConfig& c, const CalibrationStats& stats,
               const AwqOptions& opt, const SmoothCallback& report) {
  auto ws = be.make_workspace();
  for (size_t l = 0; l < w.layers.size(); ++l) {
    for (const Mapping& m : layer_mappings(w.layers[l], c)) {
      const ChannelStats& x = stats.at(static_cast<int64_t>(l), m.input);
      const int64_t width = x.width, n = x.sample_rows();
      if (n == 0) fail(ErrorKind::invalid_input, "AWQ needs sampled calibration rows (max_samples > 0)");
      for (const Tensor* t : m.balance) check_int_quant_spec(opt.spec, t->cols(), m.name);
      std::vector<std::vector<float>> ref;
      for (const Tensor* t : m.balance) {
        ref.emplace_back(static_cast<size_t>(n * t->rows()));
        be.matmul_dense(*ws, *t, x.samples.data(), ref.back().data(), n);
      }
      const std::vector<float> w_mean = normalized_weight_means(m, opt.spec, width);
      std::vector<float> best(static_cast<size_t>(width), 1.0f), s(static_cast<size_t>(width));
      const double identity = awq_loss(be, *ws, m, best, opt.spec, x, ref);
      double best_loss = identity, best_ratio = -1;
      for (int i = 0; i < opt.n_grid - 1; ++i) {
        const double r = static_cast<double>(i) / (opt.n_grid - 2);
        float lo = std::numeric_limits<float>::infinity(), hi = 0;
        for (int64_t j = 0; j < width; ++j) {
          const float v = static_cast<float>(std::pow(x.mean_abs(j), r) /
                                             (std::pow(w_mean[static_cast<size_t>(j)], 1 - r) + 1e-4));
          s[static_cast<size_t>(j)] = std::max(v, 1e-4f);
          lo = std::min(lo, s[static_cast<size_t>(j)]);
          hi = std::max(hi, s[static_cast<size_t>(j)]);
        }
        const float norm = std::sqrt(hi * lo);
        for (float& v : s) {
          v /= norm;
          if (!std::isfinite(v)) v = 1;
        }
        const double loss = awq_loss(be, *ws, m, s, opt.spec, x, ref);
        if (loss < best_loss) {
          best_loss = loss;
          best_ratio = r;
          best = s;
        }
      }
      fold(m, best);
      SmoothReport rep{static_cast<int64_t>(l), m.name, best_ratio, identity, best_loss};
      report_scales(report, rep, best);
    }
  }
}

}  // namespace loom

#include "quant/prune_structured.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace loom {
namespace {

// Indices [0, n) without the k of lowest score (equal scores: the earlier goes), ascending.
std::vector<int64_t> keep_highest(const std::vector<double>& score, int64_t k) {
  const auto n = static_cast<int64_t>(score.size());
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return score[static_cast<size_t>(a)] < score[static_cast<size_t>(b)];
  });
  std::vector<int64_t> keep(order.begin() + k, order.end());
  std::sort(keep.begin(), keep.end());
  return keep;
}

// A new f32 matrix of `m`'s row blocks `blocks` (each `block` rows), held in w.owned.
Tensor keep_row_blocks(ModelWeights& w, const Tensor& m, const std::vector<int64_t>& blocks, int64_t block) {
  LOOM_ASSERT(m.dtype == DType::f32);
  const int64_t cols = m.cols();
  auto& out = w.owned.emplace_back(static_cast<size_t>(static_cast<int64_t>(blocks.size()) * block * cols));
  const float* src = m.as<const float>();
  for (size_t i = 0; i < blocks.size(); ++i)
    std::copy_n(src + blocks[i] * block * cols, block * cols, out.data() + static_cast<int64_t>(i) * block * cols);
  return make_tensor(out.data(), DType::f32, {static_cast<int64_t>(blocks.size()) * block, cols});
}

// A new f32 matrix of `m`'s column blocks `blocks` (each `block` columns), held in w.owned.
Tensor keep_col_blocks(ModelWeights& w, const Tensor& m, const std::vector<int64_t>& blocks, int64_t block) {
  LOOM_ASSERT(m.dtype == DType::f32);
  const int64_t rows = m.rows(), cols = m.cols(), kept = static_cast<int64_t>(blocks.size()) * block;
  auto& out = w.owned.emplace_back(static_cast<size_t>(rows * kept));
  const float* src = m.as<const float>();
  for (int64_t r = 0; r < rows; ++r)
    for (size_t i = 0; i < blocks.size(); ++i)
      std::copy_n(src + r * cols + blocks[i] * block, block, out.data() + r * kept + static_cast<int64_t>(i) * block);
  return make_tensor(out.data(), DType::f32, {rows, kept});
}

// The same for a bias vector.
const float* keep_vector_blocks(ModelWeights& w, const float* v, const std::vector<int64_t>& blocks, int64_t block) {
  if (v == nullptr) return nullptr;
  auto& out = w.owned.emplace_back();
  for (int64_t b : blocks) out.insert(out.end(), v + b * block, v + (b + 1) * block);
  return out.data();
}

// ||W[:, c0 .. c0 + n)||_F^2 of an f32 matrix.
double column_block_sq(const Tensor& m, int64_t c0, int64_t n) {
  const float* v = m.as<const float>();
  double s = 0;
  for (int64_t r = 0; r < m.rows(); ++r)
    for (int64_t c = c0; c < c0 + n; ++c) s += static_cast<double>(v[r * m.cols() + c]) * v[r * m.cols() + c];
  return s;
}

double activation_sq(const ChannelStats& st, int64_t c0, int64_t n) {
  double s = 0;
  for (int64_t c = c0; c < c0 + n; ++c) s += st.sq_sum[static_cast<size_t>(c)];
  return s;
}

void prune_heads(ModelWeights& w, ModelConfig& c, const CalibrationStats& stats, double fraction,
                 StructuredReport& report) {
  const auto [per_group, groups] = head_removal_plan(c, fraction);
  const int64_t hd = c.head_dim, G = c.n_kv_heads, rep = c.n_heads / G;
  for (size_t l = 0; l < w.layers.size(); ++l) {
    LayerWeights& L = w.layers[l];
    const ChannelStats& xo = stats.at(static_cast<int64_t>(l), AdapterPoint::o);
    std::vector<double> score(static_cast<size_t>(c.n_heads));
    for (int64_t h = 0; h < c.n_heads; ++h)
      score[static_cast<size_t>(h)] = std::sqrt(activation_sq(xo, h * hd, hd) * column_block_sq(L.wo, h * hd, hd));
    std::vector<int64_t> heads, kv = std::vector<int64_t>(static_cast<size_t>(G));
    std::iota(kv.begin(), kv.end(), 0);
    if (per_group > 0) {
      for (int64_t g = 0; g < G; ++g) {
        const std::vector<double> s(score.begin() + g * rep, score.begin() + (g + 1) * rep);
        for (int64_t h : keep_highest(s, per_group)) heads.push_back(g * rep + h);
      }
    } else {
      std::vector<double> s(static_cast<size_t>(G), 0.0);
      for (int64_t h = 0; h < c.n_heads; ++h) s[static_cast<size_t>(h / rep)] += score[static_cast<size_t>(h)];
      kv = keep_highest(s, groups);
      for (int64_t g : kv)
        for (int64_t h = 0; h < rep; ++h) heads.push_back(g * rep + h);
    }
    report.kept_heads.push_back(heads);
    L.wq = keep_row_blocks(w, L.wq, heads, hd);
    L.bq = keep_vector_blocks(w, L.bq, heads, hd);
    L.wo = keep_col_blocks(w, L.wo, heads, hd);
    if (groups > 0) {
      L.wk = keep_row_blocks(w, L.wk, kv, hd);
      L.wv = keep_row_blocks(w, L.wv, kv, hd);
      L.bk = keep_vector_blocks(w, L.bk, kv, hd);
      L.bv = keep_vector_blocks(w, L.bv, kv, hd);
    }
  }
  report.heads_how = per_group > 0 ? fmt::format("{} of {} per KV group", per_group, rep)
                                   : fmt::format("{} whole KV group{} of {} heads", groups, groups > 1 ? "s" : "", rep);
  c.n_heads -= per_group > 0 ? per_group * G : groups * rep;
  c.n_kv_heads -= groups;
}

void prune_channels(ModelWeights& w, ModelConfig& c, const CalibrationStats& stats, double fraction,
                    StructuredReport& report) {
  const int64_t I = c.intermediate;
  int64_t keep = static_cast<int64_t>(std::floor(static_cast<double>(I) * (1 - fraction) / 32)) * 32;
  if (keep >= I) keep = (I - 1) / 32 * 32;
  if (keep < 32) fail(ErrorKind::invalid_input, "--channels {}: fewer than 32 of {} channels would remain", fraction, I);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    LayerWeights& L = w.layers[l];
    const ChannelStats& xd = stats.at(static_cast<int64_t>(l), AdapterPoint::down);
    std::vector<double> score(static_cast<size_t>(I));
    for (int64_t k = 0; k < I; ++k)
      score[static_cast<size_t>(k)] = std::sqrt(xd.sq_sum[static_cast<size_t>(k)] * column_block_sq(L.w_down, k, 1));
    const std::vector<int64_t> kept = keep_highest(score, I - keep);
    report.kept_channels.push_back(kept);
    L.w_gate = keep_row_blocks(w, L.w_gate, kept, 1);
    L.w_up = keep_row_blocks(w, L.w_up, kept, 1);
    L.w_down = keep_col_blocks(w, L.w_down, kept, 1);
  }
  c.intermediate = keep;
}

void check_stats_fit(const ModelConfig& c, const CalibrationStats& stats) {
  if (static_cast<int64_t>(stats.layers.size()) != c.n_layers ||
      static_cast<int64_t>(stats.residual_cosine.size()) != c.n_layers || stats.residual_tokens == 0)
    fail(ErrorKind::invalid_input, "structured pruning needs calibration statistics of all {} layers", c.n_layers);
  for (int64_t l = 0; l < c.n_layers; ++l)
    if (stats.at(l, AdapterPoint::o).width != c.q_dim() || stats.at(l, AdapterPoint::down).width != c.intermediate)
      fail(ErrorKind::invalid_input, "layer {}: the calibration statistics do not fit the model's shapes", l);
}

}  // namespace

std::pair<int64_t, int64_t> head_removal_plan(const ModelConfig& c, double heads) {
  if (!(heads >= 0 && heads < 1)) fail(ErrorKind::invalid_input, "--heads {}: expected a fraction in [0, 1)", heads);
  if (heads == 0) return {0, 0};
  const int64_t G = c.n_kv_heads, rep = c.n_heads / G;
  const double want = heads * static_cast<double>(c.n_heads);
  std::pair<int64_t, int64_t> best{0, 0};
  double best_gap = 1e300;
  // Per group first, so that it wins a tie (it keeps every KV head).
  for (int64_t r = 1; r < rep; ++r)
    if (const double gap = std::fabs(static_cast<double>(r * G) - want); gap < best_gap) best = {r, 0}, best_gap = gap;
  for (int64_t g = 1; g < G; ++g)
    if (const double gap = std::fabs(static_cast<double>(g * rep) - want); gap < best_gap) best = {0, g}, best_gap = gap;
  if (best == std::pair<int64_t, int64_t>{0, 0})
    fail(ErrorKind::invalid_input, "--heads {}: {} heads in {} KV group(s) cannot lose a head and stay grouped", heads,
         c.n_heads, G);
  return best;
}

StructuredReport prune_structure(ModelWeights& w, ModelConfig& c, const StructuredSpec& spec,
                                 const CalibrationStats& stats) {
  if (!(spec.channels >= 0 && spec.channels < 1))
    fail(ErrorKind::invalid_input, "--channels {}: expected a fraction in [0, 1)", spec.channels);
  if (spec.layers < 0 || spec.layers >= c.n_layers)
    fail(ErrorKind::invalid_input, "--layers {}: the model has {} layers; at least one must remain", spec.layers,
         c.n_layers);
  check_stats_fit(c, stats);
  StructuredReport report;
  report.heads_before = c.n_heads;
  report.kv_heads_before = c.n_kv_heads;
  report.intermediate_before = c.intermediate;
  if (spec.heads > 0) prune_heads(w, c, stats, spec.heads, report);
  if (spec.channels > 0) prune_channels(w, c, stats, spec.channels, report);
  if (spec.layers > 0) {
    std::vector<double> influence(static_cast<size_t>(c.n_layers));
    for (int64_t l = 0; l < c.n_layers; ++l) influence[static_cast<size_t>(l)] = stats.block_influence(l);
    const std::vector<int64_t> kept = keep_highest(influence, spec.layers);
    std::vector<LayerWeights> layers;
    for (int64_t l = 0, k = 0; l < c.n_layers; ++l) {
      if (k < static_cast<int64_t>(kept.size()) && kept[static_cast<size_t>(k)] == l) {
        layers.push_back(w.layers[static_cast<size_t>(l)]);
        ++k;
      } else {
        report.removed_layers.push_back(l);
      }
    }
    w.layers = std::move(layers);
    c.n_layers = static_cast<int64_t>(w.layers.size());
  }
  w.prepared.clear();
  report.heads_after = c.n_heads;
  report.kv_heads_after = c.n_kv_heads;
  report.intermediate_after = c.intermediate;
  return report;
}

}  // namespace loom

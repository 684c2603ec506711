#include "quant/prune.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <mutex>
#include <numeric>

#include "core/error.h"

namespace loom {
namespace {

constexpr int64_t kChunk = 4096;  // elements scored per unit of the segment passes
constexpr size_t kBins = 1 << 16;

// A non-negative float's bits order as the float does.
inline uint32_t key_of(float s) { return std::bit_cast<uint32_t>(s); }

// One matrix to prune, and the per-input factor of its scores (wanda's norms; empty: magnitude).
struct Target {
  int64_t layer;
  LoraTarget target;
  Tensor* w;
  std::vector<float> factor;
};

void fill_scores(const Target& t, int64_t i0, int64_t n, float* out) {
  const float* w = t.w->as<const float>();
  if (t.factor.empty()) {
    for (int64_t i = 0; i < n; ++i) out[i] = std::fabs(w[i0 + i]);
    return;
  }
  const int64_t cols = t.w->cols();
  for (int64_t i = 0; i < n; ++i) out[i] = std::fabs(w[i0 + i]) * t.factor[static_cast<size_t>((i0 + i) % cols)];
}

// The units of the segment passes: (segment, first element) in order.
using Units = std::vector<std::pair<int64_t, int64_t>>;
Units chunk_units(std::span<const int64_t> sizes) {
  Units units;
  for (size_t s = 0; s < sizes.size(); ++s)
    for (int64_t i = 0; i < sizes[s]; i += kChunk) units.emplace_back(static_cast<int64_t>(s), i);
  return units;
}

// fn(s, i0, n, scores) for units [b, e), each chunk's scores filled in turn.
template <typename F>
void scored_chunks(std::span<const int64_t> sizes, const ScoreFill& fill, const Units& units, int64_t b, int64_t e,
                   F&& fn) {
  std::vector<float> scores(static_cast<size_t>(kChunk));
  for (int64_t u = b; u < e; ++u) {
    const auto [s, i0] = units[static_cast<size_t>(u)];
    const int64_t n = std::min(kChunk, sizes[static_cast<size_t>(s)] - i0);
    fill(s, i0, n, scores.data());
    if (!fn(s, i0, n, scores.data())) return;
  }
}

// Histogram of key >> 16 (`top` < 0) or of the low 16 bits of keys whose top half is `top`.
std::vector<int64_t> key_histogram(ThreadPool& pool, std::span<const int64_t> sizes, const ScoreFill& fill,
                                   const Units& units, int64_t top) {
  std::vector<int64_t> hist(kBins, 0);
  std::mutex mu;
  pool.parallel_for(static_cast<int64_t>(units.size()), [&](int64_t b, int64_t e) {
    std::vector<int64_t> local(kBins, 0);
    scored_chunks(sizes, fill, units, b, e, [&](int64_t, int64_t, int64_t n, const float* scores) {
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t key = key_of(scores[i]);
        if (top < 0) ++local[key >> 16];
        else if (static_cast<int64_t>(key >> 16) == top) ++local[key & 0xFFFF];
      }
      return true;
    });
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < kBins; ++i) hist[i] += local[i];
  });
  return hist;
}

// The bin holding the k-th smallest (1-based k), and how many lie in lower bins.
std::pair<uint32_t, int64_t> bin_of(const std::vector<int64_t>& hist, int64_t k) {
  int64_t below = 0;
  for (size_t b = 0; b < kBins; ++b) {
    if (below + hist[b] >= k) return {static_cast<uint32_t>(b), below};
    below += hist[b];
  }
  LOOM_ASSERT(false);
  return {0, below};
}

}  // namespace

PruneMethod prune_method_from_name(const std::string& name) {
  if (name == "magnitude") return PruneMethod::magnitude;
  if (name == "wanda") return PruneMethod::wanda;
  fail(ErrorKind::invalid_input, "--method {}: expected magnitude or wanda (or heads, channels, layers)", name);
}

const char* prune_method_name(PruneMethod m) { return m == PruneMethod::wanda ? "wanda" : "magnitude"; }

PruneScope prune_scope_from_name(const std::string& name) {
  if (name == "row") return PruneScope::row;
  if (name == "matrix" || name == "layer") return PruneScope::matrix;
  if (name == "global") return PruneScope::global;
  fail(ErrorKind::invalid_input, "--scope {}: expected row, matrix or global", name);
}

const char* prune_scope_name(PruneScope s) {
  switch (s) {
    case PruneScope::row: return "row";
    case PruneScope::matrix: return "matrix";
    case PruneScope::global: return "global";
  }
  return "?";
}

std::string PruneSpec::describe() const {
  if (pattern()) return fmt::format("{}:{}", n, m);
  return fmt::format("{:g}% per {}", sparsity * 100, prune_scope_name(scope));
}

void prune_lowest_in_row(const float* scores, float* w, int64_t n, int64_t k) {
  if (k <= 0) return;
  LOOM_ASSERT(k <= n);
  std::vector<float> sorted(scores, scores + n);
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end());
  const float kth = sorted[static_cast<size_t>(k - 1)];
  int64_t ties = k - std::count_if(scores, scores + n, [kth](float s) { return s < kth; });
  for (int64_t i = 0; i < n; ++i)
    if (scores[i] < kth || (scores[i] == kth && ties-- > 0)) w[i] = 0.0f;
}

void prune_n_of_m_in_row(const float* scores, float* w, int64_t n, int N, int M) {
  LOOM_ASSERT(M > 0 && n % M == 0 && N >= 0 && N <= M);
  std::array<int, 64> order{};
  LOOM_ASSERT(M <= static_cast<int>(order.size()));
  for (int64_t g = 0; g < n; g += M) {
    std::iota(order.begin(), order.begin() + M, 0);
    // Lowest first, equal scores in position order.
    std::stable_sort(order.begin(), order.begin() + M, [&](int a, int b) { return scores[g + a] < scores[g + b]; });
    for (int i = 0; i < M - N; ++i) w[g + order[static_cast<size_t>(i)]] = 0.0f;
  }
}

void prune_lowest_over_segments(ThreadPool& pool, std::span<float* const> segments, std::span<const int64_t> sizes,
                                const ScoreFill& fill, int64_t k) {
  LOOM_ASSERT(segments.size() == sizes.size());
  if (k <= 0) return;
  const auto units = chunk_units(sizes);
  const auto [top, below_top] = bin_of(key_histogram(pool, sizes, fill, units, -1), k);
  const auto [low, below_low] = bin_of(key_histogram(pool, sizes, fill, units, top), k - below_top);
  const uint32_t threshold = (top << 16) | low;
  int64_t ties = k - below_top - below_low;
  // Ties first, in order, while every score is still the original one.
  const int64_t all = static_cast<int64_t>(units.size());
  if (ties > 0) scored_chunks(sizes, fill, units, 0, all, [&](int64_t s, int64_t i0, int64_t n, const float* scores) {
    for (int64_t i = 0; i < n && ties > 0; ++i)
      if (key_of(scores[i]) == threshold) {
        segments[static_cast<size_t>(s)][i0 + i] = 0.0f;
        --ties;
      }
    return ties > 0;
  });
  // Then everything below the threshold (a zeroed tie now scores 0: below, zeroed again).
  pool.parallel_for(all, [&](int64_t b, int64_t e) {
    scored_chunks(sizes, fill, units, b, e, [&](int64_t s, int64_t i0, int64_t n, const float* scores) {
      for (int64_t i = 0; i < n; ++i)
        if (key_of(scores[i]) < threshold) segments[static_cast<size_t>(s)][i0 + i] = 0.0f;
      return true;
    });
  });
}

std::vector<PruneReport> prune_weights(ThreadPool& pool, ModelWeights& w, const ModelConfig& c, const PruneSpec& spec,
                                       const CalibrationStats* stats) {
  if (spec.pattern() && !(spec.n > 0 && spec.n < spec.m && spec.m <= 64))
    fail(ErrorKind::invalid_input, "--pattern {}:{}: expected N:M with 0 < N < M <= 64 (e.g. 2:4)", spec.n, spec.m);
  if (!spec.pattern() && !(spec.sparsity >= 0 && spec.sparsity < 1))
    fail(ErrorKind::invalid_input, "--sparsity {}: expected a fraction in [0, 1)", spec.sparsity);
  const bool wanda = spec.method == PruneMethod::wanda;
  if (wanda && (stats == nullptr || stats->layers.size() != w.layers.size()))
    fail(ErrorKind::invalid_input, "wanda needs activation statistics of every layer: give --calib FILE");

  std::vector<Target> targets;
  for (size_t l = 0; l < w.layers.size(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      Tensor& m = target_matrix(w.layers[l], t);
      LOOM_ASSERT(m.dtype == DType::f32 && m.ndim == 2);
      if (spec.pattern() && m.cols() % spec.m != 0)
        fail(ErrorKind::invalid_input, "--pattern {}:{}: layer {} {} has rows of {}, not a multiple of {}", spec.n,
             spec.m, l, lora_target_peft_name(t), m.cols(), spec.m);
      Target tg{static_cast<int64_t>(l), t, &m, {}};
      if (wanda) {
        const ChannelStats& st = stats->at(static_cast<int64_t>(l), t);
        LOOM_ASSERT(st.width == m.cols());
        tg.factor.resize(static_cast<size_t>(m.cols()));
        for (int64_t j = 0; j < m.cols(); ++j) tg.factor[static_cast<size_t>(j)] = st.l2_norm(j);
      }
      targets.push_back(std::move(tg));
    }

  if (spec.pattern() || spec.scope == PruneScope::row) {
    for (const Target& t : targets) {
      const int64_t cols = t.w->cols();
      const auto k = static_cast<int64_t>(std::floor(spec.sparsity * static_cast<double>(cols)));
      pool.parallel_for(t.w->rows(), [&](int64_t b, int64_t e) {
        std::vector<float> scores(static_cast<size_t>(cols));
        for (int64_t r = b; r < e; ++r) {
          fill_scores(t, r * cols, cols, scores.data());
          float* row = t.w->as<float>() + r * cols;
          if (spec.pattern()) prune_n_of_m_in_row(scores.data(), row, cols, spec.n, spec.m);
          else prune_lowest_in_row(scores.data(), row, cols, k);
        }
      });
    }
  } else {
    // Matrix scope: each target its own selection; global: all of them at once.
    const size_t groups = spec.scope == PruneScope::global ? 1 : targets.size();
    const size_t per = spec.scope == PruneScope::global ? targets.size() : 1;
    for (size_t g = 0; g < groups; ++g) {
      std::vector<float*> segs;
      std::vector<int64_t> sizes;
      int64_t total = 0;
      for (size_t i = g * per; i < (g + 1) * per; ++i) {
        segs.push_back(targets[i].w->as<float>());
        sizes.push_back(targets[i].w->numel());
        total += sizes.back();
      }
      const auto k = static_cast<int64_t>(std::floor(spec.sparsity * static_cast<double>(total)));
      prune_lowest_over_segments(pool, segs, sizes, [&](int64_t s, int64_t i0, int64_t n, float* out) {
        fill_scores(targets[g * per + static_cast<size_t>(s)], i0, n, out);
      }, k);
    }
  }

  std::vector<PruneReport> reports;
  for (const Target& t : targets) {
    const float* v = t.w->as<const float>();
    const int64_t n = t.w->numel();
    reports.push_back({t.layer, t.target, std::count(v, v + n, 0.0f), n});
  }
  return reports;
}

}  // namespace loom

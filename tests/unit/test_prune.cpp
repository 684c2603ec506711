// Pruning (quant/prune.h, quant/prune_structured.h): the selection rules
// against plain sorting references, Wanda and magnitude masks against PyTorch
// (scripts/fixtures/make_prune_fixtures.py, the Wanda paper's code), the
// calibration sums against transformers' hooks, and structured pruning against
// the same model with the removed units' contributions zeroed.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/forward.h"
#include "model/model.h"
#include "quant/calibration.h"
#include "quant/prune.h"
#include "quant/prune_structured.h"
#include "quant/smoothing.h"

namespace loom {
namespace {

std::string fixture(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel; }

// 1 for the k lowest, equal scores in index order: the rule every selection follows.
std::vector<uint8_t> lowest_reference(const std::vector<float>& score, int64_t k) {
  std::vector<int64_t> order(score.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] < score[b]; });
  std::vector<uint8_t> mask(score.size(), 0);
  for (int64_t i = 0; i < k; ++i) mask[order[i]] = 1;
  return mask;
}

// Scores with many ties and zeros (a few levels), as quantized weights give.
std::vector<float> tied_scores(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(0, 12);
  std::vector<float> s(n);
  for (float& v : s) v = 0.125f * static_cast<float>(level(rng));
  return s;
}

std::vector<uint8_t> zeros_of(const std::vector<float>& w) {
  std::vector<uint8_t> m(w.size());
  for (size_t i = 0; i < w.size(); ++i) m[i] = w[i] == 0.0f;
  return m;
}

TEST(PruneSelect, RowTakesTheLowestWithTiesInIndexOrder) {
  for (int64_t k : {0, 1, 7, 50, 99, 100}) {
    const std::vector<float> s = tied_scores(100, static_cast<uint32_t>(k));
    std::vector<float> w(100, 1.0f);
    prune_lowest_in_row(s.data(), w.data(), 100, k);
    EXPECT_EQ(zeros_of(w), lowest_reference(s, k)) << "k " << k;
  }
}

TEST(PruneSelect, NofMKeepsTheNHighestOfEveryGroup) {
  const std::vector<float> s = tied_scores(64, 3);
  for (auto [n, m] : {std::pair{2, 4}, std::pair{4, 8}, std::pair{1, 4}}) {
    std::vector<float> w(64, 1.0f);
    prune_n_of_m_in_row(s.data(), w.data(), 64, n, m);
    std::vector<uint8_t> want;
    for (int64_t g = 0; g < 64; g += m) {
      const auto part = lowest_reference(std::vector<float>(s.begin() + g, s.begin() + g + m), m - n);
      want.insert(want.end(), part.begin(), part.end());
    }
    EXPECT_EQ(zeros_of(w), want) << n << ":" << m;
  }
}

TEST(PruneSelect, SegmentsEqualSortingEverythingTogether) {
  ThreadPool pool(2);
  const std::vector<int64_t> sizes = {5000, 10, 9000, 4096};
  std::vector<std::vector<float>> scores;
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    scores.push_back(tied_scores(static_cast<size_t>(sizes[i]), static_cast<uint32_t>(10 + i)));
    total += scores.back().size();
  }
  // Also distinct values with a large range (the radix select's two bit halves).
  std::mt19937 rng(7);
  std::exponential_distribution<float> e(1.0f);
  for (float& v : scores[2]) v = v * 1000.0f + e(rng) * 1e-3f;
  std::vector<float> all;
  for (const auto& s : scores) all.insert(all.end(), s.begin(), s.end());
  for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{9000}, static_cast<int64_t>(total / 2), static_cast<int64_t>(total - 1)}) {
    std::vector<std::vector<float>> w;
    std::vector<float*> segs;
    for (int64_t n : sizes) w.emplace_back(static_cast<size_t>(n), 1.0f);
    for (auto& v : w) segs.push_back(v.data());
    prune_lowest_over_segments(pool, segs, sizes, [&](int64_t s, int64_t i0, int64_t n, float* out) {
      std::copy_n(scores[static_cast<size_t>(s)].data() + i0, n, out);
    }, k);
    std::vector<float> got;
    for (const auto& v : w) got.insert(got.end(), v.begin(), v.end());
    EXPECT_EQ(zeros_of(got), lowest_reference(all, k)) << "k " << k;
  }
}

struct TinyFixture {
  std::unique_ptr<safetensors::File> file;
  std::vector<int32_t> tokens;
  int64_t chunks = 0, n_ctx = 0;

  TinyFixture() {
    file = safetensors::File::open(fixture("prune/tiny_llama.safetensors"));
    const auto* t = file->find_tensor("tokens");
    chunks = t->shape[0];
    n_ctx = t->shape[1];
    tokens.resize(static_cast<size_t>(chunks * n_ctx));
    std::memcpy(tokens.data(), t->data, tokens.size() * sizeof(int32_t));
  }
  std::vector<double> sq_sum(int64_t layer, const char* point) const {
    const auto* t = file->find_tensor(fmt::format("sq_sum.{}.{}", layer, point));
    std::vector<double> v(static_cast<size_t>(t->shape[0]));
    std::memcpy(v.data(), t->data, v.size() * sizeof(double));
    return v;
  }
  std::vector<uint8_t> mask(const std::string& name, int64_t layer, LoraTarget target) const {
    const char* names[] = {"q", "k", "v", "o", "gate", "up", "down"};
    const auto* t = file->find_tensor(fmt::format("mask.{}.{}.{}", name, layer, names[static_cast<int>(target)]));
    return std::vector<uint8_t>(t->data, t->data + t->nbytes());
  }
  // The fixture's sums as calibration statistics (for exact masks).
  CalibrationStats stats(const ModelConfig& c) const {
    const char* points[] = {"qkv", "o", "gate_up", "down"};
    CalibrationStats s;
    s.layers.resize(static_cast<size_t>(c.n_layers));
    for (int64_t l = 0; l < c.n_layers; ++l)
      for (int p = 0; p < 4; ++p) {
        ChannelStats& cs = s.layers[static_cast<size_t>(l)][static_cast<size_t>(p)];
        cs.sq_sum = sq_sum(l, points[p]);
        cs.width = static_cast<int64_t>(cs.sq_sum.size());
      }
    return s;
  }
};

std::unique_ptr<Model> load_tiny_f32() {
  auto m = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = false});
  make_weights_mutable(m->mutable_weights(), m->config());
  return m;
}

TEST(PruneWeights, MasksEqualPyTorchWandaAndMagnitude) {
  const TinyFixture fx;
  ThreadPool pool(2);
  struct Case {
    const char* name;
    PruneSpec spec;
  };
  const Case cases[] = {
      {"wanda_row50", {PruneMethod::wanda, 0.5, 0, 0, PruneScope::row}},
      {"wanda_2of4", {PruneMethod::wanda, 0, 2, 4, PruneScope::row}},
      {"wanda_4of8", {PruneMethod::wanda, 0, 4, 8, PruneScope::row}},
      {"magnitude_matrix50", {PruneMethod::magnitude, 0.5, 0, 0, PruneScope::matrix}},
      {"magnitude_global50", {PruneMethod::magnitude, 0.5, 0, 0, PruneScope::global}},
      {"wanda_global30", {PruneMethod::wanda, 0.3, 0, 0, PruneScope::global}},
  };
  for (const Case& cs : cases) {
    auto m = load_tiny_f32();
    const CalibrationStats stats = fx.stats(m->config());
    const auto reports = prune_weights(pool, m->mutable_weights(), m->config(), cs.spec, &stats);
    ASSERT_EQ(reports.size(), 2u * kLoraTargetCount);
    for (int64_t l = 0; l < 2; ++l)
      for (LoraTarget t : kAllLoraTargets) {
        const Tensor& w = target_matrix(m->weights().layers[static_cast<size_t>(l)], t);
        const float* v = w.as<const float>();
        const std::vector<uint8_t> want = fx.mask(cs.name, l, t);
        ASSERT_EQ(want.size(), static_cast<size_t>(w.numel()));
        int64_t differ = 0;
        for (int64_t i = 0; i < w.numel(); ++i) differ += (v[i] == 0.0f) != (want[static_cast<size_t>(i)] != 0);
        EXPECT_EQ(differ, 0) << cs.name << " layer " << l << " " << lora_target_peft_name(t);
      }
  }
}

TEST(PruneWeights, CalibrationSumsOfSquaresMatchTransformers) {
  const TinyFixture fx;
  ThreadPool pool(2);
  auto be = make_backend(kCpu, pool);
  auto m = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = true, .backend = be.get()});
  InferenceSession session(m->config(), m->weights(), *be, fx.n_ctx, DType::f32);
  CalibrationOptions opt;
  opt.n_ctx = fx.n_ctx;
  opt.bos = -1;
  const CalibrationStats got = collect_calibration(session, m->config(), fx.tokens, opt, nullptr);
  const char* points[] = {"qkv", "o", "gate_up", "down"};
  for (int64_t l = 0; l < m->config().n_layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const std::vector<double> want = fx.sq_sum(l, points[p]);
      const ChannelStats& cs = got.layers[static_cast<size_t>(l)][static_cast<size_t>(p)];
      ASSERT_EQ(cs.sq_sum.size(), want.size());
      for (size_t j = 0; j < want.size(); ++j)
        EXPECT_NEAR(cs.sq_sum[j], want[j], 1e-4 * want[j] + 1e-7) << "layer " << l << " " << points[p] << " " << j;
    }
  EXPECT_EQ(got.residual_tokens, fx.chunks * fx.n_ctx);
}

TEST(PruneWeights, ExactCountsPerScope) {
  ThreadPool pool(2);
  for (PruneScope scope : {PruneScope::row, PruneScope::matrix, PruneScope::global}) {
    auto m = load_tiny_f32();
    const auto reports = prune_weights(pool, m->mutable_weights(), m->config(), {PruneMethod::magnitude, 0.3, 0, 0, scope},
                                       nullptr);
    int64_t zeros = 0, total = 0;
    for (const PruneReport& r : reports) {
      zeros += r.zeros;
      total += r.total;
      const Tensor& w = target_matrix(m->weights().layers[static_cast<size_t>(r.layer)], r.target);
      if (scope == PruneScope::row) {
        EXPECT_EQ(r.zeros, w.rows() * static_cast<int64_t>(std::floor(0.3 * w.cols())));
      }
      if (scope == PruneScope::matrix) {
        EXPECT_EQ(r.zeros, static_cast<int64_t>(std::floor(0.3 * r.total)));
      }
    }
    if (scope == PruneScope::global) {
      EXPECT_EQ(zeros, static_cast<int64_t>(std::floor(0.3 * total)));
    }
  }
}

TEST(PruneWeights, RejectsBadSpecs) {
  ThreadPool pool(1);
  auto m = load_tiny_f32();
  ModelWeights& w = m->mutable_weights();
  const ModelConfig& c = m->config();
  auto kind = [&](const PruneSpec& s, const CalibrationStats* st) {
    try {
      prune_weights(pool, w, c, s, st);
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::internal;
  };
  EXPECT_EQ(kind({PruneMethod::magnitude, 1.0}, nullptr), ErrorKind::invalid_input);
  EXPECT_EQ(kind({PruneMethod::magnitude, -0.1}, nullptr), ErrorKind::invalid_input);
  EXPECT_EQ(kind({PruneMethod::magnitude, 0, 4, 2}, nullptr), ErrorKind::invalid_input);
  EXPECT_EQ(kind({PruneMethod::magnitude, 0, 2, 5}, nullptr), ErrorKind::invalid_input);  // 64 % 5 != 0
  EXPECT_EQ(kind({PruneMethod::wanda, 0.5}, nullptr), ErrorKind::invalid_input);
}

TEST(PruneStructured, HeadPlansKeepTheGroupsEqual) {
  auto plan = [](int64_t heads, int64_t kv, double f) {
    ModelConfig c;
    c.n_heads = heads;
    c.n_kv_heads = kv;
    return head_removal_plan(c, f);
  };
  EXPECT_EQ(plan(9, 3, 0.25), std::make_pair(int64_t{1}, int64_t{0}));   // SmolLM2: 1 of 3 per group
  EXPECT_EQ(plan(9, 3, 0.1), std::make_pair(int64_t{1}, int64_t{0}));    // the nearest the groups allow
  EXPECT_EQ(plan(9, 3, 0.6), std::make_pair(int64_t{2}, int64_t{0}));    // per group wins a tie
  EXPECT_EQ(plan(8, 8, 0.25), std::make_pair(int64_t{0}, int64_t{2}));   // MHA: whole (one-head) groups
  EXPECT_EQ(plan(32, 8, 0.25), std::make_pair(int64_t{1}, int64_t{0}));
  EXPECT_EQ(plan(32, 8, 0.5), std::make_pair(int64_t{2}, int64_t{0}));
  EXPECT_EQ(plan(12, 4, 0.25), std::make_pair(int64_t{0}, int64_t{1}));  // 3 heads = one group of 3
  EXPECT_EQ(plan(4, 4, 0.0), std::make_pair(int64_t{0}, int64_t{0}));
  EXPECT_THROW(plan(1, 1, 0.5), Error);
  EXPECT_THROW(plan(4, 2, 1.0), Error);
}

// Logits of the last position of each prompt, f32 weights prepared for `be`.
std::vector<float> logits_of(const ModelConfig& c, ModelWeights& w, Backend& be, const std::vector<int32_t>& tokens) {
  prepare_weights(w, be);
  InferenceSession s(c, w, be, static_cast<int64_t>(tokens.size()), DType::f32);
  const float* l = s.eval(tokens);
  return std::vector<float>(l, l + c.vocab_size);
}

// Removing heads, channels and a layer gives the logits of the full model with
// those units' outputs zeroed (o's columns of the heads, down's columns of the
// channels, o and down of the layer: nothing added to the residual).
TEST(PruneStructured, EqualsTheModelWithTheRemovedUnitsZeroed) {
  const TinyFixture fx;
  ThreadPool pool(2);
  auto be = make_backend(kCpu, pool);
  const CalibrationStats stats = [&] {
    auto m = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = true, .backend = be.get()});
    InferenceSession session(m->config(), m->weights(), *be, fx.n_ctx, DType::f32);
    CalibrationOptions opt;
    opt.n_ctx = fx.n_ctx;
    opt.bos = -1;
    return collect_calibration(session, m->config(), fx.tokens, opt, nullptr);
  }();
  for (const StructuredSpec spec : {StructuredSpec{0.25, 0, 0}, StructuredSpec{0, 0.25, 0}, StructuredSpec{0, 0, 1},
                                    StructuredSpec{0.25, 0.25, 1}}) {
    auto pruned = load_tiny_f32();
    auto zeroed = load_tiny_f32();
    ModelConfig c = pruned->config();
    const StructuredReport r = prune_structure(pruned->mutable_weights(), c, spec, stats);
    ModelWeights& z = zeroed->mutable_weights();
    const ModelConfig& zc = zeroed->config();
    for (int64_t l = 0; l < zc.n_layers; ++l) {
      LayerWeights& L = z.layers[static_cast<size_t>(l)];
      auto zero_cols = [](Tensor& t, int64_t c0, int64_t n) {
        for (int64_t row = 0; row < t.rows(); ++row) std::fill_n(t.as<float>() + row * t.cols() + c0, n, 0.0f);
      };
      if (!r.kept_heads.empty()) {
        const auto& kept = r.kept_heads[static_cast<size_t>(l)];
        for (int64_t h = 0; h < zc.n_heads; ++h)
          if (!std::binary_search(kept.begin(), kept.end(), h)) zero_cols(L.wo, h * zc.head_dim, zc.head_dim);
      }
      if (!r.kept_channels.empty()) {
        const auto& kept = r.kept_channels[static_cast<size_t>(l)];
        for (int64_t k = 0; k < zc.intermediate; ++k)
          if (!std::binary_search(kept.begin(), kept.end(), k)) zero_cols(L.w_down, k, 1);
      }
      if (std::find(r.removed_layers.begin(), r.removed_layers.end(), l) != r.removed_layers.end()) {
        zero_cols(L.wo, 0, L.wo.cols());
        zero_cols(L.w_down, 0, L.w_down.cols());
      }
    }
    EXPECT_EQ(c.n_layers, zc.n_layers - spec.layers);
    if (spec.heads > 0) {
      EXPECT_EQ(c.n_heads, 2);  // 1 of 2 per KV group
    }
    if (spec.channels > 0) {
      EXPECT_EQ(c.intermediate, 128);  // 176 * 0.75 = 132, down to a multiple of 32
    }
    const std::vector<int32_t> tokens(fx.tokens.begin(), fx.tokens.begin() + 32);
    const std::vector<float> want = logits_of(zc, z, *be, tokens);
    const std::vector<float> got = logits_of(c, pruned->mutable_weights(), *be, tokens);
    float worst = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, std::fabs(got[i] - want[i]));
      scale = std::max(scale, std::fabs(want[i]));
    }
    EXPECT_LT(worst, 1e-4f * scale) << "heads " << spec.heads << " channels " << spec.channels << " layers "
                                    << spec.layers;
  }
}

}  // namespace
}  // namespace loom

// The server's batched forward step (serve/batch_forward.h) on the tiny
// llama/qwen2 fixtures: a sequence alone matches InferenceSession; its logits
// and K/V rows are bit-identical when it shares steps with other sequences
// (prefill chunks and decodes, other adapters), under any prefill chunking,
// thread count or block placement; multi-LoRA rows match a model with the
// adapter merged into its weights; prefix-cache hits change nothing.
#include <gtest/gtest.h>

#include "core/thread_pool.h"
#include "kernels/backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "expect_error.h"
#include "kernels/ref/dequant_ref.h"
#include "model_test_util.h"
#include "model/forward.h"
#include "model/model.h"
#include "serve/batch_forward.h"

namespace loom {
namespace {

std::string fixture(const std::string& name) {
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/" + name;
}

std::unique_ptr<Model> load(const std::string& name, Backend& backend,
                            std::function<void(ModelWeights&, const ModelConfig&)> hook = nullptr) {
  return Model::load(fixture(name), {.tokenizer = false, .pack = true, .backend = &backend, .before_pack = hook});
}

double rel_err(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return num / den;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(3 + rng() % static_cast<uint32_t>(vocab - 3));
  return t;
}

// A random adapter: A ~ N(0, 1/in), B ~ N(0, 0.25); some (layer, target) pairs left out.
struct RandomAdapter {
  std::vector<std::vector<float>> store;
  ServeAdapter view;
};

RandomAdapter make_adapter(const ModelConfig& c, int64_t rank, float scale, uint32_t seed) {
  RandomAdapter ra;
  ra.view = ServeAdapter::empty(c, scale);
  ra.store.reserve(static_cast<size_t>(2 * c.n_layers * kLoraTargetCount));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t l = 0; l < c.n_layers; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      if ((l * 7 + static_cast<int64_t>(t) + seed) % 5 == 2) continue;  // not adapted
      const int64_t in = lora_target_in(c, t), out = lora_target_out(c, t);
      auto& a = ra.store.emplace_back(static_cast<size_t>(rank * in));
      for (auto& x : a) x = nd(rng) / std::sqrt(static_cast<float>(in));
      auto& b = ra.store.emplace_back(static_cast<size_t>(out * rank));
      for (auto& x : b) x = 0.5f * nd(rng);
      ServeLoraPair& p = ra.view.pair(l, t);
      p.a = make_tensor(a.data(), DType::f32, {rank, in});
      p.b = make_tensor(b.data(), DType::f32, {out, rank});
    }
  ra.view.validate(c, "random adapter");
  return ra;
}

// W' = W + scale * B A (in double) into f32 copies, before packing.
std::function<void(ModelWeights&, const ModelConfig&)> merge_hook(const ServeAdapter& ad) {
  return [&ad](ModelWeights& w, const ModelConfig& c) {
    for (int64_t l = 0; l < c.n_layers; ++l)
      for (LoraTarget t : kAllLoraTargets) {
        const ServeLoraPair& p = ad.pair(l, t);
        if (!p.present()) continue;
        Tensor* W = &target_matrix(w.layers[static_cast<size_t>(l)], t);
        const int64_t out = W->rows(), in = W->cols(), r = p.rank();
        auto& m = w.owned.emplace_back(static_cast<size_t>(out * in));
        for (int64_t n = 0; n < out; ++n) {
          dequantize_row_ref(W->dtype, W->row_ptr(n), m.data() + n * in, in);
          for (int64_t k = 0; k < in; ++k) {
            double acc = 0;
            for (int64_t j = 0; j < r; ++j)
              acc += static_cast<double>(p.b.as<float>()[n * r + j]) * p.a.as<float>()[j * in + k];
            m[static_cast<size_t>(n * in + k)] =
                static_cast<float>(m[static_cast<size_t>(n * in + k)] + static_cast<double>(ad.scale) * acc);
          }
        }
        *W = make_tensor(m.data(), DType::f32, {out, in});
      }
  };
}

// One sequence of a scenario: its tokens are fed in chunks (the schedule, then
// one at a time), starting at step `start`; logits are taken at every chunk end.
struct SeqSpec {
  std::vector<int32_t> tokens;
  const ServeAdapter* adapter = nullptr;
  int64_t adapter_id = 0;
  std::vector<int64_t> chunks;
  int64_t start = 0;
};

struct SeqResult {
  std::map<int64_t, std::vector<float>> logits;  // position -> logits
  std::vector<float> kv;                         // every layer's K and V rows of every position
};

struct RunOptions {
  int64_t block_size = 16;
  int64_t n_blocks = 64;
  bool reverse_order = false;  // chunks of a step in reverse sequence order
  bool prefix_cache = false;   // match and commit full blocks
  DType kv_dtype = DType::f32;
};

// Element i of a layer's keys or values, as f32.
float kv_elem(const KvPool& kv, const void* base, int64_t i) {
  if (kv.dtype() == DType::f16) return fp16_to_fp32(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

std::vector<SeqResult> run(const Model& m, Backend& backend, const std::vector<SeqSpec>& specs,
                           RunOptions o = {}) {
  const ModelConfig& c = m.config();
  KvPool kv(backend, c, o.n_blocks, o.block_size, o.kv_dtype);
  // NaN over the whole store first: nothing stale may leak into results.
  const int64_t n_elems = o.n_blocks * o.block_size * c.kv_dim();
  for (int64_t l = 0; l < c.n_layers; ++l)
    for (void* base : {kv.keys(l), kv.values(l)}) {
      if (o.kv_dtype == DType::f16)
        std::fill_n(static_cast<uint16_t*>(base), n_elems, uint16_t{0x7e00});
      else
        std::fill_n(static_cast<float*>(base), n_elems, NAN);
    }
  BatchForward bf(c, m.weights(), backend, kv, 128, 4);
  std::vector<BlockTable> tables(specs.size());
  std::vector<int64_t> done(specs.size(), 0), next_chunk(specs.size(), 0);
  std::vector<SeqResult> res(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    tables[i].adapter_id = specs[i].adapter_id;
  }
  for (int64_t step = 0;; ++step) {
    std::vector<BatchChunk> chunks;
    std::vector<size_t> owner;
    bool pending = false;
    for (size_t k = 0; k < specs.size(); ++k) {
      const size_t i = o.reverse_order ? specs.size() - 1 - k : k;
      const SeqSpec& s = specs[i];
      const auto len = static_cast<int64_t>(s.tokens.size());
      if (done[i] == len) continue;
      pending = true;
      if (step < s.start) continue;
      if (step == s.start && o.prefix_cache)  // a new request: reuse what the cache holds
        done[i] = kv.match_prefix(tables[i], std::span<const int32_t>(s.tokens).first(s.tokens.size() - 1));
      int64_t n = next_chunk[i] < static_cast<int64_t>(s.chunks.size())
                      ? s.chunks[static_cast<size_t>(next_chunk[i]++)]
                      : 1;
      n = std::min(n, len - done[i]);
      EXPECT_TRUE(kv.reserve(tables[i], done[i] + n));
      chunks.push_back(
          {&tables[i], done[i],
           std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(done[i]), static_cast<size_t>(n)),
           s.adapter, true});
      owner.push_back(i);
    }
    if (!pending) break;
    bf.step(chunks);
    for (size_t j = 0; j < chunks.size(); ++j) {
      const size_t i = owner[j];
      const int64_t last = done[i] + static_cast<int64_t>(chunks[j].tokens.size()) - 1;
      const float* lg = bf.logits(j);
      res[i].logits[last].assign(lg, lg + c.vocab_size);
      done[i] = last + 1;
      if (o.prefix_cache) kv.commit_full_blocks(tables[i], specs[i].tokens, done[i]);
    }
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    for (int64_t l = 0; l < c.n_layers; ++l)
      for (int64_t p = 0; p < static_cast<int64_t>(specs[i].tokens.size()); ++p) {
        for (int64_t g = 0; g < c.n_kv_heads; ++g) {
          const int64_t at = kv.offset(kv.slot_of(tables[i], p), g);
          for (int64_t e = 0; e < c.head_dim; ++e) res[i].kv.push_back(kv_elem(kv, kv.keys(l), at + e));
          for (int64_t e = 0; e < c.head_dim; ++e) res[i].kv.push_back(kv_elem(kv, kv.values(l), at + e));
        }
      }
    kv.release(tables[i]);
  }
  return res;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Logits at every position a run recorded against InferenceSession's.
void expect_matches_session(const Model& m, Backend& backend, const std::vector<int32_t>& tokens,
                            const SeqResult& r, const std::string& what, double tol = 1e-4) {
  InferenceSession s(m.config(), m.weights(), backend, static_cast<int64_t>(tokens.size()), DType::f32, 8);
  s.eval(tokens, /*all_logits=*/true);
  const int64_t V = m.config().vocab_size;
  ASSERT_FALSE(r.logits.empty());
  for (const auto& [p, lg] : r.logits)
    EXPECT_LT(rel_err(lg.data(), s.logits().data() + p * V, V), tol) << what << " position " << p;
}

const char* const kModels[] = {"tiny-llama.f32.gguf", "tiny-qwen2.f32.gguf", "tiny-llama.q4_1.gguf",
                               "tiny-llama.q8_0.gguf"};

TEST(BatchForward, AloneMatchesInferenceSession) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  for (const char* name : kModels) {
    auto m = load(name, backend);
    const auto tokens = random_tokens(53, m->config().vocab_size, 11);
    for (int64_t bs : {16, 5}) {
      // Prefill in uneven chunks, then decode one by one.
      const auto r = run(*m, backend, {{tokens, nullptr, 0, {13, 1, 20}, 0}}, {.block_size = bs});
      EXPECT_EQ(r[0].logits.size(), size_t{3 + 19});
      expect_matches_session(*m, backend, tokens, r[0], std::string(name) + " block size " + std::to_string(bs));
    }
    // f16 K/V: rounding each stored key and value to half moves the logits a
    // little (measured 1.2e-3 on f32 weights), and more where activations are
    // then quantized to 8 bits for quantized weights (measured 2.4e-2).
    const bool quantized = std::string(name).find(".q") != std::string::npos;
    const auto r = run(*m, backend, {{tokens, nullptr, 0, {13, 1, 20}, 0}}, {.kv_dtype = DType::f16});
    expect_matches_session(*m, backend, tokens, r[0], std::string(name) + " f16 K/V", quantized ? 5e-2 : 5e-3);
  }
}

void check_batch_invariance(const char* name, DType kv_dtype) {
  SCOPED_TRACE(std::string(name) + ", K/V " + dtype_name(kv_dtype));
  ThreadPool pool3(2), pool1(1);
  auto backend3_owner = make_backend(kCpu, pool3);
  Backend& backend3 = *backend3_owner;
  auto backend1_owner = make_backend(kCpu, pool1);
  Backend& backend1 = *backend1_owner;
  {
    auto m = load(name, backend3);
    const ModelConfig& c = m->config();
    const RandomAdapter a1 = make_adapter(c, 4, 0.5f, 1), a2 = make_adapter(c, 7, 0.25f, 2);
    const std::vector<SeqSpec> together = {
        {random_tokens(41, c.vocab_size, 1), nullptr, 0, {9, 17}, 0},
        {random_tokens(30, c.vocab_size, 2), &a1.view, 1, {30}, 2},
        {random_tokens(25, c.vocab_size, 3), &a2.view, 2, {4, 4, 4}, 1},
        {random_tokens(19, c.vocab_size, 4), &a1.view, 1, {1, 1, 16}, 0},
        {random_tokens(35, c.vocab_size, 5), nullptr, 0, {20}, 5},
    };
    const auto batched = run(*m, backend3, together, {.kv_dtype = kv_dtype});
    const auto batched_rev = run(
        *m, backend3, together, {.block_size = 16, .n_blocks = 64, .reverse_order = true, .kv_dtype = kv_dtype});
    for (size_t i = 0; i < together.size(); ++i) {
      const std::string what = std::string(name) + " sequence " + std::to_string(i);
      // Alone, with other prefill chunks, one thread, and other block sizes / placements.
      SeqSpec alone = together[i];
      alone.start = 0;
      const auto solo = run(*m, backend1, {alone}, {.kv_dtype = kv_dtype});
      SeqSpec rechunked = alone;
      rechunked.chunks = {3, 11};
      const auto solo_rechunked =
          run(*m, backend3, {rechunked}, {.block_size = 5, .n_blocks = 64, .kv_dtype = kv_dtype});
      EXPECT_TRUE(same_bits(batched[i].kv, solo[0].kv)) << what << ": K/V rows differ";
      EXPECT_TRUE(same_bits(batched[i].kv, solo_rechunked[0].kv)) << what << ": K/V rows differ (rechunked)";
      EXPECT_TRUE(same_bits(batched[i].kv, batched_rev[i].kv)) << what << ": K/V rows differ (order)";
      int64_t common = 0;
      for (const auto& [p, lg] : batched[i].logits) {
        EXPECT_TRUE(same_bits(lg, solo[0].logits.at(p))) << what << " position " << p;
        EXPECT_TRUE(same_bits(lg, batched_rev[i].logits.at(p))) << what << " position " << p << " (order)";
        if (solo_rechunked[0].logits.count(p)) {
          EXPECT_TRUE(same_bits(lg, solo_rechunked[0].logits.at(p)))
              << what << " position " << p << " (rechunked)";
          ++common;
        }
      }
      EXPECT_GE(common, 1) << what;  // at least the last position
    }
  }
}

TEST(BatchForward, BatchInvariantBitExact) {
  for (const char* name : kModels) check_batch_invariance(name, DType::f32);
}

TEST(BatchForward, BatchInvariantBitExactF16Cache) {
  check_batch_invariance("tiny-qwen2.f32.gguf", DType::f16);
  check_batch_invariance("tiny-llama.q4_1.gguf", DType::f16);
}

TEST(BatchForward, LoraMatchesMergedWeights) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  for (const char* name : {"tiny-llama.f32.gguf", "tiny-qwen2.f32.gguf"}) {
    auto base = load(name, backend);
    const ModelConfig& c = base->config();
    const RandomAdapter a1 = make_adapter(c, 4, 0.5f, 1), a2 = make_adapter(c, 7, 0.25f, 2);
    auto merged1 = load(name, backend, merge_hook(a1.view));
    auto merged2 = load(name, backend, merge_hook(a2.view));
    const auto t0 = random_tokens(29, c.vocab_size, 21), t1 = random_tokens(37, c.vocab_size, 22),
               t2 = random_tokens(23, c.vocab_size, 23);
    const auto r = run(*base, backend,
                       {{t0, &a1.view, 1, {7, 8}, 0}, {t1, nullptr, 0, {5}, 0}, {t2, &a2.view, 2, {23}, 3}});
    expect_matches_session(*merged1, backend, t0, r[0], std::string(name) + " adapter 1");
    expect_matches_session(*base, backend, t1, r[1], std::string(name) + " base");
    expect_matches_session(*merged2, backend, t2, r[2], std::string(name) + " adapter 2");
    // The adapters really change the model (so the comparison above can fail).
    InferenceSession s(c, base->weights(), backend, 64, DType::f32);
    const float* lg = s.eval(t0);
    EXPECT_GT(rel_err(r[0].logits.at(28).data(), lg, c.vocab_size), 1e-2);
  }
}

// factor_bytes counts the factors as kept: f32, bf16, or 4-bit codes plus a scale per group
// (what BatchForward weighs against the last-level cache to prefetch them).
TEST(BatchForward, AdapterFactorBytesCountTheFactorsAsKept) {
  const ModelConfig c = test::tiny_llama_config();
  RandomAdapter a = make_adapter(c, 4, 0.5f, 3);
  size_t f32 = 0, pairs = 0;
  for (const ServeLoraPair& p : a.view.pairs)
    if (p.present()) {
      f32 += static_cast<size_t>(p.a.numel() + p.b.numel()) * sizeof(float);
      ++pairs;
    }
  ASSERT_GT(pairs, 0u);
  EXPECT_EQ(a.view.factor_bytes(), f32);
  std::vector<uint16_t> halves(f32 / sizeof(float));
  for (ServeLoraPair& p : a.view.pairs)
    if (p.present()) {
      p.a16 = p.b16 = halves.data();  // only the kind counts here
      p.a.data = p.b.data = nullptr;
    }
  EXPECT_EQ(a.view.factor_bytes(), f32 / 2);
  const uint8_t code = 0;
  const float scale = 1.0f;
  size_t four = 0;
  for (ServeLoraPair& p : a.view.pairs)
    if (p.bf16()) {
      const int64_t r = p.rank(), in = p.a.dim(1), out = p.b.dim(0);
      p.a16 = p.b16 = nullptr;
      p.a4 = {&code, &scale, in};  // one group per row of A, one per row of B
      p.b4 = {&code, &scale, r};
      four += static_cast<size_t>(r * (in + out)) / 2 + static_cast<size_t>(r + out) * sizeof(float);
    }
  EXPECT_EQ(a.view.factor_bytes(), four);
}

TEST(BatchForward, PrefixCacheHitsGiveTheSameResults) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto m = load("tiny-llama.q4_1.gguf", backend);
  const ModelConfig& c = m->config();
  const RandomAdapter a1 = make_adapter(c, 4, 0.5f, 1);
  const auto shared = random_tokens(37, c.vocab_size, 31);
  auto with_tail = [&](uint32_t seed, int64_t n) {
    auto t = shared;
    const auto tail = random_tokens(n, c.vocab_size, seed);
    t.insert(t.end(), tail.begin(), tail.end());
    return t;
  };
  // The first two run before the others start, so the later ones can hit the cache:
  // 2 blocks of 16 under the base model, 2 under adapter 1, none for the other adapter id.
  const std::vector<SeqSpec> specs = {
      {with_tail(1, 5), nullptr, 0, {42}, 0},  {with_tail(2, 3), &a1.view, 1, {40}, 0},
      {with_tail(3, 9), nullptr, 0, {8}, 30},  {with_tail(4, 2), &a1.view, 1, {4}, 30},
      {with_tail(5, 2), &a1.view, 7, {4}, 30},
  };
  const auto cached = run(*m, backend, specs, {.block_size = 16, .n_blocks = 64, .prefix_cache = true});
  for (size_t i = 2; i < specs.size(); ++i) {
    SeqSpec fresh = specs[i];
    fresh.start = 0;
    const auto ref = run(*m, backend, {fresh});
    EXPECT_TRUE(same_bits(cached[i].kv, ref[0].kv)) << "sequence " << i;
    // A hit skips the cached positions: the first logits come after them.
    EXPECT_EQ(cached[i].logits.begin()->first, i == 4 ? 3 : 32 + specs[i].chunks[0] - 1) << "sequence " << i;
    for (const auto& [p, lg] : cached[i].logits)
      EXPECT_TRUE(same_bits(lg, ref[0].logits.at(p))) << "sequence " << i;
  }
}

TEST(BatchForward, RejectsTokensOutsideTheVocabulary) {
  ThreadPool pool(1);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto m = load("tiny-llama.f32.gguf", backend);
  KvPool kv(backend, m->config(), 4, 16);
  BatchForward bf(m->config(), m->weights(), backend, kv, 16);
  BlockTable t;
  ASSERT_TRUE(kv.reserve(t, 2));
  const int32_t bad[] = {5, 320};
  const BatchChunk ch{&t, 0, bad, nullptr, true};
  test_util::expect_error([&] { bf.step({&ch, 1}); }, ErrorKind::invalid_input, {"320", "vocabulary"});
  const int32_t good[] = {5, 6};
  const BatchChunk ok{&t, 0, good, nullptr, false};
  bf.step({&ok, 1});
  EXPECT_EQ(bf.logits(0), nullptr);
}

}  // namespace
}  // namespace loom

// The serving engine (serve/scheduler.h) on the tiny llama GGUF with random
// PEFT adapters: batch invariance across concurrent requests and adapters,
// preemption under a small KV cache, cancellation freeing the cache, adapters
// loaded and unloaded while requests run, n > 1 with seeds, and the errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include "serve/scheduler.h"
#include "train/peft_adapter.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

const std::string kModel = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/tiny-llama.f32.gguf";

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("loom_serve_test_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// A random adapter on every target of the tiny llama (2 layers, hidden 64,
// 4 heads of 16, 2 kv heads, ffn 176), strong enough to change greedy output.
void write_random_adapter(const fs::path& dir, uint32_t seed) {
  peft::AdapterTensors ad;
  ad.config.r = 4;
  ad.config.lora_alpha = 8;
  ad.config.base_model_name_or_path = "tiny-llama";
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  const std::pair<int64_t, int64_t> io[] = {{64, 64}, {64, 32}, {64, 32}, {64, 64}, {64, 176}, {64, 176}, {176, 64}};
  for (LoraTarget t : kAllLoraTargets) ad.config.target_modules.push_back(t);
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < kLoraTargetCount; ++t) {
      peft::LoraPair p;
      p.in = io[t].first;
      p.out = io[t].second;
      p.a.resize(static_cast<size_t>(4 * p.in));
      p.b.resize(static_cast<size_t>(p.out * 4));
      for (float& v : p.a) v = nd(rng);
      for (float& v : p.b) v = nd(rng);
      ad.pairs.emplace(std::make_pair(l, static_cast<LoraTarget>(t)), std::move(p));
    }
  peft::write_adapter(dir.string(), ad);
}

struct Output {
  std::vector<std::vector<int32_t>> ids;  // per choice
  std::vector<std::string> text;
  std::vector<FinishKind> finish;
  Usage usage;
  std::optional<EngineError> error;
};

// Reads a stream until its final event.
Output collect(RequestStream& s, int n = 1) {
  Output o;
  o.ids.resize(static_cast<size_t>(n));
  o.text.resize(static_cast<size_t>(n));
  o.finish.resize(static_cast<size_t>(n), FinishKind::abort);
  for (;;) {
    auto ev = s.pop(std::chrono::seconds(60));
    if (!ev) {
      ADD_FAILURE() << "no event within 60 s";
      return o;
    }
    if (ev->kind == GenerationEvent::Kind::done) {
      o.usage = ev->usage;
      return o;
    }
    if (ev->kind == GenerationEvent::Kind::error) {
      o.error = ev->error;
      return o;
    }
    const auto i = static_cast<size_t>(ev->delta.index);
    o.ids[i].insert(o.ids[i].end(), ev->delta.token_ids.begin(), ev->delta.token_ids.end());
    o.text[i] += ev->delta.text;
    if (ev->delta.finish) o.finish[i] = *ev->delta.finish;
  }
}

GenerationRequest greedy(const std::string& model, std::vector<int32_t> prompt, int64_t max_tokens) {
  GenerationRequest g;
  g.model = model;
  g.prompt.is_tokens = true;
  g.prompt.tokens = std::move(prompt);
  g.sampling.temperature = 0;
  g.sampling.top_k = 0;
  g.sampling.top_p = 1;
  g.sampling.min_p = 0;
  g.max_tokens = max_tokens;
  g.ignore_eos = true;
  return g;
}

std::vector<int32_t> random_prompt(uint32_t seed, int64_t len) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p;
  for (int64_t i = 0; i < len; ++i) p.push_back(static_cast<int32_t>(3 + rng() % 200));
  return p;
}

Output run_alone(ServingEngine& e, GenerationRequest g) {
  auto s = std::make_shared<RequestStream>();
  const int n = g.n;
  e.submit(std::move(g), s);
  return collect(*s, n);
}

class ServingEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 4; ++i) write_random_adapter(tmp.path / ("a" + std::to_string(i)), 100 + i);
  }
  ServeOptions options() const {
    ServeOptions o;
    o.model_path = kModel;
    o.model_name = "base";
    o.adapters = {{"a0", (tmp.path / "a0").string()}, {"a1", (tmp.path / "a1").string()},
                  {"a2", (tmp.path / "a2").string()}};
    o.adapter_dirs = {tmp.path.string()};
    o.threads = 2;
    o.max_batch_tokens = 64;
    return o;
  }
  TempDir tmp;
};

// 32 concurrent greedy requests over the base model and 3 adapters each return
// exactly what the same request returns alone.
TEST_F(ServingEngineTest, BatchInvarianceAcrossRequestsAndAdapters) {
  ServingEngine e(options());
  const std::string models[] = {"base", "a0", "a1", "a2"};
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 32; ++i)
    reqs.push_back(greedy(models[i % 4], random_prompt(static_cast<uint32_t>(i), 5 + (i * 7) % 40), 10 + i % 7));
  std::vector<Output> alone;
  for (const auto& g : reqs) alone.push_back(run_alone(e, g));
  // Adapters change the output (so the comparison below means something).
  const Output base_a = run_alone(e, greedy("base", random_prompt(1, 20), 12));
  const Output a0 = run_alone(e, greedy("a0", random_prompt(1, 20), 12));
  EXPECT_NE(base_a.ids[0], a0.ids[0]) << "adapter a0 does not change the output";

  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& g : reqs) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(g, streams.back());
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Output o = collect(*streams[i]);
    ASSERT_FALSE(o.error) << o.error->what();
    EXPECT_EQ(o.ids[0], alone[i].ids[0]) << "request " << i << " (" << reqs[i].model << ")";
    EXPECT_EQ(o.text[0], alone[i].text[0]);
    EXPECT_EQ(o.finish[0], FinishKind::length);
    EXPECT_EQ(o.usage.completion_tokens, reqs[i].max_tokens);
    EXPECT_EQ(o.usage.prompt_tokens, static_cast<int64_t>(reqs[i].prompt.tokens.size()));
  }
}

// A KV cache that holds only a few sequences forces preemption; the results
// are still those of each request alone, and the cache empties afterwards.
TEST_F(ServingEngineTest, PreemptionRecomputesWithoutChangingOutputs) {
  ServeOptions o = options();
  o.max_model_len = 128;
  o.block_size = 4;
  o.kv_cache_memory = KvPool::bytes_per_block(ServingEngine(options()).model().config(), 4, o.kv_dtype) * 48;
  o.max_seqs = 12;
  ServingEngine e(o);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 12; ++i) reqs.push_back(greedy(i % 2 ? "a1" : "base", random_prompt(50 + i, 12), 40));
  std::vector<Output> alone;
  for (const auto& g : reqs) alone.push_back(run_alone(e, g));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& g : reqs) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(g, streams.back());
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Output out = collect(*streams[i]);
    ASSERT_FALSE(out.error);
    EXPECT_EQ(out.ids[0], alone[i].ids[0]) << "request " << i;
  }
  EXPECT_GT(e.preemptions(), 0) << "the test meant to force preemption";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(e.stats().kv_cache_usage, 0.0);
}

// A cancelled request (client gone) ends with `done` and frees its blocks.
TEST_F(ServingEngineTest, CancelFreesTheCache) {
  ServingEngine e(options());
  auto s = std::make_shared<RequestStream>();
  e.submit(greedy("a0", random_prompt(9, 30), 200), s);
  int deltas = 0;
  while (deltas < 3) {
    auto ev = s->pop(std::chrono::seconds(30));
    ASSERT_TRUE(ev);
    ASSERT_EQ(ev->kind, GenerationEvent::Kind::delta);
    ++deltas;
  }
  EXPECT_GT(e.stats().kv_cache_usage, 0.0);
  s->cancel();
  for (;;) {
    auto ev = s->pop(std::chrono::seconds(30));
    ASSERT_TRUE(ev);
    if (ev->kind == GenerationEvent::Kind::done) break;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(e.stats().kv_cache_usage, 0.0);
  EXPECT_EQ(e.stats().requests_running, 0);
}

// Loading and unloading adapters while 16 streams run changes none of them.
TEST_F(ServingEngineTest, LoadAndUnloadWhileStreamsRun) {
  ServingEngine e(options());
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 16; ++i) reqs.push_back(greedy(i % 3 == 0 ? "a2" : i % 3 == 1 ? "a1" : "base",
                                                     random_prompt(200 + i, 10 + i), 30));
  std::vector<Output> alone;
  for (const auto& g : reqs) alone.push_back(run_alone(e, g));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& g : reqs) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(g, streams.back());
  }
  e.load_adapter("a3", (tmp.path / "a3").string());
  e.unload_adapter("a2");  // a2's requests are running: they keep their adapter
  EXPECT_THROW(e.submit(greedy("a2", {5, 6}, 2), std::make_shared<RequestStream>()), EngineError);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Output o = collect(*streams[i]);
    ASSERT_FALSE(o.error) << o.error->what();
    EXPECT_EQ(o.ids[0], alone[i].ids[0]) << "request " << i << " (" << reqs[i].model << ")";
  }
  const Output a3 = run_alone(e, greedy("a3", random_prompt(1, 20), 8));
  EXPECT_FALSE(a3.error);
  e.load_adapter("a2", (tmp.path / "a2").string());  // back under the same name: same weights, same output
  EXPECT_EQ(run_alone(e, reqs[0]).ids[0], alone[0].ids[0]);
}

// More adapters than --max-loras: the least recently used is evicted and
// reloaded on demand, with the same results.
TEST_F(ServingEngineTest, AdapterEvictionAndReload) {
  ServeOptions o = options();
  o.max_loras = 1;
  ServingEngine e(o);
  const Output first = run_alone(e, greedy("a0", random_prompt(3, 9), 8));
  run_alone(e, greedy("a1", random_prompt(3, 9), 8));
  run_alone(e, greedy("a2", random_prompt(3, 9), 8));
  EXPECT_EQ(e.stats().adapters_loaded, 1);
  EXPECT_EQ(run_alone(e, greedy("a0", random_prompt(3, 9), 8)).ids[0], first.ids[0]);
}

TEST_F(ServingEngineTest, SeededChoicesAreReproducible) {
  ServingEngine e(options());
  GenerationRequest g = greedy("a0", random_prompt(4, 8), 12);
  g.sampling.temperature = 1.0f;
  g.n = 3;
  g.seed = 1234;
  const Output x = run_alone(e, g), y = run_alone(e, g);
  ASSERT_FALSE(x.error);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(x.ids[static_cast<size_t>(i)].size(), 12u);
    EXPECT_EQ(x.ids[static_cast<size_t>(i)], y.ids[static_cast<size_t>(i)]);
  }
  EXPECT_NE(x.ids[0], x.ids[1]) << "choices draw from different seeds";
  EXPECT_EQ(x.usage.completion_tokens, 36);
}

TEST_F(ServingEngineTest, StopTokenAndMaxTokens) {
  ServingEngine e(options());
  const Output full = run_alone(e, greedy("base", random_prompt(5, 8), 12));
  GenerationRequest g = greedy("base", random_prompt(5, 8), 12);
  g.stop_token_ids = {full.ids[0][4]};
  const Output cut = run_alone(e, g);
  EXPECT_EQ(cut.finish[0], FinishKind::stop);
  // Ends at the first occurrence of that token.
  const auto first = std::find(full.ids[0].begin(), full.ids[0].end(), full.ids[0][4]) - full.ids[0].begin();
  EXPECT_EQ(cut.ids[0].size(), static_cast<size_t>(first + 1));
}

TEST_F(ServingEngineTest, BadRequestsAreTypedErrors) {
  ServingEngine e(options());
  auto code = [&](GenerationRequest g) {
    try {
      e.submit(std::move(g), std::make_shared<RequestStream>());
    } catch (const EngineError& err) {
      return err.code();
    }
    return EngineErrc::internal;
  };
  EXPECT_EQ(code(greedy("nope", {5}, 4)), EngineErrc::model_not_found);
  EXPECT_EQ(code(greedy("base", {5, 100000}, 4)), EngineErrc::invalid_request);
  EXPECT_EQ(code(greedy("base", {}, 4)), EngineErrc::invalid_request);
  EXPECT_EQ(code(greedy("base", random_prompt(1, 300), 4)), EngineErrc::context_length_exceeded);
  EXPECT_EQ(code(greedy("base", random_prompt(1, 10), e.max_model_len())), EngineErrc::context_length_exceeded);
  auto load_code = [&](const std::string& name, const std::string& path) {
    try {
      e.load_adapter(name, path);
    } catch (const EngineError& err) {
      return err.code();
    }
    return EngineErrc::internal;
  };
  EXPECT_EQ(load_code("a0", (tmp.path / "a3").string()), EngineErrc::adapter_exists);
  EXPECT_EQ(load_code("x", "/etc"), EngineErrc::invalid_request);                      // outside --adapter-dir
  EXPECT_EQ(load_code("x", (tmp.path / "a3/../../etc").string()), EngineErrc::invalid_request);
  fs::create_directories(tmp.path / "broken");
  EXPECT_EQ(load_code("x", (tmp.path / "broken").string()), EngineErrc::adapter_load_failed);
  EXPECT_THROW(e.unload_adapter("never"), EngineError);
  // The engine still serves.
  EXPECT_FALSE(run_alone(e, greedy("base", {5, 6, 7}, 3)).error);
}

}  // namespace
}  // namespace loom

// The serving engine (serve/scheduler.h) on the tiny llama GGUF with random
// PEFT adapters: batch invariance across concurrent requests and adapters,
// preemption under a small KV cache, cancellation freeing the cache, adapters
// loaded and unloaded while requests run, n > 1 with seeds, and the errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <new>
#include <random>
#include <stdexcept>
#include <thread>

#include "core/half.h"
#include "io/gguf.h"
#include "kernels/int_quant.h"
#include "kernels/lora_i8.h"
#include "model/config_load.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/peft_adapter.h"
#include "model_test_util.h"
#include "serve/grammar.h"
#include "serve/scheduler.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

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

void write_random_adapter(const fs::path& dir, uint32_t seed) { test::write_tiny_random_adapter(dir.string(), seed); }

struct Output {
  std::vector<std::vector<int32_t>> ids;  // per choice
  std::vector<std::string> text;
  std::vector<FinishKind> finish;
  std::vector<std::vector<TokenLogprob>> prompt_logprobs;  // per choice: ChoiceDelta::prompt deltas' logprobs
  Usage usage;
  std::optional<EngineError> error;
};

// Reads a stream until its final event.
Output collect(RequestStream& s, int n = 1) {
  Output o;
  o.ids.resize(static_cast<size_t>(n));
  o.text.resize(static_cast<size_t>(n));
  o.finish.resize(static_cast<size_t>(n), FinishKind::abort);
  o.prompt_logprobs.resize(static_cast<size_t>(n));
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
    if (ev->delta.prompt) {
      EXPECT_TRUE(o.ids[i].empty() && ev->delta.token_ids.empty()) << "prompt logprobs after a sampled token";
      o.prompt_logprobs[i].insert(o.prompt_logprobs[i].end(), ev->delta.logprobs.begin(),
                                  ev->delta.logprobs.end());
      continue;
    }
    o.ids[i].insert(o.ids[i].end(), ev->delta.token_ids.begin(), ev->delta.token_ids.end());
    o.text[i] += ev->delta.text;
    if (ev->delta.finish) o.finish[i] = *ev->delta.finish;
  }
}

using test::greedy_request;

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

// n greedy requests for adapter a0 on `packed`, each batched with one for a1
// (so the kernel reads a0's packed factors within a mixed step), give the
// tokens `twin` gives for them alone. Prompts from seeds seed + i and seed + 50 + i.
void expect_twin_tokens(ServingEngine& packed, ServingEngine& twin, uint32_t seed, int n) {
  for (int i = 0; i < n; ++i) {
    GenerationRequest g = greedy_request("a0", random_prompt(seed + static_cast<uint32_t>(i), 9 + 5 * i), 12);
    g.logprobs = true;
    g.top_logprobs = 3;
    auto s = std::make_shared<RequestStream>(), other = std::make_shared<RequestStream>();
    packed.submit(g, s);
    packed.submit(greedy_request("a1", random_prompt(seed + 50 + static_cast<uint32_t>(i), 17), 12), other);
    const Output o = collect(*s);
    collect(*other);
    const Output want = run_alone(twin, g);
    ASSERT_FALSE(o.error) << o.error->what();
    EXPECT_EQ(o.ids[0], want.ids[0]) << "prompt " << i;
    EXPECT_EQ(o.text[0], want.text[0]) << "prompt " << i;
  }
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
    reqs.push_back(
        greedy_request(models[i % 4], random_prompt(static_cast<uint32_t>(i), 5 + (i * 7) % 40), 10 + i % 7));
  std::vector<Output> alone;
  for (const auto& g : reqs) alone.push_back(run_alone(e, g));
  // Adapters change the output (so the comparison below means something).
  const Output base_a = run_alone(e, greedy_request("base", random_prompt(1, 20), 12));
  const Output a0 = run_alone(e, greedy_request("a0", random_prompt(1, 20), 12));
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

// --lora-bits 4: an adapter kept in 4 bits gives exactly the tokens and
// log-probs of the same server holding, in f32, the values its 4-bit codes
// stand for (A in groups of 64 or whole rows of 176, B per row), batched with
// other adapters and the base; and it takes a third of the memory or less.
TEST_F(ServingEngineTest, FourBitAdaptersServeTheirDequantizedValues) {
  const peft::AdapterTensors ad = peft::read_adapter((tmp.path / "a0").string());
  peft::AdapterTensors twin = ad;
  for (auto& [key, p] : twin.pairs) {
    const int64_t r = twin.config.r;
    const PackedInt4 qa = pack_int4_rows(p.a.data(), r, p.in, fitting_int4_group(p.in, 128));
    const PackedInt4 qb = pack_int4_rows(p.b.data(), p.out, r, fitting_int4_group(r, 128));
    unpack_int4_rows(qa.codes.data(), qa.scales.data(), r, p.in, qa.group, p.a.data());
    unpack_int4_rows(qb.codes.data(), qb.scales.data(), p.out, r, qb.group, p.b.data());
  }
  peft::write_adapter((tmp.path / "a0-dequant").string(), twin);

  ServeOptions four = options();
  four.lora_bits = 4;
  ServeOptions f32 = options();
  f32.adapters = {{"a0", (tmp.path / "a0-dequant").string()}, {"a1", (tmp.path / "a1").string()}};
  f32.lora_bits = 32;
  ServingEngine e4(four), e32(f32);
  for (const AdapterInfo& a : e4.adapter_infos())
    if (a.resident) {
      EXPECT_LT(a.bytes * 3, a.f32_bytes) << a.name;  // r = 4: B rows of 4 carry a scale each (3.8x here, 6.2x at r = 16)
      EXPECT_GT(a.bytes, 0u) << a.name;
    }
  expect_twin_tokens(e4, e32, 40, 6);
}

// --lora-bits 16: an adapter kept in bf16 gives exactly the tokens of the same
// server holding its bf16-rounded values in f32, batched with another adapter.
TEST_F(ServingEngineTest, Bf16AdaptersServeTheirRoundedValues) {
  peft::AdapterTensors twin = peft::read_adapter((tmp.path / "a0").string());
  for (auto& [key, p] : twin.pairs)
    for (std::vector<float>* v : {&p.a, &p.b})
      for (float& x : *v) x = bf16_to_fp32(fp32_to_bf16(x));
  peft::write_adapter((tmp.path / "a0-bf16").string(), twin);
  ServeOptions half = options();
  half.lora_bits = 16;
  ServeOptions f32 = options();
  f32.adapters = {{"a0", (tmp.path / "a0-bf16").string()}};
  ServingEngine e16(half), e32(f32);
  for (const AdapterInfo& a : e16.adapter_infos()) {
    if (a.resident) {
      EXPECT_EQ(a.bytes * 2, a.f32_bytes) << a.name;
    }
  }
  expect_twin_tokens(e16, e32, 140, 4);
}

// --lora-bits 8: an adapter kept in int8 gives the tokens of the same server
// holding, in f32, the values its codes stand for (kernels/lora_i8.h; the
// sums differ only in where the scales are applied, so by rounding), batched
// with another adapter; and it takes under a third of the memory.
TEST_F(ServingEngineTest, Int8AdaptersServeTheirValues) {
  peft::AdapterTensors twin = peft::read_adapter((tmp.path / "a0").string());
  for (auto& [key, p] : twin.pairs) {
    const int64_t r = twin.config.r;
    std::vector<uint8_t> a8(lora_a8_bytes(r, p.in)), b8(lora_b8_bytes(p.out, r));
    pack_lora_a8(p.a.data(), r, p.in, a8.data());
    pack_lora_b8(p.b.data(), p.out, r, b8.data());
    unpack_lora_a8(a8.data(), r, p.in, p.a.data());
    unpack_lora_b8(b8.data(), p.out, r, p.b.data());
  }
  peft::write_adapter((tmp.path / "a0-int8").string(), twin);
  ServeOptions eight = options();
  eight.lora_bits = 8;
  ServeOptions f32 = options();
  f32.adapters = {{"a0", (tmp.path / "a0-int8").string()}};
  f32.lora_bits = 32;
  ServingEngine e8(eight), e32(f32);
  for (const AdapterInfo& a : e8.adapter_infos()) {
    if (a.resident) {
      EXPECT_LT(a.bytes * 3, a.f32_bytes) << a.name;
    }
  }
  expect_twin_tokens(e8, e32, 240, 4);
}

// --max-lora-memory with room for one adapter: 12 concurrent requests over
// three adapters all finish (each waits until the one in use is released) with
// the tokens each gives alone.
TEST_F(ServingEngineTest, AdapterMemoryBudgetServesMoreAdaptersThanFit) {
  ServeOptions o = options();
  o.max_loras = 1 << 20;
  o.lora_bits = 16;
  {
    ServingEngine probe(o);
    for (const AdapterInfo& a : probe.adapter_infos())
      if (a.resident) o.max_lora_memory = a.bytes + a.bytes / 2;
  }
  ASSERT_GT(o.max_lora_memory, 0u);
  ServingEngine e(o);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 12; ++i)
    reqs.push_back(greedy_request("a" + std::to_string(i % 3), random_prompt(static_cast<uint32_t>(60 + i), 7 + i), 6));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const GenerationRequest& g : reqs) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(g, streams.back());
  }
  std::vector<Output> together;
  for (auto& s : streams) together.push_back(collect(*s));
  EXPECT_EQ(e.stats().adapters_loaded, 1);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_FALSE(together[i].error) << together[i].error->what();
    EXPECT_EQ(together[i].ids[0], run_alone(e, reqs[i]).ids[0]) << "request " << i;
  }
}

// A KV cache that holds only a few sequences forces preemption; the results
// are still those of each request alone, and the cache empties afterwards.
// Every prompt token's logprob (the first: none) against the log-softmax, in double, of InferenceSession's
// logits at the position before it, with the top alternatives in order; a 150-token prompt spans three
// 64-row chunks. Run twice (the second finds the prompt in the prefix cache and must compute it anyway),
// then 10 at once under a cache small enough to preempt: a recomputed prompt reports nothing twice.
TEST_F(ServingEngineTest, EchoPromptLogprobsMatchTheModelsLogits) {
  const std::vector<int32_t> prompt = random_prompt(7, 150);
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  auto m = Model::load(kModel, {.tokenizer = false, .pack = true, .backend = backend.get()});
  const int64_t V = m->config().vocab_size;
  InferenceSession ref(m->config(), m->weights(), *backend, 160);
  ref.eval(prompt, /*all_logits=*/true);
  auto check = [&](const Output& out, const std::string& what) {
    ASSERT_FALSE(out.error) << what << ": " << out.error->what();
    const std::vector<TokenLogprob>& got = out.prompt_logprobs[0];
    ASSERT_EQ(got.size(), prompt.size()) << what;
    EXPECT_FALSE(got[0].known) << what;
    EXPECT_EQ(got[0].token_id, prompt[0]) << what;
    EXPECT_EQ(out.ids[0].size(), 6u) << what;
    for (size_t p = 1; p < prompt.size(); ++p) {
      const float* row = ref.logits().data() + (p - 1) * static_cast<size_t>(V);
      double mx = -INFINITY, sum = 0;
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
      for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
      const double lse = mx + std::log(sum);
      const TokenLogprob& t = got[p];
      ASSERT_TRUE(t.known) << what << " position " << p;
      EXPECT_EQ(t.token_id, prompt[p]) << what << " position " << p;
      EXPECT_NEAR(t.logprob, row[prompt[p]] - lse, 1e-3) << what << " position " << p;
      ASSERT_EQ(t.top.size(), 2u) << what;
      EXPECT_EQ(t.top[0].token_id, static_cast<int32_t>(std::max_element(row, row + V) - row))
          << what << " position " << p;
      EXPECT_GE(t.top[0].logprob, t.top[1].logprob) << what << " position " << p;
    }
  };
  auto request = [&] {
    GenerationRequest g =
        greedy_request("base", prompt, 6);  // 155 positions: past the prompt's 38 blocks of 4
    g.logprobs = true;
    g.top_logprobs = 2;
    g.prompt_logprobs = true;
    return g;
  };
  {
    ServeOptions o = options();
    o.max_batch_tokens = 256;
    ServingEngine e(o);
    for (const char* what : {"first run", "prompt in the prefix cache"}) {
      check(run_alone(e, request()), what);
    }
  }
  ServeOptions o = options();
  o.max_batch_tokens = 256;
  o.max_model_len = 160;
  o.block_size = 4;
  o.kv_cache_memory =
      KvPool::bytes_per_block(m->config(), 4, o.kv_dtype) * 77;  // two prompts, then one must yield
  o.max_seqs = 10;
  ServingEngine e(o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 10; ++i) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(request(), streams.back());
  }
  for (int i = 0; i < 10; ++i)
    check(collect(*streams[static_cast<size_t>(i)]), "concurrent " + std::to_string(i));
  EXPECT_GT(e.preemptions(), 0) << "the test meant to force preemption";
}

TEST_F(ServingEngineTest, PreemptionRecomputesWithoutChangingOutputs) {
  ServeOptions o = options();
  o.max_model_len = 128;
  o.block_size = 4;
  o.kv_cache_memory = KvPool::bytes_per_block(ServingEngine(options()).model().config(), 4, o.kv_dtype) * 48;
  o.max_seqs = 12;
  ServingEngine e(o);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 12; ++i) reqs.push_back(greedy_request(i % 2 ? "a1" : "base", random_prompt(50 + i, 12), 40));
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
  // 200 tokens of the tiny model take ~0.1 s: slow each step down (2 ms) so the
  // request is still running when the test looks, even on a loaded machine.
  ServeOptions o = options();
  o.fault_hook = [](FaultPoint p, const GenerationRequest&) {
    if (p == FaultPoint::forward) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  ServingEngine e(o);
  auto s = std::make_shared<RequestStream>();
  e.submit(greedy_request("a0", random_prompt(9, 30), 200), s);
  int deltas = 0;
  while (deltas < 3) {
    auto ev = s->pop(std::chrono::seconds(30));
    ASSERT_TRUE(ev);
    ASSERT_EQ(ev->kind, GenerationEvent::Kind::delta);
    ++deltas;
  }
  EXPECT_GT(e.stats().kv_cache_usage, 0.0);
  EXPECT_EQ(e.stats().requests_running, 1);
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
  for (int i = 0; i < 16; ++i) reqs.push_back(greedy_request(i % 3 == 0 ? "a2" : i % 3 == 1 ? "a1" : "base",
                                                     random_prompt(200 + i, 10 + i), 30));
  std::vector<Output> alone;
  for (const auto& g : reqs) alone.push_back(run_alone(e, g));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& g : reqs) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(g, streams.back());
  }
  e.load_adapter("a3", (tmp.path / "a3").string(), false);
  e.unload_adapter("a2");  // a2's requests are running: they keep their adapter
  EXPECT_THROW(e.submit(greedy_request("a2", {5, 6}, 2), std::make_shared<RequestStream>()), EngineError);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Output o = collect(*streams[i]);
    ASSERT_FALSE(o.error) << o.error->what();
    EXPECT_EQ(o.ids[0], alone[i].ids[0]) << "request " << i << " (" << reqs[i].model << ")";
  }
  const Output a3 = run_alone(e, greedy_request("a3", random_prompt(1, 20), 8));
  EXPECT_FALSE(a3.error);
  e.load_adapter("a2", (tmp.path / "a2").string(), false);  // back under the same name: same weights, same output
  EXPECT_EQ(run_alone(e, reqs[0]).ids[0], alone[0].ids[0]);
}

// More adapters than --max-loras: the least recently used is evicted and
// reloaded on demand, with the same results.
TEST_F(ServingEngineTest, AdapterEvictionAndReload) {
  ServeOptions o = options();
  o.max_loras = 1;
  ServingEngine e(o);
  const Output first = run_alone(e, greedy_request("a0", random_prompt(3, 9), 8));
  run_alone(e, greedy_request("a1", random_prompt(3, 9), 8));
  run_alone(e, greedy_request("a2", random_prompt(3, 9), 8));
  EXPECT_EQ(e.stats().adapters_loaded, 1);
  EXPECT_EQ(run_alone(e, greedy_request("a0", random_prompt(3, 9), 8)).ids[0], first.ids[0]);
}

// ---- replacing an adapter in place ("load_inplace": true)

// The A factor of layer 0's q_proj, as the registry serves it (f32), copied out.
std::vector<float> q_a_values(const LoadedAdapter& a) {
  const ServeLoraPair& p = a.view.pair(0, LoraTarget::q);
  const auto* v = static_cast<const float*>(p.a.data);
  return {v, v + p.a.numel()};
}

std::vector<float> q_a_on_disk(const fs::path& dir) {
  const peft::AdapterTensors t = peft::read_adapter(dir.string());
  const peft::LoraPair& p = t.pairs.at({0, LoraTarget::q});
  return {p.a_data(), p.a_data() + p.in * t.config.r};
}

class AdapterReplaceTest : public ServingEngineTest {
 protected:
  ModelConfig config = config_from_gguf(*gguf::File::open(kModel));
};

// A holder of the old version (a running sequence) keeps its weights, unchanged, even when the folder it came
// from is rewritten afterwards; the next acquire gets the new version under a new id and path.
TEST_F(AdapterReplaceTest, HolderKeepsTheOldVersion) {
  AdapterRegistry reg(config, {tmp.path.string()}, 8);
  write_random_adapter(tmp.path / "v", 7);
  const std::vector<float> v1_values = q_a_on_disk(tmp.path / "v");
  EXPECT_FALSE(reg.add("p", (tmp.path / "v").string(), /*runtime=*/true, /*replace=*/true));  // new name: added
  const auto held = *reg.acquire("p");
  ASSERT_TRUE(held);
  EXPECT_EQ(q_a_values(*held), v1_values);
  EXPECT_THROW(reg.add("p", (tmp.path / "a1").string(), true), EngineError);  // without replace: adapter_exists
  EXPECT_TRUE(reg.add("p", (tmp.path / "a1").string(), true, /*replace=*/true));
  write_random_adapter(tmp.path / "v", 8);  // the old folder rewritten (as a trainer's next publish does)
  const auto now = *reg.acquire("p");
  ASSERT_TRUE(now);
  EXPECT_NE(now->id, held->id);
  EXPECT_NE(now.get(), held.get());
  EXPECT_EQ(now->path, fs::weakly_canonical(tmp.path / "a1").string());
  EXPECT_EQ(q_a_values(*now), q_a_on_disk(tmp.path / "a1"));
  EXPECT_EQ(q_a_values(*held), v1_values) << "the running sequence's version changed under it";
  EXPECT_EQ(held->path, fs::weakly_canonical(tmp.path / "v").string());
  const std::vector<AdapterInfo> list = reg.list();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].path, now->path);
  EXPECT_EQ(reg.resident_count(), 1);
}

// A replacement that fails to load or validate leaves the old version registered and served.
TEST_F(AdapterReplaceTest, FailedReplacementKeepsTheOldVersion) {
  AdapterRegistry reg(config, {tmp.path.string()}, 8);
  reg.add("p", (tmp.path / "a0").string(), true);
  const auto before = *reg.acquire("p");
  const int64_t id = before->id;
  fs::create_directories(tmp.path / "empty");
  write_random_adapter(tmp.path / "nan", 5);
  {
    peft::AdapterTensors ad = peft::read_adapter((tmp.path / "nan").string());
    ad.pairs.at({1, LoraTarget::v}).b[3] = std::numeric_limits<float>::quiet_NaN();
    peft::write_adapter((tmp.path / "nan").string(), ad);
  }
  const auto code = [&](const fs::path& dir) {
    try {
      reg.add("p", dir.string(), true, /*replace=*/true);
    } catch (const EngineError& e) {
      return e.code();
    }
    return EngineErrc::internal;
  };
  EXPECT_EQ(code(tmp.path / "empty"), EngineErrc::adapter_load_failed);
  EXPECT_EQ(code(tmp.path / "nan"), EngineErrc::adapter_load_failed);
  EXPECT_EQ(code("/etc"), EngineErrc::invalid_request);  // outside --adapter-dir, replacement or not
  const auto after = *reg.acquire("p");
  ASSERT_TRUE(after);
  EXPECT_EQ(after->id, id);
  EXPECT_EQ(after.get(), before.get());
  EXPECT_EQ(reg.list()[0].path, fs::weakly_canonical(tmp.path / "a0").string());
}

// With every slot taken (max_resident 1), replacing an evicted adapter loads the new version into a slot
// freed by eviction or leaves it to be loaded from the new path on demand; never more than max resident.
TEST_F(AdapterReplaceTest, ReplacingAnEvictedAdapter) {
  AdapterRegistry reg(config, {tmp.path.string()}, 1);
  reg.add("p", (tmp.path / "a0").string(), true);
  reg.add("q", (tmp.path / "a1").string(), true);  // evicts p
  auto q = *reg.acquire("q");                       // held: q cannot be evicted now
  EXPECT_TRUE(reg.add("p", (tmp.path / "a2").string(), true, /*replace=*/true));
  EXPECT_EQ(reg.resident_count(), 1);
  EXPECT_FALSE(*reg.acquire("p")) << "every slot is in use: the caller waits";
  q.reset();
  const auto p = *reg.acquire("p");  // q evicted; p loaded from its new folder
  ASSERT_TRUE(p);
  EXPECT_EQ(q_a_values(*p), q_a_on_disk(tmp.path / "a2"));
  EXPECT_EQ(reg.resident_count(), 1);
}

// A stream on version 1 keeps producing version 1's tokens while version 2 replaces it; requests after the
// swap get version 2, also for a prompt whose blocks version 1 left in the prefix cache.
TEST_F(ServingEngineTest, ReplaceInPlaceWhileAStreamRuns) {
  ServeOptions o = options();
  o.fault_hook = [](FaultPoint p, const GenerationRequest&) {
    if (p == FaultPoint::forward) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  ServingEngine e(o);
  const std::vector<int32_t> prompt = random_prompt(21, 40);  // two full blocks to cache
  const Output v1 = run_alone(e, greedy_request("a0", prompt, 60));
  const Output v2 = run_alone(e, greedy_request("a1", prompt, 60));
  ASSERT_FALSE(v1.error);
  ASSERT_NE(v1.ids[0], v2.ids[0]) << "the two adapters must differ for this test to mean anything";
  EXPECT_FALSE(e.load_adapter("p", (tmp.path / "a0").string(), /*replace=*/true));
  EXPECT_EQ(run_alone(e, greedy_request("p", prompt, 60)).ids[0], v1.ids[0]);  // caches the prompt under v1
  auto s = std::make_shared<RequestStream>();
  e.submit(greedy_request("p", prompt, 60), s);
  std::vector<int32_t> got;
  while (got.size() < 3) {
    auto ev = s->pop(std::chrono::seconds(30));
    ASSERT_TRUE(ev);
    ASSERT_EQ(ev->kind, GenerationEvent::Kind::delta);
    got.insert(got.end(), ev->delta.token_ids.begin(), ev->delta.token_ids.end());
  }
  EXPECT_TRUE(e.load_adapter("p", (tmp.path / "a1").string(), /*replace=*/true));
  const Output after = run_alone(e, greedy_request("p", prompt, 60));
  ASSERT_FALSE(after.error);
  EXPECT_EQ(after.ids[0], v2.ids[0]) << "a request after the swap must get version 2 (and no v1 cached prefix)";
  const Output rest = collect(*s);
  ASSERT_FALSE(rest.error);
  got.insert(got.end(), rest.ids[0].begin(), rest.ids[0].end());
  EXPECT_EQ(got, v1.ids[0]) << "the running stream must keep version 1";
  bool listed = false;
  for (const ModelInfo& m : e.list_models())
    if (m.id == "p") listed = m.path == fs::weakly_canonical(tmp.path / "a1").string();
  EXPECT_TRUE(listed);
  // Without load_inplace the name is still refused.
  EXPECT_THROW(e.load_adapter("p", (tmp.path / "a0").string(), false), EngineError);
}

TEST_F(ServingEngineTest, SeededChoicesAreReproducible) {
  ServingEngine e(options());
  GenerationRequest g = greedy_request("a0", random_prompt(4, 8), 12);
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
  const Output full = run_alone(e, greedy_request("base", random_prompt(5, 8), 12));
  GenerationRequest g = greedy_request("base", random_prompt(5, 8), 12);
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
  EXPECT_EQ(code(greedy_request("nope", {5}, 4)), EngineErrc::model_not_found);
  EXPECT_EQ(code(greedy_request("base", {5, 100000}, 4)), EngineErrc::invalid_request);
  EXPECT_EQ(code(greedy_request("base", {}, 4)), EngineErrc::invalid_request);
  EXPECT_EQ(code(greedy_request("base", random_prompt(1, 300), 4)), EngineErrc::context_length_exceeded);
  EXPECT_EQ(code(greedy_request("base", random_prompt(1, 10), e.max_model_len())), EngineErrc::context_length_exceeded);
  GenerationRequest stop_past_vocab = greedy_request("base", {5, 6}, 4);
  stop_past_vocab.stop_token_ids = {1000000000};  // no token is it: it would never stop anything
  EXPECT_EQ(code(stop_past_vocab), EngineErrc::invalid_request);
  auto load_code = [&](const std::string& name, const std::string& path) {
    try {
      e.load_adapter(name, path, false);
    } catch (const EngineError& err) {
      return err.code();
    }
    return EngineErrc::internal;
  };
  EXPECT_EQ(load_code("a0", (tmp.path / "a3").string()), EngineErrc::adapter_exists);
  EXPECT_EQ(load_code("x", "/etc"), EngineErrc::invalid_request);                      // outside --adapter-dir
  EXPECT_EQ(load_code(std::string("a\0b", 3), (tmp.path / "a3").string()), EngineErrc::invalid_request);
  EXPECT_EQ(load_code(std::string(300, 'n'), (tmp.path / "a3").string()), EngineErrc::invalid_request);
  EXPECT_EQ(load_code("x", (tmp.path / "a3/../../etc").string()), EngineErrc::invalid_request);
  fs::create_directories(tmp.path / "broken");
  EXPECT_EQ(load_code("x", (tmp.path / "broken").string()), EngineErrc::adapter_load_failed);
  EXPECT_THROW(e.unload_adapter("never"), EngineError);
  // The engine still serves.
  EXPECT_FALSE(run_alone(e, greedy_request("base", {5, 6, 7}, 3)).error);
}

// ---- fault containment: a failure while serving one request ends that request with an error event; the
// scheduler thread (and the process) lives on and serves the next requests.

// Requests whose max_tokens is this are "poisoned" for the fault hook.
constexpr int64_t kPoisoned = 13;

TEST_F(ServingEngineTest, FailedForwardFailsOnlyItsRequest) {
  ServeOptions o = options();
  std::atomic<int> hits{0};
  o.fault_hook = [&](FaultPoint p, const GenerationRequest& g) {
    if (p == FaultPoint::forward && g.max_tokens == kPoisoned) {
      ++hits;
      throw std::runtime_error("injected forward failure");
    }
  };
  ServingEngine e(o);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(greedy_request(i % 2 ? "a0" : "base", random_prompt(300 + i, 9 + i), 16));
  std::vector<Output> alone;
  for (const auto& g : reqs) alone.push_back(run_alone(e, g));
  // The poisoned request runs batched with the others.
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (size_t i = 0; i < reqs.size(); ++i) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(reqs[i], streams.back());
    if (i == 2) {
      streams.push_back(std::make_shared<RequestStream>());
      e.submit(greedy_request("a1", random_prompt(7, 12), kPoisoned), streams.back());
    }
  }
  for (size_t i = 0, k = 0; i < streams.size(); ++i) {
    const Output out = collect(*streams[i]);
    if (i == 3) {
      ASSERT_TRUE(out.error) << "the poisoned request must fail";
      EXPECT_EQ(out.error->code(), EngineErrc::internal);
      EXPECT_NE(std::string(out.error->what()).find("injected forward failure"), std::string::npos)
          << out.error->what();
      continue;
    }
    ASSERT_FALSE(out.error) << "request " << k << ": " << out.error->what();
    EXPECT_EQ(out.ids[0], alone[k].ids[0]) << "request " << k;
    ++k;
  }
  EXPECT_GE(hits.load(), 2) << "batched, then alone";
  // The engine still serves, and the failed request's blocks were freed.
  EXPECT_FALSE(run_alone(e, greedy_request("base", {5, 6, 7}, 3)).error);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(e.stats().kv_cache_usage, 0.0);
  EXPECT_EQ(e.stats().requests_running, 0);
}

TEST_F(ServingEngineTest, FailedSamplingMidStreamFailsThatRequest) {
  ServeOptions o = options();
  std::atomic<int> sampled{0};
  o.fault_hook = [&](FaultPoint p, const GenerationRequest& g) {
    if (p != FaultPoint::sample || g.max_tokens != kPoisoned) return;
    if (++sampled == 5) throw EngineError(EngineErrc::invalid_request, "injected sampling failure", "logit_bias");
  };
  ServingEngine e(o);
  auto bad = std::make_shared<RequestStream>();
  auto good = std::make_shared<RequestStream>();
  GenerationRequest poisoned = greedy_request("base", random_prompt(8, 10), kPoisoned);
  poisoned.n = 2;  // both choices end with the request
  e.submit(poisoned, bad);
  e.submit(greedy_request("a2", random_prompt(9, 10), 20), good);
  int deltas = 0;
  std::optional<EngineError> err;
  for (;;) {
    auto ev = bad->pop(std::chrono::seconds(30));
    ASSERT_TRUE(ev);
    if (ev->kind == GenerationEvent::Kind::delta) ++deltas;
    if (ev->kind == GenerationEvent::Kind::done) FAIL() << "done after a failure";
    if (ev->kind == GenerationEvent::Kind::error) {
      err = ev->error;
      break;
    }
  }
  EXPECT_EQ(deltas, 4) << "the tokens sampled before the failure were streamed";
  ASSERT_TRUE(err);
  EXPECT_EQ(err->code(), EngineErrc::invalid_request) << "an EngineError keeps its code";
  EXPECT_EQ(err->param(), "logit_bias");
  EXPECT_FALSE(bad->pop(std::chrono::milliseconds(100))) << "nothing after the error";
  const Output g = collect(*good);
  ASSERT_FALSE(g.error);
  EXPECT_EQ(g.ids[0].size(), 20u);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(e.stats().kv_cache_usage, 0.0);
}

// A grammar too ambiguous to enforce (2^(n-1) parse stacks after n x's; GrammarAutomaton::limit_work) ends
// its own request with an invalid_request error once a token needs too much work, instead of holding the
// scheduler; the request beside it is served in full.
TEST_F(ServingEngineTest, TooAmbiguousGrammarFailsOnlyItsRequest) {
  ServingEngine e(options());
  GenerationRequest doubling =
      greedy_request("base", random_prompt(21, 8), 40);  // ignore_eos: only x's follow
  auto grammar = std::const_pointer_cast<Grammar>(
      compile_gbnf("root ::= s\ns ::= \"x\" s e1 | \"x\" s e2 | \"x\"\ne1 ::= \"\"\ne2 ::= \"\""));
  grammar->source_param = "grammar";  // as the protocol's compile sets it: the error names the field
  doubling.grammar = grammar;
  auto bad = std::make_shared<RequestStream>();
  auto good = std::make_shared<RequestStream>();
  e.submit(doubling, bad);
  e.submit(greedy_request("a1", random_prompt(22, 10), 30), good);
  const Output b = collect(*bad);
  ASSERT_TRUE(b.error) << "text: " << b.text[0];
  EXPECT_EQ(b.error->code(), EngineErrc::invalid_request);
  EXPECT_NE(std::string(b.error->what()).find("too ambiguous to enforce"), std::string::npos)
      << b.error->what();
  EXPECT_EQ(b.error->param(), "grammar");
  EXPECT_GE(b.ids[0].size(), 8u) << "the x's before the bound were streamed";
  const Output g = collect(*good);
  ASSERT_FALSE(g.error);
  EXPECT_EQ(g.ids[0].size(), 30u);
  EXPECT_FALSE(run_alone(e, greedy_request("base", random_prompt(23, 6), 5)).error)
      << "the engine keeps serving";
}

// A failure outside any one request's rows (here: admission) ends the requests in flight with errors and
// the scheduler starts over; later requests are served.
TEST_F(ServingEngineTest, SchedulerFailureEndsRequestsInFlightAndKeepsServing) {
  ServeOptions o = options();
  std::atomic<bool> armed{true};
  o.fault_hook = [&](FaultPoint p, const GenerationRequest& g) {
    if (p == FaultPoint::admit && g.max_tokens == kPoisoned && armed.exchange(false))
      throw std::bad_alloc();
  };
  ServingEngine e(o);
  auto running = std::make_shared<RequestStream>();
  e.submit(greedy_request("base", random_prompt(10, 10), 200), running);
  ASSERT_TRUE(running->pop(std::chrono::seconds(30)));  // it is decoding
  auto bad = std::make_shared<RequestStream>();
  e.submit(greedy_request("base", random_prompt(11, 10), kPoisoned), bad);
  const Output b = collect(*bad);
  ASSERT_TRUE(b.error);
  EXPECT_EQ(b.error->code(), EngineErrc::internal);
  EXPECT_NE(std::string(b.error->what()).find("bad_alloc"), std::string::npos) << b.error->what();
  const Output r = collect(*running);
  EXPECT_TRUE(r.error || r.ids[0].size() == 199u);  // ended by the failure, unless it had finished first
  const Output after = run_alone(e, greedy_request("base", random_prompt(12, 10), kPoisoned));
  ASSERT_FALSE(after.error) << after.error->what();
  EXPECT_EQ(after.ids[0].size(), static_cast<size_t>(kPoisoned));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(e.stats().kv_cache_usage, 0.0);
  EXPECT_EQ(e.stats().requests_running, 0);
  EXPECT_EQ(e.stats().requests_waiting, 0);
}

// ---- adapter containment

// A temp folder outside the fixture's (the allowed --adapter-dir).
struct OutsideDir {
  fs::path path;
  explicit OutsideDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("loom_serve_outside_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~OutsideDir() { fs::remove_all(path); }
};

EngineErrc load_error(ServingEngine& e, const std::string& name, const std::string& path, std::string* message) {
  try {
    e.load_adapter(name, path, false);
  } catch (const EngineError& err) {
    if (message) *message = err.what();
    return err.code();
  }
  return EngineErrc::internal;
}

// A file inside --adapter-dir that is a symlink out of it is refused, naming the file; a symlink that
// stays inside is fine.
TEST_F(ServingEngineTest, AdapterFileSymlinkedOutOfTheAllowedFolderIsRefused) {
  const OutsideDir out("a");
  const fs::path& outside = out.path;
  write_random_adapter(outside / "real", 7);
  ServeOptions o = options();
  o.adapter_dirs = {(tmp.path / "allowed").string()};
  fs::create_directories(tmp.path / "allowed");
  ServingEngine e(o);
  const fs::path bad = tmp.path / "allowed" / "bad";
  fs::create_directories(bad);
  fs::copy_file(outside / "real" / "adapter_config.json", bad / "adapter_config.json");
  fs::create_symlink(outside / "real" / "adapter_model.safetensors", bad / "adapter_model.safetensors");
  std::string msg;
  EXPECT_EQ(load_error(e, "bad", bad.string(), &msg), EngineErrc::invalid_request);
  EXPECT_NE(msg.find("adapter_model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("outside the allowed adapter folders"), std::string::npos) << msg;
  EXPECT_EQ(msg.find(outside.string()), std::string::npos) << "the target is not revealed: " << msg;
  // The config file symlinked out: refused as well.
  const fs::path bad2 = tmp.path / "allowed" / "bad2";
  fs::create_directories(bad2);
  fs::create_symlink(outside / "real" / "adapter_config.json", bad2 / "adapter_config.json");
  fs::copy_file(outside / "real" / "adapter_model.safetensors", bad2 / "adapter_model.safetensors");
  EXPECT_EQ(load_error(e, "bad2", bad2.string(), &msg), EngineErrc::invalid_request);
  EXPECT_NE(msg.find("adapter_config.json"), std::string::npos) << msg;
  // A symlink to a file inside the allowed folder loads.
  const fs::path good = tmp.path / "allowed" / "good";
  fs::create_directories(good);
  fs::copy_file(outside / "real" / "adapter_config.json", good / "adapter_config.json");
  fs::copy_file(outside / "real" / "adapter_model.safetensors", tmp.path / "allowed" / "weights.safetensors");
  fs::create_symlink(tmp.path / "allowed" / "weights.safetensors", good / "adapter_model.safetensors");
  EXPECT_NO_THROW(e.load_adapter("good", good.string(), false));
  EXPECT_FALSE(run_alone(e, greedy_request("good", {5, 6, 7}, 3)).error);
  EXPECT_FALSE(e.list_models().empty());
}

// The file is swapped for a symlink after the adapter was loaded: the reload after eviction is refused too.
TEST_F(ServingEngineTest, AdapterReloadAfterEvictionChecksContainmentAgain) {
  const OutsideDir out("b");
  const fs::path& outside = out.path;
  write_random_adapter(outside / "real", 8);
  ServeOptions o = options();
  o.max_loras = 1;
  ServingEngine e(o);
  write_random_adapter(tmp.path / "swap", 9);
  e.load_adapter("swap", (tmp.path / "swap").string(), false);
  EXPECT_FALSE(run_alone(e, greedy_request("swap", {5, 6, 7}, 3)).error);
  EXPECT_FALSE(run_alone(e, greedy_request("a0", {5, 6, 7}, 3)).error);  // evicts "swap" (max_loras 1)
  fs::remove(tmp.path / "swap" / "adapter_model.safetensors");
  fs::create_symlink(outside / "real" / "adapter_model.safetensors", tmp.path / "swap" / "adapter_model.safetensors");
  try {
    const Output out = run_alone(e, greedy_request("swap", {5, 6, 7}, 3));
    ASSERT_TRUE(out.error) << "the reload read a file outside the allowed folder";
    EXPECT_NE(std::string(out.error->what()).find("outside the allowed adapter folders"), std::string::npos);
  } catch (const EngineError& err) {  // refused already at submit (the reload happens there)
    EXPECT_NE(std::string(err.what()).find("outside the allowed adapter folders"), std::string::npos) << err.what();
  }
}

// Writes the adapter of write_random_adapter with one value replaced and/or another lora_alpha.
void write_adapter_with(const fs::path& dir, uint32_t seed, std::optional<float> poison, double alpha = 8) {
  write_random_adapter(dir, seed);
  peft::AdapterTensors ad = peft::read_adapter(dir.string());
  ad.config.lora_alpha = alpha;
  if (poison) ad.pairs.at({1, LoraTarget::v}).b[5] = *poison;
  peft::write_adapter(dir.string(), ad);
}

TEST_F(ServingEngineTest, AdapterWithNonFiniteWeightsOrScaleIsRefused) {
  ServingEngine e(options());
  struct Case {
    std::string name;
    std::optional<float> poison;
    double alpha;
    std::string want;
  };
  const Case cases[] = {
      {"nan", std::numeric_limits<float>::quiet_NaN(), 8, "layers.1.self_attn.v_proj.lora_B.weight"},
      {"inf", -std::numeric_limits<float>::infinity(), 8, "non-finite value"},
      {"huge_alpha", std::nullopt, 1e308, "not a finite float32"},
      {"overflow", 100.0f, 1e37, "beyond float32"},
  };
  for (const Case& c : cases) {
    write_adapter_with(tmp.path / c.name, 20, c.poison, c.alpha);
    std::string msg;
    EXPECT_EQ(load_error(e, c.name, (tmp.path / c.name).string(), &msg), EngineErrc::adapter_load_failed) << c.name;
    EXPECT_NE(msg.find(c.want), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find("adapter '" + c.name + "'"), std::string::npos) << msg;
  }
  // Also at start-up (--adapter).
  ServeOptions o = options();
  o.adapters.push_back({"nan", (tmp.path / "nan").string()});
  EXPECT_THROW(ServingEngine bad(o), EngineError);
  // A sound adapter with a large but finite scale loads.
  write_adapter_with(tmp.path / "big", 21, std::nullopt, 1e4);
  EXPECT_NO_THROW(e.load_adapter("big", (tmp.path / "big").string(), false));
}

}  // namespace
}  // namespace loom

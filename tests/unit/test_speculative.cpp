// Prompt-lookup speculative decoding: the n-gram proposer (model/ngram_proposer.h),
// and exact greedy equality with plain decoding in generate() (InferenceSession:
// tokens, finish reasons and the session's positions afterwards) and in the
// serving engine's batched steps (tokens, text, logprobs, finish, usage), on
// the tiny llama fixtures, whose random weights repeat themselves a lot.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/thread_pool.h"
#include "expect_error.h"
#include "kernels/backend.h"
#include "model/generate.h"
#include "model/model.h"
#include "model/ngram_proposer.h"
#include "model_test_util.h"
#include "serve/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

std::string fixture(const std::string& name) {
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/" + name;
}

std::vector<int32_t> drafts_of(std::vector<int32_t> tokens, int32_t k, int32_t max_n, int32_t min_n,
                               int64_t max_draft = 1 << 20) {
  std::vector<int32_t> out = {-1};  // cleared by the call
  propose_ngram_drafts(tokens, {k, max_n, min_n}, max_draft, out);
  return out;
}

TEST(NgramProposer, LongestSuffixAtItsMostRecentEarlierOccurrence) {
  // [1 2 3] occurs at 0 and 5: the later one is followed by 5 7 1.
  EXPECT_EQ(drafts_of({1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3}, 3, 3, 1), (std::vector<int32_t>{5, 7, 1}));
  // [8 2 3] does not recur; [2 3] does, at 1.
  EXPECT_EQ(drafts_of({1, 2, 3, 8, 2, 3}, 2, 3, 1), (std::vector<int32_t>{8, 2}));
  // Fewer than k tokens follow the occurrence: as many as there are.
  EXPECT_EQ(drafts_of({5, 6, 5}, 4, 3, 1), (std::vector<int32_t>{6, 5}));
}

TEST(NgramProposer, NothingWithoutAMatchOrRoom) {
  EXPECT_TRUE(drafts_of({1, 2, 3, 4}, 4, 3, 1).empty());
  EXPECT_TRUE(drafts_of({1, 2, 9, 1}, 4, 3, 2).empty());  // only the 1-gram [1] recurs
  EXPECT_EQ(drafts_of({1, 2, 9, 1}, 4, 3, 1), (std::vector<int32_t>{2, 9, 1}));
  EXPECT_EQ(drafts_of({1, 2, 9, 1}, 4, 3, 1, /*max_draft=*/1), (std::vector<int32_t>{2}));
  EXPECT_TRUE(drafts_of({1, 2, 9, 1}, 4, 3, 1, /*max_draft=*/0).empty());
  EXPECT_TRUE(drafts_of({1, 2, 9, 1}, 0, 3, 1).empty());  // off
  EXPECT_TRUE(drafts_of({7}, 4, 3, 1).empty());
  EXPECT_TRUE(drafts_of({}, 4, 3, 1).empty());
  // A run of one token: the suffix's latest earlier occurrence overlaps it.
  EXPECT_EQ(drafts_of({4, 4, 4, 4}, 5, 3, 1), (std::vector<int32_t>{4}));
}

TEST(NgramProposer, DraftLengthDoublesOnFullAcceptanceAndShrinksOnRejection) {
  const NgramSpecParams p{8, 3, 2};
  EXPECT_EQ(next_draft_length(p, 2, 2), 4);
  EXPECT_EQ(next_draft_length(p, 5, 5), 8);  // capped at num_draft
  EXPECT_EQ(next_draft_length(p, 0, 8), 1);
  EXPECT_EQ(next_draft_length(p, 3, 8), 4);
}

TEST(NgramProposer, ValidatesItsParameters) {
  EXPECT_NO_THROW(validate_ngram_spec({0, 3, 2}));
  EXPECT_NO_THROW(validate_ngram_spec({5, 1, 1}));
  EXPECT_THROW(validate_ngram_spec({-1, 3, 2}), Error);
  EXPECT_THROW(validate_ngram_spec({65, 3, 2}), Error);
  EXPECT_THROW(validate_ngram_spec({4, 3, 0}), Error);
  EXPECT_THROW(validate_ngram_spec({4, 2, 3}), Error);
}

// Prompts: random, a block repeated (the model's continuation tends to repeat
// it), and a short one.
std::vector<std::vector<int32_t>> test_prompts() {
  std::mt19937 rng(7);
  auto rnd = [&](int n) {
    std::vector<int32_t> p;
    for (int i = 0; i < n; ++i) p.push_back(static_cast<int32_t>(3 + rng() % 250));
    return p;
  };
  std::vector<std::vector<int32_t>> out = {rnd(20), rnd(3)};
  const std::vector<int32_t> block = rnd(9);
  std::vector<int32_t> rep;
  for (int i = 0; i < 4; ++i) rep.insert(rep.end(), block.begin(), block.end());
  out.push_back(rep);
  std::vector<int32_t> quote = rnd(30);  // a passage, then its first half again
  quote.insert(quote.end(), quote.begin(), quote.begin() + 15);
  out.push_back(quote);
  return out;
}

class SpeculativeGenerate : public ::testing::Test {
 protected:
  SpeculativeGenerate()
      : backend(make_backend(kCpu, pool)),
        model(Model::load(fixture("tiny-llama.f32.gguf"),
                          {.tokenizer = true, .pack = true, .backend = backend.get()})) {}

  struct Run {
    GenerateResult r;
    std::string text;
    int64_t n_past = 0;
    std::vector<int32_t> second;  // tokens of a second turn on the same session
    int64_t n_past_second = 0;
  };
  Run run(const std::vector<int32_t>& prompt, GenerateOptions o, int64_t n_ctx = 256) {
    Run out;
    InferenceSession s(model->config(), model->weights(), *backend, n_ctx);
    out.r = generate(s, model->tokenizer(), prompt, o, [&](const std::string& t) {
      out.text += t;
      return true;
    });
    out.n_past = s.n_past();
    // A second turn continues from the session as the first left it (loom chat).
    if (s.n_past() + 8 < n_ctx) {
      GenerateOptions o2 = o;
      o2.max_tokens = 12;
      o2.stop.clear();
      const std::vector<int32_t> more = {5, 6, 7};
      out.second = generate(s, model->tokenizer(), more, o2, [](const std::string&) { return true; }).tokens;
      out.n_past_second = s.n_past();
    }
    return out;
  }

  ThreadPool pool{2};
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

GenerateOptions greedy(int64_t max_tokens) {
  GenerateOptions o;
  o.max_tokens = max_tokens;
  o.sampling.temperature = 0;
  return o;
}

TEST_F(SpeculativeGenerate, SameTokensAsPlainGreedyDecoding) {
  int64_t accepted = 0, drafted = 0;
  for (const auto& prompt : test_prompts()) {
    for (const float penalty : {1.0f, 1.3f}) {
      GenerateOptions plain = greedy(40);
      plain.sampling.repeat_penalty = penalty;
      const Run want = run(prompt, plain);
      for (const NgramSpecParams spec :
           {NgramSpecParams{1, 3, 1}, NgramSpecParams{4, 3, 2}, NgramSpecParams{8, 4, 1}}) {
        GenerateOptions o = plain;
        o.spec = spec;
        const Run got = run(prompt, o);
        SCOPED_TRACE(testing::Message() << "prompt " << prompt.size() << " tokens, k " << spec.num_draft
                                        << ", penalty " << penalty);
        EXPECT_EQ(got.r.tokens, want.r.tokens);
        EXPECT_EQ(got.text, want.text);
        EXPECT_EQ(got.r.finish, want.r.finish);
        EXPECT_EQ(got.n_past, want.n_past);
        EXPECT_EQ(got.second, want.second);
        EXPECT_EQ(got.n_past_second, want.n_past_second);
        EXPECT_LE(got.r.forward_steps, want.r.forward_steps);
        accepted += got.r.accepted_tokens;
        drafted += got.r.draft_tokens;
      }
    }
  }
  EXPECT_GT(drafted, 0);
  EXPECT_GT(accepted, 0) << "no draft was ever accepted: the test exercises nothing";
}

TEST_F(SpeculativeGenerate, CutsExactlyAtMaxTokensStopStringsAndAFullContext) {
  const std::vector<int32_t> prompt = test_prompts()[2];
  const NgramSpecParams spec{6, 3, 1};
  for (const int64_t max_tokens : {0, 1, 2, 5, 17}) {
    GenerateOptions o = greedy(max_tokens);
    const Run want = run(prompt, o);
    o.spec = spec;
    const Run got = run(prompt, o);
    EXPECT_EQ(got.r.tokens, want.r.tokens) << max_tokens;
    EXPECT_EQ(static_cast<int64_t>(got.r.tokens.size()), max_tokens);
    EXPECT_EQ(got.n_past, want.n_past) << max_tokens;
  }
  // A stop string from the middle of the plain output.
  const Run full = run(prompt, greedy(40));
  ASSERT_GT(full.text.size(), 12u);
  GenerateOptions o = greedy(40);
  o.stop = {full.text.substr(full.text.size() / 2, 3)};
  const Run want = run(prompt, o);
  o.spec = spec;
  const Run got = run(prompt, o);
  EXPECT_EQ(got.r.tokens, want.r.tokens);
  EXPECT_EQ(got.text, want.text);
  EXPECT_EQ(got.r.finish, FinishReason::stop);
  EXPECT_EQ(got.n_past, want.n_past);
  // Until the context is full.
  const int64_t n_ctx = static_cast<int64_t>(prompt.size()) + 23;
  GenerateOptions c = greedy(-1);
  const Run want_c = run(prompt, c, n_ctx);
  c.spec = spec;
  const Run got_c = run(prompt, c, n_ctx);
  EXPECT_EQ(got_c.r.tokens, want_c.r.tokens);
  EXPECT_EQ(got_c.r.finish, want_c.r.finish);
  EXPECT_EQ(got_c.n_past, want_c.n_past);
}

// Sampling with speculation: a seed gives the same tokens again; drafts are verified and some kept; the
// first 16 tokens have plain sampling's distribution (1,500 seeds each way, compared position by
// position on the frequent tokens).
TEST_F(SpeculativeGenerate, SamplingKeepsPlainSamplingsDistribution) {
  const std::vector<int32_t> prompt = test_prompts()[2];
  GenerateOptions o = greedy(16);
  o.sampling.temperature = 0.3f;
  o.sampling.top_k = 0;
  o.sampling.top_p = 1.0f;
  o.sampling.min_p = 0.0f;
  const auto tokens = [&](const GenerateOptions& g, int64_t* drafted, int64_t* accepted) {
    InferenceSession s(model->config(), model->weights(), *backend, 128);
    const GenerateResult r = generate(s, model->tokenizer(), prompt, g, [](const std::string&) { return true; });
    if (drafted) *drafted += r.draft_tokens, *accepted += r.accepted_tokens;
    return r.tokens;
  };
  GenerateOptions spec = o;
  spec.spec = {4, 3, 1};
  spec.sampling.seed = 11;
  EXPECT_EQ(tokens(spec, nullptr, nullptr), tokens(spec, nullptr, nullptr));
  constexpr int kSeeds = 1500;
  std::vector<std::map<int32_t, int>> plain_counts(16), spec_counts(16);
  int64_t drafted = 0, accepted = 0;
  for (int seed = 0; seed < kSeeds; ++seed) {
    o.sampling.seed = spec.sampling.seed = static_cast<uint64_t>(seed);
    const auto a = tokens(o, nullptr, nullptr), b = tokens(spec, &drafted, &accepted);
    for (size_t t = 0; t < a.size(); ++t) plain_counts[t][a[t]]++;
    for (size_t t = 0; t < b.size(); ++t) spec_counts[t][b[t]]++;
  }
  EXPECT_GT(drafted, kSeeds);
  EXPECT_GT(accepted, kSeeds / 4) << "few drafts kept: the test exercises little";
  // Per position, every token drawn in at least 3% of the plain runs: the two frequencies within 5
  // standard errors of their difference.
  int compared = 0;
  for (size_t t = 0; t < 16; ++t)
    for (const auto& [id, n] : plain_counts[t]) {
      if (n < kSeeds * 3 / 100) continue;
      const double a = n / static_cast<double>(kSeeds), b = spec_counts[t][id] / static_cast<double>(kSeeds);
      const double m = (a + b) / 2;
      EXPECT_LT(std::abs(a - b), 5 * std::sqrt(2 * m * (1 - m) / kSeeds)) << "position " << t << ", token " << id;
      ++compared;
    }
  EXPECT_GT(compared, 40);
}

// The default model (skipped without it): quoting, code editing and free text, 64 greedy tokens each.
TEST(SpeculativeGenerateDefaultModel, SmolLM2SameTokensAsPlainGreedyDecoding) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not present (run scripts/fetch_model)";
  ThreadPool pool(2);
  const auto backend = make_backend(kCpu, pool);
  const auto model = Model::load(path, {.tokenizer = true, .pack = true, .backend = backend.get()});
  const char* prompts[] = {
      "The lighthouse keeper climbed the stairs at dusk, polished the lens and trimmed the wick.\n\n"
      "The same sentence again, word for word:\n",
      "def total(items):\n    x = 0\n    for i in items:\n        x += i\n    return x\n\n"
      "# The same function with x renamed to acc:\ndef total(items):\n",
      "Here is a short story about a dragon who learns to cook.\n\n"};
  int64_t accepted = 0;
  for (const char* text : prompts) {
    const auto ids = model->tokenizer().encode(text, true, true);
    GenerateOptions o = greedy(64);
    InferenceSession plain_s(model->config(), model->weights(), *backend, 512);
    const auto want = generate(plain_s, model->tokenizer(), ids, o, [](const std::string&) { return true; });
    o.spec = {5, 3, 2};
    InferenceSession spec_s(model->config(), model->weights(), *backend, 512);
    const auto got = generate(spec_s, model->tokenizer(), ids, o, [](const std::string&) { return true; });
    EXPECT_EQ(got.tokens, want.tokens) << text;
    EXPECT_EQ(spec_s.n_past(), plain_s.n_past());
    accepted += got.accepted_tokens;
  }
  EXPECT_GT(accepted, 10);
}

// ---- the serving engine ---------------------------------------------------

struct Served {
  std::vector<int32_t> ids;
  std::string text;
  std::vector<TokenLogprob> logprobs;
  std::optional<FinishKind> finish;
  Usage usage;
  int deltas = 0;
};

Served collect(RequestStream& s) {
  Served o;
  for (;;) {
    auto ev = s.pop(std::chrono::seconds(60));
    if (!ev) {
      ADD_FAILURE() << "no event within 60 s";
      return o;
    }
    if (ev->kind == GenerationEvent::Kind::error) {
      ADD_FAILURE() << (ev->error ? ev->error->what() : "error event");
      return o;
    }
    if (ev->kind == GenerationEvent::Kind::done) {
      o.usage = ev->usage;
      return o;
    }
    ++o.deltas;
    o.ids.insert(o.ids.end(), ev->delta.token_ids.begin(), ev->delta.token_ids.end());
    o.text += ev->delta.text;
    o.logprobs.insert(o.logprobs.end(), ev->delta.logprobs.begin(), ev->delta.logprobs.end());
    if (ev->delta.finish) o.finish = ev->delta.finish;
  }
}

ServeOptions serve_options(const std::string& model, NgramSpecParams spec) {
  ServeOptions o;
  o.model_path = fixture(model);
  o.model_name = "base";
  o.threads = 2;
  o.max_batch_tokens = 64;
  o.max_model_len = 256;
  o.spec = spec;
  o.spec_max_batch = 0;  // drafts in every step, however many sequences share it
  return o;
}

// The requests: greedy with and without logprobs, stop strings and token limits.
std::vector<GenerationRequest> serve_requests() {
  std::vector<GenerationRequest> out;
  int i = 0;
  for (const auto& p : test_prompts()) {
    GenerationRequest g = test::greedy_request("base", p, 48);
    g.ignore_eos = false;
    if (i % 2 == 1) {
      g.logprobs = true;
      g.top_logprobs = 3;
    }
    out.push_back(g);
    g.max_tokens = 1 + 3 * i;  // cut inside an accepted run
    out.push_back(g);
    ++i;
  }
  return out;
}

Served run_alone(ServingEngine& e, const GenerationRequest& g) {
  auto s = std::make_shared<RequestStream>();
  e.submit(g, s);
  return collect(*s);
}

void expect_same(const Served& got, const Served& want) {
  EXPECT_EQ(got.ids, want.ids);
  EXPECT_EQ(got.text, want.text);
  EXPECT_EQ(got.finish, want.finish);
  EXPECT_EQ(got.usage.completion_tokens, want.usage.completion_tokens);
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
  for (size_t t = 0; t < got.logprobs.size(); ++t) {
    EXPECT_EQ(got.logprobs[t].token_id, want.logprobs[t].token_id);
    EXPECT_EQ(got.logprobs[t].logprob, want.logprobs[t].logprob) << "token " << t;
    ASSERT_EQ(got.logprobs[t].top.size(), want.logprobs[t].top.size());
    for (size_t j = 0; j < got.logprobs[t].top.size(); ++j)
      EXPECT_EQ(got.logprobs[t].top[j].logprob, want.logprobs[t].top[j].logprob);
  }
}

class SpeculativeServe : public ::testing::TestWithParam<std::string> {};

// Each request alone and all at once on a speculating server give what a plain server gives alone, bit for
// bit (logprobs included); drafts were accepted; the cache is empty afterwards.
TEST_P(SpeculativeServe, SameOutputsAsPlainDecodingAloneAndBatched) {
  ServingEngine plain(serve_options(GetParam(), {}));
  ServingEngine spec(serve_options(GetParam(), {5, 3, 1}));
  const auto reqs = serve_requests();
  std::vector<Served> want;
  for (const auto& g : reqs) want.push_back(run_alone(plain, g));
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "alone, request " << i);
    expect_same(run_alone(spec, reqs[i]), want[i]);
  }
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& g : reqs) {
    streams.push_back(std::make_shared<RequestStream>());
    spec.submit(g, streams.back());
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "batched, request " << i);
    const Served got = collect(*streams[i]);
    expect_same(got, want[i]);
  }
  EXPECT_GT(spec.spec_draft_tokens(), 0);
  EXPECT_GT(spec.spec_accepted_tokens(), 0);
  EXPECT_EQ(plain.spec_draft_tokens(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(spec.stats().kv_cache_usage, 0.0);
}

// Sampled requests speculate too (their tokens keep plain sampling's distribution, not its draws:
// SpeculativeGenerate.SamplingKeepsPlainSamplingsDistribution): drafts are verified and some kept, and a
// seeded request served alone twice gives the same tokens.
TEST_P(SpeculativeServe, SampledRequestsSpeculate) {
  ServingEngine spec(serve_options(GetParam(), {4, 3, 1}));
  GenerationRequest g = test::greedy_request("base", test_prompts()[2], 32);
  g.sampling.temperature = 0.3f;
  g.sampling.top_k = 0;
  g.sampling.top_p = 1.0f;
  g.sampling.min_p = 0.0f;
  std::vector<Served> runs;
  for (uint64_t seed : {5u, 5u, 6u, 7u, 8u, 9u}) {
    g.seed = seed;
    runs.push_back(run_alone(spec, g));
  }
  expect_same(runs[1], runs[0]);
  EXPECT_GT(spec.spec_draft_tokens(), 0);
  EXPECT_GT(spec.spec_accepted_tokens(), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SpeculativeServe,
                         ::testing::Values("tiny-llama.f32.gguf", "tiny-llama.q4_1.gguf"));

// A small KV cache: preempted speculating sequences still give the plain tokens, and drafts never take the
// blocks admission keeps free.
TEST(SpeculativeServeSmallCache, PreemptionKeepsTheOutputs) {
  ServeOptions po = serve_options("tiny-llama.f32.gguf", {});
  ServingEngine plain(po);
  ServeOptions so = serve_options("tiny-llama.f32.gguf", {8, 3, 1});
  so.max_model_len = 128;
  so.block_size = 4;
  so.kv_cache_memory = KvPool::bytes_per_block(plain.model().config(), 4, so.kv_dtype) * 48;
  so.max_seqs = 12;
  ServingEngine spec(so);
  std::mt19937 rng(3);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> p;
    for (int t = 0; t < 6; ++t) p.push_back(static_cast<int32_t>(3 + rng() % 200));
    p.insert(p.end(), p.begin(), p.end());  // repeated once: drafts from the start
    reqs.push_back(test::greedy_request("base", p, 40));
  }
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& g : reqs) {
    streams.push_back(std::make_shared<RequestStream>());
    spec.submit(g, streams.back());
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "request " << i);
    expect_same(collect(*streams[i]), run_alone(plain, reqs[i]));
  }
  EXPECT_GT(spec.preemptions(), 0) << "the test meant to force preemption";
  EXPECT_GT(spec.spec_accepted_tokens(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(spec.stats().kv_cache_usage, 0.0);
}

}  // namespace
}  // namespace loom

// /v1/embeddings: the request parsing and response JSON (serve/openai_protocol.h),
// and the engine's vectors on the tiny llama: the mean of the final-norm hidden
// states InferenceSession computes (taken independently through its layer
// hook), L2-normalized; bit-identical alone, chunked or batched with other
// requests; typed errors for empty and over-long inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model_test_util.h"
#include "serve/openai_protocol.h"
#include "serve/scheduler.h"

namespace loom {
namespace {

using json = nlohmann::json;

const std::vector<std::string> kModels = {"base", "tuned"};

std::vector<GenerationRequest> parse(const std::string& body, bool* base64 = nullptr) {
  bool b = false;
  auto r = parse_embeddings_request(body, ProtocolLimits{}, kModels, b);
  if (base64) *base64 = b;
  return r;
}

void expect_400(const std::string& body, const std::string& param) {
  try {
    parse(body);
    ADD_FAILURE() << "accepted: " << body;
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400) << body;
    EXPECT_EQ(e.param(), param) << body << ": " << e.what();
  }
}

TEST(EmbeddingsProtocol, EveryInputShape) {
  auto one = parse(R"({"input":"hello","model":"tuned"})");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].kind, RequestKind::embedding);
  EXPECT_EQ(one[0].model, "tuned");
  EXPECT_EQ(one[0].prompt.text, "hello");
  auto strings = parse(R"({"input":["a","b","c"]})");
  ASSERT_EQ(strings.size(), 3u);
  EXPECT_EQ(strings[0].model, "base");  // absent: the base model
  for (int i = 0; i < 3; ++i) EXPECT_EQ(strings[static_cast<size_t>(i)].first_choice_index, i);
  auto ids = parse(R"({"input":[1,2,3]})");
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_TRUE(ids[0].prompt.is_tokens);
  EXPECT_EQ(ids[0].prompt.tokens, (std::vector<int32_t>{1, 2, 3}));
  auto lists = parse(R"({"input":[[1,2],[3]]})");
  ASSERT_EQ(lists.size(), 2u);
  EXPECT_EQ(lists[1].prompt.tokens, (std::vector<int32_t>{3}));
  bool b64 = true;
  parse(R"({"input":"x","encoding_format":"float"})", &b64);
  EXPECT_FALSE(b64);
  parse(R"({"input":"x","encoding_format":"base64"})", &b64);
  EXPECT_TRUE(b64);
}

TEST(EmbeddingsProtocol, BadRequestsName400Fields) {
  expect_400(R"({"model":"base"})", "input");
  expect_400(R"({"input":""})", "input");
  expect_400(R"({"input":["a",""]})", "input");
  expect_400(R"({"input":[]})", "input");
  expect_400(R"({"input":[[]]})", "input");
  expect_400(R"({"input":[-1]})", "input");
  expect_400(R"({"input":7})", "input");
  expect_400(R"({"input":"x","encoding_format":"int8"})", "encoding_format");
  expect_400(R"({"input":"x","dimensions":64})", "dimensions");
  try {
    parse(R"({"input":"x","model":"nope"})");
    ADD_FAILURE();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 404);
  }
}

std::vector<uint8_t> base64_decode(const std::string& s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::vector<uint8_t> out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    const int v = val(c);
    if (v < 0) break;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<uint8_t>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

TEST(EmbeddingsProtocol, ResponseInFloatsAndBase64) {
  const std::vector<std::vector<float>> v = {{0.5f, -0.25f, 1e-8f}, {3.0f, 0.0f, -1.0f}, {1.0f, 2.0f, 3.0f}};
  const json f = embeddings_response(v, false, "base", 12);
  EXPECT_EQ(f["object"], "list");
  EXPECT_EQ(f["model"], "base");
  EXPECT_EQ(f["usage"]["prompt_tokens"], 12);
  EXPECT_EQ(f["usage"]["total_tokens"], 12);
  ASSERT_EQ(f["data"].size(), 3u);
  EXPECT_EQ(f["data"][1]["object"], "embedding");
  EXPECT_EQ(f["data"][1]["index"], 1);
  EXPECT_EQ(f["data"][0]["embedding"].get<std::vector<float>>(), v[0]);
  const json b = embeddings_response(v, true, "base", 12);
  for (size_t i = 0; i < v.size(); ++i) {
    const auto bytes = base64_decode(b["data"][i]["embedding"].get<std::string>());
    ASSERT_EQ(bytes.size(), 12u);
    std::vector<float> back(3);
    std::memcpy(back.data(), bytes.data(), 12);
    EXPECT_EQ(back, v[i]);
  }
}

// ---- the engine -----------------------------------------------------------

const std::string kTiny = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/tiny-llama.f32.gguf";

GenerationRequest embedding_request(std::vector<int32_t> tokens) {
  GenerationRequest g;
  g.kind = RequestKind::embedding;
  g.model = "base";
  g.prompt.is_tokens = true;
  g.prompt.tokens = std::move(tokens);
  return g;
}

struct Embedded {
  std::vector<float> v;
  Usage usage;
};

Embedded collect(RequestStream& s) {
  Embedded out;
  for (;;) {
    auto ev = s.pop(std::chrono::seconds(60));
    if (!ev) {
      ADD_FAILURE() << "no event within 60 s";
      return out;
    }
    if (ev->kind == GenerationEvent::Kind::error) {
      ADD_FAILURE() << (ev->error ? ev->error->what() : "error");
      return out;
    }
    if (ev->kind == GenerationEvent::Kind::done) {
      out.usage = ev->usage;
      return out;
    }
    EXPECT_TRUE(ev->delta.token_ids.empty());
    EXPECT_EQ(ev->delta.finish, FinishKind::stop);
    out.v = ev->delta.embedding;
  }
}

Embedded embed(ServingEngine& e, std::vector<int32_t> tokens) {
  auto s = std::make_shared<RequestStream>();
  e.submit(embedding_request(std::move(tokens)), s);
  return collect(*s);
}

std::vector<int32_t> random_tokens(uint32_t seed, int n) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(3 + rng() % 250));
  return t;
}

// The residual stream leaving the last layer, as InferenceSession's layer hook sees it.
class LastResidual final : public LayerAdapters {
 public:
  explicit LastResidual(int64_t n_layers, int64_t hidden) : n_layers_(n_layers), hidden_(hidden) {}
  void apply(int64_t, std::span<const AdapterJob>) override {}
  void residual(int64_t layer, const float* x, int64_t T) override {
    if (layer == n_layers_) rows.insert(rows.end(), x, x + T * hidden_);
  }
  std::vector<float> rows;

 private:
  int64_t n_layers_, hidden_;
};

// RMSNorm with the output norm's weights, mean over positions, L2 normalization, all in double.
std::vector<double> reference_embedding(const Model& m, Backend& backend,
                                        const std::vector<int32_t>& tokens) {
  const ModelConfig& c = m.config();
  InferenceSession s(c, m.weights(), backend, 256, DType::f32, /*micro_batch=*/32);
  LastResidual hook(c.n_layers, c.hidden);
  s.set_layer_hook(&hook);
  s.eval(tokens);
  const int64_t H = c.hidden, T = static_cast<int64_t>(tokens.size());
  std::vector<double> mean(static_cast<size_t>(H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const float* x = hook.rows.data() + t * H;
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(x[i]) * x[i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(H) + c.rms_eps);
    for (int64_t i = 0; i < H; ++i) mean[static_cast<size_t>(i)] += x[i] * r * m.weights().output_norm[i] / T;
  }
  double norm = 0;
  for (double v : mean) norm += v * v;
  for (double& v : mean) v /= std::sqrt(norm);
  return mean;
}

ServeOptions options() {
  ServeOptions o;
  o.model_path = kTiny;
  o.model_name = "base";
  o.threads = 2;
  o.max_batch_tokens = 64;
  o.max_model_len = 200;
  o.kv_dtype = DType::f32;
  return o;
}

TEST(EmbeddingsEngine, MeanPooledFinalNormHiddenStatesL2Normalized) {
  ServingEngine e(options());
  ThreadPool pool(2);
  const auto backend = make_backend(kCpu, pool);
  const auto m = Model::load(kTiny, {.tokenizer = false, .pack = true, .backend = backend.get()});
  for (const int n : {1, 5, 63, 64, 150, 200}) {  // 150 and 200: prefilled in several chunks
    SCOPED_TRACE(n);
    const auto tokens = random_tokens(static_cast<uint32_t>(n), n);
    const Embedded got = embed(e, tokens);
    const auto want = reference_embedding(*m, *backend, tokens);
    ASSERT_EQ(got.v.size(), want.size());
    double norm = 0, err = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      norm += static_cast<double>(got.v[i]) * got.v[i];
      err = std::max(err, std::fabs(got.v[i] - want[i]));
    }
    EXPECT_NEAR(norm, 1.0, 1e-5);
    EXPECT_LT(err, 2e-5);  // paged vs contiguous attention: another summation order
    EXPECT_EQ(got.usage.prompt_tokens, n);
    EXPECT_EQ(got.usage.completion_tokens, 0);
  }
}

// Embeddings alone equal embeddings batched with each other and with generation requests, bit for bit;
// the generations are unchanged too; no block stays in use.
TEST(EmbeddingsEngine, BatchInvariant) {
  ServingEngine e(options());
  std::vector<std::vector<int32_t>> inputs;
  for (int i = 0; i < 6; ++i) inputs.push_back(random_tokens(40 + i, 7 + 23 * i));
  std::vector<Embedded> alone;
  for (const auto& t : inputs) alone.push_back(embed(e, t));
  const auto gen = test::greedy_request("base", random_tokens(99, 12), 30);
  const auto gen_alone = test::serve_greedy_ids(e, "base", gen.prompt.tokens, 30);

  std::vector<std::shared_ptr<RequestStream>> streams, gens;
  for (int g = 0; g < 2; ++g) {
    gens.push_back(std::make_shared<RequestStream>());
    e.submit(gen, gens.back());
  }
  for (const auto& t : inputs) {
    streams.push_back(std::make_shared<RequestStream>());
    e.submit(embedding_request(t), streams.back());
  }
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_EQ(collect(*streams[i]).v, alone[i].v) << "input " << i;
  for (auto& s : gens) {
    std::vector<int32_t> ids;
    for (;;) {
      auto ev = s->pop(std::chrono::seconds(60));
      ASSERT_TRUE(ev);
      if (ev->kind != GenerationEvent::Kind::delta) break;
      ids.insert(ids.end(), ev->delta.token_ids.begin(), ev->delta.token_ids.end());
    }
    EXPECT_EQ(ids, gen_alone);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(e.stats().kv_cache_usage, 0.0);
}

TEST(EmbeddingsEngine, EmptyAndOverLongInputsAreRefusedNamingInput) {
  ServingEngine e(options());
  auto s = std::make_shared<RequestStream>();
  try {
    e.submit(embedding_request({}), s);
    ADD_FAILURE();
  } catch (const EngineError& err) {
    EXPECT_EQ(err.code(), EngineErrc::invalid_request);
    EXPECT_EQ(err.param(), "input");
  }
  try {
    e.submit(embedding_request(random_tokens(1, 201)), s);
    ADD_FAILURE();
  } catch (const EngineError& err) {
    EXPECT_EQ(err.code(), EngineErrc::context_length_exceeded);
    EXPECT_EQ(err.param(), "input");
  }
  EXPECT_EQ(embed(e, random_tokens(1, 200)).v.size(), 64u);  // max_model_len itself fits
}

}  // namespace
}  // namespace loom

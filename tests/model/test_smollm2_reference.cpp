// The default model against transformers: SmolLM2-135M-Instruct with its Q4_1
// weights expanded to f32 must give transformers' f32 logits (1e-3 relative,
// max|a-b| / max|b|) and the same 64-token greedy continuations; the tokenizer
// must give the same prompt ids. Fixtures: tests/fixtures/model/smollm2/.
#include <gtest/gtest.h>

#include "core/thread_pool.h"
#include "kernels/backend.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/forward.h"
#include "model/model.h"
#include "model/sampler.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

const std::string kRoot = std::string(LOOM_SOURCE_DIR) + "/";
const std::string kFixtures = kRoot + "tests/fixtures/model/";

std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const auto n = static_cast<size_t>(in.tellg());
  std::vector<float> v(n / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n));
  return v;
}

TEST(SmolLM2Reference, F32LogitsTokensAndGreedyMatchTransformers) {
  std::ifstream in(kFixtures + "smollm2/manifest.json");
  const auto m = nlohmann::json::parse(in);
  const std::string model_path = kRoot + m["model"]["path"].get<std::string>();
  if (!std::ifstream(model_path).good())
    GTEST_SKIP() << model_path << " is missing: run scripts/fetch_model (scripts/test does)";
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = Model::load(model_path, {.tokenizer = true, .backend = &backend, .dequantize = true});
  const auto V = static_cast<size_t>(model->config().vocab_size);
  const double min_margin = 0.05;
  for (const auto& p : m["prompts"]) {
    SCOPED_TRACE(p["name"].get<std::string>());
    const auto ids = p["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(model->tokenizer().encode(p["text"].get<std::string>(), true, true), ids);
    InferenceSession s(model->config(), model->weights(), backend, 512);  // the f16 KV cache users run
    s.eval(ids, /*all_logits=*/true);
    for (const auto& l : p["logits"]) {
      const auto want = read_f32(kFixtures + l["file"].get<std::string>());
      ASSERT_EQ(want.size(), V);
      const float* got = s.logits().data() + l["position"].get<size_t>() * V;
      double num = 0, den = 0;
      for (size_t i = 0; i < V; ++i) {
        num = std::max(num, std::fabs(static_cast<double>(got[i]) - want[i]));
        den = std::max(den, std::fabs(static_cast<double>(want[i])));
      }
      EXPECT_LT(num / den, 1e-3) << "position " << l["position"];
    }
    // Greedy continuation through the decode path.
    SamplingParams sp;
    sp.temperature = 0;
    Sampler sampler(sp, s.vocab_size());
    const auto want = p["greedy"]["ids"].get<std::vector<int32_t>>();
    const auto margins = p["greedy"]["margins"].get<std::vector<double>>();
    const float* logits = s.logits().data() + (ids.size() - 1) * V;
    for (size_t i = 0; i < want.size(); ++i) {
      const int32_t id = sampler.sample(logits, {});
      if (id != want[i]) {
        std::printf("[ smollm2 greedy ] %s: diverges at token %zu (reference margin %.4f)\n",
                    p["name"].get<std::string>().c_str(), i, margins[i]);
        EXPECT_LT(margins[i], min_margin) << "greedy token " << i << ": " << id << " vs " << want[i];
        break;
      }
      if (i + 1 == want.size()) std::printf("[ smollm2 greedy ] %s: all %zu tokens identical\n",
                                            p["name"].get<std::string>().c_str(), want.size());
      logits = s.eval(std::span<const int32_t>(&id, 1));
    }
  }
}

}  // namespace
}  // namespace loom

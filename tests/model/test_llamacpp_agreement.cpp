// The quantized path against llama.cpp: greedy continuations of the default
// Q4_1 model (16 tokens) must equal llama.cpp's (llama-simple) text, except at
// steps where the top two logits are so close that the different rounding of
// the two implementations can swap them (reported with the margin).
// Fixture: scripts/fixtures/make_llamacpp_fixtures.sh.
#include <gtest/gtest.h>

#include "core/thread_pool.h"
#include "kernels/backend.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "model/forward.h"
#include "model/model.h"
#include "model/sampler.h"
#include "tokenizer/tokenizer.h"
#include "greedy_agreement.h"

namespace loom {
namespace {

const std::string kRoot = std::string(LOOM_SOURCE_DIR) + "/";

TEST(LlamaCppAgreement, GreedyQ4_1MatchesLlamaCpp) {
  std::ifstream in(kRoot + "tests/fixtures/llamacpp/greedy_q4_1.json");
  const auto fx = nlohmann::json::parse(in);
  const std::string model_path = kRoot + fx["model"].get<std::string>();
  if (!std::ifstream(model_path).good())
    GTEST_SKIP() << model_path << " is missing: run scripts/fetch_model (scripts/test does)";
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto model = Model::load(model_path, {.tokenizer = true, .backend = &backend});
  const GreedyAgreement a =
      expect_greedy_agreement(*model, backend, fx["cases"], fx["n_predict"].get<int>(), "Q4_1");
  RecordProperty("exact_matches", a.exact);
}

}  // namespace
}  // namespace loom

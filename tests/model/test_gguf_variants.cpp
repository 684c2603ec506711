// The default model in every llama.cpp file type loom reads, made by
// llama-quantize (scripts/make_gguf_variants, which scripts/test runs): each file
// loads and its greedy continuations agree with llama.cpp's on the same file for
// 16 tokens, except at near ties (greedy_agreement.h); most prompts (60% over all
// files) agree exactly. Each file also trains two LoRA steps.
//
// Without models/variants/ the test skips, unless LOOM_REQUIRE_GGUF_VARIANTS=1
// (set by scripts/test), where a missing file fails.
#include <gtest/gtest.h>

#include "kernels/backend.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "greedy_agreement.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
const std::string kRoot = std::string(LOOM_SOURCE_DIR) + "/";

// Quantized files: how far a float-level difference between two programs moves the top-2
// margin (see the test). Measured on these files: llama.cpp's own AVX2 and AVX-512 builds
// give different continuations for 44 of the 156 prompts; against the AVX2 build loom's
// divergences are at margins up to 1.02 (IQ4_NL, a token where llama.cpp's two builds
// disagree with each other), against the AVX-512 build up to 0.42; rounding the KV cache
// to f16 alone (as llama.cpp does and this test does not) moves the margins by up to 1.43
// (Q4_K_S; mean 0.11-0.19 per token, over the cases' tokens).
constexpr float kQuantizedNearTie = 1.5f;
// Prompts identical for all 16 tokens, over all files: loom 104 of 156 against llama.cpp's
// AVX-512 build and 109 against its AVX2 build; the two builds agree on 112 (measured before
// IQ1_S and IQ1_M joined: with them 107 and 112 of 168, the IQ1 files 3 of 12 against either
// build, their models near ties everywhere; variants_kld checks them per file). A different
// quantization of the same weights (each file against a neighbouring type's continuations,
// Q4_0 against Q4_1's, IQ3_S against IQ3_XXS's) agrees on 40 of 138. Per file, 6 prompts
// cannot tell these apart (1-6 identical against 1-3), nor a kernel error that moves every
// weight of one group in eight by a scale step (it passed here): tests/cli/variants_kld_test.sh
// compares each file's next-token distributions with llama.cpp's, which does.
constexpr double kMinExactShare = 0.6;
// Tokens before the divergences, per file: at least a quarter. Measured 45-96 of 96 (Q2_K
// lowest) and 25-74 against a neighbouring type's continuations; a file whose type is
// decoded wrongly diverges within the first tokens.
constexpr double kMinAgreedShare = 0.25;

bool required() {
  const char* v = std::getenv("LOOM_REQUIRE_GGUF_VARIANTS");
  return v != nullptr && std::string(v) == "1";
}

nlohmann::json variants_or_skip() {
  std::ifstream in(kRoot + "models/variants/llamacpp_greedy.json");
  if (!in) return nullptr;
  return nlohmann::json::parse(in);
}

#define LOAD_VARIANTS_OR_SKIP(fx)                                                                  \
  const auto fx = variants_or_skip();                                                              \
  if (fx.is_null()) {                                                                              \
    if (required()) FAIL() << "models/variants/llamacpp_greedy.json is missing: run scripts/make_gguf_variants"; \
    GTEST_SKIP() << "models/variants/ is missing: run scripts/make_gguf_variants (scripts/test does)"; \
  }

TEST(GgufVariants, EveryFileTypeAgreesWithLlamaCpp) {
  LOAD_VARIANTS_OR_SKIP(fx);
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  std::set<std::string> types;
  int exact = 0, cases = 0;
  for (const auto& f : fx["files"]) {
    const std::string t = f["file_type"];
    types.insert(t);
    auto model = Model::load(kRoot + f["path"].get<std::string>(), {.tokenizer = true, .backend = &backend});
    // F16/BF16 multiply f32 activations: the two implementations differ by float
    // rounding only, so a near tie is a near tie. The quantized types round every
    // matmul input to 8 bits, and that rounding turns float-level differences into
    // logit changes: a 1-ulp change of every attention-norm weight moves the Q4_1
    // logits by 0.2-0.9 (measured), and loom's and llama.cpp's attention differ by more
    // than that (f16 K/V and Q in llama.cpp). There a divergence must be at a top-2
    // margin below kQuantizedNearTie; both are about equally close to the exact
    // product of the same weights (see docs/architecture.md).
    const bool f32_act = t == "F16" || t == "BF16";
    const float near_tie = f32_act ? kNearTie : kQuantizedNearTie;
    const GreedyAgreement a =
        expect_greedy_agreement(*model, backend, f["cases"], fx["n_predict"].get<int>(), t, near_tie);
    EXPECT_GE(a.agreed, kMinAgreedShare * a.tokens) << t;
    exact += a.exact;
    cases += static_cast<int>(f["cases"].size());
  }
  std::printf("[ llama.cpp agreement ] all variants: %d of %d prompts identical\n", exact, cases);
  EXPECT_GE(exact, kMinExactShare * cases);
  if (required()) {
    for (const char* t :
         {"Q4_0",    "Q4_1",   "Q5_0",   "Q5_1",   "Q8_0",    "Q2_K",   "Q3_K_S", "Q3_K_M", "Q3_K_L",
          "Q4_K_S",  "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",    "IQ4_NL", "IQ4_XS", "F16",    "BF16",
          "IQ2_XXS", "IQ2_XS", "IQ2_S",  "IQ2_M",  "IQ3_XXS", "IQ3_XS", "IQ3_S",  "IQ3_M",  "IQ1_S",
          "IQ1_M"})
      EXPECT_TRUE(types.count(t)) << t << " is not in models/variants/llamacpp_greedy.json";
  }
}

TEST(GgufVariants, EveryFileTypeTrainsTwoSteps) {
  LOAD_VARIANTS_OR_SKIP(fx);
  const fs::path tmp = fs::temp_directory_path() / ("loom_variants_" + std::to_string(::getpid()));
  for (const auto& f : fx["files"]) {
    const std::string t = f["file_type"];
    SCOPED_TRACE(t);
    const std::string yaml = fmt::format(
        "model: {}\ndata:\n  train: {}\n  seq_len: 64\nlora:\n  r: 4\noptim:\n  lr: 1e-3\n"
        "batch_size: 1\nsteps: 2\noutput_dir: {}\nseed: 1\nthreads: 2\n",
        kRoot + f["path"].get<std::string>(), kRoot + "tests/fixtures/train_data/text.jsonl",
        (tmp / t).string());
    const TrainResult r = run_training(parse_train_config(yaml, "variants.yaml"), nullptr);
    ASSERT_EQ(r.step_losses.size(), 2u);
    for (double l : r.step_losses) EXPECT_TRUE(std::isfinite(l)) << l;
  }
  fs::remove_all(tmp);
}

}  // namespace
}  // namespace loom

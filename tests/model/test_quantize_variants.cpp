// `loom quantize` against llama-quantize on the default model: for every file
// type scripts/make_gguf_variants made with llama-quantize --allow-requantize
// from models/SmolLM2-135M-Instruct.Q4_1.gguf, loom's quantize_gguf of the same
// file gives the same tensors in the same order, each of the same type, with
// byte-identical data, and the llama-quantize metadata keys; and the same with
// llama-imatrix's importance matrix (models/variants/imatrix.gguf) for the files
// llama-quantize --imatrix made from it (the .imatrix.gguf files, and the IQ3 grid
// files, which it makes with the matrix only).
//
// Without models/variants/ the test skips, unless LOOM_REQUIRE_GGUF_VARIANTS=1
// (set by scripts/test), where a missing file fails.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include "io/gguf.h"
#include "model/gguf_export.h"
#include "quant/gguf_quantize.h"
#include "quant/imatrix.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
const std::string kRoot = std::string(LOOM_SOURCE_DIR) + "/";
const std::string kSource = kRoot + "models/SmolLM2-135M-Instruct.Q4_1.gguf";

bool required() {
  const char* v = std::getenv("LOOM_REQUIRE_GGUF_VARIANTS");
  return v != nullptr && std::string(v) == "1";
}

// Quantizes the source as `type` (with the importance matrix when given) and
// compares every tensor and the file size with llama-quantize's file `ref_path`.
void expect_equals_llama_quantize(const std::string& type, const std::string& ref_path, const std::string& imatrix) {
  if (!fs::exists(ref_path) || !fs::exists(kSource)) {
    if (required()) FAIL() << ref_path << " is missing: run scripts/make_gguf_variants";
    GTEST_SKIP() << ref_path << " is missing: run scripts/make_gguf_variants (scripts/test does)";
  }
  const auto src = gguf::File::open(kSource);
  const auto ref = gguf::File::open(ref_path);
  GgufQuantizeOptions opt;
  opt.plan.file_type = *file_type_from_name(type);
  opt.allow_requantize = true;
  std::map<std::string, std::vector<float>> importance;
  if (!imatrix.empty()) {
    const Imatrix m = load_imatrix(imatrix);
    importance = m.importance();
    opt.importance = &importance;
    opt.plan.has_imatrix = true;
    opt.imatrix_file = imatrix;
    opt.imatrix_datasets = m.datasets;
    opt.imatrix_chunks = m.chunk_count;
  }
  const std::string out = (fs::temp_directory_path() / ("loom_quantize_" + type + "_" + std::to_string(getpid()) +
                                                         ".gguf")).string();
  ThreadPool pool(2);
  const QuantizeSummary s = quantize_gguf(pool, gguf_source_of(*src), out, opt, nullptr);
  const auto got = gguf::File::open(out);
  ASSERT_EQ(got->tensors().size(), ref->tensors().size());
  int64_t mismatched = 0;
  for (size_t i = 0; i < ref->tensors().size(); ++i) {
    const auto& r = ref->tensors()[i];
    const auto& g = got->tensors()[i];
    ASSERT_EQ(g.name, r.name) << "tensor " << i << " (llama-quantize's order)";
    EXPECT_EQ(dtype_name(g.dtype), std::string(dtype_name(r.dtype))) << r.name;
    if (g.dtype != r.dtype || g.nbytes != r.nbytes) {
      ++mismatched;
      continue;
    }
    if (std::memcmp(g.data, r.data, r.nbytes) != 0) {
      ++mismatched;
      size_t at = 0;
      while (g.data[at] == r.data[at]) ++at;
      ADD_FAILURE() << type << " " << r.name << " (" << dtype_name(r.dtype) << "): bytes differ from offset " << at
                    << " of " << r.nbytes;
    }
  }
  EXPECT_EQ(mismatched, 0) << type;
  EXPECT_EQ(got->get_uint("general.file_type"), ref->get_uint("general.file_type"));
  EXPECT_EQ(got->get_uint("general.quantization_version"), ref->get_uint("general.quantization_version"));
  EXPECT_EQ(got->get_string("tokenizer.ggml.model"), ref->get_string("tokenizer.ggml.model"));
  if (!imatrix.empty()) {
    EXPECT_EQ(got->get_uint("quantize.imatrix.entries_count"), ref->get_uint("quantize.imatrix.entries_count"));
    EXPECT_EQ(got->get_uint("quantize.imatrix.chunks_count"), ref->get_uint("quantize.imatrix.chunks_count"));
    EXPECT_TRUE(s.without_importance.empty() || s.without_importance == std::vector<std::string>{"token_embd.weight"});
  } else {
    EXPECT_EQ(static_cast<uint64_t>(fs::file_size(out)), static_cast<uint64_t>(fs::file_size(ref_path)));
  }
  EXPECT_GT(s.bytes_out, 0u);
  fs::remove(out);
}

class QuantizeVariants : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizeVariants, EqualsLlamaQuantizeByteForByte) {
  const std::string type = GetParam();
  expect_equals_llama_quantize(type, kRoot + "models/variants/SmolLM2-135M-Instruct." + type + ".gguf", "");
}

class QuantizeVariantsImatrix : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizeVariantsImatrix, EqualsLlamaQuantizeWithTheSameImportanceMatrix) {
  const std::string type = GetParam();
  expect_equals_llama_quantize(type, kRoot + "models/variants/SmolLM2-135M-Instruct." + type + ".imatrix.gguf",
                               kRoot + "models/variants/imatrix.gguf");
}

// The grid files scripts/make_gguf_variants makes with the importance matrix
// (SmolLM2's 576-wide rows fall back to iq4_nl; only ffn_down, 1536 wide, takes the grids).
class QuantizeVariantsGrid : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizeVariantsGrid, EqualsLlamaQuantizeWithTheImportanceMatrix) {
  const std::string type = GetParam();
  expect_equals_llama_quantize(type, kRoot + "models/variants/SmolLM2-135M-Instruct." + type + ".gguf",
                               kRoot + "models/variants/imatrix.gguf");
}

INSTANTIATE_TEST_SUITE_P(FileTypes, QuantizeVariantsGrid,
                         ::testing::Values("IQ3_XS", "IQ3_S", "IQ3_M", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS",
                                           "IQ1_S", "IQ1_M"),
                         [](const auto& info) { return std::string(info.param); });

INSTANTIATE_TEST_SUITE_P(FileTypes, QuantizeVariantsImatrix,
                         ::testing::Values("Q4_0", "Q5_1", "Q2_K", "Q3_K_S", "Q4_K_M", "Q6_K", "IQ4_NL",
                                           "IQ4_XS"),
                         [](const auto& info) { return std::string(info.param); });

INSTANTIATE_TEST_SUITE_P(FileTypes, QuantizeVariants,
                         ::testing::Values("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M",
                                           "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL",
                                           "IQ4_XS", "F16", "BF16"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace loom

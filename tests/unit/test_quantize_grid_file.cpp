// `loom quantize` to the IQ file types on the battery's tiny model (hidden 256,
// so the grids apply; tests/fixtures/gguf_battery/tiny.F16.gguf): IQ3_XS needs an
// importance entry for every iq3_xxs tensor and says which one is missing, as
// llama-quantize does; with one it writes llama-quantize's mix, which loads, and
// every IQ type's logits stay as near the f16 model's as llama-quantize's own. Byte equality with llama-quantize is
// tests/unit/test_quantize.cpp (rows) and tests/model/test_quantize_variants.cpp
// (whole files).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <utility>
#include <vector>

#include "expect_error.h"
#include "io/gguf.h"
#include "kernels/backend.h"
#include "model/forward.h"
#include "model/gguf_export.h"
#include "model/model.h"
#include "model_test_util.h"
#include "quant/gguf_quantize.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

const std::string kTinyF16 = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/gguf_battery/tiny.F16.gguf";
const std::vector<int32_t> kPrompt = {1, 40, 77, 12, 250, 9, 101, 64, 33, 180, 7};

std::string temp_path(const std::string& tag) {
  return (fs::temp_directory_path() / ("loom_quantize_grid_" + tag + "_" + std::to_string(::getpid()) + ".gguf"))
      .string();
}

// Every column equally important (what scripts/fixtures/make_gguf_battery.py gives llama-quantize).
std::map<std::string, std::vector<float>> uniform_importance(const gguf::File& f) {
  std::map<std::string, std::vector<float>> m;
  for (const auto& t : f.tensors())
    if (t.ndim == 2) m[t.name] = std::vector<float>(static_cast<size_t>(t.shape[1]), 1.0f);  // row width
  return m;
}

TEST(QuantizeGridFile, Iq3XsRefusesATensorWithoutImportance) {
  const auto src = gguf::File::open(kTinyF16);
  GgufQuantizeOptions opt;
  opt.plan.file_type = FileType::iq3_xs;
  ThreadPool pool(2);
  const std::string out = temp_path("none");
  test_util::expect_error([&] { quantize_gguf(pool, gguf_source_of(*src), out, opt, nullptr); },
                          ErrorKind::invalid_input,
                          {"blk.0.attn_k.weight", "iq3_xxs", "importance matrix", "--imatrix"});
  EXPECT_FALSE(fs::exists(out));
  // An imatrix without that one tensor's entry is refused the same way.
  auto importance = uniform_importance(*src);
  importance.erase("blk.1.attn_q.weight");
  opt.importance = &importance;
  opt.plan.has_imatrix = true;
  test_util::expect_error([&] { quantize_gguf(pool, gguf_source_of(*src), out, opt, nullptr); },
                          ErrorKind::invalid_input, {"blk.1.attn_q.weight"});
  EXPECT_FALSE(fs::exists(out));
}

// The largest relative logit error (max |diff| / max |logit| per position) of
// `model` against the f16 model's logits over the prompt.
double worst_logit_error(const Model& model, Backend& backend, const std::vector<float>& want) {
  InferenceSession s(model.config(), model.weights(), backend, 64, DType::f32);
  s.eval(kPrompt, /*all_logits=*/true);
  const auto V = static_cast<size_t>(model.config().vocab_size);
  double worst = 0;
  for (size_t t = 0; t < kPrompt.size(); ++t)
    worst = std::max(worst, test::relative_error(s.logits().data() + t * V, want.data() + t * V, V));
  return worst;
}

TEST(QuantizeGridFile, Iq3FilesLoadWithLlamaQuantizesMix) {
  const auto src = gguf::File::open(kTinyF16);
  const auto importance = uniform_importance(*src);
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  for (FileType ft : {FileType::iq3_xs, FileType::iq3_s, FileType::iq3_m}) {
    SCOPED_TRACE(file_type_name(ft));
    GgufQuantizeOptions opt;
    opt.plan.file_type = ft;
    opt.plan.has_imatrix = true;
    opt.importance = &importance;
    const std::string out = temp_path(file_type_name(ft));
    quantize_gguf(pool, gguf_source_of(*src), out, opt, nullptr);
    {
      auto q = Model::load(out, {.tokenizer = false, .backend = backend.get()});
      const LayerWeights& L0 = q->weights().layers[0];
      const LayerWeights& L1 = q->weights().layers[1];
      const bool xs = ft == FileType::iq3_xs, m = ft == FileType::iq3_m;
      EXPECT_EQ(L0.wq.dtype, xs ? DType::iq3_xxs : DType::iq3_s);
      EXPECT_EQ(L0.wk.dtype, xs ? DType::iq3_xxs : DType::iq3_s);
      EXPECT_EQ(L0.wv.dtype, m ? DType::q4_k : DType::iq3_s);  // GQA 2: only IQ3_M lifts attn_v
      EXPECT_EQ(L0.wo.dtype, m ? DType::q4_k : DType::iq3_s);
      EXPECT_EQ(L0.w_gate.dtype, xs ? DType::iq3_xxs : DType::iq3_s);  // IQ3_XS: layer 0 of 2 is in [n/8, 7n/8)
      EXPECT_EQ(L1.w_up.dtype, DType::iq3_s);
      EXPECT_EQ(L0.w_down.dtype, DType::iq4_nl);  // 384 wide: the grids' fallback
    }
    EXPECT_EQ(gguf::File::open(out)->get_uint("general.file_type"), static_cast<uint64_t>(ft));
    fs::remove(out);
  }
}

// Every IQ file type loom writes, on the tiny model with a uniform importance
// matrix: the file loads and its logits are as near the f16 model's as those of
// llama-quantize's files of the battery (made from these weights in f32, so not
// byte-comparable; the IQ2 types against its IQ1_M, the next lower). Measured
// (max |diff| / max |logit| over the prompt): loom IQ3_M 0.353, llama-quantize's
// 0.354; random weights of 1.5-3.5 bits move these logits this much (Q3_K_M 0.372).
TEST(QuantizeGridFile, EveryIqFileStaysAsNearF16AsLlamaQuantizesFiles) {
  const auto src = gguf::File::open(kTinyF16);
  const auto importance = uniform_importance(*src);
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  auto f16 = Model::load(kTinyF16, {.tokenizer = false, .backend = backend.get()});
  InferenceSession s16(f16->config(), f16->weights(), *backend, 64, DType::f32);
  s16.eval(kPrompt, /*all_logits=*/true);
  const std::vector<float> want = s16.logits();
  auto battery_error = [&](const std::string& type) {
    auto m = Model::load(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/gguf_battery/tiny." + type + ".gguf",
                         {.tokenizer = false, .backend = backend.get()});
    return worst_logit_error(*m, *backend, want);
  };
  const std::pair<const char*, const char*> types[] = {
      {"IQ3_M", "IQ3_M"},   {"IQ3_S", "IQ3_XXS"}, {"IQ3_XS", "IQ3_XXS"}, {"IQ3_XXS", "IQ3_XXS"}, {"IQ2_M", "IQ1_M"},
      {"IQ2_S", "IQ1_M"},   {"IQ2_XS", "IQ1_M"},  {"IQ2_XXS", "IQ1_M"},  {"IQ1_M", "IQ1_M"},     {"IQ1_S", "IQ1_S"}};
  for (const auto& [type, ref] : types) {
    SCOPED_TRACE(type);
    GgufQuantizeOptions opt;
    opt.plan.file_type = *file_type_from_name(type);
    opt.plan.has_imatrix = true;
    opt.importance = &importance;
    const std::string out = temp_path(type);
    quantize_gguf(pool, gguf_source_of(*src), out, opt, nullptr);
    {
      auto q = Model::load(out, {.tokenizer = false, .backend = backend.get()});
      const double err = worst_logit_error(*q, *backend, want), ref_err = battery_error(ref);
      EXPECT_LT(err, 1.25 * ref_err) << "llama-quantize's " << ref << ": " << ref_err;
    }
    fs::remove(out);
  }
}

}  // namespace
}  // namespace loom

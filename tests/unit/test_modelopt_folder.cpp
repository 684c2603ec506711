// Hugging Face folders NVIDIA ModelOpt exported in NVFP4 or FP8
// (model/modelopt_folder.h), on tests/fixtures/hf_modelopt_nvfp4 and
// hf_modelopt_fp8 (scripts/fixtures/make_modelopt_folder.py).
// The reference is the format itself, decoded here from the folder's bytes:
// weight = e2m1(code) * e4m3(weight_scale) * weight_scale_2. loom's repacked
// nvfp4 blocks times their output scale give those values bit for bit; the
// model's logits and LoRA steps follow; older exports that say "modelopt" only
// in hf_quant_config.json load alike; bad folders get errors naming the file and
// tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "io/hf_folder.h"
#include "io/safetensors_writer.h"
#include "kernels/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model_test_util.h"
#include "temp_dir.h"
#include "train/lora_params.h"
#include "train/train_step.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/hf_modelopt_nvfp4";
const char* kModules[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
const std::vector<int32_t> kPrompt = {1, 40, 77, 12, 250, 9, 101, 64, 33, 180, 7};

// E4M3 (fn) byte to its value, from the format: bias 7, subnormals below 2^-6.
float e4m3(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  const float v =
      e == 0 ? std::ldexp(static_cast<float>(m) / 8, -6) : std::ldexp(1 + static_cast<float>(m) / 8, e - 7);
  return (b & 0x80) ? -v : v;
}

float e2m1(uint8_t code) {
  static const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  return (code & 8) ? -mag[code & 7] : mag[code & 7];
}

// Module `m`'s weight [out, in] decoded from the folder's U8 / F8_E4M3 / F32 tensors.
std::vector<float> decode(const HfFolder& hf, const std::string& m, int64_t& rows, int64_t& cols) {
  const auto& w = *hf.find_weight(m + ".weight")->info;
  const auto& s = *hf.find_weight(m + ".weight_scale")->info;
  float s2 = 0;
  std::memcpy(&s2, hf.find_weight(m + ".weight_scale_2")->info->data, 4);
  rows = w.shape[0];
  cols = 2 * w.shape[1];
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t byte = w.data[r * (cols / 2) + c / 2];
      const uint8_t code = c % 2 == 0 ? byte & 0xf : byte >> 4;
      const float block = e4m3(s.data[r * (cols / 16) + c / 16]);
      out[static_cast<size_t>(r * cols + c)] = e2m1(code) * block * s2;
    }
  return out;
}

// Every projection of the folder at `dir`: held as `dtype`, its output scale
// the folder's "<module>" + `scale_suffix` tensor, its values times that scale
// `decode`'s, bit for bit.
void expect_format_values(
    const std::string& dir, DType dtype, const std::string& scale_suffix,
    const std::function<std::vector<float>(const HfFolder&, const std::string&)>& decode) {
  auto m = Model::load(dir, {.tokenizer = false, .pack = false});
  const auto hf = HfFolder::open(dir);
  for (size_t l = 0; l < 2; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const std::string name = fmt::format("model.layers.{}.{}", l, kModules[static_cast<int>(t)]);
      SCOPED_TRACE(name);
      const LayerWeights& L = m->weights().layers[l];
      const Tensor& W = target_matrix(L, t);
      ASSERT_EQ(W.dtype, dtype);
      float scale = 0;
      std::memcpy(&scale, hf->find_weight(name + scale_suffix)->info->data, 4);
      EXPECT_EQ(L.output_scale(t), scale);
      const std::vector<float> want = decode(*hf, name), got = matrix_f32(W, scale);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
    }
}

// kPrompt's logits of `got` within `tol` relative error of `want`'s at every position.
void expect_logits_near(const Model& got, const Model& want, Backend& backend, double tol) {
  auto logits = [&](const Model& m) {
    InferenceSession s(m.config(), m.weights(), backend, 64, DType::f32);
    s.eval(kPrompt, /*all_logits=*/true);
    return s.logits();
  };
  const auto w = logits(want), g = logits(got);
  const auto V = w.size() / kPrompt.size();
  for (size_t t = 0; t < kPrompt.size(); ++t)
    EXPECT_LT(test::relative_error(g.data() + t * V, w.data() + t * V, V), tol) << "position " << t;
}

TEST(ModelOptFolder, WeightsAreTheFormatsValuesBitForBit) {
  expect_format_values(kDir, DType::nvfp4, ".weight_scale_2",
                       [](const HfFolder& hf, const std::string& name) {
                         int64_t rows = 0, cols = 0;
                         return decode(hf, name, rows, cols);
                       });
  auto m = Model::load(kDir, {.tokenizer = false, .pack = false});
  // lm_head is excluded from quantization, the embeddings are not linear layers: BF16 as stored.
  EXPECT_EQ(m->weights().output.dtype, DType::bf16);
  EXPECT_EQ(m->weights().token_embd.dtype, DType::bf16);
}

// The NVFP4 kernels with the scales against the same model with every
// projection replaced by the decoded f32 values: within 4% relative error per
// position (8-bit activations; measured 1.0-2.1%), and two LoRA steps.
TEST(ModelOptFolder, LogitsMatchTheDecodedWeightsAndLoraTrains) {
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  const auto hf = HfFolder::open(kDir);
  Model::LoadOptions ref{.tokenizer = false, .backend = backend.get(), .dequantize = true};
  ref.before_pack = [&](ModelWeights& w, const ModelConfig&) {
    for (size_t l = 0; l < w.layers.size(); ++l)
      for (LoraTarget t : kAllLoraTargets) {
        int64_t rows = 0, cols = 0;
        auto& v = w.owned.emplace_back(
            decode(*hf, fmt::format("model.layers.{}.{}", l, kModules[static_cast<int>(t)]), rows, cols));
        Tensor& W = target_matrix(w.layers[l], t);
        W.data = v.data();
        W.dtype = DType::f32;
      }
  };
  auto want_model = Model::load(kDir, ref);
  auto got_model = Model::load(kDir, {.tokenizer = false, .backend = backend.get()});
  expect_logits_near(*got_model, *want_model, *backend, 0.04);

  Batch b;
  b.rows = 1;
  b.seq_len = 12;
  for (int32_t t = 0; t < b.seq_len; ++t) {
    b.tokens.push_back(kPrompt[static_cast<size_t>(t) % kPrompt.size()]);
    b.targets.push_back(t + 1 < b.seq_len ? kPrompt[static_cast<size_t>(t + 1) % kPrompt.size()] : -100);
    b.positions.push_back(t);
    b.seq_start.push_back(0);
    b.target_tokens += t + 1 < b.seq_len ? 1 : 0;
  }
  LoraConfig lc;
  lc.r = 4;
  LoraModel lora(got_model->config(), lc);
  TrainSession s(got_model->config(), got_model->weights(), lora, *backend, BackwardMode::exact);
  for (uint64_t step = 0; step < 2; ++step) {
    lora.zero_grads();
    const double loss = s.forward_backward(b, 1.0f / static_cast<float>(b.target_tokens), step).loss_sum;
    EXPECT_TRUE(std::isfinite(loss));
  }
}

const std::string kFp8Dir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/hf_modelopt_fp8";

// ModelOpt FP8: each projection widened to f16 (exact), weight_scale its output
// scale: the values e4m3 * weight_scale decoded from the bytes, bit for bit;
// f16 products with f32 activations against the decoded f32 values.
TEST(ModelOptFolder, Fp8WeightsAreTheFormatsValuesBitForBit) {
  expect_format_values(kFp8Dir, DType::f16, ".weight_scale", [](const HfFolder& hf, const std::string& name) {
    const auto& codes = *hf.find_weight(name + ".weight")->info;
    float scale = 0;
    std::memcpy(&scale, hf.find_weight(name + ".weight_scale")->info->data, 4);
    std::vector<float> v(static_cast<size_t>(codes.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = e4m3(codes.data[i]) * scale;
    return v;
  });
}

TEST(ModelOptFolder, Fp8LogitsMatchTheDecodedWeights) {
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  auto got_model = Model::load(kFp8Dir, {.tokenizer = false, .backend = backend.get()});
  auto want_model = Model::load(kFp8Dir, {.tokenizer = false, .backend = backend.get(), .dequantize = true});
  EXPECT_FALSE(has_output_scales(want_model->weights()));  // folded into the f32 copies
  // The f16 products keep f32 activations; lm_head stays BF16, whose product
  // rounds its activations to bf16 (as the battery's BF16 files: 1e-2; measured
  // 1.5e-3 .. 2.0e-3). Without the scales the logits would be off by their
  // size (1e-3 .. 1e-2 times).
  expect_logits_near(*got_model, *want_model, *backend, 1e-2);
}

// A copy of the fixture whose config.json / hf_quant_config.json / tensors `edit` changes.
std::string edited_copy(const test_util::TempDir& dir, const std::string& name,
                        const std::function<void(nlohmann::json& config, nlohmann::json& hf_quant)>& edit) {
  const fs::path out = dir.path / name;
  fs::create_directories(out);
  fs::copy_file(kDir + "/model.safetensors", out / "model.safetensors");
  nlohmann::json config = nlohmann::json::parse(std::ifstream(kDir + "/config.json"));
  nlohmann::json hq = nlohmann::json::parse(std::ifstream(kDir + "/hf_quant_config.json"));
  edit(config, hq);
  std::ofstream(out / "config.json") << config.dump(2);
  std::ofstream(out / "hf_quant_config.json") << hq.dump(2);
  return out.string();
}

TEST(ModelOptFolder, OlderExportsSayModelOptOnlyInHfQuantConfig) {
  test_util::TempDir dir("modelopt_old");
  const std::string path =
      edited_copy(dir, "old", [](nlohmann::json& c, nlohmann::json&) { c.erase("quantization_config"); });
  auto m = Model::load(path, {.tokenizer = false, .pack = false});
  EXPECT_EQ(m->weights().layers[1].w_down.dtype, DType::nvfp4);
  EXPECT_NE(m->weights().layers[1].output_scale(LoraTarget::down), 1.0f);
}

TEST(ModelOptFolder, OtherAlgorithmsAndBadFoldersAreErrors) {
  test_util::TempDir dir("modelopt_bad");
  auto expect_error = [](const std::string& path, ErrorKind kind, const std::vector<std::string>& parts) {
    try {
      Model::load(path, {.tokenizer = false, .pack = false});
      ADD_FAILURE() << path << " loaded";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  expect_error(edited_copy(dir, "w4a8",
                           [](nlohmann::json& c, nlohmann::json&) {
                             c["quantization_config"]["quant_algo"] = "W4A8_AWQ";
                           }),
               ErrorKind::unsupported, {"config.json", "quant_algo 'W4A8_AWQ'"});
  expect_error(
      edited_copy(dir, "group",
                  [](nlohmann::json& c, nlohmann::json&) { c["quantization_config"]["group_size"] = 32; }),
      ErrorKind::unsupported, {"group_size 32"});
  expect_error(edited_copy(dir, "old_fp8",
                           [](nlohmann::json& c, nlohmann::json& h) {
                             c.erase("quantization_config");
                             h["quantization"]["quant_algo"] = "INT4_AWQ";
                           }),
               ErrorKind::unsupported, {"hf_quant_config.json", "INT4_AWQ"});
}

// The fixture with some tensors replaced (raw bytes, any dtype and shape).
struct RawTensor {
  safetensors::StDType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
std::string with_tensors(const test_util::TempDir& dir, const std::string& name,
                         const std::map<std::string, RawTensor>& replaced) {
  const fs::path out = dir.path / name;
  fs::create_directories(out);
  fs::copy_file(kDir + "/config.json", out / "config.json");
  const auto hf = HfFolder::open(kDir);
  safetensors::Writer st((out / "model.safetensors").string());
  for (const std::string& t : hf->tensor_names()) {
    if (const auto it = replaced.find(t); it != replaced.end()) {
      st.add_raw(t, it->second.dtype, it->second.shape, it->second.bytes);
      continue;
    }
    const auto& info = *hf->find_weight(t)->info;
    st.add_raw(t, info.st_dtype, std::vector<int64_t>(info.shape.begin(), info.shape.begin() + info.ndim),
               std::string_view(reinterpret_cast<const char*>(info.data), info.nbytes()));
  }
  st.write(safetensors::WriteOrder::as_given);
  return out.string();
}

TEST(ModelOptFolder, MalformedTensorsAreErrorsNamingThem) {
  test_util::TempDir dir("modelopt_tensors");
  using safetensors::StDType;
  auto expect_error = [](const std::string& path, const std::vector<std::string>& parts) {
    try {
      Model::load(path, {.tokenizer = false, .pack = false});
      ADD_FAILURE() << path << " loaded";
    } catch (const Error& e) {
      for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  // Scales for 64 columns where the codes hold 128.
  expect_error(with_tensors(dir, "scales",
                            {{"model.layers.0.mlp.up_proj.weight_scale",
                              {StDType::f8_e4m3, {384, 4}, std::string(384 * 4, '\x38')}}}),
               {"model.layers.0.mlp.up_proj.weight_scale", "[384, 4]"});
  // Block scales stored as F32 instead of F8_E4M3.
  expect_error(with_tensors(dir, "dtype",
                            {{"model.layers.1.self_attn.k_proj.weight_scale",
                              {StDType::f32, {64, 8}, std::string(64 * 8 * 4, '\0')}}}),
               {"model.layers.1.self_attn.k_proj.weight_scale", "F32", "F8_E4M3"});
  // FP8 with a scale per output channel (compressed-tensors' channel strategy).
  {
    const fs::path out = dir.path / "fp8_channel";
    fs::create_directories(out);
    fs::copy_file(kFp8Dir + "/config.json", out / "config.json");
    const auto hf = HfFolder::open(kFp8Dir);
    safetensors::Writer st((out / "model.safetensors").string());
    for (const std::string& t : hf->tensor_names()) {
      const auto& info = *hf->find_weight(t)->info;
      if (t == "model.layers.1.mlp.gate_proj.weight_scale") {
        st.add_raw(t, StDType::f32, {384, 1}, std::string(384 * 4, '\0'));
        continue;
      }
      st.add_raw(t, info.st_dtype, std::vector<int64_t>(info.shape.begin(), info.shape.begin() + info.ndim),
                 std::string_view(reinterpret_cast<const char*>(info.data), info.nbytes()));
    }
    st.write(safetensors::WriteOrder::as_given);
    expect_error(out.string(), {"model.layers.1.mlp.gate_proj.weight_scale", "per-channel FP8 scales"});
  }
  // 96 columns: a multiple of 16, not of NVFP4's block of 64.
  expect_error(with_tensors(dir, "width",
                            {{"model.layers.0.self_attn.q_proj.weight",
                              {StDType::u8, {128, 48}, std::string(128 * 48, '\x11')}},
                             {"model.layers.0.self_attn.q_proj.weight_scale",
                              {StDType::f8_e4m3, {128, 6}, std::string(128 * 6, '\x38')}}}),
               {"model.layers.0.self_attn.q_proj.weight", "96 columns", "multiple of 64"});
}

}  // namespace
}  // namespace loom

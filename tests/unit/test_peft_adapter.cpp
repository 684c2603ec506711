// PEFT adapter folders: a folder written by PEFT itself
// (scripts/fixtures/make_peft_adapter_fixture.py), loom round trips, and
// validation errors that name the file and the field or tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/rng.h"
#include "io/safetensors_writer.h"
#include "model/config.h"
#include "model/peft_adapter.h"

namespace loom::peft {
namespace {

namespace fs = std::filesystem;
const std::string kFixture = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/peft_adapter/tiny-llama";

ModelConfig tiny_llama() {  // tests/fixtures/model/tiny-llama/config.json
  ModelConfig m;
  m.hidden = 64;
  m.intermediate = 176;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.head_dim = 16;
  return m;
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("loom_peft_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string str() const { return path.string(); }
};

TEST(PeftAdapter, ReadsFolderWrittenByPeft) {
  const AdapterTensors ad = read_adapter(kFixture);
  EXPECT_EQ(ad.config.r, 4);
  EXPECT_DOUBLE_EQ(ad.config.lora_alpha, 8);
  EXPECT_DOUBLE_EQ(ad.config.lora_dropout, 0.05);
  EXPECT_FALSE(ad.config.use_rslora);
  EXPECT_DOUBLE_EQ(ad.config.scaling(), 2.0);
  EXPECT_EQ(ad.config.target_modules.size(), 7u);
  EXPECT_EQ(ad.config.base_model_name_or_path, "tests/fixtures/model/tiny-llama");
  EXPECT_EQ(ad.n_layers(), 2);
  EXPECT_EQ(ad.pairs.size(), 14u);
  check_adapter_fits(ad, tiny_llama(), kFixture);
  const LoraPair* k = ad.find(1, LoraTarget::k);
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->in, 64);
  EXPECT_EQ(k->out, 32);
  const LoraPair* down = ad.find(0, LoraTarget::down);
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->in, 176);
  EXPECT_EQ(down->out, 64);

  const auto expected = nlohmann::json::parse(read_text_file(kFixture + "-expected.json"));
  ASSERT_EQ(expected.size(), 28u);
  for (int layer = 0; layer < 2; ++layer)
    for (LoraTarget t : kAllLoraTargets)
      for (bool b : {false, true}) {
        const std::string name = tensor_name(layer, t, b);
        ASSERT_TRUE(expected.contains(name)) << name;
        const auto& e = expected[name];
        const LoraPair* p = ad.find(layer, t);
        ASSERT_NE(p, nullptr) << name;
        const std::vector<float>& v = b ? p->b : p->a;
        EXPECT_EQ(e["shape"][0].get<int64_t>(), b ? p->out : ad.config.r) << name;
        EXPECT_EQ(e["shape"][1].get<int64_t>(), b ? ad.config.r : p->in) << name;
        for (size_t i = 0; i < 3; ++i)
          EXPECT_EQ(v[e["idx"][i].get<size_t>()], e["values"][i].get<float>()) << name;
        double sum = 0;
        for (float x : v) sum += x;
        EXPECT_NEAR(sum, e["sum"].get<double>(), 1e-9 * v.size()) << name;
      }
}

AdapterTensors random_adapter(int r, int layers, std::vector<LoraTarget> targets, uint64_t seed) {
  AdapterTensors ad;
  ad.config.r = r;
  ad.config.lora_alpha = 3 * r;
  ad.config.lora_dropout = 0.1;
  ad.config.use_rslora = true;
  ad.config.target_modules = targets;
  ad.config.base_model_name_or_path = "some/model";
  CounterRng rng(seed);
  for (int l = 0; l < layers; ++l)
    for (LoraTarget t : targets) {
      LoraPair p;
      p.in = 13 + static_cast<int64_t>(t);
      p.out = 7 + 2 * static_cast<int64_t>(t);
      p.a.resize(static_cast<size_t>(r * p.in));
      p.b.resize(static_cast<size_t>(r * p.out));
      for (float& x : p.a) x = static_cast<float>(rng.next_double() * 2 - 1);
      for (float& x : p.b) x = static_cast<float>(rng.next_double() * 2 - 1);
      ad.pairs.emplace(std::make_pair(l, t), std::move(p));
    }
  return ad;
}

TEST(PeftAdapter, RoundTripF32F16Bf16) {
  const AdapterTensors ad = random_adapter(3, 3, {LoraTarget::q, LoraTarget::v, LoraTarget::down}, 11);
  for (auto [dtype, tol] : {std::pair{safetensors::StDType::f32, 0.0}, std::pair{safetensors::StDType::f16, 1e-3},
                            std::pair{safetensors::StDType::bf16, 4e-3}}) {
    TempDir dir(safetensors::st_dtype_name(dtype));
    write_adapter(dir.str() + "/out", ad, dtype);
    const AdapterTensors back = read_adapter(dir.str() + "/out");
    EXPECT_EQ(back.config.r, 3);
    EXPECT_DOUBLE_EQ(back.config.lora_alpha, 9);
    EXPECT_DOUBLE_EQ(back.config.scaling(), 9 / std::sqrt(3.0));
    EXPECT_EQ(back.config.target_modules, ad.config.target_modules);
    ASSERT_EQ(back.pairs.size(), ad.pairs.size());
    for (const auto& [key, p] : ad.pairs) {
      const LoraPair* q = back.find(key.first, key.second);
      ASSERT_NE(q, nullptr);
      EXPECT_EQ(q->in, p.in);
      EXPECT_EQ(q->out, p.out);
      for (size_t i = 0; i < p.a.size(); ++i) ASSERT_NEAR(q->a[i], p.a[i], tol);
      for (size_t i = 0; i < p.b.size(); ++i) ASSERT_NEAR(q->b[i], p.b[i], tol);
    }
    const auto cfg = nlohmann::json::parse(read_text_file(dir.str() + "/out/adapter_config.json"));
    EXPECT_EQ(cfg["peft_type"], "LORA");
    EXPECT_TRUE(cfg["lora_alpha"].is_number_integer());
    EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
    EXPECT_EQ(cfg["bias"], "none");
    EXPECT_EQ(cfg["inference_mode"], true);
    EXPECT_EQ(cfg["fan_in_fan_out"], false);
    EXPECT_TRUE(cfg["modules_to_save"].is_null());
    EXPECT_EQ(cfg["target_modules"], nlohmann::json({"q_proj", "v_proj", "down_proj"}));
    EXPECT_FALSE(fs::exists(dir.str() + "/out/adapter_model.safetensors.tmp"));
  }
}

TEST(PeftAdapter, WriteRejectsInconsistentPairs) {
  AdapterTensors ad = random_adapter(2, 1, {LoraTarget::q}, 3);
  ad.pairs.begin()->second.a.pop_back();
  TempDir dir("badwrite");
  EXPECT_THROW(write_adapter(dir.str(), ad), Error);
  ad = random_adapter(2, 1, {LoraTarget::q}, 3);
  ad.config.target_modules = {LoraTarget::k};
  EXPECT_THROW(write_adapter(dir.str(), ad), Error);
}

void expect_misfit(const AdapterTensors& ad, const ModelConfig& model, const std::string& needle) {
  try {
    check_adapter_fits(ad, model, "my-adapter");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("my-adapter"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(PeftAdapter, ModelMismatchNamesTensor) {
  expect_misfit(random_adapter(2, 2, {LoraTarget::q}, 3), tiny_llama(), "q_proj");
}

// Without layers_to_transform an adapter adapts every layer (PEFT's meaning):
// one with fewer layers than the model was cut short and is refused; with
// layers_to_transform naming its layers it fits.
TEST(PeftAdapter, AdapterShortOfTheModelsLayersIsRefused) {
  ModelConfig model = tiny_llama();
  model.n_layers = 3;
  AdapterTensors ad = random_adapter(2, 2, {LoraTarget::q}, 3);
  for (auto& [key, p] : ad.pairs) {  // the model's shapes, so only the layer count is off
    p.in = model.hidden;
    p.out = model.q_dim();
    p.a.assign(static_cast<size_t>(2 * p.in), 0.5f);
    p.b.assign(static_cast<size_t>(2 * p.out), 0.25f);
  }
  expect_misfit(ad, model, "layers 0..1 only, the model has 3 layers");
  model.n_layers = 1;
  expect_misfit(ad, model, "adapter has 2 layers, the model 1");
  model.n_layers = 3;
  ad.config.layers_to_transform = {0, 1};
  EXPECT_NO_THROW(check_adapter_fits(ad, model, "my-adapter"));
}

// Copies the PEFT fixture, edits its config, and expects an error naming the
// config file and `needle`.
void expect_config_error(const std::string& tag, const std::function<void(nlohmann::json&)>& edit,
                         const std::string& needle) {
  TempDir dir(tag);
  fs::copy(kFixture, dir.path, fs::copy_options::recursive);
  const std::string cfg_path = dir.str() + "/adapter_config.json";
  auto cfg = nlohmann::json::parse(read_text_file(cfg_path));
  edit(cfg);
  std::ofstream(cfg_path, std::ios::trunc) << cfg.dump(2);
  try {
    read_adapter(dir.str());
    ADD_FAILURE() << tag << ": no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << tag << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(dir.str()), std::string::npos) << tag << ": " << e.what();
  }
}

TEST(PeftAdapter, RejectsUnsupportedConfigs) {
  expect_config_error("type", [](auto& c) { c["peft_type"] = "LOHA"; }, "peft_type");
  expect_config_error("dora", [](auto& c) { c["use_dora"] = true; }, "use_dora");
  expect_config_error("fifo", [](auto& c) { c["fan_in_fan_out"] = true; }, "fan_in_fan_out");
  expect_config_error("ltt", [](auto& c) { c["layers_to_transform"] = {0}; }, "layers_to_transform");
  expect_config_error("rankpat", [](auto& c) { c["rank_pattern"] = {{"q_proj", 8}}; }, "rank_pattern");
  expect_config_error("bias", [](auto& c) { c["bias"] = "all"; }, "bias");
  expect_config_error("mts", [](auto& c) { c["modules_to_save"] = {"lm_head"}; }, "modules_to_save");
  expect_config_error("alllinear", [](auto& c) { c["target_modules"] = "all-linear"; }, "target_modules");
  expect_config_error("lmhead", [](auto& c) { c["target_modules"].push_back("lm_head"); }, "lm_head");
  expect_config_error("noalpha", [](auto& c) { c.erase("lora_alpha"); }, "lora_alpha");
  expect_config_error("rzero", [](auto& c) { c["r"] = 0; }, "'r'");
  expect_config_error("rshape", [](auto& c) { c["r"] = 8; }, "r = 8");
  expect_config_error("fewer", [](auto& c) { c["target_modules"] = {"q_proj"}; }, "not in target_modules");
}

// Builds an adapter_model.safetensors from scratch next to the fixture's config.
void expect_tensor_error(const std::string& tag, const std::function<void(safetensors::Writer&)>& fill,
                         const std::string& needle) {
  TempDir dir(tag);
  fs::copy(kFixture + "/adapter_config.json", dir.path / "adapter_config.json");
  auto cfg = nlohmann::json::parse(read_text_file(dir.str() + "/adapter_config.json"));
  cfg["target_modules"] = {"q_proj"};
  std::ofstream(dir.str() + "/adapter_config.json", std::ios::trunc) << cfg.dump();
  safetensors::Writer w(dir.str() + "/adapter_model.safetensors");
  fill(w);
  w.write();
  try {
    read_adapter(dir.str());
    ADD_FAILURE() << tag << ": no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << tag << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find("adapter_model.safetensors"), std::string::npos) << tag << ": " << e.what();
  }
}

TEST(PeftAdapter, RejectsBadTensors) {
  const std::vector<float> a(4 * 64, 0.5f), b(64 * 4, 0.25f);
  const std::string qa = tensor_name(0, LoraTarget::q, false), qb = tensor_name(0, LoraTarget::q, true);
  expect_tensor_error("missingB", [&](auto& w) { w.add(qa, a, {4, 64}); }, qb);
  expect_tensor_error("extra", [&](auto& w) {
    w.add(qa, a, {4, 64});
    w.add(qb, b, {64, 4});
    w.add("base_model.model.lm_head.weight", a, {4, 64});
  }, "lm_head");
  expect_tensor_error("dora", [&](auto& w) {
    w.add(qa, a, {4, 64});
    w.add(qb, b, {64, 4});
    w.add("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", b, {256});
  }, "lora_magnitude_vector");
  expect_tensor_error("shapeA", [&](auto& w) {
    w.add(qa, a, {64, 4});
    w.add(qb, b, {64, 4});
  }, qa);
  expect_tensor_error("ndim", [&](auto& w) {
    w.add(qa, a, {4, 64, 1});
    w.add(qb, b, {64, 4});
  }, "2 dimensions");
  expect_tensor_error("dtype", [&](auto& w) {
    w.add_raw(qa, safetensors::StDType::f32, {4, 64}, std::string(4 * 64 * 4, '\0'));
    w.add(qb, b, {64, 4});
    w.add_raw(tensor_name(1, LoraTarget::q, false), safetensors::StDType::f16, {4, 64},
              std::string(4 * 64 * 2, '\0'));
  }, tensor_name(1, LoraTarget::q, true));  // layer 1 lacks B
  expect_tensor_error("gap", [&](auto& w) {
    w.add(qa, a, {4, 64});
    w.add(qb, b, {64, 4});
    w.add(tensor_name(2, LoraTarget::q, false), a, {4, 64});
    w.add(tensor_name(2, LoraTarget::q, true), b, {64, 4});
  }, "numbered");
  expect_tensor_error("wrongparent", [&](auto& w) {
    w.add("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", a, {4, 64});
  }, "unexpected tensor");
}

// A NaN/Inf weight would make every adapted output non-finite: refused, naming file and tensor,
// whatever the stored dtype and whether the tensor is copied or mapped.
TEST(PeftAdapter, RejectsNonFiniteWeights) {
  const std::string qa = tensor_name(0, LoraTarget::q, false), qb = tensor_name(0, LoraTarget::q, true);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> a(4 * 64, 0.5f), b(64 * 4, 0.25f);
    b[77] = bad;
    expect_tensor_error("nanB", [&](auto& w) {
      w.add(qa, a, {4, 64});
      w.add(qb, b, {64, 4});
    }, "tensor '" + qb + "' has the non-finite value");
    expect_tensor_error("nanB16", [&](auto& w) {
      w.add(qa, a, {4, 64}, safetensors::StDType::bf16);
      w.add(qb, b, {64, 4}, safetensors::StDType::f16);
    }, "element 77");
    a[3] = -bad;
    b[77] = 0;
    TempDir dir("nanA_mapped");
    AdapterTensors ad = random_adapter(4, 1, {LoraTarget::q}, 5);
    ad.pairs.begin()->second.a[3] = bad;
    write_adapter(dir.str(), ad);
    for (const bool mapped : {false, true}) {
      try {
        read_adapter(dir.str(), mapped);
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(dir.str() + "/adapter_model.safetensors: tensor '" + qa + "'"),
                  std::string::npos) << e.what();
      }
    }
  }
}

TEST(PeftAdapter, MissingFilesAndBadJson) {
  TempDir dir("missing");
  EXPECT_THROW(read_adapter(dir.str()), Error);
  fs::copy(kFixture + "/adapter_config.json", dir.path / "adapter_config.json");
  try {
    read_adapter(dir.str());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::not_found);
    EXPECT_NE(std::string(e.what()).find("adapter_model.safetensors"), std::string::npos);
  }
  std::ofstream(dir.str() + "/adapter_config.json", std::ios::trunc) << "{\"r\": 4,";
  try {
    read_adapter(dir.str());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("adapter_config.json"), std::string::npos);
  }
}

}  // namespace
}  // namespace loom::peft

// Every llama.cpp file type loom reads, as llama-quantize writes it (mixed tensor
// types inside a layer, fallbacks for rows that are not a multiple of 256): each
// file of tests/fixtures/gguf_battery/ loads with the tensor types the file has,
// its logits agree with the same weights expanded to f32 (output scales folded in), it generates, trains
// two LoRA steps and serves a request. Fixtures: scripts/fixtures/make_gguf_battery.py.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "kernels/backend.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model_test_util.h"
#include "serve/scheduler.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/gguf_battery/";

nlohmann::json manifest() {
  std::ifstream in(kDir + "manifest.json");
  if (!in) throw std::runtime_error("missing " + kDir + "manifest.json");
  return nlohmann::json::parse(in);
}

const std::vector<int32_t> kPrompt = {1, 40, 77, 12, 250, 9, 101, 64, 33, 180, 7};

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("loom_battery_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

TEST(GgufBattery, ManifestCoversEveryFileTypeAndMixes) {
  const auto m = manifest();
  ASSERT_EQ(m["files"].size(), 29u);
  std::set<std::string> types;
  for (const auto& f : m["files"]) types.insert(f["file_type"].get<std::string>());
  for (const char* t : {"Q4_0",   "Q4_1",   "Q5_0",    "Q5_1",   "Q8_0",        "Q2_K",  "Q3_K_S", "Q3_K_M",
                        "Q3_K_L", "Q4_K_S", "Q4_K_M",  "Q5_K_S", "Q5_K_M",      "Q6_K",  "IQ4_NL", "IQ4_XS",
                        "F16",    "BF16",   "IQ3_XXS", "IQ3_M",  "IQ1_S",       "IQ1_M", "TQ1_0",  "TQ2_0",
                        "Q1_0",   "Q2_0",   "MXFP4",   "NVFP4",  "NVFP4-scaled"})
    EXPECT_TRUE(types.count(t)) << t;
  // The point of the battery: files that mix types inside a layer (IQ4_XS: its
  // 384-wide ffn_down rows fall back to IQ4_NL).
  for (const auto& f : m["files"]) {
    if (f["file_type"] == "Q4_K_M") {
      EXPECT_GE(f["matrix_types"].size(), 3u) << f.dump();
    }
    if (f["file_type"] == "IQ4_XS") {
      EXPECT_EQ(f["matrix_types"], nlohmann::json::parse(R"(["IQ4_NL", "IQ4_XS", "Q6_K"])")) << f.dump();
    }
    if (f["file_type"] == "IQ3_XXS") {  // three grid types in one file
      EXPECT_EQ(f["matrix_types"],
                nlohmann::json::parse(R"(["IQ2_S", "IQ3_S", "IQ3_XXS", "IQ4_NL", "Q5_K"])"))
          << f.dump();
    }
    if (f["file_type"] == "IQ1_M") {  // IQ1_M beside IQ2_XXS, its 384-wide rows falling back to IQ4_NL
      EXPECT_EQ(f["matrix_types"],
                nlohmann::json::parse(R"(["IQ1_M", "IQ2_XXS", "IQ4_NL", "Q2_K", "Q5_K"])"))
          << f.dump();
    }
    if (f["file_type"] == "Q1_0") {  // Q1_0 everywhere but the output (its token embeddings too)
      EXPECT_EQ(f["matrix_types"], nlohmann::json::parse(R"(["Q1_0", "Q6_K"])")) << f.dump();
      EXPECT_EQ(f["tensor_types"]["token_embd.weight"], "Q1_0") << f.dump();
    }
    if (f["file_type"] == "MXFP4") {  // Q8_0 with --tensor-type overrides to MXFP4
      EXPECT_EQ(f["matrix_types"], nlohmann::json::parse(R"(["MXFP4", "Q8_0"])")) << f.dump();
      EXPECT_EQ(f["tensor_types"]["blk.1.ffn_up.weight"], "MXFP4") << f.dump();
    }
    if (f["file_type"] == "NVFP4") {  // Q8_0 with every projection overridden to NVFP4 (ffn_down: K = 384)
      EXPECT_EQ(f["matrix_types"], nlohmann::json::parse(R"(["NVFP4", "Q8_0"])")) << f.dump();
      EXPECT_EQ(f["tensor_types"]["blk.1.ffn_down.weight"], "NVFP4") << f.dump();
      EXPECT_EQ(f["tensor_types"]["blk.0.attn_k.weight"], "NVFP4") << f.dump();
    }
    if (f["file_type"] == "NVFP4-scaled") {  // NVFP4 with ModelOpt's per-tensor output scales beside it
      EXPECT_EQ(f["matrix_types"], nlohmann::json::parse(R"(["NVFP4", "Q8_0"])")) << f.dump();
      EXPECT_EQ(f["tensor_types"]["blk.1.ffn_down.scale"], "F32") << f.dump();
      EXPECT_EQ(f["output_scales"].size(), 14u) << f.dump();
    }
    if (f["file_type"] == "TQ1_0") {  // ternary matrices beside the k-quants, ffn_down falling back to Q4_0
      EXPECT_EQ(f["matrix_types"], nlohmann::json::parse(R"(["Q4_0", "Q4_K", "Q6_K", "TQ1_0"])")) << f.dump();
    }
  }
}

// Loads with the file's own tensor types (no silent conversion) and computes the
// same logits as the dequantized weights, up to the 8-bit activation rounding.
TEST(GgufBattery, EveryFileLoadsAndMatchesItsDequantizedWeights) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  const auto battery = manifest();
  for (const auto& f : battery["files"]) {
    const std::string path = kDir + f["path"].get<std::string>();
    SCOPED_TRACE(path);
    auto q = Model::load(path, {.tokenizer = true, .backend = &backend});
    auto d = Model::load(path, {.tokenizer = false, .backend = &backend, .dequantize = true});
    const auto& tt = f["tensor_types"];
    const LayerWeights& L0 = q->weights().layers[0];
    const LayerWeights& L1 = q->weights().layers[1];
    // gguf-py spells types upper case (Q6_K), loom lower case (q6_k).
    auto type_of = [&](const char* tensor) {
      std::string s = tt[tensor].get<std::string>();
      for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return s;
    };
    EXPECT_EQ(std::string(dtype_name(L0.wv.dtype)), type_of("blk.0.attn_v.weight"));
    EXPECT_EQ(std::string(dtype_name(L1.wv.dtype)), type_of("blk.1.attn_v.weight"));
    EXPECT_EQ(std::string(dtype_name(L0.w_down.dtype)), type_of("blk.0.ffn_down.weight"));
    EXPECT_EQ(std::string(dtype_name(L0.wq.dtype)), type_of("blk.0.attn_q.weight"));

    const auto V = static_cast<size_t>(q->config().vocab_size);
    InferenceSession sq(q->config(), q->weights(), backend, 64, DType::f32, /*micro_batch=*/4);
    InferenceSession sd(d->config(), d->weights(), backend, 64, DType::f32);
    sq.eval(kPrompt, /*all_logits=*/true);
    sd.eval(kPrompt, /*all_logits=*/true);
    // f16 uses f32 activations: only f32 rounding differs; bf16 rounds them to
    // bf16 (8 significant bits; measured 2.6e-3 .. 4.2e-3); the others to 8-bit
    // integers.
    const std::string ft = f["file_type"];
    const double tol = ft == "F16" ? 1e-4 : ft == "BF16" ? 1e-2 : 0.1;
    for (size_t t = 0; t < kPrompt.size(); ++t)
      EXPECT_LT(test::relative_error(sq.logits().data() + t * V, sd.logits().data() + t * V, V), tol) << "position " << t;
    const auto ids = test::greedy_ids(sq, sq.logits().data() + (kPrompt.size() - 1) * V, 8);
    EXPECT_EQ(ids.size(), 8u);
  }
}

// Two LoRA steps on every file (mixed types through the backward pass too).
TEST(GgufBattery, EveryFileTrainsTwoLoraSteps) {
  const std::string data = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/train_data/text.jsonl";
  const auto battery = manifest();
  for (const auto& f : battery["files"]) {
    const std::string ft = f["file_type"];
    SCOPED_TRACE(ft);
    TempDir tmp(ft);
    const std::string yaml = fmt::format(
        "model: {}\ndata:\n  train: {}\n  seq_len: 32\nlora:\n  r: 4\n  dropout: 0\noptim:\n  lr: 1e-2\n"
        "batch_size: 2\nsteps: 2\noutput_dir: {}\nseed: 1\nthreads: 2\n",
        kDir + f["path"].get<std::string>(), data, (tmp.path / "adapter").string());
    const TrainResult r = run_training(parse_train_config(yaml, "battery.yaml"), nullptr);
    ASSERT_EQ(r.step_losses.size(), 2u);
    for (double l : r.step_losses) EXPECT_TRUE(std::isfinite(l)) << l;
    EXPECT_TRUE(fs::exists(tmp.path / "adapter" / "adapter_model.safetensors"));
  }
}

// One request through the serving engine on every file: same greedy tokens as
// the single-sequence path (the batched forward agrees with it to ~1e-6).
TEST(GgufBattery, EveryFileServesARequest) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  const auto battery = manifest();
  for (const auto& f : battery["files"]) {
    const std::string path = kDir + f["path"].get<std::string>();
    SCOPED_TRACE(path);
    ServeOptions o;
    o.model_path = path;
    o.model_name = "base";
    o.threads = 2;
    o.max_batch_tokens = 64;
    o.kv_dtype = DType::f32;  // as InferenceSession's cache: an f16 cache would flip near ties
    ServingEngine e(o);
    const auto served = test::serve_greedy_ids(e, "base", kPrompt, 6);
    auto m = Model::load(path, {.tokenizer = false, .backend = &backend});
    InferenceSession s(m->config(), m->weights(), backend, 64, DType::f32);
    const auto want = test::greedy_ids(s, s.eval(kPrompt), 6);
    EXPECT_EQ(served, want);
  }
}

}  // namespace
}  // namespace loom

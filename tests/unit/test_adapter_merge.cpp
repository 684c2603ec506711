// Merging a PEFT LoRA adapter at load (train/adapter_merge.h): loom's merged
// logits against PEFT's own forward (scripts/fixtures/make_adapter_logits_fixture.py),
// on the HF folder and on the q/k-permuted GGUF, the exported HF folder
// (`loom merge`), and adapters that do not fit the model.
#include <gtest/gtest.h>

#include "kernels/backend.h"
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "expect_error.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/adapter_merge.h"
#include "model/hf_export.h"
#include "model/peft_adapter.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel; }
const std::string kAdapter = fixture("peft_adapter/tiny-llama");

struct Reference {
  std::vector<int32_t> tokens;
  int64_t vocab = 0;
  std::vector<float> logits;  // [T, vocab]
};

Reference load_reference() {
  Reference r;
  const auto j = nlohmann::json::parse(std::ifstream(fixture("adapter_merge/tokens.json")));
  r.tokens = j.at("tokens").get<std::vector<int32_t>>();
  r.vocab = j.at("vocab").get<int64_t>();
  r.logits.resize(r.tokens.size() * static_cast<size_t>(r.vocab));
  std::ifstream f(fixture("adapter_merge/logits.f32"), std::ios::binary);
  f.read(reinterpret_cast<char*>(r.logits.data()), static_cast<std::streamsize>(r.logits.size() * sizeof(float)));
  EXPECT_TRUE(f.good()) << "short logits fixture";
  return r;
}

std::vector<float> all_logits(const Model& m, Backend& backend, const std::vector<int32_t>& tokens) {
  // micro_batch 4: several prefill batches over 11 tokens
  InferenceSession s(m.config(), m.weights(), backend, 64, DType::f32, 4);
  s.eval(tokens, /*all_logits=*/true);
  return s.logits();
}

// max |a - b| / max |b| (the model fixtures' definition).
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return num / den;
}

std::unique_ptr<Model> load_merged(const std::string& model, Backend& backend, const std::string& adapter) {
  Model::LoadOptions o{.tokenizer = false, .pack = true, .backend = &backend};
  o.before_pack = adapter_merge_hook(adapter);
  return Model::load(model, o);
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("loom-adapter-merge-" + tag + "-" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string str() const { return path.string(); }
};

TEST(AdapterMerge, HfFolderMatchesPeft) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  const Reference ref = load_reference();
  auto merged = load_merged(fixture("model/tiny-llama"), backend, kAdapter);
  EXPECT_LT(rel_err(all_logits(*merged, backend, ref.tokens), ref.logits), 1e-4);
  // The adapter must matter, or the comparison above proves nothing.
  auto base = Model::load(fixture("model/tiny-llama"), {.tokenizer = false, .pack = true, .backend = &backend});
  EXPECT_GT(rel_err(all_logits(*base, backend, ref.tokens), ref.logits), 1e-2);
}

TEST(AdapterMerge, PermutedGgufMatchesPeft) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  const Reference ref = load_reference();
  auto merged = load_merged(fixture("model/tiny-llama.f32.gguf"), backend, kAdapter);
  ASSERT_TRUE(lora_needs_qk_permutation(merged->config()));
  EXPECT_LT(rel_err(all_logits(*merged, backend, ref.tokens), ref.logits), 1e-4);
}

TEST(AdapterMerge, OnlyAdaptedMatricesBecomeF32) {
  ThreadPool pool(1);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  peft::AdapterTensors a = peft::read_adapter(kAdapter);
  for (auto it = a.pairs.begin(); it != a.pairs.end();)  // keep layer 1's v_proj only
    it = it->first == std::pair{1, LoraTarget::v} ? std::next(it) : a.pairs.erase(it);
  a.config.target_modules = {LoraTarget::v};
  Model::LoadOptions o{.tokenizer = false, .pack = true, .backend = &backend};
  o.before_pack = [&a](ModelWeights& w, const ModelConfig& c) { merge_adapter(w, c, a, true); };
  auto m = Model::load(fixture("model/tiny-llama.q8_0.gguf"), o);
  const auto& L = m->weights().layers;
  EXPECT_EQ(L[1].wv.dtype, DType::f32);
  EXPECT_EQ(L[0].wv.dtype, DType::q8_0);
  EXPECT_EQ(L[1].wq.dtype, DType::q8_0);
}

TEST(AdapterMerge, ExportedFolderGivesSameLogits) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  const Reference ref = load_reference();
  for (const std::string src : {"model/tiny-llama", "model/tiny-llama.f32.gguf"}) {
    SCOPED_TRACE(src);
    TempDir out("export");
    {
      Model::LoadOptions o{.tokenizer = false, .pack = false, .backend = &backend};
      o.before_pack = adapter_merge_hook(kAdapter);
      auto merged = Model::load(fixture(src), o);
      write_hf_folder(*merged, out.str(), safetensors::StDType::f32);
    }
    ASSERT_TRUE(fs::exists(out.path / "generation_config.json"));
    const auto cfg = nlohmann::json::parse(std::ifstream(out.path / "config.json"));
    EXPECT_EQ(cfg.at("model_type"), "llama");
    EXPECT_EQ(cfg.at("rope_scaling").at("rope_type"), "llama3");
    auto reloaded = Model::load(out.str(), {.tokenizer = false, .pack = true, .backend = &backend});
    EXPECT_EQ(reloaded->config().rope_layout, RopeLayout::half);
    EXPECT_LT(rel_err(all_logits(*reloaded, backend, ref.tokens), ref.logits), 1e-4);
  }
}

TEST(AdapterMerge, Bf16ExportIsClose) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  const Reference ref = load_reference();
  TempDir out("bf16");
  {
    auto merged = load_merged(fixture("model/tiny-llama"), backend, kAdapter);
    write_hf_folder(*merged, out.str(), safetensors::StDType::bf16);
  }
  const auto cfg = nlohmann::json::parse(std::ifstream(out.path / "config.json"));
  EXPECT_EQ(cfg.at("torch_dtype"), "bfloat16");
  auto reloaded = Model::load(out.str(), {.tokenizer = false, .pack = true, .backend = &backend});
  EXPECT_EQ(reloaded->weights().layers[0].wq.dtype, DType::bf16);
  EXPECT_LT(rel_err(all_logits(*reloaded, backend, ref.tokens), ref.logits), 3e-2);
}

TEST(AdapterMerge, AdapterThatDoesNotFitNamesFolderAndTensor) {
  ThreadPool pool(1);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  auto write_bad = [](const std::string& dir, int layers, int64_t in) {
    peft::AdapterTensors a;
    a.config.r = 2;
    a.config.target_modules = {LoraTarget::q};
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    for (int l = 0; l < layers; ++l) {
      peft::LoraPair p;
      p.in = in;
      p.out = 64;
      p.a.resize(static_cast<size_t>(2 * in));
      p.b.resize(static_cast<size_t>(64 * 2));
      for (float& x : p.a) x = nd(rng);
      for (float& x : p.b) x = nd(rng);
      a.pairs[{l, LoraTarget::q}] = p;
    }
    peft::write_adapter(dir, a);
  };
  TempDir hidden("hidden");
  write_bad(hidden.str(), 2, 48);  // tiny-llama's hidden size is 64
  test_util::expect_error([&] { load_merged(fixture("model/tiny-llama"), backend, hidden.str()); },
                          ErrorKind::invalid_input, {hidden.str(), "q_proj"});
  TempDir layers("layers");
  write_bad(layers.str(), 3, 64);  // tiny-llama has 2 layers
  test_util::expect_error([&] { load_merged(fixture("model/tiny-llama.f32.gguf"), backend, layers.str()); },
                          ErrorKind::invalid_input, {layers.str(), "layers.2"});
}

// lora_alpha 1e308 keeps every adapter value finite but scale * B A overflows
// f32: the merge (generate, chat, merge) refuses it, naming the adapter and tensor.
TEST(AdapterMerge, OverflowingScaleNamesAdapterAndTensor) {
  ThreadPool pool(1);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  TempDir dir("huge");
  fs::copy(kAdapter + "/adapter_model.safetensors", dir.path / "adapter_model.safetensors");
  auto cfg = nlohmann::json::parse(std::ifstream(kAdapter + "/adapter_config.json"));
  cfg["lora_alpha"] = 1e308;
  std::ofstream(dir.path / "adapter_config.json") << cfg.dump();
  test_util::expect_error([&] { load_merged(fixture("model/tiny-llama.f32.gguf"), backend, dir.str()); },
                          ErrorKind::invalid_input,
                          {"adapter " + dir.str(), "lora_A.weight", "is not finite", "lora_alpha (1e+308)"});
}

// write_hf_folder (loom merge, full fine-tuning) replaces its folder as a whole
// and refuses a non-empty folder that is not a loom/PEFT output unless overwrite.
TEST(AdapterMerge, ExportRefusesForeignFoldersUnlessOverwrite) {
  ThreadPool pool(1);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  TempDir out("foreign");
  std::ofstream(out.path / "thesis.tex") << "keep";
  auto base = Model::load(fixture("model/tiny-llama.f32.gguf"), {.tokenizer = true, .pack = false, .backend = &backend});
  test_util::expect_error([&] { write_hf_folder(*base, out.str(), safetensors::StDType::f32); },
                          ErrorKind::invalid_input, {out.str(), "thesis.tex", "--overwrite"});
  EXPECT_FALSE(fs::exists(out.path / "config.json"));
  FolderWriteOptions opt;
  opt.overwrite = true;
  write_hf_folder(*base, out.str(), safetensors::StDType::f32, opt);
  EXPECT_FALSE(fs::exists(out.path / "thesis.tex"));
  EXPECT_TRUE(fs::exists(out.path / "tokenizer.json"));
  // Now a model folder: written again without overwrite, with nothing left beside it.
  write_hf_folder(*base, out.str(), safetensors::StDType::bf16);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(out.path / "config.json")).at("torch_dtype"), "bfloat16");
  for (const auto& e : fs::directory_iterator(out.path.parent_path()))
    EXPECT_FALSE(e.path().filename().string().starts_with("." + out.path.filename().string() + ".loom-")) << e.path();
}

}  // namespace
}  // namespace loom

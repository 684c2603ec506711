// Per-tensor output scales ("<projection>.scale", NVIDIA ModelOpt's
// weight_scale_2 in NVFP4 files; model/weights.h): the battery's
// tiny.NVFP4-scaled.gguf is tiny.NVFP4.gguf plus a scale for every projection
// (manifest "output_scales"). The reference is built here without loom's scale
// code: tiny.NVFP4.gguf expanded to f32 with each matrix multiplied by its
// scale by hand. Logits and LoRA gradients of the scaled file (NVFP4 kernels,
// scales applied to the outputs) agree with it; folding (merging an adapter,
// fold_output_scales, f32 export) gives its values exactly; a GGUF export keeps
// the scales; a bad scale is an error naming the tensor. The same file against
// llama.cpp: tests/cli/variants_kld_test.sh (every battery file).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "io/gguf.h"
#include "io/gguf_writer.h"
#include "kernels/backend.h"
#include "model/adapter_merge.h"
#include "model/forward.h"
#include "model/gguf_export.h"
#include "model/hf_export.h"
#include "model/model.h"
#include "model/peft_adapter.h"
#include "model_test_util.h"
#include "quant/gguf_quantize.h"
#include "temp_dir.h"
#include "train/data.h"
#include "train/lora_params.h"
#include "train/train_step.h"

namespace loom {
namespace {

const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/gguf_battery/";
const std::string kScaled = kDir + "tiny.NVFP4-scaled.gguf";
const std::string kPlain = kDir + "tiny.NVFP4.gguf";
const char* kProjections[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};
const std::vector<int32_t> kPrompt = {1, 40, 77, 12, 250, 9, 101, 64, 33, 180, 7};

// scale[layer][target] from the manifest.
std::vector<std::array<float, kLoraTargetCount>> manifest_scales() {
  std::ifstream in(kDir + "manifest.json");
  const auto m = nlohmann::json::parse(in);
  for (const auto& f : m["files"]) {
    if (f["file_type"] != "NVFP4-scaled") continue;
    std::vector<std::array<float, kLoraTargetCount>> s(2);
    for (int l = 0; l < 2; ++l)
      for (int t = 0; t < kLoraTargetCount; ++t)
        s[static_cast<size_t>(l)][static_cast<size_t>(t)] =
            f["output_scales"][fmt::format("blk.{}.{}.scale", l, kProjections[t])].get<float>();
    return s;
  }
  ADD_FAILURE() << "no NVFP4-scaled entry in the battery manifest";
  return {};
}

struct Fixture {
  Fixture() : pool(2), backend(make_backend(kCpu, pool)), scales(manifest_scales()) {}
  // tiny.NVFP4.gguf in f32, each matrix times its scale: the function the scaled file means.
  std::unique_ptr<Model> reference(bool pack = true) {
    Model::LoadOptions o{.tokenizer = false, .pack = pack, .backend = backend.get(), .dequantize = true};
    o.before_pack = [this](ModelWeights& w, const ModelConfig&) {
      for (size_t l = 0; l < w.layers.size(); ++l)
        for (LoraTarget t : kAllLoraTargets) {
          Tensor& m = target_matrix(w.layers[l], t);
          ASSERT_EQ(m.dtype, DType::f32);
          float* v = const_cast<float*>(m.as<const float>());
          for (int64_t i = 0; i < m.numel(); ++i) v[i] *= scales[l][static_cast<size_t>(t)];
        }
    };
    return Model::load(kPlain, o);
  }
  std::vector<float> logits(const Model& m) {
    InferenceSession s(m.config(), m.weights(), *backend, 64, DType::f32);
    s.eval(kPrompt, /*all_logits=*/true);
    return s.logits();
  }
  ThreadPool pool;
  std::unique_ptr<Backend> backend;
  std::vector<std::array<float, kLoraTargetCount>> scales;
};

TEST(OutputScales, AreReadPerProjectionAndKeptBesideTheNvfp4Blocks) {
  Fixture f;
  auto m = Model::load(kScaled, {.tokenizer = false, .pack = false});
  for (size_t l = 0; l < 2; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      EXPECT_EQ(m->weights().layers[l].output_scale(t), f.scales[l][static_cast<size_t>(t)]);
      EXPECT_EQ(target_matrix(m->weights().layers[l], t).dtype, DType::nvfp4);
    }
  EXPECT_TRUE(has_output_scales(m->weights()));
  EXPECT_FALSE(has_output_scales(Model::load(kPlain, {.tokenizer = false, .pack = false})->weights()));
}

// The NVFP4 kernels with the scales applied against the f32 reference, within
// 4% relative error per position (8-bit activations: measured 1.3-2.1%); the
// same file without its scales is over 30% off, and leaving out only attn_k's
// scales (1.25 and 0.8) gives 5.7-17%.
TEST(OutputScales, LogitsMatchTheScaledF32Weights) {
  Fixture f;
  const std::vector<float> want = f.logits(*f.reference());
  const std::vector<float> got = f.logits(*Model::load(kScaled, {.tokenizer = false, .backend = f.backend.get()}));
  const std::vector<float> plain = f.logits(*Model::load(kPlain, {.tokenizer = false, .backend = f.backend.get()}));
  const auto V = want.size() / kPrompt.size();
  for (size_t t = 0; t < kPrompt.size(); ++t) {
    EXPECT_LT(test::relative_error(got.data() + t * V, want.data() + t * V, V), 0.04) << "position " << t;
    EXPECT_GT(test::relative_error(plain.data() + t * V, want.data() + t * V, V), 0.3) << "position " << t;
  }
  // Expanded to f32 by loom (dequantize folds the scales): the reference's values exactly.
  const std::vector<float> folded =
      f.logits(*Model::load(kScaled, {.tokenizer = false, .backend = f.backend.get(), .dequantize = true}));
  EXPECT_EQ(folded, want);
}

// LoRA's input gradients go through s W^T: gradients of every LoRA factor
// (layer 0's through layer 1's scaled projections) against the reference's,
// within 4% (measured 2.5%; attn_output's input gradient left unscaled: 21%).
TEST(OutputScales, LoraGradientsMatchTheScaledF32Weights) {
  Fixture f;
  Batch b;
  b.rows = 1;
  b.seq_len = 12;
  std::mt19937 rng(4);
  for (int32_t t = 0; t < b.seq_len; ++t) {
    b.tokens.push_back(static_cast<int32_t>(rng() % 256));
    b.targets.push_back(t + 1 < b.seq_len ? static_cast<int32_t>(rng() % 256) : kIgnoreLabel);
    b.positions.push_back(t);
    b.seq_start.push_back(0);
    b.target_tokens += t + 1 < b.seq_len ? 1 : 0;
  }
  auto grads = [&](const Model& m) {
    LoraConfig lc;
    lc.r = 4;
    lc.seed = 3;
    LoraModel lora(m.config(), lc);
    std::mt19937 init(9);  // B != 0 so that every A gets a gradient too
    std::normal_distribution<float> normal(0.0f, 0.05f);
    for (int64_t i = 0; i < lora.param_count(); ++i) lora.params()[i] += normal(init);
    TrainSession s(m.config(), m.weights(), lora, *f.backend, BackwardMode::exact);
    lora.zero_grads();
    s.forward_backward(b, 1.0f / static_cast<float>(b.target_tokens), 0);
    return std::vector<float>(lora.grads(), lora.grads() + lora.param_count());
  };
  const auto want = grads(*f.reference());
  const auto got = grads(*Model::load(kScaled, {.tokenizer = false, .backend = f.backend.get()}));
  const auto plain = grads(*Model::load(kPlain, {.tokenizer = false, .backend = f.backend.get()}));
  EXPECT_LT(test::relative_error(got.data(), want.data(), want.size()), 0.04);
  EXPECT_GT(test::relative_error(plain.data(), want.data(), want.size()), 0.3);
}

// Whatever uses W's values folds the scale into an f32 copy: the reference's
// values exactly, the scale then 1.
TEST(OutputScales, FoldingGivesTheScaledValues) {
  Fixture f;
  const auto ref = f.reference(/*pack=*/false);
  const auto folded = Model::load(kScaled, {.tokenizer = false, .pack = false, .fold_output_scales = true});
  EXPECT_FALSE(has_output_scales(folded->weights()));
  for (size_t l = 0; l < 2; ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const Tensor& a = target_matrix(folded->weights().layers[l], t);
      const Tensor& b = target_matrix(ref->weights().layers[l], t);
      if (f.scales[l][static_cast<size_t>(t)] == 1.0f) {  // nothing to fold: the NVFP4 blocks stay
        EXPECT_EQ(a.dtype, DType::nvfp4);
        continue;
      }
      ASSERT_EQ(a.dtype, DType::f32);
      EXPECT_EQ(std::memcmp(a.data, b.data, static_cast<size_t>(a.numel()) * 4), 0) << l << " " << kProjections[static_cast<int>(t)];
    }

  // Merging an adapter folds the adapted projections only: W' = s W + B A
  // (llama.cpp: the scale multiplies W x, not the adapter's product).
  peft::AdapterTensors a;
  a.config.r = 1;
  a.config.lora_alpha = 1;
  a.config.target_modules = {LoraTarget::q, LoraTarget::down};
  const ModelConfig& c = folded->config();
  for (LoraTarget t : a.config.target_modules) {
    peft::LoraPair& p = a.pairs[{1, t}];
    p.in = t == LoraTarget::down ? c.intermediate : c.hidden;
    p.out = t == LoraTarget::down ? c.hidden : c.q_dim();
    p.a.assign(static_cast<size_t>(p.in), 0.0f);
    p.b.assign(static_cast<size_t>(p.out), 0.0f);
    p.a[0] = 1.0f;
    p.b[0] = 0.5f;
  }
  auto merged = Model::load(kScaled, {.tokenizer = false, .pack = false, .before_pack = [&](ModelWeights& w, const ModelConfig& mc) {
                                        merge_adapter(w, mc, a, false, "test adapter");
                                      }});
  const LayerWeights& L1 = merged->weights().layers[1];
  EXPECT_EQ(L1.output_scale(LoraTarget::q), 1.0f);
  EXPECT_EQ(L1.output_scale(LoraTarget::down), 1.0f);
  EXPECT_EQ(L1.output_scale(LoraTarget::k), f.scales[1][1]);  // not adapted: kept
  EXPECT_EQ(L1.wk.dtype, DType::nvfp4);
  const float* q = L1.wq.as<const float>();
  const float* want = target_matrix(ref->weights().layers[1], LoraTarget::q).as<const float>();
  EXPECT_EQ(q[0], want[0] + 0.5f);  // B A's only nonzero entry, unscaled
  for (int64_t i = 1; i < L1.wq.numel(); ++i) ASSERT_EQ(q[i], want[i]) << i;
}

// Exports: GGUF keeps the NVFP4 blocks and writes the scales beside them (as
// convert_hf_to_gguf.py does; llama.cpp reads the file as loom does); an F16
// GGUF keeps the scales beside the F16 matrices; a Hugging Face folder (no place
// for a scale) gets the folded values.
TEST(OutputScales, ExportsKeepOrFoldThem) {
  Fixture f;
  test_util::TempDir dir("output_scales");
  const auto src = Model::load(kScaled, {.tokenizer = true, .pack = false});
  const std::vector<float> want = f.logits(*f.reference());
  const auto V = want.size() / kPrompt.size();

  GgufQuantizeOptions q8;
  q8.plan.file_type = FileType::q8_0;
  q8.plan.overrides = {{"attn_|ffn_", DType::nvfp4}};
  q8.allow_requantize = true;
  const std::string same = dir.str() + "/same.gguf";
  quantize_gguf(f.pool, gguf_source_of(*src, "scaled"), same, q8, nullptr);
  const auto file = gguf::File::open(same);
  const auto original = gguf::File::open(kScaled);
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < kLoraTargetCount; ++t) {
      const float want_scale = f.scales[static_cast<size_t>(l)][static_cast<size_t>(t)];
      const auto* s = file->find_tensor(fmt::format("blk.{}.{}.scale", l, kProjections[t]));
      if (want_scale == 1.0f) {
        EXPECT_EQ(s, nullptr);  // a scale of 1 is no scale
      } else {
        ASSERT_NE(s, nullptr);
        EXPECT_EQ(*s->view().as<const float>(), want_scale);
      }
      const auto* w = file->find_tensor(fmt::format("blk.{}.{}.weight", l, kProjections[t]));
      const auto* w0 = original->find_tensor(fmt::format("blk.{}.{}.weight", l, kProjections[t]));
      ASSERT_EQ(w->nbytes, w0->nbytes);
      EXPECT_EQ(std::memcmp(w->data, w0->data, w->nbytes), 0);  // NVFP4 to NVFP4: the same blocks
    }

  GgufQuantizeOptions f16;
  f16.plan.file_type = FileType::f16;
  const std::string wide = dir.str() + "/f16.gguf";
  quantize_gguf(f.pool, gguf_source_of(*src, "scaled"), wide, f16, nullptr);
  auto m16 = Model::load(wide, {.tokenizer = false, .backend = f.backend.get()});
  EXPECT_EQ(m16->weights().layers[0].output_scale(LoraTarget::down), f.scales[0][6]);
  const auto got16 = f.logits(*m16);
  for (size_t t = 0; t < kPrompt.size(); ++t)
    EXPECT_LT(test::relative_error(got16.data() + t * V, want.data() + t * V, V), 1e-2) << "position " << t;

  const std::string hf = dir.str() + "/hf";
  write_hf_folder(*src, hf, safetensors::StDType::f32);
  auto mh = Model::load(hf, {.tokenizer = false, .backend = f.backend.get()});
  EXPECT_FALSE(has_output_scales(mh->weights()));
  const auto goth = f.logits(*mh);
  for (size_t t = 0; t < kPrompt.size(); ++t)
    EXPECT_LT(test::relative_error(goth.data() + t * V, want.data() + t * V, V), 1e-5) << "position " << t;
}

// A copy of tiny.NVFP4.gguf with extra f32 tensors of one element each.
std::string with_extra_scalars(const std::string& dir, const std::map<std::string, float>& extra) {
  const auto src = gguf::File::open(kPlain);
  gguf::Writer w;
  gguf::copy_metadata(*src, w);
  for (const auto& t : src->tensors())
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim),
                 [&t](uint8_t* dst) { std::memcpy(dst, t.data, t.nbytes); });
  for (const auto& [name, v] : extra)
    w.add_tensor(name, DType::f32, {1}, [v](uint8_t* dst) { std::memcpy(dst, &v, 4); });
  const std::string path = dir + "/extra_" + std::to_string(extra.size()) + "_" + extra.begin()->first + ".gguf";
  w.write(path);
  return path;
}

// output.scale is folded into an f32 copy of the output matrix at load: the
// logits are the plain file's times the scale.
TEST(OutputScales, OutputScaleScalesTheLogits) {
  Fixture f;
  test_util::TempDir dir("output_scale");
  const std::string path = with_extra_scalars(dir.str(), {{"output.scale", 0.5f}});
  const Model::LoadOptions f32{.tokenizer = false, .backend = f.backend.get(), .dequantize = true};
  const auto got = f.logits(*Model::load(path, f32));
  auto want = f.logits(*Model::load(kPlain, f32));
  for (float& x : want) x *= 0.5f;
  EXPECT_LT(test::relative_error(got.data(), want.data(), want.size()), 1e-6);
  // The input scales ModelOpt files also carry are for FP4 activations, which
  // llama.cpp does not use either: ignored.
  EXPECT_NO_THROW(Model::load(with_extra_scalars(dir.str(), {{"blk.0.attn_q.input_scale", 3.0f}}),
                              {.tokenizer = false, .pack = false}));
}

TEST(OutputScales, ANonFiniteScaleIsAnErrorNamingTheTensor) {
  test_util::TempDir dir("bad_scale");
  for (float bad : {std::nanf(""), INFINITY}) {
    const std::string path = with_extra_scalars(dir.str(), {{"blk.1.ffn_up.scale", bad}});
    try {
      Model::load(path, {.tokenizer = false, .pack = false});
      ADD_FAILURE() << "a scale of " << bad << " loaded";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
      EXPECT_NE(std::string(e.what()).find("tensor 'blk.1.ffn_up.scale'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("not a finite number"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace loom

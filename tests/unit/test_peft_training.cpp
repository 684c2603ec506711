// 20 AdamW steps of LoRA fine-tuning against PyTorch + PEFT
// (scripts/fixtures/make_peft_training_fixture.py): every step's loss and the
// final adapter match, and the adapter loom writes holds PEFT's final weights
// with the adapter_config.json fields PEFT needs to load it.
#include <gtest/gtest.h>

#include "kernels/backend.h"

#include "peft_fixture_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "safetensors_test_util.h"
#include "model/forward.h"
#include "model/adapter_merge.h"
#include "train/data.h"
#include "train/lora_params.h"
#include "train/optimizer.h"
#include "model/peft_adapter.h"
#include "train/train_step.h"

namespace loom {
namespace {

using test_util::read_f32;

const std::string kDir = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/";

Batch batch_from_hf(const nlohmann::json& j) {
  return test_util::batch_from_hf(j["input_ids"].get<std::vector<std::vector<int32_t>>>(),
                                  j["labels"].get<std::vector<std::vector<int32_t>>>());
}


// max|got - want| / max|want| over one tensor.
double rel_max_err(const float* got, const std::vector<float>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  EXPECT_GT(scale, 0) << "the golden tensor is zero, the check would be empty";
  return err / scale;
}

struct TrainedRun {
  std::unique_ptr<Model> model;
  std::unique_ptr<LoraModel> lora;
  nlohmann::json meta;
  std::vector<double> losses;
};

// Loads the tiny llama (HF folder: q/k rows in HF order, no permutation), sets
// PEFT's initial adapter and runs the fixture's steps with TrainSession + AdamW.
TrainedRun train_like_peft(Backend& backend) {
  TrainedRun run;
  run.model = Model::load(kDir + "model/tiny-llama", {.tokenizer = false, .pack = true, .backend = &backend});
  EXPECT_FALSE(lora_needs_qk_permutation(run.model->config()));
  std::ifstream f(kDir + "peft_training/tiny-llama/run.json");
  run.meta = nlohmann::json::parse(f);
  const nlohmann::json& m = run.meta;
  LoraConfig lc;
  lc.r = m["r"].get<int64_t>();
  lc.alpha = m["alpha"].get<double>();
  lc.set_targets(m["target_modules"].get<std::vector<std::string>>());
  run.lora = std::make_unique<LoraModel>(run.model->config(), lc);
  LoraModel& lora = *run.lora;

  const auto init = safetensors::File::open(kDir + "peft_training/tiny-llama/initial.safetensors");
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets)
      for (bool is_a : {true, false}) {
        Tensor dst = is_a ? lora.a(l, t) : lora.b(l, t);
        const auto v = read_f32(*init, LoraModel::peft_name(l, t, is_a), dst.numel());
        std::memcpy(dst.data, v.data(), v.size() * sizeof(float));
      }

  std::vector<Batch> batches;
  for (const auto& b : m["batches"]) batches.push_back(batch_from_hf(b));
  AdamWConfig ac;
  ac.beta1 = m["betas"][0].get<double>();
  ac.beta2 = m["betas"][1].get<double>();
  ac.eps = m["eps"].get<double>();
  ac.max_grad_norm = m["max_grad_norm"].get<double>();
  ParamGroup g;
  g.name = "lora";
  g.size = static_cast<size_t>(lora.param_count());
  g.lr = m["lr"].get<double>();
  g.weight_decay = m["weight_decay"].get<double>();
  AdamW opt(backend, ac, {g}, g.size);
  TrainSession session(run.model->config(), run.model->weights(), lora, backend);
  const auto n = static_cast<size_t>(lora.param_count());
  const int steps = m["steps"].get<int>();
  for (int s = 0; s < steps; ++s) {
    const Batch& b = batches[static_cast<size_t>(s) % batches.size()];
    lora.zero_grads();
    const LossResult res =
        session.forward_backward(b, 1.0f / static_cast<float>(b.target_tokens), static_cast<uint64_t>(s));
    EXPECT_EQ(res.n_tokens, b.target_tokens);
    run.losses.push_back(res.loss_sum / static_cast<double>(res.n_tokens));
    opt.step({lora.params(), n}, {lora.grads(), n});
  }
  return run;
}

// The adapter in PEFT form (HF row order already: no q/k permutation).
peft::AdapterTensors to_peft(LoraModel& lora) {
  peft::AdapterTensors ad;
  ad.config.r = static_cast<int>(lora.config().r);
  ad.config.lora_alpha = lora.config().alpha;
  ad.config.base_model_name_or_path = "tests/fixtures/model/tiny-llama";
  for (LoraTarget t : kAllLoraTargets) ad.config.target_modules.push_back(t);
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets) {
      const Tensor a = lora.a(l, t), b = lora.b(l, t);
      peft::LoraPair p;
      p.in = a.shape[1];
      p.out = b.shape[0];
      p.a.assign(a.as<float>(), a.as<float>() + a.numel());
      p.b.assign(b.as<float>(), b.as<float>() + b.numel());
      ad.pairs[{static_cast<int>(l), t}] = std::move(p);
    }
  return ad;
}

TEST(PeftTraining, TwentyAdamWStepsMatchPeft) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  TrainedRun run = train_like_peft(backend);
  const auto want = run.meta["losses"].get<std::vector<double>>();
  ASSERT_EQ(run.losses.size(), want.size());
  ASSERT_EQ(want.size(), 20u);
  double worst_loss = 0;
  for (size_t s = 0; s < want.size(); ++s) {
    const double rel = std::fabs(run.losses[s] - want[s]) / std::fabs(want[s]);
    EXPECT_LE(rel, 1e-3) << "step " << s + 1 << ": loss " << run.losses[s] << " vs PEFT " << want[s];
    worst_loss = std::max(worst_loss, rel);
  }
  // Training moved the loss: the comparison is not of a frozen model.
  EXPECT_LT(want.back(), 0.5 * want.front());

  LoraModel& lora = *run.lora;
  const auto fin = safetensors::File::open(kDir + "peft_training/tiny-llama/final.safetensors");
  double worst_w = 0;
  for (int64_t l = 0; l < lora.n_layers(); ++l)
    for (LoraTarget t : kAllLoraTargets)
      for (bool is_a : {true, false}) {
        const Tensor got = is_a ? lora.a(l, t) : lora.b(l, t);
        const std::string name = LoraModel::peft_name(l, t, is_a);
        const double e = rel_max_err(got.as<float>(), read_f32(*fin, name, got.numel()));
        EXPECT_LE(e, 1e-3) << name;
        worst_w = std::max(worst_w, e);
      }
  std::printf("20 steps vs PEFT: worst loss rel err %.2e, worst final adapter max|d|/max|ref| %.2e\n",
              worst_loss, worst_w);

  // Optional hand-off for scripts/fixtures/make_peft_training_fixture.py
  // --check-loom-adapter: PEFT loads loom's adapter and compares logits.
  if (const char* dir = std::getenv("LOOM_WRITE_ADAPTER_TO"); dir != nullptr && *dir != '\0')
    peft::write_adapter(dir, to_peft(lora));
}

TEST(PeftTraining, WrittenAdapterHoldsPeftWeightsAndConfig) {
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  TrainedRun run = train_like_peft(backend);
  testing_util::TempDir tmp;
  const std::string dir = tmp.file("adapter");
  peft::write_adapter(dir, to_peft(*run.lora));

  // Tensors: the names PEFT expects, f32, PEFT's final weights.
  const auto written = safetensors::File::open(dir + "/adapter_model.safetensors");
  const auto fin = safetensors::File::open(kDir + "peft_training/tiny-llama/final.safetensors");
  double worst = 0;
  int n_tensors = 0;
  for (int l = 0; l < 2; ++l)
    for (LoraTarget t : kAllLoraTargets)
      for (bool is_b : {false, true}) {
        const std::string name = peft::tensor_name(l, t, is_b);
        const Tensor ref = fin->view(name);
        const auto got = read_f32(*written, name, ref.numel());
        EXPECT_EQ(written->view(name).shape, ref.shape) << name;
        const double e = rel_max_err(got.data(), read_f32(*fin, name, ref.numel()));
        EXPECT_LE(e, 1e-3) << name;
        worst = std::max(worst, e);
        ++n_tensors;
      }
  EXPECT_EQ(n_tensors, 28);
  std::printf("written adapter vs PEFT final: worst max|d|/max|ref| %.2e over %d tensors\n", worst,
              n_tensors);

  // Config: what PeftModel.from_pretrained reads to rebuild the LoRA layers.
  std::ifstream f(dir + "/adapter_config.json");
  const nlohmann::json cfg = nlohmann::json::parse(f);
  EXPECT_EQ(cfg.at("peft_type"), "LORA");
  EXPECT_EQ(cfg.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(cfg.at("r"), 4);
  EXPECT_EQ(cfg.at("lora_alpha"), 8);
  EXPECT_EQ(cfg.at("bias"), "none");
  EXPECT_EQ(cfg.at("use_dora"), false);
  EXPECT_EQ(cfg.at("use_rslora"), false);
  EXPECT_EQ(cfg.at("fan_in_fan_out"), false);
  EXPECT_EQ(cfg.at("base_model_name_or_path"), "tests/fixtures/model/tiny-llama");
  EXPECT_TRUE(cfg.at("lora_dropout").is_number());
  EXPECT_TRUE(cfg.at("modules_to_save").is_null());
  EXPECT_TRUE(cfg.at("layers_to_transform").is_null());
  const auto targets = cfg.at("target_modules").get<std::vector<std::string>>();
  EXPECT_EQ(
      std::set<std::string>(targets.begin(), targets.end()),
      (std::set<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));

  // And loom reads it back to the same weights.
  const peft::AdapterTensors back = peft::read_adapter(dir);
  EXPECT_EQ(back.pairs.size(), 14u);
  const peft::LoraPair* q1 = back.find(1, LoraTarget::q);
  ASSERT_NE(q1, nullptr);
  const Tensor b = run.lora->b(1, LoraTarget::q);
  ASSERT_EQ(q1->b.size(), static_cast<size_t>(b.numel()));
  EXPECT_EQ(std::memcmp(q1->b.data(), b.data, q1->b.size() * sizeof(float)), 0);
}

// Round trip loom -> PEFT: the adapter loom trains here equals the committed
// loom_adapter/ (made by this test, see scripts/fixtures/make_peft_training_fixture.py
// --loom-adapter-fixture), and PEFT's logits with that folder (PeftModel.from_pretrained,
// committed) equal loom's with it.
TEST(PeftTraining, LoomTrainedAdapterInPeftGivesLoomLogits) {
  const std::string dir = kDir + "peft_training/tiny-llama/loom_adapter";
  ThreadPool pool(2);
  auto backend_owner = make_backend(kCpu, pool);
  Backend& backend = *backend_owner;
  TrainedRun run = train_like_peft(backend);
  const peft::AdapterTensors committed = peft::read_adapter(dir);
  const peft::AdapterTensors now = to_peft(*run.lora);
  double worst_w = 0;
  for (const auto& [key, p] : committed.pairs) {
    const peft::LoraPair* q = now.find(key.first, key.second);
    ASSERT_NE(q, nullptr);
    worst_w = std::max({worst_w, rel_max_err(q->a.data(), p.a), rel_max_err(q->b.data(), p.b)});
  }
  EXPECT_LE(worst_w, 1e-5) << "loom no longer trains the committed adapter";

  auto model = Model::load(kDir + "model/tiny-llama",
                           {.tokenizer = false, .pack = true, .backend = &backend, .before_pack = adapter_merge_hook(dir)});
  std::vector<float> ref;
  {
    std::ifstream g(kDir + "peft_training/tiny-llama/loom_adapter_logits.f32", std::ios::binary);
    g.seekg(0, std::ios::end);
    ref.resize(static_cast<size_t>(g.tellg()) / sizeof(float));
    g.seekg(0);
    g.read(reinterpret_cast<char*>(ref.data()), static_cast<std::streamsize>(ref.size() * sizeof(float)));
  }
  const int64_t V = model->config().vocab_size;
  std::vector<float> got;
  for (const auto& b : run.meta["batches"])
    for (const auto& row : b["input_ids"]) {
      const auto ids = row.get<std::vector<int32_t>>();
      InferenceSession s(model->config(), model->weights(), backend, 64, DType::f32);
      s.eval(ids, /*all_logits=*/true);
      got.insert(got.end(), s.logits().begin(), s.logits().begin() + static_cast<int64_t>(ids.size()) * V);
    }
  ASSERT_EQ(got.size(), ref.size());
  const double e = rel_max_err(got.data(), ref);
  std::printf("loom-trained adapter: loom logits vs PEFT's with the same folder: max|d|/max|ref| %.2e over %zu\n", e,
              ref.size());
  EXPECT_LE(e, 1e-4);
}

}  // namespace
}  // namespace loom

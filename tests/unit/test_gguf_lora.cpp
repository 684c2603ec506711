// llama.cpp GGUF LoRA adapters read as PEFT adapter tensors (model/gguf_lora.h): a PEFT adapter written
// as GGUF (write_lora_gguf, what convert_lora_to_gguf.py writes) reads back as the same pairs, q/k rows
// of B back in Hugging Face order on a llama GGUF base, with the same scaling; files that are no LoRA
// adapter, or one for another architecture, are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/half.h"
#include "expect_error.h"
#include "io/gguf.h"
#include "model/gguf_export.h"
#include "model/gguf_lora.h"
#include "model/model.h"
#include "temp_dir.h"

namespace loom {
namespace {

using test_util::expect_error;
using test_util::TempDir;

std::string fixture(const std::string& rel) {
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel;
}

ModelConfig config_of(const std::string& model) {
  return Model::load(fixture(model), {.tokenizer = false, .pack = false})->config();
}

void expect_same_pairs(const peft::AdapterTensors& want, const peft::AdapterTensors& got, float tol) {
  ASSERT_EQ(got.pairs.size(), want.pairs.size());
  EXPECT_EQ(got.config.r, want.config.r);
  EXPECT_NEAR(got.config.scaling(), want.config.scaling(), 1e-6 * want.config.scaling());
  EXPECT_EQ(got.config.target_modules, want.config.target_modules);
  for (const auto& [key, p] : want.pairs) {
    const auto it = got.pairs.find(key);
    ASSERT_NE(it, got.pairs.end()) << key.first;
    const peft::LoraPair& q = it->second;
    ASSERT_EQ(q.in, p.in);
    ASSERT_EQ(q.out, p.out);
    for (int64_t i = 0; i < p.in * want.config.r; ++i)
      ASSERT_NEAR(q.a_data()[i], p.a_data()[i], tol * std::fabs(p.a_data()[i]))
          << "A " << key.first << " @" << i;
    for (int64_t i = 0; i < p.out * want.config.r; ++i)
      ASSERT_NEAR(q.b_data()[i], p.b_data()[i], tol * std::fabs(p.b_data()[i]))
          << "B " << key.first << " @" << i;
  }
}

TEST(GgufLora, PeftAdapterWrittenAsGgufReadsBackTheSame) {
  const ModelConfig base = config_of("model/tiny-llama.f32.gguf");
  ASSERT_TRUE(lora_needs_qk_permutation(base));  // B's q/k rows go to GGUF order and back
  const peft::AdapterTensors peft_adapter = peft::read_adapter(fixture("peft_adapter/tiny-llama"));
  TempDir dir("gguf_lora");
  const std::string f32 = dir.str() + "/a.gguf", f16 = dir.str() + "/a16.gguf";
  write_lora_gguf(peft_adapter, base, f32, DType::f32);
  write_lora_gguf(peft_adapter, base, f16, DType::f16);
  EXPECT_TRUE(gguf::is_gguf_file(f32));
  EXPECT_FALSE(gguf::is_gguf_file(fixture("peft_adapter/tiny-llama")));
  const peft::AdapterTensors back = peft::read_any_adapter(f32, base);
  expect_same_pairs(peft_adapter, back, 0.0f);
  EXPECT_TRUE(back.config.layers_to_transform.empty());                           // every layer
  expect_same_pairs(peft_adapter, peft::read_gguf_lora(f16, base), 1.0f / 1024);  // f16's rounding
}

TEST(GgufLora, SomeLayersBecomeLayersToTransform) {
  const ModelConfig base = config_of("model/tiny-llama.f32.gguf");
  peft::AdapterTensors a = peft::read_adapter(fixture("peft_adapter/tiny-llama"));
  std::erase_if(a.pairs, [](const auto& kv) { return kv.first.first == 0; });
  a.config.layers_to_transform = {1};
  TempDir dir("gguf_lora_layers");
  write_lora_gguf(a, base, dir.str() + "/a.gguf", DType::f32);
  const peft::AdapterTensors back = peft::read_gguf_lora(dir.str() + "/a.gguf", base);
  EXPECT_EQ(back.config.layers_to_transform, std::vector<int>{1});
  expect_same_pairs(a, back, 0.0f);
}

TEST(GgufLora, FilesThatAreNoAdapterForTheModelAreRefused) {
  const ModelConfig llama = config_of("model/tiny-llama.f32.gguf");
  expect_error([&] { peft::read_gguf_lora(fixture("model/tiny-llama.f32.gguf"), llama); },
               ErrorKind::invalid_input, {"tiny-llama.f32.gguf", "not a LoRA adapter"});
  TempDir dir("gguf_lora_bad");
  write_lora_gguf(peft::read_adapter(fixture("peft_adapter/tiny-llama")), llama, dir.str() + "/a.gguf",
                  DType::f32);
  ModelConfig qwen = llama;
  qwen.arch = Arch::qwen2;
  expect_error([&] { peft::read_gguf_lora(dir.str() + "/a.gguf", qwen); }, ErrorKind::invalid_input,
               {"a.gguf", "architecture 'llama', the model is 'qwen2'"});
  ModelConfig other = llama;
  other.hidden = 96;
  expect_error([&] { peft::read_gguf_lora(dir.str() + "/a.gguf", other); }, ErrorKind::invalid_input,
               {"a.gguf"});
  expect_error([&] { Model::load(dir.str() + "/a.gguf", {.tokenizer = false, .pack = false}); },
               ErrorKind::invalid_input, {"a LoRA adapter", "--adapter"});
  expect_error([&] { peft::read_adapter(dir.str() + "/a.gguf"); }, ErrorKind::invalid_input,
               {"a PEFT adapter is a folder"});
}

}  // namespace
}  // namespace loom

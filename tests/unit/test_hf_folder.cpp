// Hugging Face model folders: single-file and sharded weights, the optional
// tokenizer / generation files, and the index validation errors.
#include <gtest/gtest.h>

#include "expect_error.h"

#include <functional>

#include "core/half.h"
#include "core/mapped_file.h"
#include "io/hf_folder.h"
#include "model/config_load.h"
#include "safetensors_test_util.h"

namespace loom {
namespace {

using namespace loom::testing_util;
using json = nlohmann::json;

using test_util::expect_error;

StEntry f32_entry(const std::string& name, std::vector<int64_t> shape, float base) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = base + static_cast<float>(i);
  return {name, "F32", shape, raw_bytes(v)};
}

const char* kConfig = R"({"model_type": "llama", "hidden_size": 8})";

// A folder with two shards and an index, written fresh per test so each test
// can then break one piece.
struct ShardedFolder {
  TempDir dir;
  json index;
  ShardedFolder() {
    write_file(dir.file("config.json"), kConfig);
    write_file(dir.file("model-00001-of-00002.safetensors"),
               st_build({f32_entry("model.embed_tokens.weight", {5, 3}, 0), f32_entry("model.norm.weight", {3}, 100)}));
    write_file(dir.file("model-00002-of-00002.safetensors"), st_build({f32_entry("lm_head.weight", {5, 3}, 200)}));
    index = {{"metadata", {{"total_size", 132}}},
             {"weight_map",
              {{"model.embed_tokens.weight", "model-00001-of-00002.safetensors"},
               {"model.norm.weight", "model-00001-of-00002.safetensors"},
               {"lm_head.weight", "model-00002-of-00002.safetensors"}}}};
    write_index();
  }
  void write_index() { write_file(dir.file("model.safetensors.index.json"), index.dump(2)); }
};

TEST(HfFolder, SingleFileWithAllOptionalFiles) {
  TempDir dir;
  write_file(dir.file("config.json"), kConfig);
  write_file(dir.file("model.safetensors"), st_build({f32_entry("model.norm.weight", {7}, 1.5f)}));
  write_file(dir.file("tokenizer.json"), "{}");
  write_file(dir.file("tokenizer_config.json"), R"({
    "add_bos_token": true,
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
    "eos_token": "</s>",
    "pad_token": null,
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"
  })");
  write_file(dir.file("generation_config.json"),
             R"({"bos_token_id": 1, "eos_token_id": [2, 32000], "temperature": 0.6, "top_p": 0.9, "top_k": 0,
                 "do_sample": true, "transformers_version": "4.45.0"})");

  const auto f = HfFolder::open(dir.str());
  EXPECT_FALSE(f->sharded());
  EXPECT_EQ(f->config().at("hidden_size"), 8);
  EXPECT_EQ(f->tensor_names(), std::vector<std::string>{"model.norm.weight"});
  const Tensor& t = f->tensor("model.norm.weight");
  EXPECT_EQ(t.dtype, DType::f32);
  EXPECT_EQ(t.numel(), 7);
  EXPECT_EQ(t.as<float>()[6], 7.5f);
  EXPECT_EQ(f->find_tensor("lm_head.weight"), nullptr);
  expect_error([&] { f->tensor("lm_head.weight"); }, ErrorKind::not_found, {dir.str(), "'lm_head.weight'"});

  ASSERT_TRUE(f->tokenizer_json_path());
  EXPECT_EQ(*f->tokenizer_json_path(), dir.file("tokenizer.json"));
  ASSERT_TRUE(f->tokenizer_config());
  const TokenizerSettings s = f->tokenizer_settings();
  EXPECT_EQ(s.bos_token, "<s>");
  EXPECT_EQ(s.eos_token, "</s>");
  EXPECT_FALSE(s.pad_token);
  EXPECT_EQ(s.add_bos_token, true);
  EXPECT_FALSE(s.add_eos_token);
  EXPECT_EQ(s.chat_template, "{% for m in messages %}{{ m.content }}{% endfor %}");

  const GenerationDefaults g = f->generation_defaults();
  EXPECT_EQ(g.eos_token_ids, (std::vector<int64_t>{2, 32000}));
  EXPECT_EQ(g.bos_token_id, 1);
  EXPECT_DOUBLE_EQ(*g.temperature, 0.6);
  EXPECT_DOUBLE_EQ(*g.top_p, 0.9);
  EXPECT_EQ(g.top_k, 0);
  EXPECT_EQ(g.do_sample, true);
  EXPECT_FALSE(g.max_new_tokens);
}

TEST(HfFolder, OptionalFilesAbsent) {
  TempDir dir;
  write_file(dir.file("config.json"), kConfig);
  write_file(dir.file("model.safetensors"), st_build({f32_entry("w", {2}, 0)}));
  const auto f = HfFolder::open(dir.str());
  EXPECT_FALSE(f->tokenizer_json_path());
  EXPECT_FALSE(f->tokenizer_config());
  EXPECT_FALSE(f->generation_config());
  EXPECT_FALSE(f->tokenizer_settings().chat_template);
  EXPECT_TRUE(f->generation_defaults().eos_token_ids.empty());
}

TEST(HfFolder, ChatTemplateVariants) {
  TempDir dir;
  write_file(dir.file("config.json"), kConfig);
  write_file(dir.file("tokenizer_config.json"),
             R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  auto f = HfFolder::open(dir.str(), /*require_weights=*/false);
  EXPECT_EQ(f->tokenizer_settings().chat_template, "D");
  // A chat_template.jinja beside it wins (newer transformers write it there).
  write_file(dir.file("chat_template.jinja"), "J{{ x }}");
  f = HfFolder::open(dir.str(), false);
  EXPECT_EQ(f->tokenizer_settings().chat_template, "J{{ x }}");
}

TEST(HfFolder, EosTokenIdScalar) {
  const auto g = parse_generation_defaults(json::parse(R"({"eos_token_id": 7, "bos_token_id": null})"), "g.json");
  EXPECT_EQ(g.eos_token_ids, std::vector<int64_t>{7});
  EXPECT_FALSE(g.bos_token_id);
}

TEST(HfFolder, ShardedWeights) {
  ShardedFolder s;
  const auto f = HfFolder::open(s.dir.str());
  EXPECT_TRUE(f->sharded());
  EXPECT_EQ(f->shards().size(), 2u);
  EXPECT_EQ(f->tensor_names(),
            (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}));
  EXPECT_EQ(f->tensor("model.norm.weight").as<float>()[2], 102.f);
  EXPECT_EQ(f->tensor("lm_head.weight").as<float>()[14], 214.f);
  const auto* ref = f->find_weight("lm_head.weight");
  ASSERT_NE(ref, nullptr);
  EXPECT_EQ(ref->file->path(), s.dir.file("model-00002-of-00002.safetensors"));
}

// A folder written by transformers' save_pretrained (4 shards, BF16).
TEST(HfFolder, TransformersShardedFixture) {
  const std::string root = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/hf_folder/";
  const auto f = HfFolder::open(root + "tiny_sharded");
  const json expected = json::parse(read_text_file(root + "tiny_sharded_expected.json"));
  EXPECT_TRUE(f->sharded());
  EXPECT_EQ(f->shards().size(), 4u);
  EXPECT_EQ(static_cast<int64_t>(f->tensor_names().size()), expected["n_tensors"].get<int64_t>());
  for (const auto& [name, values] : expected["first_values"].items()) {
    const Tensor& t = f->tensor(name);
    ASSERT_EQ(t.dtype, DType::bf16) << name;
    for (size_t i = 0; i < values.size(); ++i)
      EXPECT_EQ(bf16_to_fp32(t.as<uint16_t>()[i]), values[i].get<float>()) << name << " @" << i;
  }
  EXPECT_EQ(f->tensor("model.layers.1.mlp.down_proj.weight").shape_string(), "[16, 24]");
  const GenerationDefaults g = f->generation_defaults();
  EXPECT_EQ(g.eos_token_ids, (std::vector<int64_t>{2, 3}));
  EXPECT_DOUBLE_EQ(*g.top_p, 0.95);
  const ModelConfig c = config_from_hf(f->config(), f->path_of("config.json"));
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_FALSE(c.tied_embeddings);
}

TEST(HfFolder, SingleFilePreferredOverIndex) {
  ShardedFolder s;
  write_file(s.dir.file("model.safetensors"), st_build({f32_entry("only", {1}, 0)}));
  const auto f = HfFolder::open(s.dir.str());
  EXPECT_FALSE(f->sharded());
  EXPECT_EQ(f->tensor_names(), std::vector<std::string>{"only"});
}

TEST(HfFolder, NonWeightDtypeOpensButCannotBeAWeight) {
  TempDir dir;
  write_file(dir.file("config.json"), kConfig);
  const std::vector<int64_t> ids = {0, 1, 2};
  write_file(dir.file("model.safetensors"), st_build({{"ids", "I64", {3}, raw_bytes(ids)}, f32_entry("w", {2}, 0)}));
  const auto f = HfFolder::open(dir.str());
  ASSERT_NE(f->find_weight("ids"), nullptr);
  EXPECT_FALSE(f->find_weight("ids")->view);
  expect_error([&] { f->find_tensor("ids"); }, ErrorKind::unsupported, {"model.safetensors", "'ids'", "I64"});
  EXPECT_NE(f->find_tensor("w"), nullptr);
}

// ---- folder-level errors ---------------------------------------------------

TEST(HfFolderErrors, MissingPieces) {
  TempDir dir;
  expect_error([&] { HfFolder::open(dir.file("nope")); }, ErrorKind::not_found, {"nope", "not a directory"});
  expect_error([&] { HfFolder::open(dir.str()); }, ErrorKind::not_found, {dir.str(), "config.json"});
  write_file(dir.file("config.json"), kConfig);
  expect_error([&] { HfFolder::open(dir.str()); }, ErrorKind::not_found, {dir.str(), "model.safetensors"});
  EXPECT_NO_THROW(HfFolder::open(dir.str(), /*require_weights=*/false));
  write_file(dir.file("pytorch_model.bin"), "x");
  expect_error([&] { HfFolder::open(dir.str()); }, ErrorKind::not_found, {"convert them to safetensors"});
}

TEST(HfFolderErrors, BadJsonNamesFileAndPosition) {
  TempDir dir;
  write_file(dir.file("config.json"), "{\n  \"a\": 1,\n  \"b\": tru\n}");
  expect_error([&] { HfFolder::open(dir.str(), false); }, ErrorKind::invalid_input,
               {dir.file("config.json"), "line 3"});
  write_file(dir.file("config.json"), "{\"rope_theta\": 1e999}");  // overflows double
  expect_error([&] { HfFolder::open(dir.str(), false); }, ErrorKind::invalid_input, {dir.file("config.json")});
  write_file(dir.file("config.json"), "[1]");
  expect_error([&] { HfFolder::open(dir.str(), false); }, ErrorKind::invalid_input,
               {dir.file("config.json"), "JSON object"});
  write_file(dir.file("config.json"), kConfig);
  write_file(dir.file("generation_config.json"), "{\"eos_token_id\": [1, 2,]}");
  expect_error([&] { HfFolder::open(dir.str(), false); }, ErrorKind::invalid_input,
               {dir.file("generation_config.json"), "line 1, column"});
  std::filesystem::remove(dir.file("generation_config.json"));
  write_file(dir.file("tokenizer_config.json"), "");
  expect_error([&] { HfFolder::open(dir.str(), false); }, ErrorKind::invalid_input,
               {dir.file("tokenizer_config.json")});
}

TEST(HfFolderErrors, OptionalFilesWithWrongTypes) {
  const std::string p = "x/generation_config.json";
  expect_error([&] { parse_generation_defaults(json::parse(R"({"eos_token_id": "2"})"), p); },
               ErrorKind::invalid_input, {p, "eos_token_id"});
  expect_error([&] { parse_generation_defaults(json::parse(R"({"eos_token_id": [2, -1]})"), p); },
               ErrorKind::invalid_input, {p, "eos_token_id"});
  expect_error([&] { parse_generation_defaults(json::parse(R"({"temperature": "hot"})"), p); },
               ErrorKind::invalid_input, {p, "'temperature'"});
  expect_error([&] { parse_generation_defaults(json::parse(R"({"top_p": 1.5})"), p); }, ErrorKind::invalid_input,
               {p, "'top_p'"});
  expect_error([&] { parse_generation_defaults(json::parse(R"({"top_k": 2.5})"), p); }, ErrorKind::invalid_input,
               {p, "'top_k'"});
  const std::string t = "x/tokenizer_config.json";
  expect_error([&] { parse_tokenizer_settings(json::parse(R"({"bos_token": 5})"), t); }, ErrorKind::invalid_input,
               {t, "'bos_token'"});
  expect_error([&] { parse_tokenizer_settings(json::parse(R"({"eos_token": {"id": 5}})"), t); },
               ErrorKind::invalid_input, {t, "'eos_token'"});
  expect_error([&] { parse_tokenizer_settings(json::parse(R"({"add_bos_token": "yes"})"), t); },
               ErrorKind::invalid_input, {t, "'add_bos_token'"});
  expect_error([&] { parse_tokenizer_settings(json::parse(R"({"chat_template": 3})"), t); },
               ErrorKind::invalid_input, {t, "'chat_template'"});
  expect_error([&] { parse_tokenizer_settings(json::parse(R"({"chat_template": [{"name": "default"}]})"), t); },
               ErrorKind::invalid_input, {t, "'chat_template'"});
}

TEST(HfFolderErrors, MissingShard) {
  ShardedFolder s;
  std::filesystem::remove(s.dir.file("model-00002-of-00002.safetensors"));
  expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::not_found,
               {"model.safetensors.index.json", "model-00002-of-00002.safetensors", "does not exist"});
}

TEST(HfFolderErrors, IndexNamesMissingTensor) {
  ShardedFolder s;
  s.index["weight_map"]["model.layers.0.mlp.up_proj.weight"] = "model-00002-of-00002.safetensors";
  s.write_index();
  expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::invalid_input,
               {"model.safetensors.index.json", "'model.layers.0.mlp.up_proj.weight'", "model-00002-of-00002",
                "no such tensor"});
}

TEST(HfFolderErrors, TensorInWrongShard) {
  ShardedFolder s;
  s.index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors";
  s.index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors";
  s.write_index();
  expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::invalid_input, {"'model.norm.weight'", "names"});
}

TEST(HfFolderErrors, TensorNotInIndex) {
  ShardedFolder s;
  s.index["weight_map"].erase("model.norm.weight");
  s.write_index();
  expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::invalid_input,
               {"'model.norm.weight'", "not listed in the weight map"});
}

TEST(HfFolderErrors, DuplicateAcrossShards) {
  ShardedFolder s;
  write_file(s.dir.file("model-00002-of-00002.safetensors"),
             st_build({f32_entry("lm_head.weight", {5, 3}, 200), f32_entry("model.norm.weight", {3}, 0)}));
  expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::invalid_input,
               {"'model.norm.weight'", "in both", "model-00001-of-00002", "model-00002-of-00002"});
}

TEST(HfFolderErrors, MalformedIndex) {
  ShardedFolder s;
  const std::vector<std::pair<json, std::string>> cases = {
      {json::array(), "JSON object"},
      {json{{"metadata", json::object()}}, "'weight_map'"},
      {json{{"weight_map", json::array()}}, "'weight_map'"},
      {json{{"weight_map", json::object()}}, "empty"},
      {json{{"weight_map", {{"a", 3}}}}, "weight_map['a']"},
      {json{{"weight_map", {{"a", "../outside.safetensors"}}}}, "not a plain file name"},
      {json{{"weight_map", {{"a", ""}}}}, "not a plain file name"},
  };
  for (const auto& [idx, needle] : cases) {
    s.index = idx;
    s.write_index();
    expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::invalid_input,
                 {"model.safetensors.index.json", needle});
  }
  write_file(s.dir.file("model.safetensors.index.json"), "{\"weight_map\": {\"a\": }");
  expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::invalid_input,
               {"model.safetensors.index.json", "invalid JSON"});
}

TEST(HfFolderErrors, CorruptShardNamesShard) {
  ShardedFolder s;
  const std::string shard = s.dir.file("model-00002-of-00002.safetensors");
  const std::string image = st_build({f32_entry("lm_head.weight", {5, 3}, 200)});
  write_file(shard, image.substr(0, image.size() - 1));
  expect_error([&] { HfFolder::open(s.dir.str()); }, ErrorKind::invalid_input, {shard, "'lm_head.weight'"});
}

}  // namespace
}  // namespace loom

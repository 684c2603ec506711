// ModelConfig loading: GGUF metadata (built in memory by a tiny GGUF writer),
// config.json files written by transformers, and the validation errors.
#include <gtest/gtest.h>

#include "expect_error.h"

#include <cstring>
#include <filesystem>
#include <functional>

#include "core/mapped_file.h"
#include "io/gguf.h"
#include "model/config_load.h"

namespace loom {
namespace {

using json = nlohmann::json;

using test_util::expect_error;

// ---- a minimal GGUF v3 writer ----------------------------------------------

class GgufWriter {
 public:
  void u32(const std::string& key, uint32_t v) { header(key, 4); pod(v); }
  void u64(const std::string& key, uint64_t v) { header(key, 10); pod(v); }
  void f32(const std::string& key, float v) { header(key, 6); pod(v); }
  void str(const std::string& key, const std::string& v) { header(key, 8); string(v); }
  void str_array(const std::string& key, const std::vector<std::string>& v) {
    header(key, 9);
    pod(uint32_t{8});
    pod(static_cast<uint64_t>(v.size()));
    for (const auto& s : v) string(s);
  }
  void u32_array(const std::string& key, const std::vector<uint32_t>& v) {
    header(key, 9);
    pod(uint32_t{4});
    pod(static_cast<uint64_t>(v.size()));
    for (auto x : v) pod(x);
  }
  // F32 tensor, shape outermost first.
  void tensor(const std::string& name, std::vector<int64_t> shape) { tensors_.push_back({name, std::move(shape)}); }

  std::string build() const {
    std::string out = "GGUF";
    append(out, uint32_t{3});
    append(out, static_cast<uint64_t>(tensors_.size()));
    append(out, n_kv_);
    out += kv_;
    uint64_t offset = 0;
    for (const auto& t : tensors_) {
      append(out, static_cast<uint64_t>(t.name.size()));
      out += t.name;
      append(out, static_cast<uint32_t>(t.shape.size()));
      for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) append(out, static_cast<uint64_t>(*it));
      append(out, uint32_t{0});  // F32
      append(out, offset);
      offset += (bytes_of(t) + 31) / 32 * 32;
    }
    out.resize((out.size() + 31) / 32 * 32, '\0');
    out.resize(out.size() + offset, '\0');
    return out;
  }

 private:
  struct T {
    std::string name;
    std::vector<int64_t> shape;
  };
  static uint64_t bytes_of(const T& t) {
    uint64_t n = 4;
    for (auto d : t.shape) n *= static_cast<uint64_t>(d);
    return n;
  }
  template <typename V>
  static void append(std::string& s, V v) {
    char b[sizeof(V)];
    std::memcpy(b, &v, sizeof(V));
    s.append(b, sizeof(V));
  }
  template <typename V>
  void pod(V v) { append(kv_, v); }
  void string(const std::string& s) {
    pod(static_cast<uint64_t>(s.size()));
    kv_ += s;
  }
  void header(const std::string& key, uint32_t type) {
    ++n_kv_;
    string(key);
    pod(type);
  }

  std::string kv_;
  uint64_t n_kv_ = 0;
  std::vector<T> tensors_;
};

// A small valid llama GGUF; `skip` drops one key, `extra` adds more.
struct GgufSpec {
  std::string arch = "llama";
  std::string skip;
  std::function<void(GgufWriter&)> extra;
  bool output_tensor = false;
  bool tokens = true;
  int64_t embd_rows = 11;
};

std::string make_gguf(const GgufSpec& s) {
  GgufWriter w;
  const std::string a = s.arch;
  auto u32 = [&](const std::string& k, uint32_t v) { if (k != s.skip) w.u32(k, v); };
  if (s.skip != "general.architecture") w.str("general.architecture", a);
  if (s.skip != "general.name") w.str("general.name", "tiny-test");
  u32(a + ".block_count", 3);
  u32(a + ".context_length", 2048);
  u32(a + ".embedding_length", 48);
  u32(a + ".feed_forward_length", 80);
  u32(a + ".attention.head_count", 6);
  u32(a + ".attention.head_count_kv", 2);
  if (s.skip != a + ".attention.layer_norm_rms_epsilon") w.f32(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  if (s.skip != a + ".rope.freq_base") w.f32(a + ".rope.freq_base", 100000.f);
  if (s.tokens) w.str_array("tokenizer.ggml.tokens", std::vector<std::string>(11, "t"));
  if (s.extra) s.extra(w);
  w.tensor("token_embd.weight", {s.embd_rows, 48});
  if (s.output_tensor) w.tensor("output.weight", {s.embd_rows, 48});
  return w.build();
}

// Keeps the image alive as long as the File that points into it.
struct ParsedGguf {
  std::string image;
  std::unique_ptr<gguf::File> file;
};

ParsedGguf parse_gguf(const GgufSpec& s) {
  ParsedGguf p;
  p.image = make_gguf(s);
  p.file = gguf::File::parse(reinterpret_cast<const uint8_t*>(p.image.data()), p.image.size(), "tiny.gguf");
  return p;
}

ModelConfig gguf_config(const GgufSpec& s) { return config_from_gguf(*parse_gguf(s).file); }

// ---- GGUF ------------------------------------------------------------------

TEST(ConfigFromGguf, LlamaDefaultsAndDerivedFields) {
  const ModelConfig c = gguf_config({});
  EXPECT_EQ(c.arch, Arch::llama);
  EXPECT_EQ(c.name, "tiny-test");
  EXPECT_EQ(c.n_layers, 3);
  EXPECT_EQ(c.max_context, 2048);
  EXPECT_EQ(c.hidden, 48);
  EXPECT_EQ(c.intermediate, 80);
  EXPECT_EQ(c.n_heads, 6);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 11);  // from tokenizer.ggml.tokens
  EXPECT_FLOAT_EQ(static_cast<float>(c.rms_eps), 1e-5f);
  EXPECT_DOUBLE_EQ(c.rope_theta, 100000.0);
  EXPECT_EQ(c.rope_layout, RopeLayout::interleaved);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope_scaling.factor, 0.0);
}

TEST(ConfigFromGguf, Qwen2LayoutBiasAndUntied) {
  GgufSpec s;
  s.arch = "qwen2";
  s.output_tensor = true;
  const ModelConfig c = gguf_config(s);
  EXPECT_EQ(c.arch, Arch::qwen2);
  EXPECT_EQ(c.rope_layout, RopeLayout::half);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.tied_embeddings);
}

TEST(ConfigFromGguf, OptionalKeysAndVocabSources) {
  GgufSpec s;
  s.skip = "llama.attention.head_count_kv";
  EXPECT_EQ(gguf_config(s).n_kv_heads, 6);
  s.skip = "llama.rope.freq_base";
  EXPECT_DOUBLE_EQ(gguf_config(s).rope_theta, 10000.0);
  s.skip = "general.name";
  EXPECT_EQ(gguf_config(s).name, "llama");

  GgufSpec v;  // vocab from token_embd rows when there is no token list
  v.tokens = false;
  v.embd_rows = 13;
  EXPECT_EQ(gguf_config(v).vocab_size, 13);
  v.extra = [](GgufWriter& w) { w.u32("llama.vocab_size", 13); };
  EXPECT_EQ(gguf_config(v).vocab_size, 13);

  GgufSpec k;  // explicit key_length wins over hidden / heads
  k.extra = [](GgufWriter& w) {
    w.u32("llama.attention.key_length", 16);
    w.u32("llama.attention.value_length", 16);
    w.u32("llama.rope.dimension_count", 16);
  };
  const ModelConfig c = gguf_config(k);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.q_dim(), 96);
}

TEST(ConfigFromGgufErrors, UnsupportedArchitectureAndFeatures) {
  GgufSpec s;
  s.arch = "phi3";
  expect_error([&] { gguf_config(s); }, ErrorKind::unsupported, {"tiny.gguf", "'phi3'"});
  GgufSpec moe;
  moe.extra = [](GgufWriter& w) { w.u32("llama.expert_count", 8); };
  expect_error([&] { gguf_config(moe); }, ErrorKind::unsupported, {"tiny.gguf", "llama.expert_count", "experts"});
  GgufSpec yarn;
  yarn.extra = [](GgufWriter& w) {
    w.str("llama.rope.scaling.type", "yarn");
    w.f32("llama.rope.scaling.factor", 4.f);
  };
  expect_error([&] { gguf_config(yarn); }, ErrorKind::unsupported, {"llama.rope.scaling.type", "yarn"});
  GgufSpec none;  // "none" and linear x1 are no scaling at all
  none.extra = [](GgufWriter& w) { w.str("llama.rope.scaling.type", "none"); };
  EXPECT_NO_THROW(gguf_config(none));
  GgufSpec partial;
  partial.extra = [](GgufWriter& w) { w.u32("llama.rope.dimension_count", 4); };
  expect_error([&] { gguf_config(partial); }, ErrorKind::unsupported, {"llama.rope.dimension_count", "partial"});
  GgufSpec per_layer;
  per_layer.skip = "llama.attention.head_count_kv";
  per_layer.extra = [](GgufWriter& w) { w.u32_array("llama.attention.head_count_kv", {2, 2, 2}); };
  expect_error([&] { gguf_config(per_layer); }, ErrorKind::unsupported, {"llama.attention.head_count_kv", "per-layer"});
}

TEST(ConfigFromGgufErrors, MissingAndInconsistentKeys) {
  for (const char* key : {"general.architecture", "llama.block_count", "llama.context_length",
                          "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
                          "llama.attention.layer_norm_rms_epsilon"}) {
    GgufSpec s;
    s.skip = key;
    expect_error([&] { gguf_config(s); }, ErrorKind::invalid_input, {"tiny.gguf", key});
  }
  GgufSpec heads;  // 48 is not a multiple of 5 heads
  heads.skip = "llama.attention.head_count";
  heads.extra = [](GgufWriter& w) { w.u32("llama.attention.head_count", 5); };
  expect_error([&] { gguf_config(heads); }, ErrorKind::invalid_input,
               {"llama.embedding_length", "llama.attention.head_count"});
  GgufSpec kv;  // 6 heads, 4 kv heads
  kv.skip = "llama.attention.head_count_kv";
  kv.extra = [](GgufWriter& w) { w.u32("llama.attention.head_count_kv", 4); };
  expect_error([&] { gguf_config(kv); }, ErrorKind::invalid_input, {"llama.attention.head_count_kv"});
  GgufSpec zero;
  zero.skip = "llama.block_count";
  zero.extra = [](GgufWriter& w) { w.u32("llama.block_count", 0); };
  expect_error([&] { gguf_config(zero); }, ErrorKind::invalid_input, {"llama.block_count", "out of range"});
  GgufSpec embd;  // token list says 11 tokens, embedding has 12 rows
  embd.embd_rows = 12;
  expect_error([&] { gguf_config(embd); }, ErrorKind::invalid_input, {"token_embd.weight", "[12, 48]"});
  GgufSpec eps;
  eps.skip = "llama.attention.layer_norm_rms_epsilon";
  eps.extra = [](GgufWriter& w) { w.f32("llama.attention.layer_norm_rms_epsilon", 0.f); };
  expect_error([&] { gguf_config(eps); }, ErrorKind::invalid_input, {"llama.attention.layer_norm_rms_epsilon"});
  GgufSpec wrong_type;
  wrong_type.skip = "llama.block_count";
  wrong_type.extra = [](GgufWriter& w) { w.str("llama.block_count", "three"); };
  expect_error([&] { gguf_config(wrong_type); }, ErrorKind::invalid_input, {"llama.block_count"});
}

// ---- config.json -----------------------------------------------------------

json fixture(const std::string& name) {
  return json::parse(read_text_file(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/hf_config/" + name));
}

TEST(ConfigFromHf, TransformersLlama31) {
  const ModelConfig c = config_from_hf(fixture("llama31.json"), "llama31/config.json");
  EXPECT_EQ(c.arch, Arch::llama);
  EXPECT_EQ(c.rope_layout, RopeLayout::half);
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.hidden, 96);
  EXPECT_EQ(c.intermediate, 200);
  EXPECT_EQ(c.n_layers, 3);
  EXPECT_EQ(c.n_heads, 6);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.max_context, 16384);
  EXPECT_DOUBLE_EQ(c.rms_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position, 8192);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
}

TEST(ConfigFromHf, TransformersQwen2AndMistral) {
  const ModelConfig q = config_from_hf(fixture("qwen2.json"), "qwen2/config.json");
  EXPECT_EQ(q.arch, Arch::qwen2);
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_EQ(q.rope_layout, RopeLayout::half);
  EXPECT_EQ(q.n_kv_heads, 1);
  EXPECT_EQ(q.head_dim, 16);
  EXPECT_DOUBLE_EQ(q.rope_theta, 1e6);
  EXPECT_EQ(q.max_context, 4096);  // sliding window disabled: no cap
  EXPECT_EQ(q.rope_scaling.factor, 0.0);
  EXPECT_FALSE(q.tied_embeddings);

  const ModelConfig m = config_from_hf(fixture("mistral.json"), "mistral/config.json");
  EXPECT_EQ(m.arch, Arch::llama);
  EXPECT_EQ(m.head_dim, 16);
  EXPECT_EQ(m.q_dim(), 128);  // explicit head_dim: q width differs from hidden (64)
  EXPECT_EQ(m.max_context, 4096);  // capped at the sliding window
  EXPECT_DOUBLE_EQ(m.rms_eps, 1e-6);
}

// transformers 4.x spelling (rope_theta at top level, rope_scaling with "type").
const char* kV4Llama = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "tiny/llama-v4",
  "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
  "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
  "rope_theta": 100000, "rope_scaling": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "hidden_act": "silu", "attention_bias": false, "mlp_bias": false, "pretraining_tp": 1
})";

TEST(ConfigFromHf, TransformersV4Spelling) {
  json j = json::parse(kV4Llama);
  ModelConfig c = config_from_hf(j, "config.json");
  EXPECT_EQ(c.name, "tiny/llama-v4");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 100000.0);
  EXPECT_EQ(c.rope_scaling.factor, 0.0);
  j["rope_scaling"] = {{"type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  c = config_from_hf(j, "config.json");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  // Minimal config: defaults for optional keys.
  json m = {{"model_type", "llama"}, {"hidden_size", 64}, {"intermediate_size", 100}, {"num_hidden_layers", 1},
            {"num_attention_heads", 4}, {"vocab_size", 10}, {"max_position_embeddings", 128}};
  c = config_from_hf(m, "config.json");
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_DOUBLE_EQ(c.rms_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.name, "llama");
  EXPECT_EQ(c.torch_dtype, "");
}

TEST(ConfigFromHfErrors, MissingOrMistypedKeys) {
  const json base = json::parse(kV4Llama);
  for (const char* key : {"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "vocab_size", "max_position_embeddings"}) {
    json j = base;
    j.erase(key);
    expect_error([&] { config_from_hf(j, "m/config.json"); }, ErrorKind::invalid_input, {"m/config.json", key});
  }
  const std::vector<std::pair<const char*, json>> wrong = {
      {"hidden_size", "576"},        {"hidden_size", 576.5},        {"num_hidden_layers", true},
      {"num_key_value_heads", "3"},  {"rms_norm_eps", "1e-5"},      {"rope_theta", json::array()},
      {"tie_word_embeddings", 1},    {"vocab_size", -5},            {"head_dim", 6.0},
      {"rope_scaling", "llama3"},    {"torch_dtype", 16},           {"intermediate_size", 0},
  };
  for (const auto& [key, value] : wrong) {
    json j = base;
    j[key] = value;
    expect_error([&] { config_from_hf(j, "m/config.json"); }, ErrorKind::invalid_input, {"m/config.json", key});
  }
  expect_error([&] { config_from_hf(json::array(), "m/config.json"); }, ErrorKind::invalid_input,
               {"m/config.json", "JSON object"});
}

TEST(ConfigFromHfErrors, ShapeRules) {
  json j = json::parse(kV4Llama);
  j["num_attention_heads"] = 7;  // 576 % 7 != 0 and no head_dim
  j["num_key_value_heads"] = 7;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input,
               {"config.json", "hidden_size", "num_attention_heads"});
  j = json::parse(kV4Llama);
  j["num_key_value_heads"] = 2;  // 9 % 2 != 0
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input,
               {"num_attention_heads", "num_key_value_heads"});
  j = json::parse(kV4Llama);
  j["head_dim"] = 63;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input, {"head_dim", "even"});
  j = json::parse(kV4Llama);
  j["rms_norm_eps"] = 0;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input, {"rms_norm_eps"});
  j = json::parse(kV4Llama);
  j["num_hidden_layers"] = 1000000;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input,
               {"num_hidden_layers", "out of range"});
  j = json::parse(kV4Llama);
  j["vocab_size"] = 18446744073709551615ull;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input, {"vocab_size"});
}

TEST(ConfigFromHfErrors, RopeScaling) {
  json j = json::parse(kV4Llama);
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::unsupported, {"config.json", "'linear'"});
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::unsupported, {"'dynamic'"});
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input, {"rope_scaling", "'factor'"});
  j["rope_scaling"]["factor"] = 8.0;
  j["rope_scaling"]["low_freq_factor"] = 4.0;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::invalid_input, {"low_freq_factor"});
  json v5 = fixture("llama31.json");
  v5["rope_parameters"]["rope_type"] = "yarn";
  expect_error([&] { config_from_hf(v5, "config.json"); }, ErrorKind::unsupported, {"rope_parameters", "'yarn'"});
}

TEST(ConfigFromHfErrors, UnsupportedModels) {
  json j = json::parse(kV4Llama);
  j["model_type"] = "gemma";
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::unsupported, {"config.json", "'gemma'"});
  j = json::parse(kV4Llama);
  j["hidden_act"] = "gelu";
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::unsupported, {"hidden_act", "gelu"});
  j = json::parse(kV4Llama);
  j["quantization_config"] = {{"quant_method", "gptq"}};
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::unsupported, {"quantization_config"});
  j = json::parse(kV4Llama);
  j["attention_bias"] = true;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::unsupported, {"attention_bias"});
  j = json::parse(kV4Llama);
  j["mlp_bias"] = true;
  expect_error([&] { config_from_hf(j, "config.json"); }, ErrorKind::unsupported, {"mlp_bias"});
}

// The default model's GGUF metadata and the transformers config of the same
// model (SmolLM2-135M-Instruct, spelled as in its repository) must agree.
TEST(ConfigFromGguf, DefaultModelMatchesItsHfConfig) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "default model not fetched: " << path;
  const auto file = gguf::File::open(path);
  const ModelConfig g = config_from_gguf(*file);
  const ModelConfig h = config_from_hf(json::parse(kV4Llama), "config.json");
  EXPECT_EQ(g.arch, h.arch);
  EXPECT_EQ(g.vocab_size, h.vocab_size);
  EXPECT_EQ(g.hidden, h.hidden);
  EXPECT_EQ(g.intermediate, h.intermediate);
  EXPECT_EQ(g.n_layers, h.n_layers);
  EXPECT_EQ(g.n_heads, h.n_heads);
  EXPECT_EQ(g.n_kv_heads, h.n_kv_heads);
  EXPECT_EQ(g.head_dim, h.head_dim);
  EXPECT_EQ(g.max_context, h.max_context);
  EXPECT_NEAR(g.rms_eps, h.rms_eps, 1e-9);
  EXPECT_DOUBLE_EQ(g.rope_theta, h.rope_theta);
  EXPECT_EQ(g.tied_embeddings, h.tied_embeddings);
  EXPECT_EQ(g.rope_layout, RopeLayout::interleaved);
}

}  // namespace
}  // namespace loom

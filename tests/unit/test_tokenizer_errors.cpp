// Corruption battery for the tokenizer loaders: a broken tokenizer.json or
// GGUF tokenizer must raise loom::Error naming the file and the field, never
// crash or silently tokenize differently.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/gguf.h"
#include "test_tokenizer_util.h"

namespace loom {
namespace {

using namespace tok_test;

json base_json() {
  return json::parse(R"({
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<s>": 3, "\u0120": 4}, "merges": ["a b"],
              "unk_token": null, "byte_fallback": false},
    "added_tokens": [{"id": 3, "content": "<s>", "special": true, "normalized": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "decoder": {"type": "ByteLevel"},
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [3]}}}
  })");
}

Tokenizer load(const json& j) {
  return Tokenizer::from_spec(Tokenizer::spec_from_tokenizer_json(j, std::nullopt, "tok.json"));
}

TEST(TokenizerErrors, BaseIsValid) {
  const Tokenizer t = load(base_json());
  EXPECT_EQ(t.encode("ab", true, true), (std::vector<int32_t>{3, 2}));
}

struct JsonCase {
  const char* what;
  std::function<void(json&)> mutate;
  ErrorKind kind;
  std::vector<std::string> needles;
};

TEST(TokenizerErrors, TokenizerJsonBattery) {
  const std::vector<JsonCase> cases = {
      {"root is an array",
       [](json& j) { j = json::array(); },
       ErrorKind::invalid_input,
       {"expected an object"}},
      {"no model", [](json& j) { j.erase("model"); }, ErrorKind::invalid_input, {"missing field 'model'"}},
      {"model type",
       [](json& j) { j["model"]["type"] = "Unigram"; },
       ErrorKind::unsupported,
       {"model.type", "Unigram"}},
      {"model type not a string",
       [](json& j) { j["model"]["type"] = 3; },
       ErrorKind::invalid_input,
       {"model.type"}},
      {"vocab not an object",
       [](json& j) { j["model"]["vocab"] = json::array(); },
       ErrorKind::invalid_input,
       {"model.vocab", "expected an object"}},
      {"vocab id a string",
       [](json& j) { j["model"]["vocab"]["a"] = "0"; },
       ErrorKind::invalid_input,
       {"model.vocab.a", "expected an integer"}},
      {"vocab id negative",
       [](json& j) { j["model"]["vocab"]["a"] = -1; },
       ErrorKind::invalid_input,
       {"model.vocab.a"}},
      {"vocab id huge",
       [](json& j) { j["model"]["vocab"]["a"] = 1LL << 40; },
       ErrorKind::invalid_input,
       {"model.vocab.a", "outside"}},
      {"vocab id sparse",
       [](json& j) { j["model"]["vocab"]["a"] = 5000000; },
       ErrorKind::invalid_input,
       {"model.vocab", "5000000"}},
      {"vocab id twice",
       [](json& j) { j["model"]["vocab"]["b"] = 0; },
       ErrorKind::invalid_input,
       {"model.vocab", "id 0"}},
      {"merges missing",
       [](json& j) { j["model"].erase("merges"); },
       ErrorKind::invalid_input,
       {"missing field 'merges'"}},
      {"merge without space",
       [](json& j) { j["model"]["merges"][0] = "ab"; },
       ErrorKind::invalid_input,
       {"model.merges[0]"}},
      {"merge with two spaces",
       [](json& j) { j["model"]["merges"][0] = "a b c"; },
       ErrorKind::invalid_input,
       {"model.merges[0]"}},
      {"merge triple",
       [](json& j) {
         j["model"]["merges"][0] = json::array({"a", "b", "c"});
       },
       ErrorKind::invalid_input,
       {"model.merges[0]"}},
      {"merge pair of numbers",
       [](json& j) {
         j["model"]["merges"][0] = json::array({1, 2});
       },
       ErrorKind::invalid_input,
       {"model.merges[0][0]"}},
      {"merge unknown token",
       [](json& j) { j["model"]["merges"].push_back("a z"); },
       ErrorKind::invalid_input,
       {"merges[1]", "\"z\""}},
      {"merge result missing",
       [](json& j) { j["model"]["merges"].push_back("b a"); },
       ErrorKind::invalid_input,
       {"merges[1]", "\"ba\""}},
      {"unk token missing",
       [](json& j) { j["model"]["unk_token"] = "<unk>"; },
       ErrorKind::invalid_input,
       {"unk_token", "<unk>"}},
      {"subword prefix",
       [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       ErrorKind::unsupported,
       {"model.continuing_subword_prefix"}},
      {"dropout", [](json& j) { j["model"]["dropout"] = 0.1; }, ErrorKind::unsupported, {"model.dropout"}},
      {"byte_fallback not bool",
       [](json& j) { j["model"]["byte_fallback"] = "yes"; },
       ErrorKind::invalid_input,
       {"model.byte_fallback", "true or false"}},
      {"added tokens not array",
       [](json& j) { j["added_tokens"] = json::object(); },
       ErrorKind::invalid_input,
       {"added_tokens", "expected an array"}},
      {"added token id string",
       [](json& j) { j["added_tokens"][0]["id"] = "3"; },
       ErrorKind::invalid_input,
       {"added_tokens[0].id"}},
      {"added token no content",
       [](json& j) { j["added_tokens"][0].erase("content"); },
       ErrorKind::invalid_input,
       {"added_tokens[0]", "content"}},
      {"added token special not bool",
       [](json& j) { j["added_tokens"][0]["special"] = 1; },
       ErrorKind::invalid_input,
       {"added_tokens[0].special"}},
      {"normalizer unknown",
       [](json& j) {
         j["normalizer"] = {{"type", "NFKC"}};
       },
       ErrorKind::unsupported,
       {"normalizer", "NFKC"}},
      {"normalizer no type",
       [](json& j) { j["normalizer"] = json::object(); },
       ErrorKind::invalid_input,
       {"normalizer", "missing field 'type'"}},
      {"replace bad pattern",
       [](json& j) {
         j["normalizer"] = {{"type", "Replace"}, {"pattern", "x"}, {"content", "y"}};
       },
       ErrorKind::invalid_input,
       {"normalizer.pattern"}},
      {"replace bad regex",
       [](json& j) {
         j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", "("}}}, {"content", "y"}};
       },
       ErrorKind::invalid_input,
       {"normalizer step 0", "regex"}},
      {"pre-tokenizer unknown",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Whitespace"}};
       },
       ErrorKind::unsupported,
       {"pre_tokenizer", "Whitespace"}},
      {"split bad regex",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "[a-"}}}, {"behavior", "Isolated"}};
       },
       ErrorKind::invalid_input,
       {"pre_tokenizer step 0", "regex"}},
      {"split bad behavior",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}};
       },
       ErrorKind::invalid_input,
       {"pre_tokenizer.behavior", "Sideways"}},
      {"sequence not array",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", 3}};
       },
       ErrorKind::invalid_input,
       {"pre_tokenizer.pretokenizers"}},
      {"nested unknown",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Digits"}}, {{"type", "Bert"}}}}};
       },
       ErrorKind::unsupported,
       {"pre_tokenizer.pretokenizers[1]", "Bert"}},
      {"metaspace long replacement",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "ab"}, {"prepend_scheme", "first"}};
       },
       ErrorKind::invalid_input,
       {"pre_tokenizer.replacement", "single character"}},
      {"metaspace bad scheme",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}, {"prepend_scheme", "sometimes"}};
       },
       ErrorKind::invalid_input,
       {"prepend_scheme", "sometimes"}},
      {"decoder unknown",
       [](json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       },
       ErrorKind::unsupported,
       {"decoder", "WordPiece"}},
      {"strip negative",
       [](json& j) {
         j["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", -1}, {"stop", 0}};
       },
       ErrorKind::invalid_input,
       {"decoder.start"}},
      {"post-processor unknown",
       [](json& j) {
         j["post_processor"] = {{"type", "BertProcessing"}};
       },
       ErrorKind::unsupported,
       {"post_processor", "BertProcessing"}},
      {"template unknown special",
       [](json& j) { j["post_processor"]["special_tokens"] = json::object(); },
       ErrorKind::invalid_input,
       {"post_processor.single[0]", "<s>"}},
      {"template without A",
       [](json& j) { j["post_processor"]["single"].erase(1); },
       ErrorKind::invalid_input,
       {"post_processor.single", "$A"}},
      {"template id out of range",
       [](json& j) { j["post_processor"]["special_tokens"]["<s>"]["ids"] = {99}; },
       ErrorKind::invalid_input,
       {"BOS id 99"}},
      {"nesting",
       [](json& j) {
         json d = {{"type", "Digits"}};
         for (int i = 0; i < 40; ++i) d = {{"type", "Sequence"}, {"pretokenizers", json::array({d})}};
         j["pre_tokenizer"] = d;
       },
       ErrorKind::invalid_input,
       {"too deeply nested"}},
      {"template two specials",
       [](json& j) {
         j["post_processor"]["single"].insert(
             j["post_processor"]["single"].begin(),
             json::parse(R"({"SpecialToken": {"id": "<s>", "type_id": 0}})"));
       },
       ErrorKind::unsupported,
       {"post_processor"}},
  };
  for (const JsonCase& c : cases) {
    SCOPED_TRACE(c.what);
    json j = base_json();
    c.mutate(j);
    std::vector<std::string> needles = c.needles;
    needles.push_back("tok.json");
    expect_error([&] { load(j); }, c.kind, needles);
  }
}

TEST(TokenizerErrors, BadFiles) {
  const auto dir = std::filesystem::temp_directory_path() / "loom_tokenizer_errors";
  std::filesystem::create_directories(dir);
  const auto write = [&](const char* name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  };
  const std::string bad_utf8 =
      write("bad_utf8.json", "{\"model\": {\"vocab\": {\"\xFF\": 0}, \"merges\": []}}");
  expect_error([&] { Tokenizer::from_tokenizer_json(bad_utf8); }, ErrorKind::invalid_input,
               {"bad_utf8.json"});
  const std::string truncated = write("truncated.json", base_json().dump().substr(0, 40));
  expect_error([&] { Tokenizer::from_tokenizer_json(truncated); }, ErrorKind::invalid_input,
               {"truncated.json"});
  std::filesystem::remove_all(dir);
}

TEST(TokenizerErrors, AddedTokenIdsFollowHuggingFace) {
  // HF ignores the id written for an added token: a content in the vocabulary
  // keeps its id, a new one goes after the vocabulary.
  json j = base_json();
  j["added_tokens"].push_back({{"id", 77}, {"content", "<new>"}, {"special", true}});
  j["added_tokens"].push_back({{"id", 1}, {"content", "ab"}, {"special", false}});
  const Tokenizer t = load(j);
  EXPECT_EQ(t.token_id("<new>"), 5);
  EXPECT_EQ(t.token_id("ab"), 2);
  EXPECT_EQ(t.vocab_size(), 6);
  EXPECT_EQ(t.encode("x<new>", false, true).back(), 5);
}

// ---- GGUF ------------------------------------------------------------------

// Builds a tensor-less GGUF v3 image holding only metadata.
class GgufImage {
 public:
  template <typename T>
  void put(T v) {
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &v, sizeof(T));
  }
  void put_str(std::string_view s) {
    put<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  void key(std::string_view k, gguf::ValueType t) {
    put_str(k);
    put<uint32_t>(static_cast<uint32_t>(t));
    ++n_kv_;
  }
  void str(std::string_view k, std::string_view v) {
    key(k, gguf::ValueType::string);
    put_str(v);
  }
  void u32(std::string_view k, uint32_t v) {
    key(k, gguf::ValueType::u32);
    put(v);
  }
  void boolean(std::string_view k, bool v) {
    key(k, gguf::ValueType::boolean);
    put<uint8_t>(v);
  }
  void strs(std::string_view k, const std::vector<std::string>& v) {
    key(k, gguf::ValueType::array);
    put<uint32_t>(static_cast<uint32_t>(gguf::ValueType::string));
    put<uint64_t>(v.size());
    for (const auto& s : v) put_str(s);
  }
  void i32s(std::string_view k, const std::vector<int32_t>& v) {
    key(k, gguf::ValueType::array);
    put<uint32_t>(static_cast<uint32_t>(gguf::ValueType::i32));
    put<uint64_t>(v.size());
    for (int32_t x : v) put(x);
  }
  void f32s(std::string_view k, const std::vector<float>& v) {
    key(k, gguf::ValueType::array);
    put<uint32_t>(static_cast<uint32_t>(gguf::ValueType::f32));
    put<uint64_t>(v.size());
    for (float x : v) put(x);
  }
  std::vector<uint8_t> finish() const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F', 3, 0, 0, 0};
    const uint64_t zero = 0, n = n_kv_;
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&zero),
               reinterpret_cast<const uint8_t*>(&zero) + 8);
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&n), reinterpret_cast<const uint8_t*>(&n) + 8);
    out.insert(out.end(), bytes_.begin(), bytes_.end());
    return out;
  }

 private:
  std::vector<uint8_t> bytes_;
  uint64_t n_kv_ = 0;
};

struct GgufTok {
  std::string model = "gpt2";
  std::optional<std::string> pre = "llama-bpe";
  std::vector<std::string> tokens = {"a", "b", "ab", "<s>", "\xC4\xA0"};
  std::optional<std::vector<int32_t>> types = std::vector<int32_t>{1, 1, 1, 3, 1};
  std::optional<std::vector<std::string>> merges = std::vector<std::string>{"a b"};
  std::optional<std::vector<float>> scores;
  std::optional<uint32_t> bos = 3;
};

Tokenizer load_gguf(const GgufTok& g) {
  GgufImage img;
  img.str("tokenizer.ggml.model", g.model);
  if (g.pre) img.str("tokenizer.ggml.pre", *g.pre);
  img.strs("tokenizer.ggml.tokens", g.tokens);
  if (g.types) img.i32s("tokenizer.ggml.token_type", *g.types);
  if (g.merges) img.strs("tokenizer.ggml.merges", *g.merges);
  if (g.scores) img.f32s("tokenizer.ggml.scores", *g.scores);
  if (g.bos) img.u32("tokenizer.ggml.bos_token_id", *g.bos);
  const std::vector<uint8_t> bytes = img.finish();
  auto f = gguf::File::parse(bytes.data(), bytes.size(), "tok.gguf");
  return Tokenizer::from_gguf(*f);
}

TEST(TokenizerErrors, GgufBaseIsValid) {
  const Tokenizer t = load_gguf(GgufTok{});
  EXPECT_EQ(t.encode("ab<s>", false, true), (std::vector<int32_t>{2, 3}));
  EXPECT_FALSE(t.add_bos());  // gpt2 vocabularies add no BOS unless the file says so
  GgufTok spm;
  spm.model = "llama";
  spm.pre.reset();
  spm.tokens = {"<unk>",
                "<s>",
                "</s>",
                "\xE2\x96\x81",
                "a",
                "\xE2\x96\x81"
                "a"};
  spm.types = std::vector<int32_t>{2, 3, 3, 1, 1, 1};
  spm.merges.reset();
  spm.scores = std::vector<float>{0, 0, 0, -1, -2, -3};
  spm.bos = 1;
  const Tokenizer s = load_gguf(spm);
  EXPECT_EQ(s.encode("a a", true, true), (std::vector<int32_t>{1, 5, 5}));
  EXPECT_EQ(s.decode(s.encode("a a", true, true), true), "a a");
}

TEST(TokenizerErrors, GgufBattery) {
  struct Case {
    const char* what;
    std::function<void(GgufTok&)> mutate;
    ErrorKind kind;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"unknown model",
       [](GgufTok& g) { g.model = "bert"; },
       ErrorKind::unsupported,
       {"tokenizer.ggml.model", "bert"}},
      {"unknown pre",
       [](GgufTok& g) { g.pre = "mystery"; },
       ErrorKind::unsupported,
       {"tokenizer.ggml.pre", "mystery"}},
      {"empty vocabulary",
       [](GgufTok& g) {
         g.tokens.clear();
         g.types->clear();
         g.merges->clear();
         g.bos.reset();
       },
       ErrorKind::invalid_input,
       {"tokenizer.ggml.tokens", "empty"}},
      {"token not UTF-8",
       [](GgufTok& g) { g.tokens[1] = std::string(1, static_cast<char>(0xFF)); },
       ErrorKind::invalid_input,
       {"token 1", "UTF-8"}},
      {"types length",
       [](GgufTok& g) { g.types->pop_back(); },
       ErrorKind::invalid_input,
       {"token_type", "4 entries"}},
      {"bos out of range", [](GgufTok& g) { g.bos = 99; }, ErrorKind::invalid_input, {"bos_token_id", "99"}},
      {"no merges",
       [](GgufTok& g) { g.merges.reset(); },
       ErrorKind::invalid_input,
       {"tokenizer.ggml.merges"}},
      {"merge without space",
       [](GgufTok& g) { g.merges = std::vector<std::string>{"ab"}; },
       ErrorKind::invalid_input,
       {"tokenizer.ggml.merges", "entry 0"}},
      {"merge unknown token",
       [](GgufTok& g) { g.merges->push_back("a q"); },
       ErrorKind::invalid_input,
       {"merges[1]", "\"q\""}},
      {"llama without scores",
       [](GgufTok& g) {
         g.model = "llama";
         g.merges.reset();
       },
       ErrorKind::invalid_input,
       {"tokenizer.ggml.scores"}},
      {"llama scores length",
       [](GgufTok& g) {
         g.model = "llama";
         g.merges.reset();
         g.scores = std::vector<float>{0, 1};
       },
       ErrorKind::invalid_input,
       {"tokenizer.ggml.scores", "2 entries"}},
      {"llama score NaN",
       [](GgufTok& g) {
         g.model = "llama";
         g.merges.reset();
         g.scores = std::vector<float>{0, 0, std::nanf(""), 0, 0};
       },
       ErrorKind::invalid_input,
       {"tokenizer.ggml.scores", "entry 2"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    GgufTok g;
    c.mutate(g);
    std::vector<std::string> needles = c.needles;
    needles.push_back("tok.gguf");
    expect_error([&] { load_gguf(g); }, c.kind, needles);
  }
}

}  // namespace
}  // namespace loom

// Tokenizer export (tokenizer/tokenizer_export.h): every committed tokenizer,
// GGUF and tokenizer.json forms, and the default SmolLM2 GGUF are written as
// tokenizer.json + tokenizer_config.json, reloaded, and must give the same ids,
// decodings and special tokens as the original and as HF's reference ids; plus
// the write_hf_folder hook for a GGUF model and the refusals.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>

#include "io/gguf.h"
#include "model/model.h"
#include "test_tokenizer_util.h"
#include "tokenizer/tokenizer_export.h"
#include "model/hf_export.h"

namespace loom {
namespace {

using namespace tok_test;
namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("loom-tokexp-" + tag + "-" + std::to_string(::getpid()));
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string str() const { return path.string(); }
};

Tokenizer load_gguf(const std::string& path) {
  auto f = gguf::File::open(path);
  return Tokenizer::from_gguf(*f);
}

// Writes `tok` to a folder and loads it back the way Model does for an HF folder.
Tokenizer round_trip(const Tokenizer& tok, const std::string& tag,
                     const std::optional<std::string>& chat_template = std::nullopt) {
  TempDir dir(tag);
  write_tokenizer_files(tok, chat_template, 4096, dir.str());
  const json cfg = read_json_file(dir.str() + "/tokenizer_config.json");
  return Tokenizer::from_tokenizer_json(dir.str() + "/tokenizer.json", cfg);
}

// Texts beyond the fixture corpus: whitespace runs, digit runs, CJK, emoji,
// special-token strings, byte-fallback material, and random glued fragments.
std::vector<std::string> test_texts() {
  std::vector<std::string> texts;
  for (const auto& l : references()["corpus"]) texts.push_back(l.get<std::string>());
  const std::vector<std::string> frags = {" ",
                                          "  ",
                                          "\n",
                                          "\r\n",
                                          "\t",
                                          "a",
                                          "Z",
                                          "'s",
                                          "'LL",
                                          "1",
                                          "23",
                                          "456",
                                          "7890",
                                          "é",
                                          "e\xCC\x81",
                                          "中",
                                          "文字",
                                          "😀",
                                          "👍🏽",
                                          "\xE2\x96\x81",
                                          "<|im_end|>",
                                          "<|im_start|>",
                                          "<s>",
                                          "</s>",
                                          "<unk>",
                                          "<|begin_of_text|>",
                                          "<|eot_id|>",
                                          "<|endoftext|>",
                                          "!",
                                          "...",
                                          "\xC2\xA0",
                                          "\xEF\xBF\xBD",
                                          "x",
                                          "hello",
                                          " world",
                                          "\xF0\x9F\x87\xBA\xF0\x9F\x87\xB8",
                                          "\xE3\x80\x80",
                                          "\x01"};
  std::mt19937 rng(20240531);
  for (int iter = 0; iter < 200; ++iter) {
    std::string s;
    const int n = std::uniform_int_distribution<int>(1, 37)(rng);
    for (int k = 0; k < n; ++k) s += frags[std::uniform_int_distribution<size_t>(0, frags.size() - 1)(rng)];
    texts.push_back(std::move(s));
  }
  texts.push_back(std::string(1000, ' '));
  texts.push_back("\n\n\n\n\n\n\n\t\t\t\t    \n");
  texts.push_back("0123456789 00000000000 3.14159265358979 1,234,567.89");
  return texts;
}

// The reloaded tokenizer must behave exactly as the original one.
void expect_same(const Tokenizer& a, const Tokenizer& b, const std::string& name) {
  ASSERT_EQ(a.vocab_size(), b.vocab_size()) << name;
  EXPECT_EQ(a.bos(), b.bos()) << name;
  EXPECT_EQ(a.eos(), b.eos()) << name;
  EXPECT_EQ(a.add_bos(), b.add_bos()) << name;
  EXPECT_EQ(a.spec().add_eos, b.spec().add_eos) << name;
  EXPECT_EQ(a.kind(), b.kind()) << name;
  EXPECT_EQ(a.chat_template(), b.chat_template()) << name;
  int text_diffs = 0;
  for (int32_t id = 0; id < a.vocab_size() && text_diffs < 5; ++id) {
    text_diffs += a.token_text(id) != b.token_text(id) || a.is_special(id) != b.is_special(id);
    EXPECT_EQ(a.token_text(id), b.token_text(id)) << name << " id " << id;
    EXPECT_EQ(a.is_special(id), b.is_special(id)) << name << " id " << id;
    if (a.is_eog(id)) {
      EXPECT_TRUE(b.is_eog(id)) << name << " id " << id;
    }
  }
  int mismatches = 0;
  // Byte-level BPE loses nothing unless a normalizer or a whitespace-swallowing added token changes the text.
  bool lossless = a.kind() == TokenizerKind::byte_level_bpe && a.spec().normalizers.empty();
  for (const AddedToken& t : a.spec().added_tokens) lossless = lossless && !t.lstrip && !t.rstrip;
  for (const std::string& t : test_texts()) {
    for (const bool add_special : {false, true})
      for (const bool parse_special : {true, false}) {
        const auto ids = a.encode(t, add_special, parse_special);
        const auto got = b.encode(t, add_special, parse_special);
        EXPECT_EQ(got, ids) << name << " add_special " << add_special << " parse_special " << parse_special
                            << ": \"" << show(t) << "\"";
        mismatches += got != ids;
        EXPECT_EQ(b.decode(ids), a.decode(ids)) << name << ": \"" << show(t) << "\"";
        EXPECT_EQ(b.decode(ids, true), a.decode(ids, true)) << name << ": \"" << show(t) << "\"";
        if (lossless && !add_special) {
          EXPECT_EQ(b.decode(got), t) << name << ": \"" << show(t) << "\"";
        }
      }
    if (mismatches > 5) FAIL() << "too many mismatches for " << name;
  }
}

// HF's reference ids (reference_ids.json) for the reloaded tokenizer.
void expect_reference(const Tokenizer& tok, const json& ref, const json& corpus, const std::string& name) {
  const auto prefix = ref["add_special_prefix"].get<std::vector<int32_t>>();
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string line = corpus[i].get<std::string>();
    const auto want = ref["ids"][i].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(line, false, true), want) << name << " line " << i << ": \"" << show(line) << "\"";
    auto with = prefix;
    with.insert(with.end(), want.begin(), want.end());
    EXPECT_EQ(tok.encode(line, true, true), with) << name << " add_special, line " << i;
    const std::string decoded = ref["decoded"][i].is_null() ? line : ref["decoded"][i].get<std::string>();
    EXPECT_EQ(tok.decode(want), decoded) << name << " decode, line " << i;
    if (ref.contains("ids_no_parse_special")) {
      EXPECT_EQ(tok.encode(line, false, false), ref["ids_no_parse_special"][i].get<std::vector<int32_t>>())
          << name << " parse_special=false, line " << i;
    }
  }
}

class ExportGguf : public ::testing::TestWithParam<std::string> {};

TEST_P(ExportGguf, ReloadsToTheSameTokenizer) {
  const std::string name = GetParam();
  const Tokenizer orig = load_gguf(fixture(name));
  const Tokenizer back = round_trip(orig, "gguf");
  expect_same(orig, back, name);
  expect_reference(back, reference_for(name), references()["corpus"], name + " exported");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ExportGguf,
                         ::testing::Values("llama3_style.gguf", "qwen2_style.gguf", "spm_style.gguf"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '.') c = '_';
                           return s;
                         });

// tokenizer.json forms: the writer is generic over the spec, so normalizers
// (Prepend/Replace, NFC), lstrip/rstrip/single_word tokens and added tokens
// after the vocabulary must survive too.
class ExportJson : public ::testing::TestWithParam<std::string> {};

TEST_P(ExportJson, ReloadsToTheSameTokenizer) {
  const std::string name = GetParam();
  const Tokenizer orig = json_variant(name);
  const Tokenizer back = round_trip(orig, "json");
  expect_same(orig, back, name);
  expect_reference(back, references()["tokenizers"][name], references()["corpus"], name + " exported");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ExportJson,
                         ::testing::Values("llama3_style", "llama3_style+added", "qwen2_style", "spm_style",
                                           "spm_style+added", "spm_style+metaspace"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '+') c = '_';
                           return s;
                         });

TEST(TokenizerExport, JsonShapeForEachFamily) {
  const auto llama3 = tokenizer_json_of(load_gguf(fixture("llama3_style.gguf")));
  EXPECT_EQ(llama3["model"]["type"], "BPE");
  EXPECT_EQ(llama3["model"]["ignore_merges"], true);
  EXPECT_EQ(llama3["pre_tokenizer"]["type"], "Sequence");
  EXPECT_EQ(llama3["pre_tokenizer"]["pretokenizers"][0]["type"], "Split");
  EXPECT_EQ(llama3["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].get<std::string>().substr(0, 10),
            "(?i:'s|'t|");
  EXPECT_EQ(llama3["pre_tokenizer"]["pretokenizers"][1]["type"], "ByteLevel");
  EXPECT_EQ(llama3["pre_tokenizer"]["pretokenizers"][1]["use_regex"], false);
  EXPECT_EQ(llama3["decoder"]["type"], "ByteLevel");
  const auto& pp = llama3["post_processor"];
  ASSERT_EQ(pp["type"], "Sequence");
  EXPECT_EQ(pp["processors"][1]["single"][0]["SpecialToken"]["id"], "<|begin_of_text|>");
  EXPECT_EQ(pp["processors"][1]["special_tokens"]["<|begin_of_text|>"]["ids"], json::array({0}));

  const auto qwen2 = tokenizer_json_of(load_gguf(fixture("qwen2_style.gguf")));
  EXPECT_EQ(qwen2["post_processor"]["type"], "ByteLevel");  // no BOS added
  EXPECT_EQ(qwen2["model"]["ignore_merges"], false);

  const Tokenizer spm_tok = load_gguf(fixture("spm_style.gguf"));
  const auto spm = tokenizer_json_of(spm_tok);
  EXPECT_EQ(spm["model"]["byte_fallback"], true);
  EXPECT_EQ(spm["model"]["fuse_unk"], true);
  EXPECT_EQ(spm["model"]["vocab"]["<0x0A>"], spm_tok.token_id("<0x0A>"));
  // The GGUF has scores only: the merges written are the ones derived from them.
  EXPECT_EQ(spm["model"]["merges"].size(), spm_tok.spec().merges.size());
  EXPECT_GT(spm["model"]["merges"].size(), 100u);
  // A GGUF "llama" vocabulary is read as llama.cpp reads it: ▁ before every
  // piece of text, written as the original Llama 2 normalizer.
  EXPECT_TRUE(spm["pre_tokenizer"].is_null());
  ASSERT_EQ(spm["normalizer"]["type"], "Sequence");
  EXPECT_EQ(spm["normalizer"]["normalizers"][0]["type"], "Prepend");
  EXPECT_EQ(spm["normalizer"]["normalizers"][0]["prepend"], "\xE2\x96\x81");
  EXPECT_EQ(spm["normalizer"]["normalizers"][1]["type"], "Replace");
  EXPECT_EQ(spm["normalizer"]["normalizers"][1]["pattern"]["String"], " ");
  EXPECT_EQ(spm["normalizer"]["normalizers"][1]["content"], "\xE2\x96\x81");
  const auto& dec = spm["decoder"]["decoders"];
  ASSERT_EQ(dec.size(), 4u);
  EXPECT_EQ(dec[0]["type"], "Replace");
  EXPECT_EQ(dec[1]["type"], "ByteFallback");
  EXPECT_EQ(dec[2]["type"], "Fuse");
  EXPECT_EQ(dec[3]["type"], "Strip");
  EXPECT_EQ(spm["post_processor"]["type"], "TemplateProcessing");
  bool control_special = false;
  for (const auto& t : spm["added_tokens"]) control_special |= t["content"] == "<s>" && t["special"] == true;
  EXPECT_TRUE(control_special);

  const auto legacy = tokenizer_json_of(json_variant("spm_style"));
  EXPECT_EQ(legacy["normalizer"]["type"], "Sequence");
  EXPECT_EQ(legacy["normalizer"]["normalizers"][0]["type"], "Prepend");
  EXPECT_EQ(legacy["normalizer"]["normalizers"][1]["type"], "Replace");
}

TEST(TokenizerExport, ConfigFile) {
  const Tokenizer tok = load_gguf(fixture("llama3_style.gguf"));
  const auto cfg = tokenizer_config_of(tok, "{{ messages }}", 8192);
  EXPECT_EQ(cfg["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(cfg["bos_token"], "<|begin_of_text|>");
  EXPECT_EQ(cfg["eos_token"], "<|eot_id|>");
  EXPECT_TRUE(cfg["pad_token"].is_null());
  EXPECT_EQ(cfg["add_bos_token"], true);
  EXPECT_EQ(cfg["add_eos_token"], false);
  EXPECT_EQ(cfg["model_max_length"], 8192);
  EXPECT_EQ(cfg["chat_template"], "{{ messages }}");
  EXPECT_EQ(cfg["clean_up_tokenization_spaces"], false);
  EXPECT_FALSE(tokenizer_config_of(tok, "", 0).contains("chat_template"));
  EXPECT_FALSE(tokenizer_config_of(tok, std::nullopt, 0).contains("model_max_length"));

  const Tokenizer spm = load_gguf(fixture("spm_style.gguf"));
  const auto scfg = tokenizer_config_of(spm, std::nullopt, 0);
  EXPECT_EQ(scfg["unk_token"], "<unk>");
  EXPECT_EQ(scfg["bos_token"], "<s>");
  EXPECT_EQ(scfg["eos_token"], "</s>");
  // Given chat template reaches the reloaded tokenizer.
  EXPECT_EQ(round_trip(tok, "tmpl", "{{ bos_token }}x").chat_template(), "{{ bos_token }}x");
}

TEST(TokenizerExport, AddedTokenIdThatCannotBeReloadedIsRefused) {
  TokenizerSpec s;
  s.name = "gap.gguf";
  s.vocab = {"a", "b", "ab"};
  s.merges = {{"a", "b"}};
  AddedToken t;
  t.id = 5;  // ids 3 and 4 are unused: tokenizer.json would give it id 3
  t.content = "<x>";
  t.special = true;
  s.added_tokens.push_back(t);
  const Tokenizer tok = Tokenizer::from_spec(s);
  TempDir dir("refused");
  expect_error([&] { write_tokenizer_files(tok, std::nullopt, 0, dir.str()); }, ErrorKind::unsupported,
               {"gap.gguf", "BPE", "<x>", "id 5", "id 3"});
  EXPECT_FALSE(fs::exists(dir.path / "tokenizer.json"));  // nothing half-written
}

TEST(TokenizerExport, DuplicateVocabularyTextKeepsTheIdTheModelEncodesTo) {
  TokenizerSpec s;
  s.name = "dup";
  s.vocab = {"a", "b", "ab", "a", "c"};
  s.merges = {{"a", "b"}};
  const Tokenizer tok = Tokenizer::from_spec(s);
  const auto j = tokenizer_json_of(tok);
  EXPECT_EQ(j["model"]["vocab"].size(), 4u);
  EXPECT_EQ(j["model"]["vocab"]["a"], 3);
  const Tokenizer back = round_trip(tok, "dup");
  EXPECT_EQ(back.encode("abac", false, true), tok.encode("abac", false, true));
}

// `loom merge` / full fine-tuning of a GGUF model: the exported folder has a
// tokenizer that loom loads as the model's own.
TEST(TokenizerExport, HfFolderFromGgufModelHasTokenizer) {
  const std::string src = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/tiny-llama.f32.gguf";
  TempDir out("hf");
  auto m = Model::load(src, {.tokenizer = true, .pack = false});
  ASSERT_TRUE(m->has_tokenizer());
  write_hf_folder(*m, out.str(), safetensors::StDType::f32);
  ASSERT_TRUE(fs::exists(out.path / "tokenizer.json"));
  ASSERT_TRUE(fs::exists(out.path / "tokenizer_config.json"));
  const json cfg = read_json_file(out.str() + "/tokenizer_config.json");
  EXPECT_EQ(cfg["model_max_length"], m->config().max_context);
  auto reloaded = Model::load(out.str(), {.tokenizer = true, .pack = false});
  ASSERT_TRUE(reloaded->has_tokenizer());
  expect_same(m->tokenizer(), reloaded->tokenizer(), "tiny-llama.f32.gguf");
}

TEST(TokenizerExport, SmolLM2) {
  if (!fs::exists(smollm2_path())) GTEST_SKIP() << "models/ not fetched (scripts/fetch_model)";
  const Tokenizer orig = load_gguf(smollm2_path());
  const Tokenizer back = round_trip(orig, "smollm2");
  EXPECT_EQ(back.vocab_size(), 49152);
  expect_same(orig, back, "smollm2");
  const json ref = read_json_file(fixture("smollm2_reference.json"));
  expect_reference(back, ref["reference"], ref["corpus"], "smollm2 exported");
  const json& texts = ref["reference"]["chat_texts"];
  for (size_t i = 0; i < texts.size(); ++i)
    EXPECT_EQ(back.encode(texts[i].get<std::string>(), false, true),
              ref["reference"]["chat_ids"][i].get<std::vector<int32_t>>());
  EXPECT_FALSE(back.chat_template().empty());
  EXPECT_EQ(back.chat_template(), orig.chat_template());
}

}  // namespace
}  // namespace loom

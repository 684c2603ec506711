// Tokenizer parity with Hugging Face `tokenizers` on all of Unicode: strings
// built around a sample of every general category (new code points included),
// combining marks, CJK, emoji sequences, other scripts' digits, white space and
// added tokens, through every pre-tokenizer kind loom has (SmolLM2's real
// tokenizer, Llama 3, Qwen2 with NFC, GPT-2, SentencePiece). Reference ids and
// decodings come from scripts/fixtures/make_unicode_tokenizer_fixtures.py.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "io/gguf.h"
#include "test_tokenizer_util.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"
#include "tokenizer/unicode_classes.h"

namespace loom {
namespace {

using namespace tok_test;

const json& unicode_refs() {
  static const json j = read_json_file(fixture("unicode/unicode_reference.json"));
  return j;
}

// "U+0061 U+0301" for a message: the text itself may not print.
std::string code_points(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    size_t bad = 0;
    const size_t n = tok::utf8_decode(s, i, cp, bad);
    out += n ? fmt::format("{}U+{:04X}", out.empty() ? "" : " ", static_cast<uint32_t>(cp)) : " <bad>";
    i += n ? n : bad;
  }
  return out;
}

std::string ids_text(const std::vector<int32_t>& ids) { return fmt::format("[{}]", fmt::join(ids, ",")); }

bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

Tokenizer load_unicode_tokenizer(const std::string& name) {
  if (name == "smollm2") {
    auto f = gguf::File::open(smollm2_path());
    return Tokenizer::from_gguf(*f);
  }
  if (name == "gpt2_style")
    return Tokenizer::from_spec(Tokenizer::spec_from_tokenizer_json(
        read_json_file(fixture("unicode/gpt2_style.json")), std::nullopt, name));
  return json_variant(name);
}

// Lengths in code points of the pre-tokenizer's pieces of `s` after the normalizer.
std::vector<size_t> piece_lengths(const Tokenizer& tok, const std::string& s) {
  const tok::Normalizer norm(tok.spec().normalizers, "test");
  const tok::PreTokenizer pre(tok.spec().pre_tokenizers, "test");
  std::vector<tok::Piece> pieces{{norm.apply(s), true}};
  pre.apply(pieces);
  std::vector<size_t> out;
  for (const auto& p : pieces) out.push_back(tok::utf8_length(p.text));
  return out;
}

// Every string of one set: ids, decoding and (where given) pre-tokenizer pieces. Returns the number of
// differing strings and prints the first few with their code points.
size_t check_set(const Tokenizer& tok, const std::string& name, const std::string& set, const json& strings,
                 const json& ref) {
  const json& ids = ref["ids"];
  EXPECT_EQ(ids.size(), strings.size()) << name << "/" << set;
  size_t bad_ids = 0, bad_decode = 0, bad_pieces = 0;
  for (size_t i = 0; i < strings.size() && i < ids.size(); ++i) {
    const std::string s = strings[i].get<std::string>();
    const auto want = ids[i].get<std::vector<int32_t>>();
    const auto got = tok.encode(s, /*add_special=*/false, /*parse_special=*/true);
    if (got != want && ++bad_ids <= 8)
      ADD_FAILURE() << name << "/" << set << " string " << i << " \"" << show(s) << "\" (" << code_points(s)
                    << ")\n  loom: " << ids_text(got) << "\n  HF:   " << ids_text(want);
    if (ref.contains("piece_lengths")) {
      const auto want_pieces = ref["piece_lengths"][i].get<std::vector<size_t>>();
      const auto got_pieces = piece_lengths(tok, s);
      if (got_pieces != want_pieces && ++bad_pieces <= 8)
        ADD_FAILURE() << name << "/" << set << " pre-tokenizer pieces of string " << i << " \"" << show(s)
                      << "\" (" << code_points(s)
                      << ")\n  loom: " << fmt::format("{}", fmt::join(got_pieces, ","))
                      << "\n  HF:   " << fmt::format("{}", fmt::join(want_pieces, ","));
    }
    const std::string key = std::to_string(i);
    const std::string decoded = ref["decoded"].contains(key) ? ref["decoded"][key].get<std::string>() : s;
    const std::string back = tok.decode(want);
    if (back != decoded && ++bad_decode <= 4)
      ADD_FAILURE() << name << "/" << set << " decode of string " << i << " (" << code_points(s)
                    << ")\n  loom: " << code_points(back) << "\n  HF:   " << code_points(decoded);
  }
  EXPECT_EQ(bad_ids, 0u) << name << "/" << set << ": strings whose ids differ from HF, of " << strings.size();
  EXPECT_EQ(bad_decode, 0u) << name << "/" << set << ": decodings that differ from HF";
  EXPECT_EQ(bad_pieces, 0u) << name << "/" << set << ": strings whose pre-tokenizer pieces differ from HF";
  return bad_ids + bad_decode + bad_pieces;
}

class TokenizerUnicode : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerUnicode, MatchesHuggingFace) {
  const std::string name = GetParam();
  if (name == "smollm2" && !std::filesystem::exists(smollm2_path())) {
    // CI fetches the model; without it there this test must fail, not pass unseen.
    if (in_ci()) FAIL() << smollm2_path() << " is missing (scripts/fetch_model)";
    GTEST_SKIP() << "models/ not fetched (scripts/fetch_model): SmolLM2 Unicode parity NOT checked";
  }
  const json& refs = unicode_refs();
  ASSERT_TRUE(refs["tokenizers"].contains(name)) << name;
  const Tokenizer tok = load_unicode_tokenizer(name);
  size_t checked = 0;
  for (const auto& [set, ref] : refs["tokenizers"][name].items()) {
    ASSERT_TRUE(refs["sets"].contains(set)) << name << ": unknown set " << set;
    check_set(tok, name, set, refs["sets"][set], ref);
    checked += ref["ids"].size();
  }
  EXPECT_GT(checked, 100u) << name << ": too few strings checked";
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizerUnicode,
                         ::testing::Values("smollm2", "llama3_style", "llama3_style+added", "qwen2_style",
                                           "gpt2_style", "spm_style", "spm_style+added",
                                           "spm_style+metaspace"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '+' || c == '.') c = '_';
                           return s;
                         });

TEST(TokenizerUnicode, EveryBlockIsTested) {
  // A tokenizer added to the fixture without a test entry above would go unchecked.
  EXPECT_EQ(unicode_refs()["tokenizers"].size(), 8u);
  // The category set holds every general category's sample (29 categories, 9 templates each).
  EXPECT_GT(unicode_refs()["sets"]["categories"].size(), 29u * 9u * 5u);
  // Pre-tokenizer pieces are checked for every tokenizer that has a pre-tokenizer.
  for (const char* name : {"smollm2", "llama3_style", "qwen2_style", "gpt2_style"})
    for (const char* set : {"categories", "extra"})
      EXPECT_TRUE(unicode_refs()["tokenizers"][name][set].contains("piece_lengths")) << name << "/" << set;
  EXPECT_TRUE(unicode_refs()["tokenizers"]["spm_style+metaspace"]["extra"].contains("piece_lengths"));
}

// Matches of `pattern` in `text`, as "b-e" byte ranges.
std::string spans(std::string_view pattern, std::string_view text) {
  std::string out;
  for (const auto& [b, e] : tok::Regex(pattern, false, "test").find_all(text))
    out += fmt::format("{}{}-{}", out.empty() ? "" : " ", b, e);
  return out;
}

TEST(TokenizerUnicode, RegexClassesFollowHuggingFace) {
  // U+1C89 (a letter) and U+10D40 (a digit) are Unicode 16: older PCRE2 tables lack them.
  const std::string letter = "\xE1\xB2\x89", digit = "\xF0\x90\xB5\x80";
  EXPECT_EQ(spans(R"(\p{L}+)", "a" + letter + "b"), "0-5");
  EXPECT_EQ(spans(R"(\pL)", letter), "0-3");
  EXPECT_EQ(spans(R"(\p{N})", digit), "0-4");
  EXPECT_EQ(spans(R"([^\r\n\p{L}\p{N}]+)", " " + letter + digit + "!"), "0-1 8-9");
  EXPECT_EQ(spans(R"(\P{L})", "a" + letter + "1"), "4-5");
  EXPECT_EQ(spans(R"([\]\p{N}]+)", "]" + digit + "x"), "0-5");
  EXPECT_EQ(spans(R"([[:alpha:]\p{N}]+)", "a" + digit), "0-5");
  // Escaped backslashes and quoted text are not properties.
  EXPECT_EQ(spans(R"(\\p{L})", "\\p{L}" + letter), "0-5");
  EXPECT_EQ(spans(R"(\Q\p{L}\E)", letter + "\\p{L}"), "3-8");
  // HF's Digits and single_word tables.
  EXPECT_TRUE(tok::is_hf_numeric(0x10D40));
  EXPECT_TRUE(tok::is_hf_numeric(0xBD));  // ½ (No)
  EXPECT_FALSE(tok::is_hf_numeric('x'));
  EXPECT_TRUE(tok::is_hf_word_char(0x24B6));  // Ⓐ: So but Alphabetic, so a word character
  EXPECT_TRUE(tok::is_hf_word_char('_'));
  EXPECT_FALSE(tok::is_hf_word_char(' '));
}

}  // namespace
}  // namespace loom

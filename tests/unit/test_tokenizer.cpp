// Tokenizer parity with Hugging Face `tokenizers`: every corpus line through
// every committed tokenizer (tokenizer.json and GGUF forms, with variants)
// must give the reference ids and decodings produced by
// scripts/fixtures/make_tokenizer_fixtures.py; plus streaming decode, round
// trips, invalid UTF-8 and the default SmolLM2 GGUF when models/ has it.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <random>

#include "io/gguf.h"
#include "test_tokenizer_util.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

using namespace tok_test;

Tokenizer load_named(const std::string& name) {
  if (name.size() > 5 && name.substr(name.size() - 5) == ".gguf") {
    auto f = gguf::File::open(fixture(name));
    return Tokenizer::from_gguf(*f);
  }
  return json_variant(name);
}

class Reference : public ::testing::TestWithParam<std::string> {};

TEST_P(Reference, MatchesHuggingFace) {
  const json& refs = references();
  const std::string name = GetParam();
  ASSERT_TRUE(refs["tokenizers"].contains(name)) << name;
  const Tokenizer tok = load_named(name);
  check_reference(tok, reference_for(name), refs["corpus"], name);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Reference,
                         ::testing::Values("llama3_style", "llama3_style+added", "qwen2_style", "spm_style",
                                           "spm_style+added", "spm_style+metaspace", "llama3_style.gguf",
                                           "qwen2_style.gguf", "spm_style.gguf"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '+' || c == '.') c = '_';
                           return s;
                         });

TEST(Tokenizer, EveryReferenceBlockIsTested) {
  // A block added to the fixture without a test entry above would go unchecked.
  EXPECT_EQ(references()["tokenizers"].size(), 9u);
}

TEST(Tokenizer, StreamingDecodeEqualsFullDecode) {
  const json& refs = references();
  for (const auto& [name, ref] : refs["tokenizers"].items()) {
    const Tokenizer tok = load_named(name);
    for (size_t i = 0; i < ref["ids"].size(); ++i) {
      const auto ids = ids_of(ref["ids"][i]);
      for (bool skip : {true, false}) {
        StreamDecoder sd(tok, skip);
        std::string streamed;
        for (int32_t id : ids) {
          const std::string piece = sd.push(id);
          // Only whole characters come out.
          EXPECT_EQ(tok::utf8_complete_prefix(piece), piece.size()) << name << " line " << i;
          streamed += piece;
        }
        streamed += sd.finish();
        EXPECT_EQ(streamed, tok.decode(ids, skip)) << name << " line " << i << " skip_special=" << skip;
      }
    }
  }
}

TEST(Tokenizer, StreamingHoldsBackSplitCharacters) {
  const Tokenizer tok = json_variant("llama3_style");
  // The vocabulary is small: an emoji is several byte tokens.
  const auto ids = tok.encode("\xF0\x9F\x98\x80!", false, true);  // 😀!
  ASSERT_GE(ids.size(), 3u);
  StreamDecoder sd(tok);
  std::string out;
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    const std::string piece = sd.push(ids[i]);
    if (i + 2 < ids.size()) {
      EXPECT_EQ(piece, "") << "emitted half a character at token " << i;
    }
    out += piece;
  }
  out += sd.push(ids.back());
  out += sd.finish();
  EXPECT_EQ(out, "\xF0\x9F\x98\x80!");
}

// Found by fuzz/fuzz_tokenize.cpp: text holding real U+FFFD characters (as
// scraped data and lossy conversions do) made the stream decoder take each
// U+FFFD for a character still being spelled, hold tokens back, and, at its
// pending limit, cut one in the middle: extra U+FFFD in the streamed text.
TEST(Tokenizer, StreamingPassesRealReplacementCharacters) {
  for (const char* name : {"llama3_style", "qwen2_style", "spm_style"}) {
    const Tokenizer tok = json_variant(name);
    std::string text = "Hello, worl";
    for (int i = 0; i < 70; ++i) text += "\xEF\xBF\xBD";
    text += "d! 123 \xEF\xBF\xBD\xE4\xB8\xAD";
    const auto ids = tok.encode(text, false, false);
    for (bool skip : {true, false}) {
      StreamDecoder sd(tok, skip);
      std::string streamed;
      for (int32_t id : ids) {
        const std::string piece = sd.push(id);
        EXPECT_EQ(tok::utf8_complete_prefix(piece), piece.size()) << name;
        streamed += piece;
      }
      streamed += sd.finish();
      EXPECT_EQ(streamed, tok.decode(ids, skip)) << name << " skip_special=" << skip;
    }
  }
}

TEST(Tokenizer, ByteLevelRoundTripAndPieces) {
  const json& corpus = references()["corpus"];
  for (const char* name : {"llama3_style", "qwen2_style", "llama3_style.gguf"}) {
    const Tokenizer tok = load_named(name);
    for (const auto& l : corpus) {
      const std::string line = l.get<std::string>();
      const auto ids = tok.encode(line, false, false);
      std::string pieces;
      for (int32_t id : ids) pieces += tok.token_to_piece(id);
      if (std::string(name) != "qwen2_style") {  // qwen2_style applies NFC
        EXPECT_EQ(tok.decode(ids), line) << name;
        EXPECT_EQ(pieces, line) << name;
      }
    }
  }
}

TEST(Tokenizer, SpmPieces) {
  const Tokenizer tok = json_variant("spm_style");
  const auto ids = tok.encode("a b\n\xE4\xB8\xAD", false, true);
  std::string pieces;
  for (int32_t id : ids) pieces += tok.token_to_piece(id);
  EXPECT_EQ(pieces, " a b\n\xE4\xB8\xAD");  // the prefix space stays; decode strips it
  EXPECT_EQ(tok.decode(ids), "a b\n\xE4\xB8\xAD");
  EXPECT_EQ(tok.token_to_piece(tok.token_id("<0x0A>")), "\n");
  EXPECT_EQ(tok.token_to_piece(tok.bos()), "<s>");
}

TEST(Tokenizer, RandomTextRoundTrips) {
  // Awkward fragments glued at random (fixed seed): byte-level BPE must give
  // back exactly the input, and every tokenizer must survive it.
  const std::vector<std::string> frags = {" ",
                                          "  ",
                                          "\n",
                                          "\r\n",
                                          "\t",
                                          "a",
                                          "Z",
                                          "'s",
                                          "'S",
                                          "1",
                                          "23",
                                          "456",
                                          "\xC3\xA9",
                                          "e\xCC\x81",
                                          "\xE4\xB8\xAD",
                                          "\xF0\x9F\x98\x80",
                                          "<|im_end|>",
                                          "<s>",
                                          "\xE2\x96\x81",
                                          "!",
                                          "...",
                                          "x",
                                          "\xEF\xBF\xBD",
                                          "\xC2\xA0"};
  std::mt19937 rng(1234);
  std::vector<Tokenizer> toks;
  for (const char* n : {"llama3_style", "qwen2_style", "spm_style", "spm_style+metaspace",
                        "llama3_style+added", "spm_style.gguf"})
    toks.push_back(load_named(n));
  for (int iter = 0; iter < 300; ++iter) {
    std::string s;
    const int n = std::uniform_int_distribution<int>(0, 40)(rng);
    for (int k = 0; k < n; ++k) s += frags[std::uniform_int_distribution<size_t>(0, frags.size() - 1)(rng)];
    for (size_t t = 0; t < toks.size(); ++t) {
      const auto ids = toks[t].encode(s, true, iter % 2 == 0);
      const std::string back = toks[t].decode(ids, true);
      if (t == 0) {
        EXPECT_EQ(back, s) << show(s);
      }
      for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < toks[t].vocab_size());
    }
  }
}

TEST(Tokenizer, InvalidUtf8ReadsAsReplacementCharacter) {
  const Tokenizer tok = json_variant("llama3_style");
  EXPECT_EQ(tok.encode("a\xFF"
                       "b\xE4\xB8",
                       false, true),
            tok.encode("a\xEF\xBF\xBD"
                       "b\xEF\xBF\xBD",
                       false, true));
  EXPECT_EQ(tok.encode("\xC0\x80", false, true), tok.encode("\xEF\xBF\xBD\xEF\xBF\xBD", false, true));
}

TEST(Tokenizer, Accessors) {
  const Tokenizer tok = json_variant("llama3_style");
  EXPECT_EQ(tok.kind(), TokenizerKind::byte_level_bpe);
  EXPECT_STREQ(tok.kind_name(), "byte-level BPE");
  EXPECT_EQ(tok.token_text(tok.bos()), "<|begin_of_text|>");
  EXPECT_TRUE(tok.add_bos());
  EXPECT_TRUE(tok.is_special(tok.bos()));
  EXPECT_TRUE(tok.is_eog(tok.token_id("<|eot_id|>")));
  EXPECT_TRUE(tok.is_eog(tok.token_id("<|end_of_text|>")));
  EXPECT_FALSE(tok.is_eog(tok.token_id("<|start_header_id|>")));
  EXPECT_EQ(tok.token_id("no such token"), -1);
  expect_error([&] { tok.decode(std::vector<int32_t>{tok.vocab_size()}); }, ErrorKind::invalid_input,
               {"token id"});
  expect_error([&] { tok.token_to_piece(-1); }, ErrorKind::invalid_input, {"-1"});
  const Tokenizer spm = json_variant("spm_style");
  EXPECT_EQ(spm.kind(), TokenizerKind::spm_bpe);
  EXPECT_EQ(spm.bos(), 1);
  EXPECT_EQ(spm.eos(), 2);
  EXPECT_TRUE(spm.is_eog(2));
}

TEST(Tokenizer, ConfigOverridesSpecialTokens) {
  const json j = read_json_file(fixture("llama3_style.json"));
  const json cfg = {{"bos_token", "<|begin_of_text|>"},
                    {"eos_token", {{"content", "<|eot_id|>"}}},
                    {"add_bos_token", false},
                    {"chat_template", "{{ x }}"}};
  const Tokenizer tok = Tokenizer::from_spec(Tokenizer::spec_from_tokenizer_json(j, cfg, "cfg"));
  EXPECT_FALSE(tok.add_bos());
  EXPECT_EQ(tok.eos(), tok.token_id("<|eot_id|>"));
  EXPECT_EQ(tok.chat_template(), "{{ x }}");
  EXPECT_EQ(tok.encode("hi", true, true), tok.encode("hi", false, true));
  const json bad = {{"eos_token", "<nope>"}};
  expect_error([&] { Tokenizer::spec_from_tokenizer_json(j, bad, "cfg"); }, ErrorKind::invalid_input,
               {"eos_token", "<nope>"});
}

TEST(Tokenizer, FromFiles) {
  const Tokenizer tok = Tokenizer::from_tokenizer_json(fixture("qwen2_style.json"));
  EXPECT_EQ(tok.encode("<|im_start|>user", false, true)[0], tok.token_id("<|im_start|>"));
  EXPECT_TRUE(tok.is_eog(tok.token_id("<|im_end|>")));
  EXPECT_TRUE(tok.is_eog(tok.token_id("<|endoftext|>")));
  expect_error([] { Tokenizer::from_tokenizer_json(fixture("no_such_file.json")); }, ErrorKind::not_found,
               {"no_such_file.json"});
}

TEST(Tokenizer, EncodesTenThousandTokensQuickly) {
  const Tokenizer tok = json_variant("llama3_style");
  std::string text;
  const json& corpus = references()["corpus"];
  while (text.size() < 40000)
    for (const auto& l : corpus) text += l.get<std::string>() + "\n";
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok.encode(text, false, true);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(ids.size(), 10000u);
  EXPECT_LT(ms, 500.0) << ids.size() << " tokens";  // milliseconds in practice; generous for sanitizer builds
  std::printf("[ info ] %zu tokens (%zu bytes) in %.2f ms\n", ids.size(), text.size(), ms);
}

// ---- the default model ------------------------------------------------------

TEST(Tokenizer, SmolLM2GgufMatchesHuggingFace) {
  if (!std::filesystem::exists(smollm2_path())) GTEST_SKIP() << "models/ not fetched (scripts/fetch_model)";
  auto f = gguf::File::open(smollm2_path());
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  const json ref = read_json_file(fixture("smollm2_reference.json"));
  check_reference(tok, ref["reference"], ref["corpus"], "smollm2");
  EXPECT_EQ(tok.vocab_size(), 49152);
  EXPECT_FALSE(tok.add_bos());
  EXPECT_TRUE(tok.is_eog(tok.token_id("<|im_end|>")));
  EXPECT_TRUE(tok.is_eog(tok.token_id("<|endoftext|>")));
  // The chat prompts rendered by the model's own template encode the same.
  const json& texts = ref["reference"]["chat_texts"];
  for (size_t i = 0; i < texts.size(); ++i)
    EXPECT_EQ(tok.encode(texts[i].get<std::string>(), false, true), ids_of(ref["reference"]["chat_ids"][i]));
  const ChatTemplate ct = ChatTemplate::from_text(tok.chat_template(), "", "");
  EXPECT_EQ(ct.kind, ChatTemplateKind::chatml);
  EXPECT_EQ(ct.default_system, "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
}

TEST(Tokenizer, SmolLM2EncodeSpeed) {
  if (!std::filesystem::exists(smollm2_path())) GTEST_SKIP() << "models/ not fetched (scripts/fetch_model)";
  auto f = gguf::File::open(smollm2_path());
  const auto t0 = std::chrono::steady_clock::now();
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  const double load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::string text;
  const json& corpus = references()["corpus"];
  while (text.size() < 60000)
    for (const auto& l : corpus) text += l.get<std::string>() + "\n";
  const auto t1 = std::chrono::steady_clock::now();
  const auto ids = tok.encode(text, false, true);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_GT(ids.size(), 10000u);
  EXPECT_LT(ms, 500.0);
  std::printf("[ info ] SmolLM2: load %.1f ms; %zu tokens (%zu bytes) in %.2f ms\n", load_ms, ids.size(),
              text.size(), ms);
}

}  // namespace
}  // namespace loom

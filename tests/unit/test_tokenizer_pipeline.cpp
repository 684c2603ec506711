// Single pipeline steps against Hugging Face `tokenizers`: every pre-tokenizer,
// normalizer and decoder configuration in pipeline_cases.json (split
// behaviours, inverted and empty matches, Metaspace schemes, Strip counts,
// byte fallback runs) and the BPE model corner cases must give HF's output.
#include <gtest/gtest.h>

#include "test_tokenizer_util.h"
#include "tokenizer/pipeline.h"

namespace loom {
namespace {

using namespace tok_test;

const json& cases() {
  static const json j = read_json_file(fixture("pipeline_cases.json"));
  return j;
}

// A tokenizer.json around one step, parsed by the real loader.
TokenizerSpec spec_with(const char* field, const json& cfg, json vocab = json::object()) {
  const json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}, {field, cfg}};
  return Tokenizer::spec_from_tokenizer_json(j, std::nullopt, "case");
}

TEST(TokenizerPipeline, PreTokenizers) {
  const json& inputs = cases()["inputs"];
  for (const auto& c : cases()["pre_tokenizers"]) {
    const TokenizerSpec spec = spec_with("pre_tokenizer", c["config"]);
    const tok::PreTokenizer pre(spec.pre_tokenizers, "case");
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::vector<tok::Piece> pieces = {{inputs[i].get<std::string>(), true}};
      pre.apply(pieces);
      std::vector<std::string> got;
      for (const auto& p : pieces) got.push_back(p.text);
      if (got.size() == 1 && got[0].empty()) got.clear();
      EXPECT_EQ(got, c["pieces"][i].get<std::vector<std::string>>())
          << c["config"].dump() << "\n  input: \"" << show(inputs[i].get<std::string>()) << "\"";
    }
  }
}

TEST(TokenizerPipeline, Normalizers) {
  const json& inputs = cases()["inputs"];
  for (const auto& c : cases()["normalizers"]) {
    const TokenizerSpec spec = spec_with("normalizer", c["config"]);
    const tok::Normalizer norm(spec.normalizers, "case");
    for (size_t i = 0; i < inputs.size(); ++i)
      EXPECT_EQ(norm.apply(inputs[i].get<std::string>()), c["outputs"][i].get<std::string>())
          << c["config"].dump() << "\n  input: \"" << show(inputs[i].get<std::string>()) << "\"";
  }
}

TEST(TokenizerPipeline, Decoders) {
  const json& token_lists = cases()["decoder_tokens"];
  json vocab = json::object();
  for (const auto& list : token_lists)
    for (const auto& t : list)
      if (!vocab.contains(t.get<std::string>())) vocab[t.get<std::string>()] = vocab.size();
  for (const auto& c : cases()["decoders"]) {
    const Tokenizer tok = Tokenizer::from_spec(spec_with("decoder", c["config"], vocab));
    for (size_t i = 0; i < token_lists.size(); ++i) {
      std::vector<int32_t> ids;
      for (const auto& t : token_lists[i]) ids.push_back(tok.token_id(t.get<std::string>()));
      EXPECT_EQ(tok.decode(ids), c["outputs"][i].get<std::string>())
          << c["config"].dump() << "\n  tokens " << i;
      // Streaming gives the same text (whole characters only) when it is valid.
      if (c["outputs"][i].get<std::string>().find("\xEF\xBF\xBD") != std::string::npos) continue;
      StreamDecoder sd(tok, false);
      std::string streamed;
      for (int32_t id : ids) streamed += sd.push(id);
      streamed += sd.finish();
      EXPECT_EQ(streamed, tok.decode(ids)) << c["config"].dump() << "\n  streamed tokens " << i;
    }
  }
}

TEST(TokenizerPipeline, BpeModelCorners) {
  // ignore_merges, unknown characters (fused or not), partial byte fallback,
  // equal-rank ties and repeated merges, each against HF.
  for (const auto& c : cases()["models"]) {
    const Tokenizer tok =
        Tokenizer::from_spec(Tokenizer::spec_from_tokenizer_json(c["tokenizer"], std::nullopt, "case"));
    for (size_t i = 0; i < c["inputs"].size(); ++i)
      EXPECT_EQ(tok.encode(c["inputs"][i].get<std::string>(), false, true),
                c["ids"][i].get<std::vector<int32_t>>())
          << c["tokenizer"]["model"].dump() << "\n  input: " << c["inputs"][i].get<std::string>();
  }
  EXPECT_GE(cases()["models"].size(), 9u);
}

TEST(TokenizerPipeline, SplitRangesEdgeCases) {
  using tok::split_ranges;
  using R = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(split_ranges(0, {}, SplitBehavior::isolated, false), R{});
  EXPECT_EQ(split_ranges(3, {}, SplitBehavior::removed, false), (R{{0, 3}}));
  EXPECT_EQ(split_ranges(3, {}, SplitBehavior::removed, true), R{});  // everything is a "match" when inverted
  EXPECT_EQ(split_ranges(4, {{0, 4}}, SplitBehavior::removed, false), R{});
  EXPECT_EQ(split_ranges(5, {{1, 2}, {2, 3}}, SplitBehavior::contiguous, false), (R{{0, 1}, {1, 3}, {3, 5}}));
  EXPECT_EQ(split_ranges(5, {{1, 2}, {2, 3}}, SplitBehavior::merged_with_previous, false),
            (R{{0, 2}, {2, 3}, {3, 5}}));
  EXPECT_EQ(split_ranges(5, {{1, 2}, {2, 3}}, SplitBehavior::merged_with_next, false),
            (R{{0, 1}, {1, 2}, {2, 5}}));
}

TEST(TokenizerPipeline, NfcComposesAndKeepsComposedText) {
  EXPECT_EQ(tok::nfc("cafe\xCC\x81"), "caf\xC3\xA9");
  EXPECT_EQ(tok::nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // jamo -> 각
  EXPECT_EQ(tok::nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(tok::nfc("\xE4\xB8\xAD\xF0\x9F\x98\x80"), "\xE4\xB8\xAD\xF0\x9F\x98\x80");
}

}  // namespace
}  // namespace loom

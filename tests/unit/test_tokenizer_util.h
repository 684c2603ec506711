// Shared helpers for the tokenizer tests: fixture paths, the tokenizer
// variants the fixture script describes, and error expectations.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/hf_folder.h"
#include "tokenizer/tokenizer.h"

namespace loom::tok_test {

using json = nlohmann::json;

inline std::string fixture(const std::string& file) {
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/tokenizer/" + file;
}
inline std::string smollm2_path() {
  return std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

inline const json& references() {
  static const json j = read_json_file(fixture("reference_ids.json"));
  return j;
}

// The reference block a named tokenizer must give. A GGUF "llama" vocabulary
// must tokenize as llama.cpp does, which for spm_style.gguf is the
// tokenizer.json it was made from (Prepend + Replace normalizer): its
// reference is the "spm_style" block. The fixture's own "spm_style.gguf" block
// is transformers' GGUF loader (▁ only at the very start of the text), which
// SpmGguf.TransformersGgufLoaderDiffersOnlyWhereLlamaCppDoes pins the
// difference from.
inline const json& reference_for(const std::string& name) {
  return references()["tokenizers"][name == "spm_style.gguf" ? "spm_style" : name];
}

// make_tokenizer_fixtures.py's with_extra_added(): EXTRA_ADDED appended with ids
// after the vocabulary, skipping contents already present.
inline json with_extra_added(json j) {
  int64_t next = 0;
  for (auto& [k, v] : j["model"]["vocab"].items()) next = std::max<int64_t>(next, v.get<int64_t>() + 1);
  for (auto& t : j["added_tokens"]) next = std::max<int64_t>(next, t["id"].get<int64_t>() + 1);
  for (const auto& t : references()["extra_added_tokens"]) {
    bool present = false;
    for (const auto& a : j["added_tokens"]) present = present || a["content"] == t["content"];
    if (present) continue;
    json e = t;
    e["id"] = next++;
    j["added_tokens"].push_back(e);
  }
  return j;
}

// spm_metaspace_variant(): no normalizer, Metaspace prepending at the very start only.
inline json spm_metaspace_variant(json j) {
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "first"}, {"split", false}};
  return j;
}

// The tokenizer.json variant named in reference_ids.json ("spm_style+added", ...).
inline Tokenizer json_variant(const std::string& name) {
  const size_t plus = name.find('+');
  const std::string base = name.substr(0, plus);
  json j = read_json_file(fixture(base + ".json"));
  if (plus != std::string::npos) {
    const std::string v = name.substr(plus + 1);
    if (v == "added")
      j = with_extra_added(std::move(j));
    else if (v == "metaspace")
      j = spm_metaspace_variant(std::move(j));
    else
      ADD_FAILURE() << "unknown variant " << v;
  }
  return Tokenizer::from_spec(Tokenizer::spec_from_tokenizer_json(j, std::nullopt, name));
}

inline void expect_error(const std::function<void()>& fn, ErrorKind kind,
                         const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\n  missing: " << n;
    return;
  }
  ADD_FAILURE() << "no loom::Error thrown";
}

inline std::string show(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n')
      out += "\\n";
    else if (c < 0x20 || c == 0x7f)
      out += fmt::format("\\x{:02x}", c);
    else
      out += static_cast<char>(c);
  }
  return out;
}

inline std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

// ids, add_special prefix and both decodings of every corpus line.
inline void check_reference(const Tokenizer& tok, const json& ref, const json& corpus, const std::string& name) {
  const auto prefix = ids_of(ref["add_special_prefix"]);
  int mismatches = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string line = corpus[i].get<std::string>();
    const auto want = ids_of(ref["ids"][i]);
    const auto got = tok.encode(line, /*add_special=*/false, /*parse_special=*/true);
    EXPECT_EQ(got, want) << name << " line " << i << ": \"" << show(line) << "\"";
    mismatches += got != want;
    auto with = prefix;
    with.insert(with.end(), want.begin(), want.end());
    EXPECT_EQ(tok.encode(line, true, true), with) << name << " add_special, line " << i;
    const std::string decoded = ref["decoded"][i].is_null() ? line : ref["decoded"][i].get<std::string>();
    EXPECT_EQ(tok.decode(want), decoded) << name << " decode, line " << i;
    const std::string skipped = ref["decoded_skip_special"][i].is_null()
                                    ? decoded
                                    : ref["decoded_skip_special"][i].get<std::string>();
    EXPECT_EQ(tok.decode(want, /*skip_special=*/true), skipped) << name << " decode skip_special, line " << i;
    if (mismatches > 5) FAIL() << "too many mismatches for " << name;
  }
  if (ref.contains("ids_no_parse_special")) {
    for (size_t i = 0; i < corpus.size(); ++i) {
      EXPECT_EQ(tok.encode(corpus[i].get<std::string>(), false, false),
                ids_of(ref["ids_no_parse_special"][i]))
          << name << " parse_special=false, line " << i;
    }
  }
}

}  // namespace loom::tok_test

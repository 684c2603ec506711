// The text side of the tokenizer pipeline, compiled from the spec's steps:
// normalizers (Prepend, Replace, NFC) and pre-tokenizers (Split, ByteLevel,
// Digits, Metaspace) with Hugging Face `tokenizers`' exact semantics.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/regex.h"
#include "tokenizer/spec.h"

namespace loom::tok {

// GPT-2's pre-tokenizer pattern (HF ByteLevel with use_regex).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// One pre-token: its text and whether it starts at offset 0 of the input
// (Metaspace's "first" prepend scheme looks at that).
struct Piece {
  std::string text;
  bool at_start = false;
};

class Normalizer {
 public:
  Normalizer() = default;
  Normalizer(const std::vector<NormalizerStep>& steps, const std::string& what);
  bool empty() const { return steps_.empty(); }
  std::string apply(std::string_view text) const;

 private:
  struct Step {
    NormalizerStep::Kind kind;
    std::string text, content;
    std::optional<Regex> re;
  };
  std::vector<Step> steps_;
};

class PreTokenizer {
 public:
  PreTokenizer() = default;
  PreTokenizer(const std::vector<PreTokenizerStep>& steps, const std::string& what);
  // Runs every step over `pieces` in place.
  void apply(std::vector<Piece>& pieces) const;

 private:
  struct Step {
    PreTokenizerStep spec;
    std::optional<Regex> re;  // split pattern / GPT-2 pattern / digits
  };
  std::vector<Step> steps_;
};

// Splits `text` at `matches` (sorted, non-overlapping [b, e)) the way HF's
// NormalizedString::split does for `behavior`, `invert` flipping which parts
// count as matches. Empty parts are dropped. Returns [b, e) ranges.
std::vector<std::pair<size_t, size_t>> split_ranges(size_t text_size,
                                                    const std::vector<std::pair<size_t, size_t>>& matches,
                                                    SplitBehavior behavior, bool invert);

// Unicode NFC of valid UTF-8 text.
std::string nfc(std::string_view text);

}  // namespace loom::tok

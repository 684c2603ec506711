// Finds added tokens in text the way HF `tokenizers`' AddedVocabulary does:
// leftmost-longest matching over all patterns, then the single_word, lstrip
// and rstrip rules, splitting the text into plain runs and token matches.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/spec.h"

namespace loom::tok {

struct TextSpan {
  size_t begin = 0, end = 0;
  const AddedToken* token = nullptr;  // nullptr: plain text to tokenize
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher();
  // `pattern` is what is searched for (the content, or its normalized form).
  void add(std::string pattern, const AddedToken* token);
  bool empty() const { return patterns_.empty(); }

  // Splits `text` into spans covering it; special tokens are skipped (left as
  // text) when !parse_special. Appends to `out`.
  void split(std::string_view text, bool parse_special, std::vector<TextSpan>& out) const;

 private:
  // Longest pattern starting at `pos`, or -1.
  int32_t longest_at(std::string_view text, size_t pos, size_t& len) const;

  struct Node {
    std::unordered_map<unsigned char, int32_t> next;
    int32_t pattern = -1;  // index into patterns_ ending here
  };
  std::vector<Node> trie_;
  std::vector<std::pair<std::string, const AddedToken*>> patterns_;
  bool first_byte_[256] = {};
};

}  // namespace loom::tok

// Added-token matching (see added_tokens.h).
#include "tokenizer/added_tokens.h"

#include "tokenizer/unicode.h"
#include "tokenizer/unicode_classes.h"

namespace loom::tok {
namespace {

// Start of the character that ends just before `pos`.
size_t prev_char_start(std::string_view s, size_t pos) {
  size_t k = pos - 1;
  while (k > 0 && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
  return k;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher() : trie_(1) {}

void AddedTokenMatcher::add(std::string pattern, const AddedToken* token) {
  if (pattern.empty()) return;  // HF ignores empty added tokens
  int32_t node = 0;
  for (unsigned char c : pattern) {
    auto it = trie_[static_cast<size_t>(node)].next.find(c);
    if (it == trie_[static_cast<size_t>(node)].next.end()) {
      trie_.emplace_back();
      const int32_t fresh = static_cast<int32_t>(trie_.size() - 1);
      trie_[static_cast<size_t>(node)].next.emplace(c, fresh);
      node = fresh;
    } else {
      node = it->second;
    }
  }
  first_byte_[static_cast<unsigned char>(pattern[0])] = true;
  // A content given twice keeps its first entry (HF keeps one pattern per content).
  if (trie_[static_cast<size_t>(node)].pattern < 0) {
    trie_[static_cast<size_t>(node)].pattern = static_cast<int32_t>(patterns_.size());
    patterns_.emplace_back(std::move(pattern), token);
  }
}

int32_t AddedTokenMatcher::longest_at(std::string_view text, size_t pos, size_t& len) const {
  int32_t best = -1;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto& next = trie_[static_cast<size_t>(node)].next;
    auto it = next.find(static_cast<unsigned char>(text[i]));
    if (it == next.end()) break;
    node = it->second;
    if (trie_[static_cast<size_t>(node)].pattern >= 0) {
      best = trie_[static_cast<size_t>(node)].pattern;
      len = i + 1 - pos;
    }
  }
  return best;
}

void AddedTokenMatcher::split(std::string_view text, bool parse_special, std::vector<TextSpan>& out) const {
  // HF's \w (Rust regex crate): Alphabetic (so also Other_Alphabetic symbols
  // such as U+24B6 Ⓐ), marks, Nd, Pc, joiners, in HF's newer Unicode; not a
  // PCRE2 class approximating it.
  const auto is_word = [&](size_t b) {
    char32_t cp;
    size_t bad;
    return utf8_decode(text, b, cp, bad) > 0 && is_hf_word_char(cp);
  };
  const auto space_at = [&](size_t b, size_t& n) {
    char32_t cp;
    size_t bad;
    n = utf8_decode(text, b, cp, bad);
    return n > 0 && is_unicode_space(cp);
  };

  size_t covered = 0;  // end of the last emitted token span
  size_t pos = 0;
  while (pos < text.size() && !patterns_.empty()) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    size_t len = 0;
    const int32_t p = longest_at(text, pos, len);
    if (p < 0) {
      ++pos;
      continue;
    }
    const AddedToken* tok = patterns_[static_cast<size_t>(p)].second;
    size_t start = pos, stop = pos + len;
    pos = stop;  // the search resumes after the match whether or not it is kept
    if (tok->special && !parse_special) continue;
    if (tok->single_word) {
      const bool word_before = start > 0 && is_word(prev_char_start(text, start));
      const bool word_after = stop < text.size() && is_word(stop);
      if (word_before || word_after) continue;
    }
    if (tok->lstrip) {
      size_t s = start;
      while (s > covered) {
        const size_t k = prev_char_start(text, s);
        size_t n;
        if (!space_at(k, n)) break;
        s = k;
      }
      start = s;
    }
    if (tok->rstrip) {
      size_t n;
      while (stop < text.size() && space_at(stop, n)) stop += n;
    }
    if (start < covered) continue;  // only possible inside white space an rstrip token took
    if (covered < start) out.push_back(TextSpan{covered, start, nullptr});
    out.push_back(TextSpan{start, stop, tok});
    covered = stop;
  }
  if (covered < text.size()) out.push_back(TextSpan{covered, text.size(), nullptr});
}

}  // namespace loom::tok

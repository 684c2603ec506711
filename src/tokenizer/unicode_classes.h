// Unicode character classes exactly as Hugging Face `tokenizers` sees them.
// HF's engines (Oniguruma for regexes, Rust's char and regex crate for the
// Digits pre-tokenizer and single_word added tokens) follow a newer Unicode
// than the system's PCRE2 and ICU may (Debian 12: PCRE2 10.42 = Unicode 14),
// so a letter or digit added since would split differently. The tables are
// generated from HF itself (unicode_classes.inc).
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace loom::tok {

struct CodeRange {
  char32_t lo, hi;
};

// Oniguruma's \p{L} and \p{N}, as sorted disjoint ranges.
std::span<const CodeRange> hf_letter_ranges();
std::span<const CodeRange> hf_number_ranges();
// Rust char::is_numeric (HF's Digits pre-tokenizer).
bool is_hf_numeric(char32_t cp);
// Rust regex \w (a word character next to a single_word added token).
bool is_hf_word_char(char32_t cp);

// `pattern` with \p{L}, \pL, \p{N}, \pN (and \P{L}, \P{N} outside character
// classes) made to match what Oniguruma matches, whatever Unicode version the
// linked PCRE2 has: code points PCRE2 does not know are added as ranges.
std::string widen_unicode_classes(std::string_view pattern);

}  // namespace loom::tok

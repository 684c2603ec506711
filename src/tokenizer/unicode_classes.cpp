// HF's Unicode classes (see unicode_classes.h) and the regex widening that
// makes PCRE2's \p{L} / \p{N} agree with them.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/unicode_classes.h"

#include <fmt/format.h>
#include <pcre2.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace loom::tok {
namespace {

#include "tokenizer/unicode_classes.inc"

constexpr char32_t kCodeSpace = 0x110000;

bool in_ranges(std::span<const CodeRange> r, char32_t c) {
  const auto it =
      std::upper_bound(r.begin(), r.end(), c, [](char32_t v, const CodeRange& x) { return v < x.lo; });
  return it != r.begin() && c <= std::prev(it)->hi;
}

std::vector<bool> bitmap(std::span<const CodeRange> r) {
  std::vector<bool> m(kCodeSpace, false);
  for (const CodeRange& x : r)
    for (char32_t c = x.lo; c <= x.hi; ++c) m[c] = true;
  return m;
}

// The code points the linked PCRE2 matches with `property` ("\\p{L}+"), found by
// running it over `all`, a text of every code point (surrogates excepted).
std::vector<bool> pcre2_members(const char* property, const std::string& all) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(property), PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  LOOM_ASSERT(code != nullptr);
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  std::vector<bool> m(kCodeSpace, false);
  const auto* s = reinterpret_cast<PCRE2_SPTR>(all.data());
  for (size_t pos = 0; pos < all.size();) {
    if (pcre2_match(code, s, all.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr) < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    for (size_t i = ov[0]; i < ov[1];) {
      char32_t c = 0;
      size_t bad = 0;
      const size_t n = utf8_decode(all, i, c, bad);
      LOOM_ASSERT(n > 0);
      m[c] = true;
      i += n;
    }
    pos = ov[1] > ov[0] ? ov[1] : ov[0] + 1;
  }
  pcre2_match_data_free(md);
  pcre2_code_free(code);
  return m;
}

std::string class_items(const std::vector<bool>& m) {
  std::string out;
  for (char32_t c = 0; c < kCodeSpace; ++c) {
    if (!m[c]) continue;
    char32_t e = c;
    while (e + 1 < kCodeSpace && m[e + 1]) ++e;
    out += e == c
               ? fmt::format("\\x{{{:X}}}", static_cast<uint32_t>(c))
               : fmt::format("\\x{{{:X}}}-\\x{{{:X}}}", static_cast<uint32_t>(c), static_cast<uint32_t>(e));
    c = e;
  }
  return out;
}

// What goes inside a character class in place of \p{X}: PCRE2's own property
// (a fast table lookup) plus the code points it lacks; only if PCRE2 also has
// code points HF does not (a PCRE2 newer than HF) the whole table is spelled out.
std::string class_body(const char* property, std::span<const CodeRange> table, const std::string& all) {
  const std::vector<bool> hf = bitmap(table), pc = pcre2_members(fmt::format("{}+", property).c_str(), all);
  std::vector<bool> extra(kCodeSpace, false);
  bool pcre2_has_more = false;
  for (char32_t c = 0; c < kCodeSpace; ++c) {
    extra[c] = hf[c] && !pc[c];
    pcre2_has_more = pcre2_has_more || (pc[c] && !hf[c]);
  }
  return pcre2_has_more ? class_items(hf) : std::string(property) + class_items(extra);
}

struct Widening {
  std::string letter, number;  // class bodies for \p{L}, \p{N}
};

Widening make_widening() {
  std::string all;
  all.reserve(4 * kCodeSpace);
  for (char32_t c = 0; c < kCodeSpace; ++c)
    if (c < 0xD800 || c > 0xDFFF) utf8_append(all, c);
  return {class_body("\\p{L}", kLetterRanges, all), class_body("\\p{N}", kNumberRanges, all)};
}

// Computed once per process (about 50 ms) and immutable afterwards.
const Widening& widening() {
  static const Widening w = make_widening();
  return w;
}

}  // namespace

std::span<const CodeRange> hf_letter_ranges() { return kLetterRanges; }
std::span<const CodeRange> hf_number_ranges() { return kNumberRanges; }
bool is_hf_numeric(char32_t cp) { return in_ranges(kNumericRanges, cp); }
bool is_hf_word_char(char32_t cp) { return in_ranges(kWordRanges, cp); }

std::string widen_unicode_classes(std::string_view p) {
  std::string out;
  out.reserve(p.size());
  bool in_class = false;
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 'Q') {  // \Q...\E is literal text
        const size_t end = p.find("\\E", i + 2);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i, stop - i));
        i = stop;
        continue;
      }
      if (e == 'p' || e == 'P') {
        size_t len = 0;
        char name = 0;
        if (i + 2 < p.size() && (p[i + 2] == 'L' || p[i + 2] == 'N')) {
          name = p[i + 2], len = 3;  // \pL
        } else if (p.substr(i + 2, 3) == "{L}" || p.substr(i + 2, 3) == "{N}") {
          name = p[i + 3], len = 5;  // \p{L}
        }
        // A negated property inside a class would need class subtraction: left to PCRE2.
        if (name != 0 && !(e == 'P' && in_class)) {
          const std::string& body = name == 'L' ? widening().letter : widening().number;
          if (in_class)
            out += body;
          else
            out += (e == 'P' ? "[^" : "[") + body + "]";
          i += len;
          continue;
        }
      }
      out.append(p.substr(i, 2));  // any other escape, kept whole (so \] or \[ does not count)
      i += 2;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];  // a leading ] is literal
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const size_t end = p.find(":]", i + 2);
      const size_t stop = end == std::string_view::npos ? i + 1 : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop;
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
    ++i;
  }
  return out;
}

}  // namespace loom::tok

// Grammars for structured outputs: GBNF text (llama.cpp's syntax) compiled into a context-free grammar over
// bytes. Code points are spelled as their UTF-8 bytes, so the recognizer (grammar_matcher.h) and the token
// mask read bytes only; a character class becomes alternatives of byte-range sequences.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace loom {

// A grammar that cannot be compiled. `line` and `column` (1-based) say where, 0 when the fault concerns the
// whole grammar (no root rule); the message already includes them.
class GrammarError : public Error {
 public:
  GrammarError(const std::string& message, int line = 0, int column = 0);
  int line() const { return line_; }
  int column() const { return column_; }

 private:
  int line_, column_;
};

// Bounds on what one request may ask for, so that a request cannot make the server compile or hold
// something huge.
struct GrammarLimits {
  size_t max_text = 128 * 1024;  // bytes of GBNF text
  size_t max_elements = 1 << 20; // compiled elements (repetitions are expanded)
  size_t max_rules = 50000;      // rules, generated ones included
  int64_t max_repeat = 10000;    // the n of x{m,n}
};

// The compiled grammar. Each alternative of a rule is a run of elements in `elems` ended by an `end`.
struct Grammar {
  enum class Op : uint8_t { end, bytes, rule };
  struct Elem {
    Op op = Op::end;
    int32_t arg = 0;  // bytes: index into `bytesets`; rule: rule index
  };
  using ByteSet = std::array<uint64_t, 4>;

  std::vector<Elem> elems;
  std::vector<std::vector<int32_t>> rule_alts;  // per rule: the index of each alternative's first element
  std::vector<std::string> rule_names;          // generated rules: "<parent>_<n>"
  std::vector<ByteSet> bytesets;
  int32_t root = 0;
  // Bytes that no byteset tells apart share a class: the recognizer's transition tables have one column
  // per class instead of 256.
  std::array<uint8_t, 256> byte_class{};
  std::vector<uint8_t> class_byte;  // a byte of each class
  int32_t n_classes() const { return static_cast<int32_t>(class_byte.size()); }
  // The request field it came from ("response_format", "grammar", ...), for errors found while generating.
  std::string source_param;

  static bool has(const ByteSet& s, uint8_t b) { return (s[b >> 6] >> (b & 63)) & 1; }
};

// Parses and checks GBNF: rules `name ::= alternatives`, `|`, groups, string literals, character classes
// ([a-z], [^...]), `.`, escapes \x.. \u.... \U........ \t \n \r \\ \" \[ \] , `*` `+` `?` `{m}` `{m,}`
// `{m,n}`, `#` comments. Needs a `root` rule; rejects undefined rules and left recursion. Throws GrammarError.
std::shared_ptr<const Grammar> compile_gbnf(std::string_view text, const GrammarLimits& limits = {});

// A GBNF string literal ("...") spelling `s` (for grammars written by code, e.g. from a JSON schema).
std::string gbnf_literal(std::string_view s);

}  // namespace loom

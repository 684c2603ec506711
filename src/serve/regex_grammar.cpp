// JSON Schema `pattern` -> GBNF (regex_grammar.h): a recursive-descent parser over the pattern's code
// points; each atom becomes a GBNF expression over the JSON-encoded characters it matches.
#include "serve/regex_grammar.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "serve/grammar.h"
#include "serve/json_schema_grammar.h"
#include "tokenizer/unicode.h"

namespace loom {

namespace {

using Range = std::pair<char32_t, char32_t>;

// A set of code points: `ranges`, or everything but them.
struct CharSet {
  std::vector<Range> ranges;
  bool negated = false;
  bool contains(char32_t c) const {
    for (const auto& [lo, hi] : ranges)
      if (c >= lo && c <= hi) return !negated;
    return negated;
  }
};

// ECMAScript's \s: WhiteSpace and LineTerminator.
const std::vector<Range>& space_ranges() {
  static const std::vector<Range> r = {{0x09, 0x0D}, {0x20, 0x20},     {0xA0, 0xA0},     {0x1680, 0x1680},
                                       {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F},
                                       {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
  return r;
}
const std::vector<Range> kDigit = {{'0', '9'}};
const std::vector<Range> kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};

// Characters JSON cannot hold raw in a string: the escapes written for them.
bool needs_escape(char32_t c) { return c < 0x20 || c == '"' || c == '\\' || c == 0x7F; }
std::string json_escape(char32_t c) {
  switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\n': return "\\n";
    case '\t': return "\\t";
    case '\r': return "\\r";
    case '\b': return "\\b";
    case '\f': return "\\f";
    default: return fmt::format("\\u{:04x}", static_cast<uint32_t>(c));
  }
}

std::string class_char(char32_t c) {
  return c <= 0xFFFF ? fmt::format("\\u{:04X}", static_cast<uint32_t>(c))
                     : fmt::format("\\U{:08X}", static_cast<uint32_t>(c));
}

std::vector<Range> merged(std::vector<Range> r) {
  std::sort(r.begin(), r.end());
  std::vector<Range> out;
  for (const Range& x : r) {
    if (!out.empty() && x.first <= out.back().second + 1)
      out.back().second = std::max(out.back().second, x.second);
    else
      out.push_back(x);
  }
  return out;
}

// The ranges minus the characters JSON escapes.
std::vector<Range> raw_part(const std::vector<Range>& ranges) {
  std::vector<Range> out;
  for (auto [lo, hi] : ranges) {
    for (const Range& cut : {Range{0x00, 0x1F}, Range{'"', '"'}, Range{'\\', '\\'}, Range{0x7F, 0x7F}}) {
      if (hi < cut.first || lo > cut.second) continue;
      if (lo < cut.first) out.push_back({lo, cut.first - 1});
      lo = cut.second + 1;
      if (lo > hi) break;
    }
    if (lo <= hi) out.push_back({lo, hi});
  }
  return merged(out);
}

std::string gbnf_class(const std::vector<Range>& ranges, bool negated) {
  std::string out = negated ? "[^" : "[";
  for (const auto& [lo, hi] : ranges) out += lo == hi ? class_char(lo) : class_char(lo) + "-" + class_char(hi);
  return out + "]";
}

std::string alternatives(const std::vector<std::string>& alts) {
  if (alts.size() == 1) return alts[0];
  std::string out = "(";
  for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + alts[i];
  return out + ")";
}

class RegexConverter {
 public:
  RegexConverter(std::string_view pattern, int64_t max_repeat, RegexText text, std::string_view name)
      : max_repeat_(max_repeat), raw_(text == RegexText::raw), name_(name) {
    if (!tok::utf8_valid(pattern)) fail("is not valid UTF-8");
    for (size_t at = 0; at < pattern.size();) {
      char32_t cp = 0;
      size_t bad = 0;
      at += tok::utf8_decode(pattern, at, cp, bad);
      cps_.push_back(cp);
    }
  }

  std::string run() {
    bool start = false, end = false;
    if (!cps_.empty() && cps_.front() == '^') start = true, pos_ = 1;
    size_t stop = cps_.size();
    if (stop > pos_ && cps_.back() == '$' && !escaped_at(stop - 1)) end = true, --stop;
    end_ = stop;
    std::vector<std::string> alts = alternation();
    if (pos_ != end_) fail(fmt::format("unmatched ')' at character {}", pos_ + 1));
    if ((start || end) && alts.size() > 1)
      fail("'^' / '$' with a '|' outside any group is not supported (write ^(a|b)$)");
    std::string body = alternatives(alts);
    if (raw_) return body;  // matched whole
    if (!start) body = "char* " + body;
    if (!end) body += " char*";
    return body;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw SchemaError(name_ + " " + what); }

  // Whether cps_[i] is escaped by an odd run of backslashes before it.
  bool escaped_at(size_t i) const {
    size_t n = 0;
    while (i > n && cps_[i - n - 1] == '\\') ++n;
    return n % 2 == 1;
  }
  bool more() const { return pos_ < end_; }
  char32_t peek(size_t ahead = 0) const { return pos_ + ahead < end_ ? cps_[pos_ + ahead] : 0; }

  std::vector<std::string> alternation() {
    std::vector<std::string> alts = {sequence()};
    while (more() && peek() == '|') {
      ++pos_;
      alts.push_back(sequence());
    }
    return alts;
  }

  std::string sequence() {
    std::string out;
    while (more() && peek() != '|' && peek() != ')') {
      std::string a = atom();
      a = quantified(a);
      out += (out.empty() ? "" : " ") + a;
    }
    return out.empty() ? "\"\"" : out;
  }

  std::string atom() {
    const char32_t c = cps_[pos_++];
    switch (c) {
      case '(': return group();
      case '[': return emit(char_class());
      case '.': return emit({{{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}, true});
      case '\\': return emit(escape(false));
      case '^': fail("'^' is supported only at the start");
      case '$': fail("'$' is supported only at the end");
      case '*':
      case '+':
      case '?': fail(fmt::format("'{}' at character {} has nothing to repeat", static_cast<char>(c), pos_));
      case '{':
        if (quantifier_ahead(pos_ - 1)) fail(fmt::format("'{{' at character {} has nothing to repeat", pos_));
        return emit({{{c, c}}});
      default: return emit({{{c, c}}});
    }
  }

  std::string group() {
    if (++depth_ > kMaxDepth) fail(fmt::format("nests groups deeper than {}", kMaxDepth));
    if (peek() == '?') {
      if (peek(1) == ':') {
        pos_ += 2;
      } else if (peek(1) == '<' && peek(2) != '=' && peek(2) != '!') {  // a named group
        pos_ += 2;
        while (more() && peek() != '>') ++pos_;
        if (!more()) fail("has an unterminated group name");
        ++pos_;
      } else {
        fail("lookahead and lookbehind ((?=, (?!, (?<=, (?<!) are not supported");
      }
    }
    std::vector<std::string> alts = alternation();
    if (!more() || peek() != ')') fail("has an unclosed '('");
    ++pos_;
    --depth_;
    return alternatives(alts);
  }

  // Whether a valid {n}, {n,} or {n,m} starts at cps_[at] ('{').
  bool quantifier_ahead(size_t at) const {
    size_t i = at + 1, digits = 0;
    while (i < end_ && cps_[i] >= '0' && cps_[i] <= '9') ++i, ++digits;
    if (digits == 0) return false;
    if (i < end_ && cps_[i] == '}') return true;
    if (i >= end_ || cps_[i] != ',') return false;
    ++i;
    while (i < end_ && cps_[i] >= '0' && cps_[i] <= '9') ++i;
    return i < end_ && cps_[i] == '}';
  }

  int64_t number() {
    int64_t v = 0;
    while (more() && peek() >= '0' && peek() <= '9') {
      v = std::min<int64_t>(v * 10 + (peek() - '0'), int64_t{1} << 40);
      ++pos_;
    }
    return v;
  }

  std::string quantified(const std::string& a) {
    if (!more()) return a;
    std::string q;
    const char32_t c = peek();
    if (c == '*' || c == '+' || c == '?') {
      q = std::string(1, static_cast<char>(c));
      ++pos_;
    } else if (c == '{' && quantifier_ahead(pos_)) {
      ++pos_;
      const int64_t lo = number();
      int64_t hi = lo;
      bool open = false;
      if (peek() == ',') {
        ++pos_;
        open = !(peek() >= '0' && peek() <= '9');
        if (!open) hi = number();
      }
      ++pos_;  // '}'
      if (!open && hi < lo) fail(fmt::format("has {{{},{}}}: the maximum is below the minimum", lo, hi));
      if ((open ? lo : hi) > max_repeat_)
        fail(fmt::format("repeats more than {} times, the limit", max_repeat_));
      q = open ? fmt::format("{{{},}}", lo) : lo == hi ? fmt::format("{{{}}}", lo) : fmt::format("{{{},{}}}", lo, hi);
    } else {
      return a;
    }
    if (more() && peek() == '?') ++pos_;  // lazy: the same strings
    if (more() && (peek() == '*' || peek() == '+' || (peek() == '{' && quantifier_ahead(pos_))))
      fail(fmt::format("has a quantifier after a quantifier at character {}", pos_ + 1));
    return "(" + a + ")" + q;
  }

  // An escape's set; `in_class`: inside [...] (\b is a backspace there).
  CharSet escape(bool in_class) {
    if (!more()) fail("ends with a lone '\\'");
    const char32_t c = cps_[pos_++];
    switch (c) {
      case 'd': return {kDigit};
      case 'D': return {kDigit, true};
      case 'w': return {kWord};
      case 'W': return {kWord, true};
      case 's': return {space_ranges()};
      case 'S': return {space_ranges(), true};
      case 'n': return {{{'\n', '\n'}}};
      case 't': return {{{'\t', '\t'}}};
      case 'r': return {{{'\r', '\r'}}};
      case 'f': return {{{'\f', '\f'}}};
      case 'v': return {{{'\v', '\v'}}};
      case '0':
        if (peek() >= '0' && peek() <= '9') fail("octal escapes are not supported");
        return {{{0, 0}}};
      case 'x':
      case 'u': {
        const int n = c == 'x' ? 2 : 4;
        char32_t v = 0;
        for (int i = 0; i < n; ++i) {
          const char32_t h = peek();
          const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                                        : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
          if (d < 0) fail(fmt::format("has a bad \\{} escape at character {}", static_cast<char>(c), pos_));
          v = v * 16 + static_cast<char32_t>(d);
          ++pos_;
        }
        return {{{v, v}}};
      }
      case 'b':
        if (in_class) return {{{'\b', '\b'}}};
        fail("word boundaries (\\b, \\B) are not supported");
      case 'B': fail("word boundaries (\\b, \\B) are not supported");
      case 'p':
      case 'P': fail("Unicode property escapes (\\p, \\P) are not supported");
      case 'k': fail("named back-references (\\k) are not supported");
      case 'c': fail("control escapes (\\c) are not supported");
      default:
        if (c >= '1' && c <= '9') fail("back-references (\\1 ...) are not supported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
          fail(fmt::format("has an unknown escape '\\{}'", static_cast<char>(c)));
        return {{{c, c}}};
    }
  }

  CharSet char_class() {
    CharSet set;
    if (peek() == '^') set.negated = true, ++pos_;
    bool first = true;
    while (true) {
      if (!more()) fail("has an unclosed '['");
      if (peek() == ']' && !first) break;
      if (peek() == ']') fail("has an empty class '[]', which matches nothing");
      first = false;
      const CharSet lo = member();
      if (peek() == '-' && peek(1) != ']' && pos_ + 1 < end_) {
        ++pos_;
        const CharSet hi = member();
        if (lo.negated || hi.negated || lo.ranges.size() != 1 || hi.ranges.size() != 1 ||
            lo.ranges[0].first != lo.ranges[0].second || hi.ranges[0].first != hi.ranges[0].second)
          fail("has a class range whose end is a class (\\d, \\w, \\s)");
        if (hi.ranges[0].first < lo.ranges[0].first) fail("has a class range out of order");
        set.ranges.push_back({lo.ranges[0].first, hi.ranges[0].first});
        continue;
      }
      if (lo.negated) fail("\\D, \\W and \\S inside a class are not supported");
      set.ranges.insert(set.ranges.end(), lo.ranges.begin(), lo.ranges.end());
    }
    ++pos_;  // ']'
    set.ranges = merged(set.ranges);
    return set;
  }

  CharSet member() {
    const char32_t c = cps_[pos_++];
    if (c == '\\') return escape(true);
    return {{{c, c}}};
  }

  // The GBNF of one character of `set`, JSON-encoded unless raw_.
  std::string emit(const CharSet& set) {
    if (raw_) return emit_raw(set);
    std::vector<std::string> alts;
    if (!set.negated) {
      const std::vector<Range> ranges = merged(set.ranges);
      const std::vector<Range> raw = raw_part(ranges);
      if (raw.size() == 1 && raw[0].first == raw[0].second) {
        std::string s;
        tok::utf8_append(s, raw[0].first);
        alts.push_back(gbnf_literal(s));
      } else if (!raw.empty()) {
        alts.push_back(gbnf_class(raw, false));
      }
      for (const auto& [lo, hi] : ranges)
        for (char32_t c = lo; c <= std::min<char32_t>(hi, 0x7F); ++c)
          if (needs_escape(c)) alts.push_back(gbnf_literal(json_escape(c)));
    } else {
      std::vector<Range> excluded = set.ranges;
      for (const Range& r : {Range{0x00, 0x1F}, Range{'"', '"'}, Range{'\\', '\\'}, Range{0x7F, 0x7F}})
        excluded.push_back(r);
      alts.push_back(gbnf_class(merged(excluded), true));
      for (const char32_t c : {U'"', U'\\', U'\t', U'\n', U'\r'})
        if (set.contains(c)) alts.push_back(gbnf_literal(json_escape(c)));
    }
    if (alts.empty()) fail("has a class that matches no character");
    return alternatives(alts);
  }

  std::string emit_raw(const CharSet& set) {
    const std::vector<Range> ranges = merged(set.ranges);
    if (!set.negated && ranges.size() == 1 && ranges[0].first == ranges[0].second) {
      std::string s;
      tok::utf8_append(s, ranges[0].first);
      return gbnf_literal(s);
    }
    if (!set.negated && ranges.empty()) fail("has a class that matches no character");
    return gbnf_class(ranges, set.negated);
  }

  static constexpr int kMaxDepth = 64;  // the parser recurses per group: a bound, not the stack's size

  std::vector<char32_t> cps_;
  size_t pos_ = 0, end_ = 0;
  int depth_ = 0;
  int64_t max_repeat_;
  bool raw_;
  std::string name_;
};

}  // namespace

std::string regex_to_gbnf(std::string_view pattern, int64_t max_repeat, RegexText text, std::string_view name) {
  return RegexConverter(pattern, max_repeat, text, name).run();
}

}  // namespace loom

// GBNF parsing and checking (grammar.h). The parser builds rules of element sequences; repetitions are
// expanded into generated rules (x* -> R ::= x R | ε, with R's recursion in tail position so the
// recognizer's stacks do not grow); character classes become UTF-8 byte-range sequences.
#include "serve/grammar.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>

#include "tokenizer/unicode.h"

namespace loom {

GrammarError::GrammarError(const std::string& message, int line, int column)
    : Error(ErrorKind::invalid_input, message), line_(line), column_(column) {}

namespace {

using Elem = Grammar::Elem;
using Op = Grammar::Op;
using Seq = std::vector<Elem>;
using ByteSet = Grammar::ByteSet;

constexpr uint32_t kMaxCodePoint = 0x10FFFF;

struct Range {
  uint32_t lo, hi;
};

// Code point ranges without surrogates (not valid in UTF-8), sorted and merged.
std::vector<Range> normalize(std::vector<Range> rs) {
  std::vector<Range> split;
  for (const Range& r : rs) {
    if (r.lo <= 0xD7FF) split.push_back({r.lo, std::min(r.hi, 0xD7FFu)});
    if (r.hi >= 0xE000) split.push_back({std::max(r.lo, 0xE000u), r.hi});
  }
  std::sort(split.begin(), split.end(), [](Range a, Range b) { return a.lo < b.lo; });
  std::vector<Range> out;
  for (const Range& r : split) {
    if (!out.empty() && r.lo <= out.back().hi + 1)
      out.back().hi = std::max(out.back().hi, r.hi);
    else
      out.push_back(r);
  }
  return out;
}

std::vector<Range> complement(const std::vector<Range>& rs) {
  std::vector<Range> out;
  uint32_t next = 0;
  for (const Range& r : rs) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return normalize(out);
}

int utf8_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

std::string utf8_encode(uint32_t cp) {
  std::string s;
  tok::utf8_append(s, static_cast<char32_t>(cp));
  return s;
}

using ByteRanges = std::vector<std::pair<uint8_t, uint8_t>>;  // one range per byte of the sequence

// Splits [lo, hi] (same UTF-8 length) until each piece is a product of per-byte ranges (the split of
// Russ Cox's UTF-8 automata / Rust's utf8 sequences).
void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<ByteRanges>& out) {
  const int n = utf8_len(lo);
  if (utf8_len(hi) != n) {
    const uint32_t edge = n == 1 ? 0x7F : n == 2 ? 0x7FF : 0xFFFF;
    utf8_sequences(lo, edge, out);
    utf8_sequences(edge + 1, hi, out);
    return;
  }
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_sequences(lo, lo | m, out);
        utf8_sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_sequences(lo, (hi & ~m) - 1, out);
        utf8_sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  const std::string a = utf8_encode(lo), b = utf8_encode(hi);
  ByteRanges seq;
  for (size_t k = 0; k < a.size(); ++k) seq.emplace_back(static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k]));
  out.push_back(std::move(seq));
}

ByteSet byte_range_set(uint8_t lo, uint8_t hi) {
  ByteSet s{};
  for (int b = lo; b <= hi; ++b) s[b >> 6] |= uint64_t{1} << (b & 63);
  return s;
}

bool is_word_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

class Parser {
 public:
  Parser(std::string_view text, const GrammarLimits& limits) : src_(text), lim_(limits) {}

  std::shared_ptr<Grammar> run() {
    if (src_.size() > lim_.max_text)
      throw GrammarError(fmt::format("the grammar is {} bytes long; at most {} are allowed", src_.size(),
                                     lim_.max_text));
    skip_space(true);
    while (!eof()) {
      parse_rule();
      skip_space(true);
    }
    return finish();
  }

 private:
  struct RuleInfo {
    std::vector<Seq> alts;
    bool defined = false;
    size_t first_use = std::string_view::npos;  // where it was first referenced (for "undefined")
    size_t def_pos = 0;
  };

  // --- errors and positions -------------------------------------------------------------------------------
  [[noreturn]] void error_at(size_t at, const std::string& what) const {
    int line = 1, col = 1;
    for (size_t i = 0; i < at && i < src_.size(); ++i) {
      if (src_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    throw GrammarError(fmt::format("grammar parse error at line {}, column {}: {}", line, col, what), line, col);
  }
  [[noreturn]] void error(const std::string& what) const { error_at(pos_, what); }

  bool eof() const { return pos_ >= src_.size(); }
  char peek(size_t ahead = 0) const { return pos_ + ahead < src_.size() ? src_[pos_ + ahead] : '\0'; }

  // Spaces, tabs and comments; newlines too when `newlines` (inside groups, after ::= and |).
  void skip_space(bool newlines) {
    while (!eof()) {
      const char c = peek();
      if (c == ' ' || c == '\t') {
        ++pos_;
      } else if (c == '#') {
        while (!eof() && peek() != '\n') ++pos_;
      } else if (newlines && (c == '\n' || c == '\r')) {
        ++pos_;
      } else {
        break;
      }
    }
  }

  // --- rules ---------------------------------------------------------------------------------------------
  int32_t rule_id(const std::string& name) {
    const auto it = ids_.find(name);
    if (it != ids_.end()) return it->second;
    if (rules_.size() >= lim_.max_rules)
      error(fmt::format("more than {} rules (repetitions count as rules)", lim_.max_rules));
    const auto id = static_cast<int32_t>(rules_.size());
    ids_.emplace(name, id);
    names_.push_back(name);
    rules_.emplace_back();
    return id;
  }

  int32_t new_rule(const std::string& parent, std::vector<Seq> alts) {
    std::string name;
    do name = fmt::format("{}_{}", parent, ++generated_);
    while (ids_.count(name));
    const int32_t id = rule_id(name);
    rules_[static_cast<size_t>(id)].alts = std::move(alts);
    rules_[static_cast<size_t>(id)].defined = true;
    rules_[static_cast<size_t>(id)].def_pos = pos_;  // inside the rule it was made for
    count_elements(rules_[static_cast<size_t>(id)].alts);
    return id;
  }

  void count_elements(const std::vector<Seq>& alts) {
    for (const Seq& s : alts) n_elements_ += s.size() + 1;
    if (n_elements_ > lim_.max_elements)
      error(fmt::format("the grammar expands to more than {} elements (large repetition counts?)",
                        lim_.max_elements));
  }

  std::string parse_name() {
    const size_t start = pos_;
    while (!eof() && is_word_char(peek())) ++pos_;
    if (pos_ == start) error("expected a rule name");
    return std::string(src_.substr(start, pos_ - start));
  }

  void parse_rule() {
    const size_t start = pos_;
    const std::string name = parse_name();
    skip_space(false);
    if (src_.substr(pos_, 3) != "::=") error(fmt::format("expected '::=' after the rule name '{}'", name));
    pos_ += 3;
    skip_space(true);
    std::vector<Seq> alts = parse_alternatives(name, false);
    const int32_t id = rule_id(name);
    RuleInfo& r = rules_[static_cast<size_t>(id)];
    if (r.defined) error_at(start, fmt::format("the rule '{}' is defined twice", name));
    r.alts = std::move(alts);
    r.defined = true;
    r.def_pos = start;
    count_elements(r.alts);
    if (!eof() && peek() != '\n' && peek() != '\r')
      error(fmt::format("unexpected '{}' in the rule '{}'", peek(), name));
  }

  std::vector<Seq> parse_alternatives(const std::string& rule, bool nested) {
    std::vector<Seq> alts;
    alts.push_back(parse_sequence(rule, nested));
    while (true) {
      if (!nested) {
        // An alternative may start on the next line ("  | b"): look past line ends for a '|'.
        const size_t save = pos_;
        skip_space(true);
        if (peek() != '|') {
          pos_ = save;
          break;
        }
      }
      if (peek() != '|') break;
      ++pos_;
      skip_space(true);
      alts.push_back(parse_sequence(rule, nested));
    }
    return alts;
  }

  Seq parse_sequence(const std::string& rule, bool nested) {
    Seq seq;
    size_t last = std::string_view::npos;  // where the last item starts in seq
    while (!eof()) {
      const char c = peek();
      if (c == '"') {
        last = seq.size();
        parse_literal(seq);
      } else if (c == '[') {
        last = seq.size();
        seq.push_back(parse_class(rule));
      } else if (c == '.') {
        ++pos_;
        last = seq.size();
        seq.push_back(class_elem(rule, {{0, kMaxCodePoint}}, false));
      } else if (c == '(') {
        ++pos_;
        skip_space(true);
        std::vector<Seq> alts = parse_alternatives(rule, true);
        if (peek() != ')') error("expected ')'");
        ++pos_;
        last = seq.size();
        seq.push_back({Op::rule, new_rule(rule, std::move(alts))});
      } else if (is_word_char(c)) {
        const size_t at = pos_;
        const std::string name = parse_name();
        const int32_t id = rule_id(name);
        RuleInfo& r = rules_[static_cast<size_t>(id)];
        if (r.first_use == std::string_view::npos) r.first_use = at;
        last = seq.size();
        seq.push_back({Op::rule, id});
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (last == std::string_view::npos) error(fmt::format("'{}' without an item before it", c));
        apply_repetition(rule, seq, last);
      } else if (c == '<') {
        error("token references (<...>) are not supported");
      } else {
        break;  // '|', ')', a line end or something the caller reports
      }
      skip_space(nested);
    }
    return seq;
  }

  // --- terminals -----------------------------------------------------------------------------------------
  uint32_t parse_hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char c = peek();
      int d;
      if (c >= '0' && c <= '9')
        d = c - '0';
      else if (c >= 'a' && c <= 'f')
        d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        d = c - 'A' + 10;
      else
        error(fmt::format("expected {} hex digits", digits));
      v = v * 16 + static_cast<uint32_t>(d);
      ++pos_;
    }
    return v;
  }

  // One character of a literal or class: an escape or a UTF-8 character of the text.
  uint32_t parse_char() {
    const size_t at = pos_;
    const auto c = static_cast<unsigned char>(peek());
    uint32_t cp;
    if (c == '\\') {
      ++pos_;
      const char e = peek();
      ++pos_;
      switch (e) {
        case 'x': cp = parse_hex(2); break;
        case 'u': cp = parse_hex(4); break;
        case 'U': cp = parse_hex(8); break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case '\\': case '"': case '[': case ']': case '-': case '^': case '/': case '\'': cp = static_cast<uint8_t>(e); break;
        default: error_at(at, e == '\0' ? "unfinished escape" : fmt::format("unknown escape '\\{}'", e));
      }
    } else if (c < 0x80) {
      cp = c;
      ++pos_;
    } else {
      cp = decode_utf8(at);
    }
    if (cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF))
      error_at(at, fmt::format("U+{:X} is not a valid character", cp));
    return cp;
  }

  uint32_t decode_utf8(size_t at) {
    char32_t cp = 0;
    size_t bad = 0;
    const size_t n = tok::utf8_decode(src_, pos_, cp, bad);  // refuses overlongs and surrogates
    if (n == 0) error_at(at, "invalid UTF-8 in the grammar text");
    pos_ += n;
    return static_cast<uint32_t>(cp);
  }

  void parse_literal(Seq& seq) {
    ++pos_;  // opening quote
    while (peek() != '"') {
      if (eof() || peek() == '\n') error("unterminated string literal");
      for (const char b : utf8_encode(parse_char()))
        seq.push_back({Op::bytes, byteset(byte_range_set(static_cast<uint8_t>(b), static_cast<uint8_t>(b)))});
    }
    ++pos_;
  }

  Elem parse_class(const std::string& rule) {
    ++pos_;  // '['
    bool negated = false;
    if (peek() == '^') {
      negated = true;
      ++pos_;
    }
    std::vector<Range> ranges;
    while (peek() != ']') {
      if (eof() || peek() == '\n') error("unterminated character class");
      const uint32_t lo = parse_char();
      uint32_t hi = lo;
      if (peek() == '-' && peek(1) != ']' && peek(1) != '\0') {
        ++pos_;
        const size_t at = pos_;
        hi = parse_char();
        if (hi < lo) error_at(at, fmt::format("the range U+{:X}-U+{:X} is reversed", lo, hi));
      }
      ranges.push_back({lo, hi});
    }
    ++pos_;
    return class_elem(rule, ranges, negated);
  }

  // A class as one bytes element (all of it single-byte) or a generated rule of byte sequences; sequences
  // with the same continuation bytes share one alternative (their lead bytes united).
  Elem class_elem(const std::string& rule, const std::vector<Range>& ranges, bool negated) {
    std::vector<Range> rs = normalize(ranges);
    if (negated) rs = complement(rs);
    if (rs.empty()) error("the character class matches no character");
    std::vector<ByteRanges> seqs;
    for (const Range& r : rs) utf8_sequences(r.lo, r.hi, seqs);
    std::map<ByteRanges, ByteSet> by_tail;
    for (const ByteRanges& s : seqs) {
      ByteSet& lead = by_tail[ByteRanges(s.begin() + 1, s.end())];
      const ByteSet add = byte_range_set(s[0].first, s[0].second);
      for (int k = 0; k < 4; ++k) lead[static_cast<size_t>(k)] |= add[static_cast<size_t>(k)];
    }
    std::vector<Seq> alts;
    for (const auto& [tail, lead] : by_tail) {
      Seq s{{Op::bytes, byteset(lead)}};
      for (const auto& [lo, hi] : tail) s.push_back({Op::bytes, byteset(byte_range_set(lo, hi))});
      alts.push_back(std::move(s));
    }
    if (alts.size() == 1 && alts[0].size() == 1) return alts[0][0];
    return {Op::rule, new_rule(rule, std::move(alts))};
  }

  int32_t byteset(const ByteSet& s) {
    const auto it = byteset_ids_.find(s);
    if (it != byteset_ids_.end()) return it->second;
    const auto id = static_cast<int32_t>(bytesets_.size());
    bytesets_.push_back(s);
    byteset_ids_.emplace(s, id);
    return id;
  }

  // --- repetitions ---------------------------------------------------------------------------------------
  int64_t parse_count() {
    const size_t start = pos_;
    int64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      if (v > lim_.max_repeat) error_at(start, fmt::format("repetition counts are limited to {}", lim_.max_repeat));
      ++pos_;
    }
    return pos_ == start ? -1 : v;
  }

  // Replaces seq[last..] (the item) by its repetition.
  void apply_repetition(const std::string& rule, Seq& seq, size_t last) {
    const char c = peek();
    const size_t at = pos_;
    ++pos_;
    int64_t min = 0, max = -1;  // max -1: unbounded
    if (c == '+') {
      min = 1;
    } else if (c == '?') {
      max = 1;
    } else if (c == '{') {
      skip_space(false);
      min = parse_count();
      if (min < 0 && peek() != ',') error("expected a number after '{'");
      min = std::max<int64_t>(min, 0);  // {,n}
      skip_space(false);
      max = min;
      if (peek() == ',') {
        ++pos_;
        skip_space(false);
        max = parse_count();
        skip_space(false);
      }
      if (peek() != '}') error("expected '}'");
      ++pos_;
      if (max >= 0 && max < min) error_at(at, fmt::format("{{{},{}}}: the maximum is below the minimum", min, max));
    }
    Seq item_seq(seq.begin() + static_cast<std::ptrdiff_t>(last), seq.end());
    seq.resize(last);
    const Elem item = item_seq.size() == 1 ? item_seq[0] : Elem{Op::rule, new_rule(rule, {item_seq})};
    for (int64_t i = 0; i < min; ++i) seq.push_back(item);
    n_elements_ += static_cast<size_t>(min);
    if (max < 0) {
      // R ::= item R | ε
      const int32_t r = rule_id_reserved(rule);
      rules_[static_cast<size_t>(r)].alts = {{item, {Op::rule, r}}, {}};
      count_elements(rules_[static_cast<size_t>(r)].alts);
      seq.push_back({Op::rule, r});
    } else if (max > min) {
      // (item (item ...)?)?: T_1 ::= item | ε, T_k ::= item T_{k-1} | ε
      int32_t tail = new_rule(rule, {{item}, {}});
      for (int64_t k = 2; k <= max - min; ++k) tail = new_rule(rule, {{item, {Op::rule, tail}}, {}});
      seq.push_back({Op::rule, tail});
    }
    count_elements({});
  }

  // A generated rule whose alternatives are filled in by the caller (it refers to itself).
  int32_t rule_id_reserved(const std::string& parent) { return new_rule(parent, {}); }

  // --- checks and flattening -----------------------------------------------------------------------------
  std::shared_ptr<Grammar> finish() {
    for (size_t i = 0; i < rules_.size(); ++i)
      if (!rules_[i].defined) error_at(rules_[i].first_use, fmt::format("undefined rule '{}'", names_[i]));
    const auto root = ids_.find("root");
    if (root == ids_.end()) throw GrammarError("the grammar has no 'root' rule");
    check_left_recursion();
    auto g = std::make_shared<Grammar>();
    g->root = root->second;
    g->rule_names = names_;
    g->bytesets = bytesets_;
    for (const RuleInfo& r : rules_) {
      std::vector<int32_t> starts;
      for (const Seq& s : r.alts) {
        starts.push_back(static_cast<int32_t>(g->elems.size()));
        g->elems.insert(g->elems.end(), s.begin(), s.end());
        g->elems.push_back({Op::end, 0});
      }
      g->rule_alts.push_back(std::move(starts));
    }
    compute_byte_classes(*g);
    return g;
  }

  // A rule that can reach itself without consuming a byte would make the recognizer expand forever.
  void check_left_recursion() {
    const size_t n = rules_.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t i = 0; i < n; ++i) {
        if (nullable[i]) continue;
        for (const Seq& s : rules_[i].alts) {
          const bool all = std::all_of(s.begin(), s.end(), [&](const Elem& e) {
            return e.op == Op::rule && nullable[static_cast<size_t>(e.arg)];
          });
          if (all) {
            nullable[i] = changed = true;
            break;
          }
        }
      }
    }
    std::vector<std::vector<int32_t>> left(n);  // rules that can come first in a rule
    for (size_t i = 0; i < n; ++i)
      for (const Seq& s : rules_[i].alts)
        for (const Elem& e : s) {
          if (e.op != Op::rule) break;
          left[i].push_back(e.arg);
          if (!nullable[static_cast<size_t>(e.arg)]) break;
        }
    // Iterative DFS (deep rule chains must not overflow an HTTP thread's stack).
    std::vector<int8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
    for (size_t start = 0; start < n; ++start) {
      if (color[start]) continue;
      std::vector<std::pair<int32_t, size_t>> path{{static_cast<int32_t>(start), 0}};
      color[start] = 1;
      while (!path.empty()) {
        auto& [r, next] = path.back();
        if (next == left[static_cast<size_t>(r)].size()) {
          color[static_cast<size_t>(r)] = 2;
          path.pop_back();
          continue;
        }
        const int32_t to = left[static_cast<size_t>(r)][next++];
        if (color[static_cast<size_t>(to)] == 1) report_cycle(path, to);
        if (color[static_cast<size_t>(to)] == 0) {
          color[static_cast<size_t>(to)] = 1;
          path.emplace_back(to, 0);
        }
      }
    }
  }

  [[noreturn]] void report_cycle(const std::vector<std::pair<int32_t, size_t>>& path, int32_t to) {
    std::string chain;
    bool on = false;
    for (const auto& [r, unused] : path) {
      if (r == to) on = true;
      if (on) chain += names_[static_cast<size_t>(r)] + " -> ";
    }
    chain += names_[static_cast<size_t>(to)];
    error_at(rules_[static_cast<size_t>(to)].def_pos,
             fmt::format("left recursion (a rule that can reach itself without reading a character): {}", chain));
  }

  static void compute_byte_classes(Grammar& g) {
    std::map<std::vector<bool>, uint8_t> classes;
    for (int b = 0; b < 256; ++b) {
      std::vector<bool> sig(g.bytesets.size());
      for (size_t i = 0; i < g.bytesets.size(); ++i) sig[i] = Grammar::has(g.bytesets[i], static_cast<uint8_t>(b));
      const auto [it, added] = classes.emplace(std::move(sig), static_cast<uint8_t>(g.class_byte.size()));
      if (added) g.class_byte.push_back(static_cast<uint8_t>(b));
      g.byte_class[static_cast<size_t>(b)] = it->second;
    }
  }

  std::string_view src_;
  GrammarLimits lim_;
  size_t pos_ = 0;
  std::vector<RuleInfo> rules_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, int32_t> ids_;
  std::vector<ByteSet> bytesets_;
  std::map<ByteSet, int32_t> byteset_ids_;
  size_t n_elements_ = 0;
  int generated_ = 0;
};

}  // namespace

std::shared_ptr<const Grammar> compile_gbnf(std::string_view text, const GrammarLimits& limits) {
  return Parser(text, limits).run();
}

std::string gbnf_literal(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7F) {
      out += fmt::format("\\x{:02X}", c);
    } else {
      out += ch;  // UTF-8 bytes pass as they are
    }
  }
  return out + "\"";
}

}  // namespace loom

// Normalizers and pre-tokenizers (see pipeline.h). The split behaviours are
// transcribed from HF's NormalizedString::split so that empty matches,
// adjacent matches and inverted patterns come out the same.
#include "tokenizer/pipeline.h"

#include <unicode/unorm2.h>
#include <unicode/uset.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/unicode.h"
#include "tokenizer/unicode_classes.h"

namespace loom::tok {
namespace {

std::string replace_all(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches,
                        std::string_view with) {
  std::string out;
  out.reserve(text.size());
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    out.append(text.substr(prev, b - prev));
    out.append(with);
    prev = e;
  }
  out.append(text.substr(prev));
  return out;
}

std::vector<std::pair<size_t, size_t>> literal_matches(std::string_view text, std::string_view needle) {
  std::vector<std::pair<size_t, size_t>> out;
  if (needle.empty()) return out;
  for (size_t at = text.find(needle); at != std::string_view::npos;
       at = text.find(needle, at + needle.size()))
    out.emplace_back(at, at + needle.size());
  return out;
}

// One match per numeric character, as HF's Digits (Rust char::is_numeric)
// splits. Not PCRE2's \p{N}: Rust's Unicode tables are newer than PCRE2's and
// differ from Oniguruma's \p{N} too (unicode_classes.h).
std::vector<std::pair<size_t, size_t>> numeric_matches(std::string_view text) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t i = 0; i < text.size();) {
    char32_t cp = 0;
    size_t bad = 0;
    const size_t n = utf8_decode(text, i, cp, bad);
    LOOM_ASSERT(n > 0);  // pre-tokenizer input is valid UTF-8
    if (is_hf_numeric(cp)) out.emplace_back(i, i + n);
    i += n;
  }
  return out;
}

// HF's NFC (the unicode-normalization-alignments crate) has Unicode 9.0 tables:
// a mark added since counts as class 0 (never reordered) and the compositions
// added since (U+11935 U+11930 -> U+11938) are not made. ICU's NFC restricted to
// the code points assigned by Unicode 9.0 does exactly that: any other code
// point is left as it is and ends a normalization run, as an unknown starter
// does in HF. Built once, immutable (ICU's frozen set and normalizer are
// thread-safe), released at exit.
const UNormalizer2* hf_nfc(UErrorCode& err) {
  struct Filtered {
    USet* set = nullptr;
    UNormalizer2* norm = nullptr;
    UErrorCode err = U_ZERO_ERROR;
    Filtered() {
      const UNormalizer2* nfc = unorm2_getNFCInstance(&err);
      static const UChar kPattern[] = u"[:age=9.0:]";
      if (U_SUCCESS(err)) set = uset_openPattern(kPattern, -1, &err);
      if (U_SUCCESS(err)) {
        uset_freeze(set);
        norm = unorm2_openFiltered(nfc, set, &err);
      }
    }
    ~Filtered() {
      if (norm) unorm2_close(norm);
      if (set) uset_close(set);
    }
  };
  static const Filtered f;
  err = f.err;
  return f.norm;
}

}  // namespace

std::vector<std::pair<size_t, size_t>> split_ranges(size_t text_size,
                                                    const std::vector<std::pair<size_t, size_t>>& matches,
                                                    SplitBehavior behavior, bool invert) {
  struct Part {
    size_t b, e;
    bool match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) parts.push_back({prev, b, false});
    parts.push_back({b, e, true});
    prev = e;
  }
  if (prev != text_size || parts.empty()) parts.push_back({prev, text_size, false});
  if (invert)
    for (auto& p : parts) p.match = !p.match;

  struct Out {
    size_t b, e;
    bool remove;
  };
  std::vector<Out> out;
  bool prev_match = false;
  switch (behavior) {
    case SplitBehavior::isolated:
      for (const auto& p : parts) out.push_back({p.b, p.e, false});
      break;
    case SplitBehavior::removed:
      for (const auto& p : parts) out.push_back({p.b, p.e, p.match});
      break;
    case SplitBehavior::contiguous:
      for (const auto& p : parts) {
        if (p.match == prev_match && !out.empty())
          out.back().e = p.e;
        else
          out.push_back({p.b, p.e, false});
        prev_match = p.match;
      }
      break;
    case SplitBehavior::merged_with_previous:
      for (const auto& p : parts) {
        if (p.match && !prev_match && !out.empty())
          out.back().e = p.e;
        else
          out.push_back({p.b, p.e, false});
        prev_match = p.match;
      }
      break;
    case SplitBehavior::merged_with_next:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !prev_match && !out.empty())
          out.back().b = it->b;
        else
          out.push_back({it->b, it->e, false});
        prev_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& o : out)
    if (!o.remove && o.e > o.b) ranges.emplace_back(o.b, o.e);
  return ranges;
}

std::string nfc(std::string_view text) {
  bool ascii = true;
  for (unsigned char c : text) ascii = ascii && c < 0x80;
  if (ascii) return std::string(text);
  if (text.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max() / 4))
    fail(ErrorKind::invalid_input, "text of {} bytes is too long to normalize", text.size());
  UErrorCode err = U_ZERO_ERROR;
  const UNormalizer2* norm = hf_nfc(err);
  if (U_FAILURE(err)) fail(ErrorKind::internal, "ICU NFC normalizer unavailable: {}", u_errorName(err));
  std::u16string src(text.size(), u'\0');
  int32_t n16 = 0;
  u_strFromUTF8(src.data(), static_cast<int32_t>(src.size()), &n16, text.data(),
                static_cast<int32_t>(text.size()), &err);
  if (U_FAILURE(err)) fail(ErrorKind::internal, "ICU UTF-8 conversion failed: {}", u_errorName(err));
  src.resize(static_cast<size_t>(n16));
  if (unorm2_isNormalized(norm, src.data(), n16, &err) && U_SUCCESS(err)) return std::string(text);
  err = U_ZERO_ERROR;
  // NFC never grows text by more than a factor of 3 (Unicode stability guarantee).
  std::u16string dst(src.size() * 3 + 16, u'\0');
  const int32_t nd =
      unorm2_normalize(norm, src.data(), n16, dst.data(), static_cast<int32_t>(dst.size()), &err);
  if (U_FAILURE(err)) fail(ErrorKind::internal, "ICU NFC failed: {}", u_errorName(err));
  std::string out(static_cast<size_t>(nd) * 3, '\0');
  int32_t n8 = 0;
  u_strToUTF8(out.data(), static_cast<int32_t>(out.size()), &n8, dst.data(), nd, &err);
  if (U_FAILURE(err)) fail(ErrorKind::internal, "ICU UTF-8 conversion failed: {}", u_errorName(err));
  out.resize(static_cast<size_t>(n8));
  return out;
}

Normalizer::Normalizer(const std::vector<NormalizerStep>& steps, const std::string& what) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const NormalizerStep& s = steps[i];
    Step c{s.kind, s.pattern, s.content, std::nullopt};
    if (s.kind == NormalizerStep::Kind::replace)
      c.re.emplace(s.pattern, !s.pattern_is_regex, fmt::format("{}: normalizer step {} (Replace)", what, i));
    steps_.push_back(std::move(c));
  }
}

std::string Normalizer::apply(std::string_view text) const {
  std::string cur(text);
  for (const Step& s : steps_) {
    switch (s.kind) {
      case NormalizerStep::Kind::prepend:
        if (!cur.empty()) cur.insert(0, s.text);
        break;
      case NormalizerStep::Kind::replace:
        if (!cur.empty()) cur = replace_all(cur, s.re->find_all(cur), s.content);  // HF finds nothing in ""
        break;
      case NormalizerStep::Kind::nfc:
        cur = nfc(cur);
        break;
    }
  }
  return cur;
}

PreTokenizer::PreTokenizer(const std::vector<PreTokenizerStep>& steps, const std::string& what) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const PreTokenizerStep& s = steps[i];
    Step c{s, std::nullopt};
    const std::string where = fmt::format("{}: pre_tokenizer step {}", what, i);
    switch (s.kind) {
      case PreTokenizerStep::Kind::split:
        c.re.emplace(s.pattern, !s.pattern_is_regex, where + " (Split)");
        break;
      case PreTokenizerStep::Kind::byte_level:
        if (s.use_regex) c.re.emplace(kGpt2Pattern, false, where + " (ByteLevel)");
        break;
      case PreTokenizerStep::Kind::digits:  // no regex: see numeric_matches()
        break;
      case PreTokenizerStep::Kind::metaspace:
        if (s.replacement.empty()) fail(ErrorKind::invalid_input, "{} (Metaspace): empty replacement", where);
        break;
    }
    steps_.push_back(std::move(c));
  }
}

void PreTokenizer::apply(std::vector<Piece>& pieces) const {
  std::vector<Piece> next;
  for (const Step& st : steps_) {
    const PreTokenizerStep& s = st.spec;
    next.clear();
    next.reserve(pieces.size());
    for (Piece& piece : pieces) {
      if (piece.text.empty()) continue;  // HF drops empty splits before any step sees them
      std::string& text = piece.text;
      std::vector<std::pair<size_t, size_t>> ranges;
      switch (s.kind) {
        case PreTokenizerStep::Kind::split:
          ranges = split_ranges(text.size(), st.re->find_all(text), s.behavior, s.invert);
          break;
        case PreTokenizerStep::Kind::digits:
          ranges =
              split_ranges(text.size(), numeric_matches(text),
                           s.individual_digits ? SplitBehavior::isolated : SplitBehavior::contiguous, false);
          break;
        case PreTokenizerStep::Kind::byte_level:
          if (s.add_prefix_space && (text.empty() || text[0] != ' ')) text.insert(text.begin(), ' ');
          if (st.re)
            ranges = split_ranges(text.size(), st.re->find_all(text), SplitBehavior::isolated, false);
          else if (!text.empty())
            ranges.emplace_back(0, text.size());
          break;
        case PreTokenizerStep::Kind::metaspace: {
          text = replace_all(text, literal_matches(text, " "), s.replacement);
          const bool starts = text.compare(0, s.replacement.size(), s.replacement) == 0;
          if (!starts && (s.prepend_scheme == PrependScheme::always ||
                          (s.prepend_scheme == PrependScheme::first && piece.at_start)))
            text.insert(0, s.replacement);
          if (s.split)
            ranges = split_ranges(text.size(), literal_matches(text, s.replacement),
                                  SplitBehavior::merged_with_next, false);
          else if (!text.empty())
            ranges.emplace_back(0, text.size());
          break;
        }
      }
      for (const auto& [b, e] : ranges) {
        Piece out{std::string(), piece.at_start && b == 0};
        if (s.kind == PreTokenizerStep::Kind::byte_level)
          bytes_to_chars(std::string_view(text).substr(b, e - b), out.text);
        else
          out.text.assign(text, b, e - b);
        next.push_back(std::move(out));
      }
    }
    pieces.swap(next);
  }
}

}  // namespace loom::tok

// PCRE2 wrapper (see regex.h). JIT-compiled when the library supports it; a
// match the JIT cannot finish (stack limit on huge inputs) is redone by the
// interpreter, which keeps its backtracking state on the heap.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include <memory>

#include "core/error.h"
#include "tokenizer/unicode_classes.h"

namespace loom::tok {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  const int n = pcre2_get_error_message(code, buf, sizeof buf);
  return n < 0 ? fmt::format("PCRE2 error {}", code) : std::string(reinterpret_cast<const char*>(buf));
}

struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

}  // namespace

Regex::Regex(std::string_view pattern, bool literal, const std::string& what) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE err_off = 0;
  // PCRE2 refuses UCP together with LITERAL (it has no meaning there).
  const uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  const auto compile = [&](std::string_view p) {
    return pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), opts, &err, &err_off, nullptr);
  };
  // HF's Oniguruma knows a newer Unicode than the system PCRE2 may: \p{L} and
  // \p{N} are widened to the code points HF gives them (unicode_classes.h).
  code_ = compile(literal ? std::string(pattern) : widen_unicode_classes(pattern));
  if (!code_ && !literal) code_ = compile(pattern);  // for the error message, about the pattern as written
  if (!code_)
    fail(ErrorKind::invalid_input, "{}: regex {:?} is not supported: {} at offset {}", what,
         std::string(pattern), pcre2_message(err), static_cast<size_t>(err_off));
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
  if (code_) pcre2_code_free(code_);
}

Regex::Regex(Regex&& other) noexcept
    : code_(other.code_), jit_(other.jit_), pattern_(std::move(other.pattern_)) {
  other.code_ = nullptr;
}

Regex& Regex::operator=(Regex&& other) noexcept {
  if (this != &other) {
    if (code_) pcre2_code_free(code_);
    code_ = other.code_;
    jit_ = other.jit_;
    pattern_ = std::move(other.pattern_);
    other.code_ = nullptr;
  }
  return *this;
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view subject) const {
  LOOM_ASSERT(code_ != nullptr);
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> md(
      pcre2_match_data_create_from_pattern(code_, nullptr));
  if (!md) fail(ErrorKind::internal, "out of memory for a regex match");
  std::vector<std::pair<size_t, size_t>> out;
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t pos = 0;
  size_t last_end = std::string_view::npos;
  while (pos <= subject.size()) {
    // The subject was validated (or sanitised) before; skip PCRE2's own check.
    int rc = pcre2_match(code_, s, subject.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
    if (jit_ && rc < 0 && rc != PCRE2_ERROR_NOMATCH)
      rc = pcre2_match(code_, s, subject.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0)
      fail(ErrorKind::internal, "regex {:?} failed on a {}-byte text: {}", pattern_, subject.size(),
           pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    const size_t b = ov[0], e = ov[1];
    LOOM_ASSERT(b >= pos && e >= b && e <= subject.size());
    // Like Oniguruma's iterator (which HF uses), an empty match right where the
    // previous match ended is not reported.
    if (e > b || b != last_end) out.emplace_back(b, e);
    last_end = e;
    if (e > b) {
      pos = e;
    } else {  // empty match: step over one whole character
      if (b >= subject.size()) break;
      pos = b + 1;
      while (pos < subject.size() && (static_cast<uint8_t>(subject[pos]) & 0xC0) == 0x80) ++pos;
    }
  }
  return out;
}

}  // namespace loom::tok

// A compiled PCRE2 pattern (UTF + Unicode properties, JIT when available) for
// the tokenizer's split and replace steps. Immutable after construction, so one
// instance may be used from several threads.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct pcre2_real_code_8;

namespace loom::tok {

class Regex {
 public:
  // `literal` matches `pattern` as plain text. `what` names the pattern's origin
  // (file and field) in the error raised for a pattern PCRE2 rejects.
  Regex(std::string_view pattern, bool literal, const std::string& what);
  ~Regex();
  Regex(Regex&& other) noexcept;
  Regex& operator=(Regex&& other) noexcept;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Successive non-overlapping matches [start, end) in `subject` (valid UTF-8),
  // left to right, as Oniguruma's iterator gives them: after an empty match the
  // search resumes one character on, and an empty match where the previous
  // match ended is skipped.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view subject) const;

  const std::string& pattern() const { return pattern_; }

 private:
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
  std::string pattern_;
};

}  // namespace loom::tok

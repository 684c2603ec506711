// UTF-8 helpers for the tokenizer: decoding one code point, sanitising invalid
// input the way Python/Rust lossy conversion does, and small predicates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom::tok {

// Decodes the code point at s[pos]. On success sets cp, returns its byte length
// (1-4). On an invalid sequence returns 0 and sets `bad` to the length of the
// maximal invalid subpart (>= 1) that one U+FFFD replaces.
size_t utf8_decode(std::string_view s, size_t pos, char32_t& cp, size_t& bad);

void utf8_append(std::string& out, char32_t cp);

bool utf8_valid(std::string_view s);

// `s` with every maximal invalid subpart replaced by U+FFFD (Unicode's
// recommended practice, as Rust's from_utf8_lossy and Python's "replace").
std::string utf8_sanitize(std::string_view s);

// Length of the longest prefix of `s` that does not end inside a sequence that
// could still be completed by more bytes (used by streaming decoders).
size_t utf8_complete_prefix(std::string_view s);

// Number of code points of valid UTF-8 `s`.
size_t utf8_length(std::string_view s);

// Unicode White_Space (Rust's char::is_whitespace, regex \s).
bool is_unicode_space(char32_t cp);
// Python's str.isspace: White_Space plus the separators U+001C..U+001F.
bool is_python_space(char32_t cp);

// `s` without leading and trailing Python white space (str.strip(), Jinja's trim).
std::string_view strip_python_space(std::string_view s);

}  // namespace loom::tok

// UTF-8 decoding and sanitising for the tokenizer (see unicode.h).
#include "tokenizer/unicode.h"

namespace loom::tok {

size_t utf8_decode(std::string_view s, size_t pos, char32_t& cp, size_t& bad) {
  const auto at = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = at(pos);
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  size_t need = 0;
  char32_t v = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte (excludes overlongs, surrogates)
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    v = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    v = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    v = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    bad = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (pos + k >= s.size()) {
      bad = k;
      return 0;
    }
    const uint8_t b = at(pos + k);
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      bad = k;
      return 0;
    }
    v = (v << 6) | (b & 0x3F);
  }
  cp = v;
  return need + 1;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool utf8_valid(std::string_view s) {
  char32_t cp;
  size_t bad;
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_decode(s, i, cp, bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  char32_t cp;
  size_t bad;
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_decode(s, i, cp, bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

size_t utf8_complete_prefix(std::string_view s) {
  // Only the last 3 bytes can belong to an unfinished sequence.
  const size_t start = s.size() > 3 ? s.size() - 3 : 0;
  for (size_t i = start; i < s.size(); ++i) {
    char32_t cp;
    size_t bad;
    const size_t n = utf8_decode(s, i, cp, bad);
    // A sequence cut short by the end of the string may still be completed.
    if (n == 0 && i + bad == s.size() && static_cast<uint8_t>(s[i]) >= 0xC2) return i;
    if (n) i += n - 1;
  }
  return s.size();
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool is_unicode_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool is_python_space(char32_t c) { return is_unicode_space(c) || (c >= 0x1C && c <= 0x1F); }

std::string_view strip_python_space(std::string_view s) {
  size_t b = 0, e = s.size();
  char32_t cp;
  size_t bad;
  while (b < e) {
    const size_t n = utf8_decode(s, b, cp, bad);
    if (n == 0 || !is_python_space(cp)) break;
    b += n;
  }
  while (e > b) {
    size_t k = e - 1;
    while (k > b && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
    const size_t n = utf8_decode(s, k, cp, bad);
    if (n == 0 || k + n != e || !is_python_space(cp)) break;
    e = k;
  }
  return s.substr(b, e - b);
}

}  // namespace loom::tok

// GPT-2 byte <-> character tables, built at compile time (see byte_level.h).
#include "tokenizer/byte_level.h"

#include <array>
#include <cstdint>

#include "tokenizer/unicode.h"

namespace loom::tok {
namespace {

// Printable Latin-1 bytes keep their own code point; the other 68 bytes take
// 256, 257, ... in byte order.
constexpr bool printable(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct Tables {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 324> to_byte{};  // code point -> byte, -1 if none (all code points < 256 + 68)
};

constexpr Tables make_tables() {
  Tables t;
  for (auto& v : t.to_byte) v = -1;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
    t.to_char[b] = c;
    t.to_byte[c] = static_cast<int16_t>(b);
  }
  return t;
}

constexpr Tables kTables = make_tables();

// Decodes one code point of valid UTF-8 at s[i]; returns its length, 0 if invalid.
size_t next_cp(std::string_view s, size_t i, char32_t& cp) {
  size_t bad;
  return utf8_decode(s, i, cp, bad);
}

}  // namespace

char32_t byte_to_char(unsigned char b) { return kTables.to_char[b]; }

void bytes_to_chars(std::string_view bytes, std::string& out) {
  for (unsigned char b : bytes) utf8_append(out, kTables.to_char[b]);
}

bool chars_to_bytes(std::string_view token, std::string& out) {
  const size_t mark = out.size();
  for (size_t i = 0; i < token.size();) {
    char32_t cp;
    const size_t n = next_cp(token, i, cp);
    if (n == 0 || cp >= kTables.to_byte.size() || kTables.to_byte[cp] < 0) {
      out.resize(mark);
      return false;
    }
    out += static_cast<char>(kTables.to_byte[cp]);
    i += n;
  }
  return true;
}

bool is_byte_level_spelled(std::string_view token) {
  std::string scratch;
  return chars_to_bytes(token, scratch);
}

}  // namespace loom::tok

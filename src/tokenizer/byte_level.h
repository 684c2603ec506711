// GPT-2's reversible byte <-> printable-character map used by byte-level BPE:
// every byte gets a visible code point (space -> 'Ġ', '\n' -> 'Ċ', ...).
#pragma once

#include <string>
#include <string_view>

namespace loom::tok {

// The code point byte `b` is spelled with.
char32_t byte_to_char(unsigned char b);

// Appends the byte-level spelling of `bytes` to `out`.
void bytes_to_chars(std::string_view bytes, std::string& out);

// Maps a byte-level spelled token back to bytes, appending to `out`. Returns
// false (leaving `out` as it was) if some character is outside the alphabet.
bool chars_to_bytes(std::string_view token, std::string& out);

// True if every character of `token` belongs to the 256-character alphabet.
bool is_byte_level_spelled(std::string_view token);

}  // namespace loom::tok

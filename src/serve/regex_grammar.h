// JSON Schema `pattern` (an ECMA-262 regular expression) -> the GBNF of the JSON string contents whose
// decoded text it matches (or, for vLLM's guided_regex, of the raw text it matches whole). A pattern
// matches anywhere in the string unless anchored (^ first, $ last), as JSON Schema says.
// Supported: literals, escapes (\d \w \s and their negations, \n \t \r \f \v \0 \xHH \uHHHH, escaped
// punctuation), `.`, classes ([a-z], [^...], with \d \w \s inside), groups ((...), (?:...), named
// (?<n>...)), alternation, quantifiers * + ? {n} {n,} {n,m} (lazy forms are the same language).
// Refused, naming the construct: back-references, lookaround, \b \B, \p{...}, anchors elsewhere.
// Characters JSON must escape are written as the escapes \" \\ \n \t \r \uXXXX; a negated class or `.`
// takes the raw characters and \" \\ \t \n \r, not the \uXXXX forms of other controls.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

// What the grammar spells: the contents of a JSON string (JSON Schema's `pattern`; unanchored ends allow
// any characters), or raw text matched whole (vLLM's `guided_regex`; ^ and $ change nothing).
enum class RegexText { json_string, raw };

// The GBNF expression (no surrounding quotes) or throws SchemaError whose message starts with `name`
// ("'pattern'"). `max_repeat` bounds the counts of {n,m}.
std::string regex_to_gbnf(std::string_view pattern, int64_t max_repeat, RegexText text = RegexText::json_string,
                          std::string_view name = "'pattern'");

}  // namespace loom

// Structured outputs: GBNF parsing and its errors, the recognizer on accepted / rejected strings
// (llama.cpp's test-grammar-integration style), JSON Schema -> grammar on valid and invalid instances, and
// the token mask against a brute-force reference on SmolLM2's vocabulary.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "serve/grammar.h"
#include "serve/grammar_matcher.h"
#include "serve/grammar_vocab.h"
#include "serve/json_schema_grammar.h"
#include "serve/openai_protocol.h"
#include "serve/structured_output.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

using ojson = nlohmann::ordered_json;

void expect_matches(const std::string& gbnf, const std::vector<std::string>& good,
                    const std::vector<std::string>& bad) {
  const auto g = compile_gbnf(gbnf);
  for (const auto& s : good) EXPECT_TRUE(grammar_matches(g, s)) << "should accept: " << s << "\n" << gbnf;
  for (const auto& s : bad) EXPECT_FALSE(grammar_matches(g, s)) << "should reject: " << s << "\n" << gbnf;
}

// The error message of compiling `gbnf` (empty when it compiles).
std::string gbnf_error(const std::string& gbnf, GrammarLimits limits = {}) {
  try {
    compile_gbnf(gbnf, limits);
  } catch (const GrammarError& e) {
    return e.what();
  }
  return {};
}

const char* kArithmetic = R"G(
root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
)G";

TEST(Gbnf, ArithmeticGrammar) {
  expect_matches(kArithmetic, {"1+2=3\n", "(a+b)*c= 42\n", "x=1\ny=2\n", "foo_1 = (1)\n"},
                 {"1+2=3", "1+=3\n", "=3\n", "(1=1\n", "A=1\n", ""});
}

TEST(Gbnf, JsonGrammar) {
  const char* json_gbnf = R"(
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
)";
  expect_matches(json_gbnf,
                 {R"({})", R"({"a": [1, 2.5e3, true, null, "x\"y"]})", "{\n  \"k\": {\"n\": -0.5}}",
                  R"({"é": "日本語 😀", "u": "\u00e9"})"},
                 {R"({"a" 1})", R"([1])", R"({"a": tru})", R"({"a": "x)", "{\"a\": \"\x01\"}", R"({"a": 01x})"});
}

TEST(Gbnf, CharClassesRangesAndNegation) {
  expect_matches(R"(root ::= [a-cx-z0-9]+)", {"abc", "xyz09", "a"}, {"", "d", "abw", "A"});
  expect_matches(R"(root ::= [^a-c\n]*)", {"", "xyz", "é中😀", "A-"}, {"a", "xa", "\n", "zzc"});
  expect_matches(R"(root ::= [\-\]x]+)", {"-", "]", "x-]"}, {"a"});
  expect_matches(R"(root ::= [a-] "!")", {"a!", "-!"}, {"b!"});
  expect_matches(R"(root ::= . .)", {"ab", "é中", "😀x"}, {"a", "abc", std::string("\xC3", 1) + "a"});
}

TEST(Gbnf, Utf8Ranges) {
  expect_matches(R"(root ::= [α-ω]+)", {"αβγ", "ω"}, {"abc", "Α", "αa"});
  expect_matches(R"(root ::= [\u00e0-\u00ff\U0001F600-\U0001F64F]*)", {"àÿ😀🙏", ""}, {"é ", "ß", "🚀"});
  expect_matches(R"(root ::= [\x00-\U0010FFFF]*)", {"anything ✓ 😀", std::string("\0", 1)},
                 {std::string("\xFF"), std::string("\xC0\x80"), std::string("\xED\xA0\x80")});  // invalid UTF-8
  expect_matches(R"(root ::= "\x41\u00e9\U0001F600" "\t\n\\\"")", {"Aé😀\t\n\\\""}, {"Ae😀\t\n\\\""});
}

TEST(Gbnf, Repetitions) {
  expect_matches(R"(root ::= "a"{2,4})", {"aa", "aaa", "aaaa"}, {"", "a", "aaaaa"});
  expect_matches(R"(root ::= "ab"{3})", {"ababab"}, {"abab", "abababab"});
  expect_matches(R"(root ::= "a"{2,} "b")", {"aab", "aaaaaaab"}, {"ab", "b"});
  expect_matches(R"(root ::= "a"{,2} "b")", {"b", "ab", "aab"}, {"aaab"});
  expect_matches(R"(root ::= "a"{0} "b")", {"b"}, {"ab"});
  expect_matches(R"(root ::= ("x" | "yz")+ "!"?)", {"x", "yzx!", "xx"}, {"", "!", "y", "x!!"});
  expect_matches(R"(root ::= [0-9]{1,3} ("," [0-9]{3})*)", {"1", "123,456", "12,345,678"}, {"1234", "1,23", ","});
}

TEST(Gbnf, CommentsLinesAndRecursion) {
  expect_matches("# a comment\nroot ::= a # trailing\n  | b\na ::= \"(\" root \")\" | \"x\"\nb ::= \"y\"\n",
                 {"x", "y", "((x))", "(y)"}, {"(x", "()", "x)"});
  expect_matches("root ::= \"\"", {""}, {"a"});
}

TEST(GbnfErrors, ReportLineColumnAndReason) {
  EXPECT_NE(gbnf_error("a ::= \"x\"").find("no 'root' rule"), std::string::npos);
  auto e = gbnf_error("root ::= a\na ::= b \"x\"\n");
  EXPECT_NE(e.find("line 2, column 7: undefined rule 'b'"), std::string::npos) << e;
  e = gbnf_error("root ::= \"abc\n");
  EXPECT_NE(e.find("line 1, column 14: unterminated string literal"), std::string::npos) << e;
  e = gbnf_error("root ::= [a-z\n");
  EXPECT_NE(e.find("unterminated character class"), std::string::npos) << e;
  e = gbnf_error("root ::= \"\\q\"");
  EXPECT_NE(e.find("line 1, column 11: unknown escape '\\q'"), std::string::npos) << e;
  e = gbnf_error("root ::= \"a\"{3,1}");
  EXPECT_NE(e.find("the maximum is below the minimum"), std::string::npos) << e;
  e = gbnf_error("root ::= * \"a\"");
  EXPECT_NE(e.find("without an item before it"), std::string::npos) << e;
  e = gbnf_error("root ::= \"a\"\nroot ::= \"b\"");
  EXPECT_NE(e.find("line 2, column 1: the rule 'root' is defined twice"), std::string::npos) << e;
  e = gbnf_error("root ::= (\"a\" | \"b\"");
  EXPECT_NE(e.find("expected ')'"), std::string::npos) << e;
  e = gbnf_error("root ::= [z-a]");
  EXPECT_NE(e.find("reversed"), std::string::npos) << e;
  e = gbnf_error("root ::= \"a\" ) \"b\"");
  EXPECT_NE(e.find("unexpected ')'"), std::string::npos) << e;
  e = gbnf_error("root ::= \"\\uD800\"");
  EXPECT_NE(e.find("not a valid character"), std::string::npos) << e;
  e = gbnf_error("root = \"a\"");
  EXPECT_NE(e.find("expected '::='"), std::string::npos) << e;
  e = gbnf_error("root ::= \"a\"{100000}");
  EXPECT_NE(e.find("limited to"), std::string::npos) << e;
  e = gbnf_error("root ::= \"ab\"", GrammarLimits{.max_text = 4});
  EXPECT_NE(e.find("at most 4"), std::string::npos) << e;
  std::string big = "root ::=";
  for (int i = 0; i < 110; ++i) big += " \"a\"{10000}";
  e = gbnf_error(big);
  EXPECT_NE(e.find("more than"), std::string::npos) << e;
}

TEST(GbnfErrors, LeftRecursionIsRefusedNotLooped) {
  auto e = gbnf_error("root ::= expr\nexpr ::= expr \"+\" \"1\" | \"1\"");
  EXPECT_NE(e.find("line 2, column 1: left recursion"), std::string::npos) << e;
  EXPECT_NE(e.find("expr -> expr"), std::string::npos) << e;
  e = gbnf_error("root ::= a\na ::= b? \"x\"\nb ::= \"\" | a");  // through a nullable rule
  EXPECT_NE(e.find("left recursion"), std::string::npos) << e;
  e = gbnf_error("root ::= (\"a\"?)*");  // a repetition of something that can be empty
  EXPECT_NE(e.find("left recursion"), std::string::npos) << e;
}

// --- JSON Schema -----------------------------------------------------------------------------------------

void expect_schema(const char* schema, const std::vector<std::string>& good, const std::vector<std::string>& bad) {
  const std::string gbnf = json_schema_to_gbnf(ojson::parse(schema));
  const auto g = compile_gbnf(gbnf);
  for (const auto& s : good) EXPECT_TRUE(grammar_matches(g, s)) << "should accept: " << s << "\n" << gbnf;
  for (const auto& s : bad) EXPECT_FALSE(grammar_matches(g, s)) << "should reject: " << s << "\n" << gbnf;
}

std::string schema_error(const char* schema) {
  try {
    json_schema_to_gbnf(ojson::parse(schema));
  } catch (const SchemaError& e) {
    return e.what();
  }
  return {};
}

TEST(JsonSchema, ObjectRequiredAndOptional) {
  const char* s = R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
    "email":{"type":"string"}},"required":["name"],"additionalProperties":false})";
  expect_schema(s, {R"({"name":"Al"})", R"({"name": "Al", "age": 3})", R"({"name":"Al","email":"a@b"})",
                    R"({"name":"Al","age":-12,"email":"x"})", "{\n  \"name\": \"Al\"\n}"},
                {R"({})", R"({"age":3})", R"({"name":"Al",})", R"({"name":"Al","age":"3"})",
                 R"({"name":"Al","other":1})", R"({"name":"Al","age":3.5})", R"({"name":"Al","age":01})"});
}

TEST(JsonSchema, OpenAiMathReasoning) {
  const char* s = R"({"type":"object","properties":{"steps":{"type":"array","items":{"type":"object",
    "properties":{"explanation":{"type":"string"},"output":{"type":"string"}},
    "required":["explanation","output"],"additionalProperties":false}},"final_answer":{"type":"string"}},
    "required":["steps","final_answer"],"additionalProperties":false})";
  expect_schema(s,
                {R"({"steps":[],"final_answer":"x"})",
                 R"({"steps": [{"explanation": "8x = -23", "output": "x = -23/8"}], "final_answer": "-23/8"})"},
                {R"({"final_answer":"x","steps":[]})", R"({"steps":[{"explanation":"a"}],"final_answer":"x"})",
                 R"({"steps":{},"final_answer":"x"})"});
}

TEST(JsonSchema, CalendarEvent) {
  const char* s = R"({"type":"object","properties":{"name":{"type":"string"},"date":{"type":"string"},
    "participants":{"type":"array","items":{"type":"string"}}},"required":["name","date","participants"],
    "additionalProperties":false})";
  expect_schema(s, {R"({"name":"Science fair","date":"Friday","participants":["Alice","Bob"]})"},
                {R"({"name":"x","date":"y","participants":[1]})", R"({"name":"x","date":"y"})"});
}

TEST(JsonSchema, ArraysWithBounds) {
  expect_schema(R"({"type":"array","items":{"type":"number"},"minItems":2,"maxItems":3})",
                {"[1, 2]", "[1.5,-2e3,0]"}, {"[]", "[1]", "[1,2,3,4]", "[1,]", "[\"a\",1]"});
  expect_schema(R"({"type":"array","items":{"type":"boolean"},"maxItems":1})", {"[]", "[true]"}, {"[true,false]"});
  expect_schema(R"({"type":"array","items":{"type":"null"},"minItems":1})", {"[null]", "[null,null,null]"}, {"[]"});
  expect_schema(R"({"type":"array","prefixItems":[{"type":"integer"},{"type":"string"}]})", {R"([1,"a"])"},
                {R"(["a",1])", "[1]"});
}

TEST(JsonSchema, EnumConstAndPrimitives) {
  expect_schema(R"({"enum":["red","green",3,null]})", {R"("red")", R"("green")", "3", "null"},
                {R"("blue")", "4", R"("Red")"});
  expect_schema(R"({"const":{"a":1}})", {R"({"a":1})"}, {R"({"a":2})", R"({"a": 1})"});
  expect_schema(R"({"type":"boolean"})", {"true", "false"}, {"1", "\"true\""});
  expect_schema(R"({"type":"null"})", {"null"}, {"nul"});
  expect_schema(R"({"type":"number"})", {"0", "-1.25", "3e10", "1E-2"}, {"+1", ".5", "1.", "01", "--1"});
  expect_schema(R"({"type":"string","minLength":2,"maxLength":3})", {R"("ab")", R"("abc")", R"("\n\u00e9")"},
                {R"("a")", R"("abcd")"});
  expect_schema(R"({"type":["string","null"]})", {R"("x")", "null"}, {"1"});
  expect_schema(R"({"type":"string","format":"email"})", {R"("x")", R"("a@b.c")"}, {"1"});  // annotation only
}

TEST(JsonSchema, AnyOfOneOfAndRefs) {
  expect_schema(R"({"anyOf":[{"type":"integer"},{"type":"object","properties":{"a":{"type":"string"}},
    "required":["a"],"additionalProperties":false}]})",
                {"12", R"({"a":"x"})"}, {R"({"b":"x"})", R"("12")"});
  expect_schema(R"({"oneOf":[{"const":"a"},{"const":"b"}]})", {R"("a")", R"("b")"}, {R"("c")"});
  expect_schema(R"({"type":"object","properties":{"home":{"$ref":"#/$defs/addr"},"work":{"$ref":"#/definitions/addr"}},
    "required":["home"],"additionalProperties":false,
    "$defs":{"addr":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"],"additionalProperties":false}},
    "definitions":{"addr":{"type":"object","properties":{"zip":{"type":"integer"}},"required":["zip"],"additionalProperties":false}}})",
                {R"({"home":{"city":"Paris"}})", R"({"home":{"city":"P"},"work":{"zip":75}})"},
                {R"({"home":{"zip":1}})", R"({"work":{"zip":1}})"});
}

// The keywords beside $ref, allOf, anyOf, oneOf, enum and const constrain the same value: merged into it
// (an intersection), or refused; never dropped (a probe got "a" for {"type":"integer","enum":["a",3]}).
TEST(JsonSchema, KeywordsBesideCombinatorsStillConstrain) {
  expect_schema(R"({"type":"integer","enum":["a","b",3]})", {"3"}, {R"("a")", R"("b")"});
  expect_schema(R"({"type":["string","null"],"enum":["a",null,1]})", {R"("a")", "null"}, {"1"});
  expect_schema(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"}},
    "anyOf":[{"required":["a"]},{"required":["b"]}],"additionalProperties":false})",
                {R"({"a":1})", R"({"b":"x"})", R"({"a":1,"b":"x"})"}, {"{}", R"({"a":"x"})"});
  expect_schema(R"({"type":"number","anyOf":[{"type":"integer"},{"type":"string"}]})", {"3", "-12"},
                {"1.5", R"("s")"});  // number and integer meet in integer; number and string in nothing
  expect_schema(R"({"$ref":"#/$defs/s","maxLength":2,"$defs":{"s":{"type":"string"}}})", {R"("ab")"},
                {R"("abc")", "1"});
  expect_schema(R"({"allOf":[{"type":"object","properties":{"a":{"type":"integer"}}},{"required":["a"]}],
    "additionalProperties":false})",
                {R"({"a":1})"}, {"{}", R"({"a":"x"})"});
  expect_schema(R"({"anyOf":[{"type":"string"},{"type":"null"}],"default":null,"title":"Name"})",  // pydantic's
                                                                                                   // Optional
                {R"("x")", "null"}, {"1"});
  EXPECT_NE(schema_error(R"({"type":"integer","anyOf":[{"type":"string"}]})").find("no value is of type"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref":"#/$defs/s","type":"integer","$defs":{"s":{"type":"string"}}})")
                .find("no value is of type"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"string","const":5})").find("no value of 'const' is of type"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"enum":["a","bb"],"maxLength":1})").find("'maxLength' together with 'enum'"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref":"#/anyOf/5","anyOf":[{"type":"string"}]})").find("does not resolve"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"allOf":[{"maxLength":1},{"maxLength":2}]})").find("'maxLength' is given twice"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"object","required":["a"]})").find("'a' is not in 'properties'"),
            std::string::npos);  // the generic object would not require it
}

TEST(JsonSchema, RecursiveRef) {
  expect_schema(R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
    "children":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v"],"additionalProperties":false}}})",
                {R"({"v":1})", R"({"v":1,"children":[{"v":2,"children":[{"v":3}]}]})"},
                {R"({"v":1,"children":[{"x":2}]})"});
}

TEST(JsonSchema, AdditionalPropertiesAndGenericObjects) {
  expect_schema(R"({"type":"object"})", {"{}", R"({"a":[1,{"b":null}]})"}, {"[]", R"({"a"})"});
  expect_schema(R"({"type":"object","additionalProperties":{"type":"integer"}})", {"{}", R"({"a":1,"b":2})"},
                {R"({"a":"x"})"});
  expect_schema(R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":true})",
                {R"({"a":1})", R"({"a":1,"zz":[true]})"}, {R"({"zz":1})"});
  expect_schema(R"({})", {"1", R"("s")", "[{}]"}, {"x"});
}

// Integer bounds (pydantic's Field(ge=, le=, gt=, lt=)): every integer of a window around the bounds, and
// some far away, is accepted exactly when it lies within them; never "-0", leading zeros or a fraction.
TEST(JsonSchema, IntegerBoundsAcceptExactlyTheRange) {
  struct Case {
    const char* bounds;
    int64_t lo, hi;  // INT64_MIN / INT64_MAX: open
  };
  constexpr int64_t kOpenLo = INT64_MIN, kOpenHi = INT64_MAX;
  const Case cases[] = {
      {R"("minimum":0,"maximum":0)", 0, 0},          {R"("minimum":5,"maximum":123)", 5, 123},
      {R"("minimum":-17,"maximum":42)", -17, 42},    {R"("minimum":-100,"maximum":-3)", -100, -3},
      {R"("minimum":7)", 7, kOpenHi},                {R"("maximum":-5)", kOpenLo, -5},
      {R"("maximum":250)", kOpenLo, 250},            {R"("minimum":99,"maximum":1000)", 99, 1000},
      {R"("minimum":1,"maximum":12)", 1, 12},        {R"("exclusiveMinimum":0,"exclusiveMaximum":100)", 1, 99},
      {R"("minimum":1.5,"maximum":9.9)", 2, 9},      {R"("minimum":10,"exclusiveMinimum":true)", 11, kOpenHi},
      {R"("maximum":10,"exclusiveMaximum":true)", kOpenLo, 9}, {R"("minimum":-1999,"maximum":1999)", -1999, 1999},
      {R"("minimum":2024,"maximum":2030)", 2024, 2030}, {R"("minimum":-9,"maximum":9)", -9, 9},
  };
  for (const Case& c : cases) {
    const std::string schema = std::string(R"({"type":"integer",)") + c.bounds + "}";
    const std::string gbnf = json_schema_to_gbnf(ojson::parse(schema));
    const auto g = compile_gbnf(gbnf);
    std::vector<int64_t> values;
    for (int64_t v = -2500; v <= 2500; ++v) values.push_back(v);
    for (int64_t v : {int64_t{99999}, int64_t{-99999}, int64_t{1234567890123}, int64_t{-1234567890123},
                      int64_t{9999999999999999}, int64_t{-9999999999999999}})
      values.push_back(v);
    for (const int64_t v : values) {
      const bool in = v >= c.lo && v <= c.hi;
      ASSERT_EQ(grammar_matches(g, std::to_string(v)), in) << schema << " value " << v << "\n" << gbnf;
    }
    const bool zero = 0 >= c.lo && 0 <= c.hi;
    for (const char* bad : {"-0", "007", "+5", "1.0", "1e2", "", "-", "00"})
      EXPECT_FALSE(grammar_matches(g, bad)) << schema << " " << bad;
    EXPECT_EQ(grammar_matches(g, "0 "), zero) << schema;  // the trailing space of every value
  }
  // Inside an object, as the openai client sends a pydantic model with Field(ge=0, le=150).
  expect_schema(R"({"type":"object","properties":{"age":{"type":"integer","minimum":0,"maximum":150}},
    "required":["age"],"additionalProperties":false})",
                {R"({"age":0})", R"({"age": 150})", R"({"age":37})"}, {R"({"age":151})", R"({"age":-1})", R"({"age":1000})"});
}

// `pattern` on strings: the JSON text of a string is accepted exactly when its decoded text matches
// (anchored or anywhere, as JSON Schema says); characters JSON escapes are matched as their escapes.
TEST(JsonSchema, PatternMatchesAsTheRegexDoes) {
  const auto pat = [](const char* pattern_json) {
    return std::string(R"({"type":"string","pattern":)") + pattern_json + "}";
  };
  const auto check = [&](const char* pattern_json, const std::vector<std::string>& good,
                         const std::vector<std::string>& bad) {
    expect_schema(pat(pattern_json).c_str(), good, bad);
  };
  check(R"("^[a-z]+$")", {R"("abc")", R"("z")"}, {R"("")", R"("aBc")", R"("abc1")", "abc"});
  check(R"("^\\d{3}-\\d{4}$")", {R"("555-1234")"}, {R"("5551234")", R"("55-1234")", R"("555-12345")"});
  check(R"("^(foo|bar)baz$")", {R"("foobaz")", R"("barbaz")"}, {R"("baz")", R"("foobarbaz")"});
  check(R"("ab")", {R"("ab")", R"("xxabyy")", R"("a\"ab")"}, {R"("a b")", R"("ba")", R"("")"});
  check(R"("^ab")", {R"("ab")", R"("abc")"}, {R"("xab")"});
  check(R"("ab$")", {R"("ab")", R"("xab")"}, {R"("abx")"});
  check(R"("^[^\"]*$")", {R"("hello")", R"("")", R"("a\\b")"}, {R"("he\"llo")"});
  check(R"("^a\"b$")", {R"("a\"b")"}, {R"("ab")", R"("a\\b")"});
  check(R"("^.{2,3}$")", {R"("éx")", R"("a\tb")", R"("a\"b")", R"("a\\b")"},
        {R"("a")", R"("abcd")", R"("a\nb")"});
  check(R"("^\\w+@\\w+\\.com$")", {R"("a_b@x.com")"}, {R"("a@x.org")", R"("a@xcom")", R"("@x.com")"});
  check(R"("^(?:ab)?c$")", {R"("c")", R"("abc")"}, {R"("ababc")", R"("ac")"});
  check(R"("^[A-Z]{2}\\s?[0-9]{2,4}$")", {R"("AB 123")", R"("AB12")", R"("AB\t1234")"},
        {R"("AB 1")", R"("ab 12")", R"("AB  12")"});
  check(R"("^(?<year>\\d{4})-(?<m>0[1-9]|1[0-2])$")", {R"("2024-01")", R"("1999-12")"}, {R"("2024-13")"});
  check(R"("^a\\tb\\n$")", {R"("a\tb\n")"}, {R"("a b\n")", R"("atb")"});
  check(R"("^[\\d.,-]+$")", {R"("-1,234.5")"}, {R"("1 2")"});
  check(R"("^a+?b*?$")", {R"("a")", R"("aab")"}, {R"("b")"});
  check(R"("^x{2}\\{y$")", {R"("xx{y")"}, {R"("xxy")"});
  check(R"("^\\u00e9\\x41$")", {R"("éA")"}, {R"("eA")"});
  check(R"("^[α-ω]+$")", {R"("αβγ")"}, {R"("abc")"});
  // In an object, as pydantic's Field(pattern=...) sends it.
  expect_schema(R"({"type":"object","properties":{"zip":{"type":"string","pattern":"^[0-9]{5}$"}},
    "required":["zip"],"additionalProperties":false})",
                {R"({"zip":"75001"})"}, {R"({"zip":"7500"})", R"({"zip":"75001a"})"});
}

// The formats the grammar spells (RFC 3339 date, time, date-time; uuid), as pydantic's date, time,
// datetime and UUID fields send them.
TEST(JsonSchema, DateTimeAndUuidFormats) {
  const auto fmt_schema = [](const char* f) { return std::string(R"({"type":"string","format":")") + f + "\"}"; };
  expect_schema(fmt_schema("date").c_str(), {R"("2024-01-31")", R"("1999-12-01")"},
                {R"("2024-1-31")", R"("2024-13-01")", R"("2024-00-10")", R"("2024-01-32")", R"("Friday")", R"("")"});
  expect_schema(fmt_schema("time").c_str(), {R"("23:59:59Z")", R"("08:00:00.123+02:00")", R"("12:30:00-05:30")"},
                {R"("24:00:00Z")", R"("12:60:00Z")", R"("12:30:00")", R"("12:30Z")"});
  expect_schema(fmt_schema("date-time").c_str(), {R"("2024-02-29T13:45:00Z")", R"("2024-02-29t13:45:00.5+01:00")"},
                {R"("2024-02-29 13:45:00Z")", R"("2024-02-29T13:45Z")", R"("2024-02-29")"});
  expect_schema(fmt_schema("uuid").c_str(), {R"("123e4567-e89b-12d3-a456-426614174000")"},
                {R"("123e4567e89b12d3a456426614174000")", R"("123e4567-e89b-12d3-a456-42661417400g")"});
  EXPECT_NE(schema_error(R"({"type":"string","format":"date","maxLength":10})").find("together with"),
            std::string::npos);
}

TEST(JsonSchema, UnsupportedPatternsSayWhy) {
  const auto err = [](const char* pattern_json) {
    return schema_error((std::string(R"({"type":"string","pattern":)") + pattern_json + "}").c_str());
  };
  EXPECT_NE(err(R"("(?=a)b")").find("lookahead"), std::string::npos);
  EXPECT_NE(err(R"("(a)\\1")").find("back-references"), std::string::npos);
  EXPECT_NE(err(R"("\\bfoo")").find("word boundaries"), std::string::npos);
  EXPECT_NE(err(R"("\\p{L}")").find("Unicode property"), std::string::npos);
  EXPECT_NE(err(R"("a**")").find("quantifier after a quantifier"), std::string::npos);
  EXPECT_NE(err(R"("[z-a]")").find("out of order"), std::string::npos);
  EXPECT_NE(err(R"("^a|b$")").find("'|' outside any group"), std::string::npos);
  EXPECT_NE(err(R"("(ab")").find("unclosed '('"), std::string::npos);
  EXPECT_NE(err(R"x("ab)")x").find("unmatched ')'"), std::string::npos);
  EXPECT_NE(err(R"("[abc")").find("unclosed '['"), std::string::npos);
  EXPECT_NE(err(R"("*a")").find("nothing to repeat"), std::string::npos);
  EXPECT_NE(err(R"("a{2000}")").find("more than 1000"), std::string::npos);
  EXPECT_NE(err(R"("a{3,2}")").find("below the minimum"), std::string::npos);
  EXPECT_NE(err(R"("a^b")").find("only at the start"), std::string::npos);
  EXPECT_NE(err(R"("\\q")").find("unknown escape"), std::string::npos);
  EXPECT_NE(err(("\"" + std::string(100000, '(') + "\"").c_str()).find("nests groups deeper than 64"),
            std::string::npos);
  EXPECT_NE(err("3").find("'pattern' must be a string"), std::string::npos);
  EXPECT_NE(schema_error(R"x({"type":"object","properties":{"z":{"type":"string","pattern":"(?!x)"}}})x")
                .find("at '/properties/z': 'pattern' lookahead"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"string","pattern":"^a$","maxLength":3})").find("together with"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"number","pattern":"1"})").find("(it is, on type \"string\")"),
            std::string::npos);
}

TEST(JsonSchema, JsonObjectGrammar) {
  const auto g = compile_gbnf(json_object_gbnf());
  EXPECT_TRUE(grammar_matches(g, R"({"a": {"b": [1, "2", false]}})"));
  EXPECT_FALSE(grammar_matches(g, R"([1])"));
  EXPECT_FALSE(grammar_matches(g, R"("x")"));
}

TEST(JsonSchema, RefusedSchemasSayWhy) {
  EXPECT_NE(schema_error(R"({"type":"number","minimum":0})").find("'minimum' is not supported (bounds are, on type"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":["integer","null"],"maximum":3})").find("'maximum' is not supported"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"integer","minimum":5,"maximum":4})").find("no integer"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"integer","exclusiveMinimum":2,"exclusiveMaximum":3})").find("no integer"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"integer","minimum":"0"})").find("'minimum' must be a number"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"strin"})").find("unknown type 'strin'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":3})").find("'type' must be"), std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref":"#/$defs/missing"})").find("does not resolve"), std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref":"https://x/y.json"})").find("only local references"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"object","properties":{"a":{"type":"object","properties":{"b":{"type":"string",
    "multipleOf":2}}}}})").find("at '/properties/a/properties/b'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"object","properties":[]})").find("'properties' must be an object"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"array","minItems":-1})").find("non-negative"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"array","uniqueItems":true})").find("'uniqueItems' is not supported"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"array","uniqueItems":"uuid"})").find("'uniqueItems' must be a boolean"),
            std::string::npos);  // found by fuzz_structured_output: a non-boolean threw nlohmann's type_error
  EXPECT_NE(schema_error(R"({"type":"object","required":["x"],"properties":{},"additionalProperties":false})")
                .find("'x' is not in 'properties'"), std::string::npos);
  std::string deep = R"({"type":"string"})";
  for (int i = 0; i < 40; ++i) deep = R"({"type":"array","items":)" + deep + "}";
  EXPECT_NE(schema_error(deep.c_str()).find("nested deeper than"), std::string::npos);
  // A million levels beside an anyOf (whose siblings are copied) are refused before any copy.
  const std::string million = R"({"anyOf":[{}],"default":0,"properties":{"a":)" + std::string(1000000, '[') +
                              std::string(1000000, ']') + "}}";
  EXPECT_NE(schema_error(million.c_str()).find("levels of JSON"), std::string::npos);
  EXPECT_NE(schema_error("3").find("must be an object"), std::string::npos);
}

// --- Request fields -----------------------------------------------------------------------------------------

std::pair<int, std::string> request_error(const std::string& body) {
  try {
    parse_structured_output(nlohmann::json::parse(body), body);
  } catch (const ApiError& e) {
    return {e.status(), e.param()};
  }
  return {0, ""};
}

TEST(StructuredOutputRequest, FieldsAndErrors) {
  auto parse = [](const std::string& body) { return parse_structured_output(nlohmann::json::parse(body), body); };
  EXPECT_EQ(parse(R"({"messages":[]})"), nullptr);
  EXPECT_EQ(parse(R"({"response_format":{"type":"text"}})"), nullptr);
  EXPECT_NE(parse(R"({"response_format":{"type":"json_object"}})"), nullptr);
  const auto g = parse(R"({"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,
    "schema":{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"integer"}},"required":["b","a"]}}}})");
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(grammar_matches(g, R"({"b":1,"a":2})"));  // the schema's order, not nlohmann's sorted one
  EXPECT_FALSE(grammar_matches(g, R"({"a":2,"b":1})"));
  EXPECT_TRUE(grammar_matches(parse(R"({"grammar":"root ::= \"yes\" | \"no\""})"), "no"));
  EXPECT_TRUE(grammar_matches(parse(R"({"guided_grammar":"root ::= [0-9]+"})"), "42"));
  EXPECT_TRUE(grammar_matches(parse(R"({"guided_json":{"type":"boolean"}})"), "true"));
  EXPECT_TRUE(grammar_matches(parse(R"({"guided_json":"{\"type\":\"null\"}"})"), "null"));
  EXPECT_TRUE(grammar_matches(parse(R"({"json_schema":{"type":"integer"}})"), "7"));
  EXPECT_TRUE(grammar_matches(parse(R"({"guided_choice":["a b","c"]})"), "a b"));
  // vLLM's guided_regex: raw text matched whole (quotes and newlines as themselves, ^ $ change nothing).
  const auto rx = parse(R"({"guided_regex":"^[A-Z][a-z]+ \\d{2}\\n\"ok\"$"})");
  EXPECT_TRUE(grammar_matches(rx, "Paris 75\n\"ok\""));
  EXPECT_FALSE(grammar_matches(rx, "Paris 75\\n\"ok\""));
  EXPECT_FALSE(grammar_matches(rx, "xParis 75\n\"ok\""));
  const auto dot = parse(R"({"guided_regex":"a.c|[^x]"})");
  EXPECT_TRUE(grammar_matches(dot, "a\"c"));
  EXPECT_TRUE(grammar_matches(dot, "\n"));
  EXPECT_FALSE(grammar_matches(dot, "a\nc"));
  EXPECT_FALSE(grammar_matches(dot, "x"));

  EXPECT_EQ(request_error(R"({"response_format":{"type":"xml"}})"), std::make_pair(400, std::string("response_format")));
  EXPECT_EQ(request_error(R"({"response_format":"json"})"), std::make_pair(400, std::string("response_format")));
  EXPECT_EQ(request_error(R"({"response_format":{"type":"json_schema","json_schema":{"schema":{"type":"x"}}}})"),
            std::make_pair(400, std::string("response_format")));
  EXPECT_EQ(request_error(R"({"grammar":"root ::= foo"})"), std::make_pair(400, std::string("grammar")));
  EXPECT_EQ(request_error(R"({"grammar":5})"), std::make_pair(400, std::string("grammar")));
  EXPECT_EQ(request_error(R"({"guided_json":"{"})"), std::make_pair(400, std::string("guided_json")));
  EXPECT_EQ(request_error(R"({"guided_json":"{\"const\": 1e400}"})"),
            std::make_pair(400, std::string("guided_json")));
  EXPECT_EQ(request_error(R"({"guided_regex":"(a+"})"), std::make_pair(400, std::string("guided_regex")));
  EXPECT_EQ(request_error(R"({"guided_regex":7})"), std::make_pair(400, std::string("guided_regex")));
  EXPECT_EQ(request_error(R"({"grammar":"root ::= \"a\"","guided_json":{}})").first, 400);
}

// --- Ambiguity: bounded work per token -------------------------------------------------------------------

// Every pending "e1" / "e2" is its own return position, so after n x's the recognizer holds 2^(n-1)
// stacks: the exponential case of ambiguous grammars.
const char* kDoubling = "root ::= s\ns ::= \"x\" s e1 | \"x\" s e2 | \"x\"\ne1 ::= \"\"\ne2 ::= \"\"";
// The shape a fuzzer found (an expression grammar with optional parentheses and optional blanks at every
// level): each " +" may close any number of levels, and the next term nests again from there.
const char* kOptionalDelimiters =
    "root ::= e\ne ::= t (w \"+\" w t)*\nt ::= [a-z] f\nf ::= [0-9] | \"(\"? w e w \")\"?\nw ::= \" \"?";

// Before any byte: each a_i reaches a_(i+1) from two alternatives with different continuations, so the
// start state holds 2^n parses.
std::string doubling_chain(int n) {
  std::string g = "root ::= a0\n";
  for (int i = 0; i < n; ++i) g += fmt::format("a{} ::= a{} \"x\" | a{} \"y\"\n", i, i + 1, i + 1);
  return g + fmt::format("a{} ::= \"z\"\n", n);
}

// Single bytes as a vocabulary: every text can be fed one byte per token.
const TokenTrie& byte_vocabulary() {
  static const TokenTrie trie = [] {
    std::vector<std::string> pieces;
    for (int b = 0; b < 256; ++b) pieces.emplace_back(1, static_cast<char>(b));
    return TokenTrie(pieces, std::vector<bool>(pieces.size(), false));
  }();
  return trie;
}

// Feeds `text` a byte per token, computing each mask as generation does; the error of the first token that
// throws (empty: all accepted).
std::string feed_bytes(const std::string& gbnf, const std::string& text) {
  GrammarMatcher m(compile_gbnf(gbnf), byte_vocabulary(), {});
  try {
    for (const char c : text) {
      (void)m.allowed();
      if (!m.accept(static_cast<uint8_t>(c))) return "rejected";
    }
  } catch (const GrammarError& e) {
    return e.what();
  }
  return "";
}

TEST(GrammarAmbiguity, ExponentialStacksFailTheChoiceInsteadOfStallingIt) {
  // Within the bound the matcher follows the grammar as the unbounded recognizer does.
  EXPECT_EQ(feed_bytes(kDoubling, std::string(12, 'x')), "");
  EXPECT_TRUE(grammar_matches(compile_gbnf(kDoubling), std::string(12, 'x')));
  // 2^23 stacks are past it: a GrammarError that says why, not minutes of work.
  const std::string e = feed_bytes(kDoubling, std::string(24, 'x'));
  EXPECT_NE(e.find("too ambiguous to enforce"), std::string::npos) << e;
  EXPECT_NE(e.find("parser steps"), std::string::npos) << e;

  // The start state alone: a matcher (or the request, a 400 naming the field) is refused at once
  // instead of expanding 2^24 parses (the server's memory) before the first token.
  EXPECT_EQ(feed_bytes(doubling_chain(8), "z" + std::string(8, 'y')), "");
  EXPECT_THROW(GrammarMatcher(compile_gbnf(doubling_chain(24)), byte_vocabulary(), {}), GrammarError);
  try {
    const nlohmann::json body = {{"grammar", doubling_chain(24)}};
    parse_structured_output(body, body.dump());
    ADD_FAILURE() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.param(), "grammar");
    EXPECT_NE(std::string(e.what()).find("too ambiguous"), std::string::npos) << e.what();
  }

  std::string sums;
  for (int i = 0; i < 12; ++i) sums += "aaaaa1 +";
  EXPECT_EQ(feed_bytes(kOptionalDelimiters, "aaaaa1 +a1"), "");
  EXPECT_NE(feed_bytes(kOptionalDelimiters, sums + "a1").find("too ambiguous"), std::string::npos);
}

// --- The token mask on a real vocabulary ------------------------------------------------------------------

std::string smollm2_path() { return std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }

class MaskTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(smollm2_path())) return;
    const auto f = gguf::File::open(smollm2_path());
    tok_ = new Tokenizer(Tokenizer::from_gguf(*f));
    trie_ = make_token_trie(*tok_).release();
  }
  static void TearDownTestSuite() {
    delete trie_;
    delete tok_;
  }
  void SetUp() override {
    if (!tok_) GTEST_SKIP() << "models/SmolLM2-135M-Instruct.Q4_1.gguf is absent";
  }
  static Tokenizer* tok_;
  static TokenTrie* trie_;
};
Tokenizer* MaskTest::tok_ = nullptr;
TokenTrie* MaskTest::trie_ = nullptr;

// For each of `prefixes`, fed as tokens: the mask equals "the token's bytes after the prefix are still a
// prefix of the grammar" checked token by token on an automaton of its own (no trie, no mask cache), and
// end tokens are allowed exactly when the prefix is complete.
void expect_mask_matches_reference(const Tokenizer& tok, const TokenTrie& trie, const std::string& gbnf,
                                   const std::vector<std::string>& prefixes) {
  const auto g = compile_gbnf(gbnf);
  const std::vector<int32_t> ends = {tok.eos()};
  for (const std::string& prefix : prefixes) {
    GrammarMatcher m(g, trie, ends);
    for (const int32_t id : tok.encode(prefix, false, false)) ASSERT_TRUE(m.accept(id)) << prefix;
    const auto& mask = m.allowed();
    GrammarAutomaton ref(g);
    const int32_t at = ref.walk(ref.start(), prefix);
    ASSERT_NE(at, GrammarAutomaton::kDead);
    int64_t n_allowed = 0, mismatches = 0;
    for (int32_t id = 0; id < tok.vocab_size(); ++id) {
      bool want;
      if (id == tok.eos())
        want = ref.accepts(at);
      else if (tok.is_special(id) || tok.token_to_piece(id).empty())
        want = false;
      else
        want = ref.walk(at, tok.token_to_piece(id)) != GrammarAutomaton::kDead;
      const bool got = (mask[static_cast<size_t>(id) >> 6] >> (id & 63)) & 1;
      n_allowed += got;
      if (want != got && ++mismatches <= 5)
        ADD_FAILURE() << "prefix '" << prefix << "': token " << id << " '" << tok.token_to_piece(id)
                      << "' mask " << got << ", reference " << want;
    }
    EXPECT_EQ(mismatches, 0) << prefix;
    EXPECT_GT(n_allowed, 0) << prefix;
  }
}

TEST_F(MaskTest, SchemaMaskEqualsBruteForce) {
  const std::string gbnf = json_schema_to_gbnf(ojson::parse(
      R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
      "tags":{"type":"array","items":{"enum":["a","b"]}}},"required":["name","age"],"additionalProperties":false})"));
  expect_mask_matches_reference(*tok_, *trie_, gbnf,
                                {"", "{", "{\"", "{\"name\": \"Al", "{\"name\": \"Al\\", "{\"name\":\"é\", \"age\": 1",
                                 "{\"name\":\"x\",\"age\":12,\"tags\":[\"a\"", "{\"name\":\"x\",\"age\":1}"});
}

TEST_F(MaskTest, PatternMaskEqualsBruteForce) {
  const std::string gbnf = json_schema_to_gbnf(ojson::parse(R"({"type":"string","pattern":"^[A-Z]{2}-\\d{3}(x|yz)?$"})"));
  expect_mask_matches_reference(*tok_, *trie_, gbnf, {"", "\"", "\"AB", "\"AB-12", "\"AB-123", "\"AB-123y"});
}

TEST_F(MaskTest, GbnfMaskEqualsBruteForce) {
  expect_mask_matches_reference(*tok_, *trie_, kArithmetic, {"", "(a", "12+x", "1=2\n"});
  expect_mask_matches_reference(*tok_, *trie_, R"(root ::= [α-ω]{1,3} "日本")", {"", "α", "αβγ", "αβγ日"});
}

// The work bound leaves room for large real grammars: a choice among 1,000 words sharing prefixes (the
// most work measured per token, within 2^15 parser steps of the 2^18 allowed) gets its exact masks.
TEST_F(MaskTest, ThousandWordChoiceStaysWithinTheWorkBound) {
  std::mt19937 rng(3);
  std::set<std::string> words;
  while (words.size() < 1000) {
    std::string w;
    for (size_t n = 3 + rng() % 10; w.size() < n;) w += static_cast<char>('a' + rng() % 10);
    words.insert(w);
  }
  std::string gbnf = "root ::= ";
  for (const std::string& w : words) gbnf += (w == *words.begin() ? "" : " | ") + gbnf_literal(w);
  const std::string first = *words.begin(), last = *words.rbegin();
  expect_mask_matches_reference(*tok_, *trie_, gbnf, {"", first.substr(0, 2), last.substr(0, 3)});
}

TEST_F(MaskTest, MatcherEndsAndRejects) {
  const auto g = compile_gbnf(R"(root ::= "yes" | "no")");
  GrammarMatcher m(g, *trie_, {tok_->eos()});
  EXPECT_FALSE(m.complete());
  const int32_t maybe = tok_->encode("maybe", false, false)[0];
  EXPECT_FALSE(m.accept(maybe));
  EXPECT_FALSE(m.accept(tok_->eos()));  // not complete yet
  for (const int32_t id : tok_->encode("no", false, false)) ASSERT_TRUE(m.accept(id));
  EXPECT_TRUE(m.complete());
  // Only the end token is left.
  std::vector<float> logits(static_cast<size_t>(tok_->vocab_size()), 0.0f);
  const float* masked = m.masked_logits(logits.data(), static_cast<int64_t>(logits.size()));
  ASSERT_NE(masked, nullptr);
  int allowed = 0;
  for (size_t i = 0; i < logits.size(); ++i) allowed += std::isfinite(masked[i]);
  EXPECT_EQ(allowed, 1);
  EXPECT_TRUE(std::isfinite(masked[tok_->eos()]));
  EXPECT_TRUE(m.accept(tok_->eos()));

  // Without end tokens (ignore_eos), a complete grammar with nothing to add allows no token at all.
  GrammarMatcher none(g, *trie_, {});
  for (const int32_t id : tok_->encode("yes", false, false)) ASSERT_TRUE(none.accept(id));
  EXPECT_EQ(none.masked_logits(logits.data(), static_cast<int64_t>(logits.size())), nullptr);
}

TEST_F(MaskTest, AutomatonResetKeepsTheState) {
  const auto g = compile_gbnf(json_object_gbnf());
  GrammarAutomaton a(g);
  const int32_t s = a.walk(a.start(), "{\"a\": [1, {\"b\": \"x");
  const int32_t kept = a.reset_keeping(s);
  EXPECT_EQ(a.n_states(), 3u);  // dead, start, kept
  EXPECT_TRUE(a.accepts(a.walk(kept, "\"}]}")));
  EXPECT_EQ(a.walk(kept, "\"]"), GrammarAutomaton::kDead);
}

}  // namespace
}  // namespace loom

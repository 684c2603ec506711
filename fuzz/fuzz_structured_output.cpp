// libFuzzer entry for structured outputs, what a request body may carry and the
// server compiles on its HTTP thread: response_format (json_object, json_schema
// with patterns and formats), llama-server's "grammar" (GBNF) and "json_schema",
// vLLM's guided_json / guided_grammar / guided_regex / guided_choice. Input that
// is not a JSON object is taken as GBNF text itself, so the grammar parser is
// fuzzed on raw bytes too. A grammar that compiles is then enforced as
// generation would: the token mask over a small vocabulary, 16 tokens accepted.
// Bad input must end in loom::Error (a 400), never a crash or a hang.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "serve/grammar.h"
#include "serve/grammar_matcher.h"
#include "serve/structured_output.h"

namespace {

// Every byte alone (so any grammar can be spelled), then pieces a BPE
// vocabulary has: JSON punctuation, keywords, digits, words, UTF-8.
const loom::TokenTrie& vocabulary() {
  static const loom::TokenTrie trie = [] {
    std::vector<std::string> pieces;
    for (int b = 0; b < 256; ++b) pieces.emplace_back(1, static_cast<char>(b));
    for (const char* p : {"{\"",          "\":",
                          "\": ",         "\",",
                          "\"}",          "},",
                          "[\"",          "\"]",
                          "true",         "false",
                          "null",         "12",
                          "0.",           "e+",
                          " the",         "ing",
                          "name",         "\\n",
                          "\\u00",        "\xC3\xA9",
                          "\xE4\xB8\xAD", "\xF0\x9F\x98\x80",
                          "  ",           "\n\n",
                          "<|im_end|>"})
      pieces.emplace_back(p);
    std::vector<bool> excluded(pieces.size(), false);
    excluded.back() = true;  // a special token
    return loom::TokenTrie(pieces, excluded);
  }();
  return trie;
}

// Up to 16 tokens, each the allowed one the input's bytes pick; stops at the end
// of the grammar or when nothing is allowed. The bound on parser work per token is
// 1/8 of the server's, so that inputs that reach it (ambiguous grammars) stay fast
// under the sanitizers and still take the path that refuses them.
void generate(std::shared_ptr<const loom::Grammar> grammar, std::string_view input) {
  const loom::TokenTrie& vocab = vocabulary();
  const int32_t end_id = vocab.vocab_size() - 1;
  loom::GrammarMatcher m(std::move(grammar), vocab, {end_id}, loom::GrammarMatcher::kTokenWork / 8);
  std::vector<float> logits(static_cast<size_t>(vocab.vocab_size()), 0.0f);
  for (size_t step = 0; step < 16; ++step) {
    if (!m.any_allowed()) return;
    const float* masked = m.masked_logits(logits.data(), static_cast<int64_t>(logits.size()));
    if (masked == nullptr) return;
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < vocab.vocab_size(); ++id)
      if (masked[id] == 0.0f) allowed.push_back(id);
    if (allowed.empty()) return;
    const auto pick = input.empty() ? 0u : static_cast<uint8_t>(input[step % input.size()]);
    const int32_t id = allowed[pick % allowed.size()];
    if (m.is_end(id)) {
      if (!m.complete()) __builtin_trap();  // the end token is allowed only where the grammar is complete
      return;
    }
    if (!m.accept(id)) __builtin_trap();  // an allowed token must be accepted
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  try {
    std::shared_ptr<const loom::Grammar> grammar;
    const nlohmann::json body = nlohmann::json::parse(input, nullptr, /*allow_exceptions=*/false);
    if (body.is_object())
      grammar = loom::parse_structured_output(body, input);
    else
      grammar = loom::compile_gbnf(input);
    if (grammar != nullptr) generate(std::move(grammar), input);
  } catch (const loom::Error&) {
    // Rejected input is the expected outcome for most mutations.
  }
  return 0;
}

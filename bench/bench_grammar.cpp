// The structured-output token mask on SmolLM2's 49,152-token vocabulary (serve/grammar_matcher.h), one
// thread, for a JSON schema (OpenAI's math_reasoning example):
//   Walk/<state>: one trie walk from a state whose transitions are cached (what a step costs when the mask
//     cache misses): in a string value (nearly every token allowed: the worst case), before a key, in an
//     integer;
//   Cold: a fresh matcher's first mask (no transition cached yet: the first token of a request);
//   PerToken: a whole constrained answer token by token (mask with -inf logits + advance), as the
//     scheduler runs it, caches and all: the cost per generated token.
//   build/bench/loom_bench_grammar [--benchmark_filter=Grammar]
#include <benchmark/benchmark.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/gguf.h"
#include "serve/grammar.h"
#include "serve/grammar_matcher.h"
#include "serve/grammar_vocab.h"
#include "serve/json_schema_grammar.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

const char* kSchema = R"({"type":"object","properties":{"steps":{"type":"array","items":{"type":"object",
  "properties":{"explanation":{"type":"string"},"output":{"type":"string"}},"required":["explanation","output"],
  "additionalProperties":false}},"final_answer":{"type":"string"},"confidence":{"type":"integer"}},
  "required":["steps","final_answer","confidence"],"additionalProperties":false})";

const char* kAnswer = R"({"steps": [{"explanation": "Subtract 7 from both sides to isolate the term with x.", "output": "8x = -30"}, {"explanation": "Divide both sides by 8.", "output": "x = -3.75"}], "final_answer": "x = -3.75", "confidence": 97})";

struct Setup {
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<TokenTrie> trie;
  std::shared_ptr<const Grammar> grammar;
};

const Setup* setup() {
  static const std::unique_ptr<Setup> s = [] {
    const std::string path = std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!std::filesystem::exists(path)) return std::unique_ptr<Setup>();
    auto out = std::make_unique<Setup>();
    const auto f = gguf::File::open(path);
    out->tok = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*f));
    out->trie = make_token_trie(*out->tok);
    out->grammar = compile_gbnf(json_schema_to_gbnf(nlohmann::ordered_json::parse(kSchema)));
    return out;
  }();
  return s.get();
}

std::unique_ptr<GrammarMatcher> matcher_after(const Setup& s, const std::string& prefix) {
  auto m = std::make_unique<GrammarMatcher>(s.grammar, *s.trie, std::vector<int32_t>{s.tok->eos()});
  for (const int32_t id : s.tok->encode(prefix, false, false))
    if (!m->accept(id)) return nullptr;
  return m;
}

void count_allowed(benchmark::State& state, const std::vector<uint64_t>& mask) {
  int64_t n = 0;
  for (const uint64_t w : mask) n += __builtin_popcountll(w);
  state.counters["allowed"] = static_cast<double>(n);
}

void BM_GrammarWalk(benchmark::State& state, std::string prefix) {
  const Setup* s = setup();
  if (!s) return state.SkipWithError("models/SmolLM2-135M-Instruct.Q4_1.gguf is absent");
  auto m = matcher_after(*s, prefix);
  if (!m) return state.SkipWithError("the prefix does not follow the grammar");
  std::vector<uint64_t> mask;
  m->compute_mask(mask);  // warm the transitions
  for (auto _ : state) {
    m->compute_mask(mask);
    benchmark::DoNotOptimize(mask.data());
  }
  count_allowed(state, mask);
}
BENCHMARK_CAPTURE(BM_GrammarWalk, in_string, std::string(R"({"steps": [{"explanation": "Subtract)"))
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_GrammarWalk, before_key, std::string(R"({"steps": [{)"))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_GrammarWalk, in_integer,
                  std::string(R"({"steps": [], "final_answer": "x", "confidence": 9)"))
    ->Unit(benchmark::kMicrosecond);

void BM_GrammarCold(benchmark::State& state) {
  const Setup* s = setup();
  if (!s) return state.SkipWithError("models/SmolLM2-135M-Instruct.Q4_1.gguf is absent");
  std::vector<uint64_t> mask;
  for (auto _ : state) {
    GrammarMatcher m(s->grammar, *s->trie, {s->tok->eos()});
    m.compute_mask(mask);
    benchmark::DoNotOptimize(mask.data());
  }
  count_allowed(state, mask);
}
BENCHMARK(BM_GrammarCold)->Unit(benchmark::kMicrosecond);

void BM_GrammarPerToken(benchmark::State& state) {
  const Setup* s = setup();
  if (!s) return state.SkipWithError("models/SmolLM2-135M-Instruct.Q4_1.gguf is absent");
  std::vector<int32_t> ids = s->tok->encode(kAnswer, false, false);
  ids.push_back(s->tok->eos());
  std::vector<float> logits(static_cast<size_t>(s->tok->vocab_size()), 0.0f);
  for (auto _ : state) {
    GrammarMatcher m(s->grammar, *s->trie, {s->tok->eos()});
    for (const int32_t id : ids) {
      benchmark::DoNotOptimize(m.masked_logits(logits.data(), static_cast<int64_t>(logits.size())));
      if (!m.accept(id)) return state.SkipWithError("the answer does not follow the grammar");
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(ids.size()));
  state.counters["tokens"] = static_cast<double>(ids.size());
  state.counters["us_per_token"] = benchmark::Counter(
      static_cast<double>(state.iterations() * static_cast<int64_t>(ids.size())),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_GrammarPerToken)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace loom

BENCHMARK_MAIN();

// The generation loop shared by `loom generate`, `loom chat` and the server:
// prompt evaluation, sampling, end-of-generation and stop strings, streaming
// text that never splits a UTF-8 character.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "model/forward.h"
#include "model/ngram_proposer.h"
#include "model/sampler.h"

namespace loom {

class Tokenizer;

// Holds back generated text that could still become a stop string, and cuts
// the output at the first stop string found. Never splits a UTF-8 sequence.
class StopStreamer {
 public:
  explicit StopStreamer(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Adds a token's bytes; returns the text that is safe to emit now.
  std::string push(const std::string& piece);
  // Text still held back (emitted at the end when no stop string matched).
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

struct GenerateOptions {
  int64_t max_tokens = 128;  // -1: until end of generation or a full context
  SamplingParams sampling;
  std::vector<std::string> stop;
  std::vector<int32_t> extra_eos;  // besides the tokenizer's end-of-generation ids
  // Prompt-lookup speculation: greedy, the same tokens as without it; sampled, the same distribution.
  NgramSpecParams spec;
};

enum class FinishReason { length, stop, context_full };
const char* finish_reason_name(FinishReason r);

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids
  FinishReason finish = FinishReason::length;
  int64_t prompt_tokens = 0;
  double prompt_seconds = 0;
  double generate_seconds = 0;
  int64_t draft_tokens = 0;     // speculation: tokens proposed
  int64_t accepted_tokens = 0;  // and accepted by the model
  int64_t forward_steps = 0;    // evaluations after the prompt
};

// Evaluates `prompt` (appended to whatever the session holds) and samples up to
// max_tokens more. `on_text` receives printable text as it becomes final; it
// may return false to cancel (finish = stop). With opts.spec, drafts are
// verified several tokens per evaluation: greedy, the tokens and the session's
// positions at the end are those of plain decoding; sampled, the tokens have
// plain decoding's distribution (not its draws: the seed's numbers are used
// differently).
GenerateResult generate(InferenceSession& session, const Tokenizer& tok, std::span<const int32_t> prompt,
                        const GenerateOptions& opts, const std::function<bool(const std::string&)>& on_text);

}  // namespace loom

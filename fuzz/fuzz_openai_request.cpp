// libFuzzer entry for the OpenAI-compatible request bodies (serve/openai_protocol.h):
// the same bytes through every endpoint's parser, as the HTTP server hands them
// over (chat and text completions, embeddings, /tokenize, /detokenize, adapter
// loading). Bad input must end in loom::Error (an ApiError: a 4xx), never a
// crash or a hang; a parsed request must respect the limits it was given.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "serve/openai_protocol.h"

namespace {

const std::vector<std::string> kModels = {"base", "lora-a"};

template <typename Parse>
void parse(Parse p) {
  try {
    p();
  } catch (const loom::Error&) {
    // Rejected input is the expected outcome for most mutations.
  }
}

void check(const loom::GenerationRequest& g, const loom::ProtocolLimits& limits) {
  if (g.n < 1 || g.n > limits.max_n) __builtin_trap();
  if (g.max_tokens > limits.max_model_len) __builtin_trap();
  if (static_cast<int64_t>(g.stop.size()) > limits.max_stop) __builtin_trap();
  if (g.top_logprobs > limits.max_logprobs) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  loom::ProtocolLimits limits;
  limits.max_model_len = 512;
  parse([&] { check(loom::parse_chat_request(body, limits, kModels), limits); });
  parse([&] {
    for (const loom::GenerationRequest& g : loom::parse_completion_request(body, limits, kModels))
      check(g, limits);
  });
  parse([&] {
    bool base64 = false;
    (void)loom::parse_embeddings_request(body, limits, kModels, base64);
  });
  parse([&] { (void)loom::parse_tokenize_request(body, kModels); });
  parse([&] { (void)loom::parse_detokenize_request(body, kModels); });
  parse([&] { (void)loom::parse_load_adapter_request(body); });
  parse([&] { (void)loom::parse_unload_adapter_request(body); });
  return 0;
}

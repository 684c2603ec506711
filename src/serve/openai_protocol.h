// The OpenAI-compatible wire format: request bodies parsed and validated into engine structs, errors as
// OpenAI's error object with an HTTP status, and the JSON of responses and streamed (SSE) chunks. Also the
// vLLM extras: /tokenize, /detokenize and LoRA adapter loading. No I/O here.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "serve/engine_api.h"

namespace loom {

// An error the client gets: HTTP status plus OpenAI's {"error":{"message","type","param","code"}}.
class ApiError : public Error {
 public:
  ApiError(int status, std::string type, std::string code, std::string param, const std::string& message);
  int status() const { return status_; }
  const std::string& type() const { return type_; }    // "invalid_request_error", "server_error"
  const std::string& code() const { return code_; }    // "model_not_found", ...; empty: null
  const std::string& param() const { return param_; }  // offending field; empty: null

 private:
  int status_;
  std::string type_, code_, param_;
};

// 400 invalid_request_error naming `param`.
ApiError invalid_request(std::string param, const std::string& message);
// The ApiError for an engine failure (status from its code) or for any other loom::Error (by kind).
ApiError api_error_from(const EngineError& e);
ApiError api_error_from(const Error& e);
// {"error":{...}} with null for an empty param/code.
nlohmann::json error_json(const ApiError& e);
// nlohmann's dump, replacing invalid UTF-8 (token pieces can split a character) instead of throwing.
std::string dump_json(const nlohmann::json& j);

struct ProtocolLimits {
  int64_t max_model_len = 2048;  // max_tokens may not exceed it
  int32_t max_n = 16;            // choices per prompt
  int32_t max_prompts = 64;      // prompts in one /v1/completions request
  int32_t max_stop = 4;          // stop strings
  int32_t max_logprobs = 20;     // logprobs / top_logprobs
  int32_t max_embedding_inputs = 2048;  // inputs in one /v1/embeddings request (OpenAI's limit)
};

// Parsing throws ApiError. `models`: the names a request may give in "model" (an absent "model" means
// models[0]); any other name is 404 model_not_found.

// /v1/completions: one GenerationRequest per prompt (choices numbered prompt * n + i), all alike otherwise.
std::vector<GenerationRequest> parse_completion_request(std::string_view body, const ProtocolLimits& limits,
                                                        std::span<const std::string> models);
// /v1/chat/completions.
GenerationRequest parse_chat_request(std::string_view body, const ProtocolLimits& limits,
                                     std::span<const std::string> models);
// /tokenize: {"model"?, "prompt", "add_special_tokens"?} or {"model"?, "messages", "add_generation_prompt"?}.
TokenizeRequest parse_tokenize_request(std::string_view body, std::span<const std::string> models);
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
// /detokenize: {"model"?, "tokens": [ids]}.
DetokenizeRequest parse_detokenize_request(std::string_view body, std::span<const std::string> models);
struct AdapterRequest {
  std::string name;
  std::string path;      // load only
  bool inplace = false;  // load only: "load_inplace" (vLLM's name), replace an adapter of that name
};
// /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}; /v1/unload_lora_adapter {"lora_name"}.
AdapterRequest parse_load_adapter_request(std::string_view body);
AdapterRequest parse_unload_adapter_request(std::string_view body);

// /v1/embeddings: one GenerationRequest (kind embedding) per input, numbered by first_choice_index; `base64`
// tells whether encoding_format asked for base64. `dimensions` is refused (400).
std::vector<GenerationRequest> parse_embeddings_request(std::string_view body, const ProtocolLimits& limits,
                                                        std::span<const std::string> models, bool& base64);
// {"object":"list","data":[{"object":"embedding","index","embedding"}],"model","usage"}; base64: each vector
// as the base64 of its little-endian float32 bytes.
nlohmann::json embeddings_response(std::span<const std::vector<float>> vectors, bool base64,
                                   const std::string& model, int64_t prompt_tokens);

nlohmann::json tokenize_response(std::span<const int32_t> tokens, int64_t max_model_len);
nlohmann::json detokenize_response(const std::string& text);
// vLLM's GET /tokenizer_info body: the special tokens, whether text prompts get BOS, the chat template.
nlohmann::json tokenizer_info_response(const TokenizerInfo& info, int64_t max_model_len);
// /v1/models:
// {"object":"list","data":[{"id","object":"model","created","owned_by","root","parent","max_model_len"}]}
nlohmann::json models_response(std::span<const ModelInfo> models, int64_t max_model_len);

// What every response object of one request shares.
struct ResponseMeta {
  RequestKind kind = RequestKind::completion;
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;
  std::string model;
  int32_t num_choices = 1;
  bool logprobs = false;
  int32_t top_logprobs = 0;
  std::vector<std::string> echo;  // completions with echo: text put before each choice (per choice index)
};

// The characters of a text built token by token, for completions' text_offset: a character split
// across tokens counts at the token holding its first byte; bytes that form no character count one
// U+FFFD per maximal invalid run, as the response's text shows them (tok::utf8_sanitize).
class TextCursor {
 public:
  int64_t offset() const { return chars_ + (tail_.empty() ? 0 : 1); }  // where the next token starts
  void add(std::string_view bytes);

 private:
  int64_t chars_ = 0;  // characters of the part no later byte can change
  std::string tail_;   // trailing bytes a later token may still complete
};

// Builds a non-streaming response from the engine's deltas.
class ResponseAccumulator {
 public:
  explicit ResponseAccumulator(ResponseMeta meta);
  // Throws ApiError 500 for a choice index outside [0, num_choices).
  void add(const ChoiceDelta& delta);
  void add_usage(const Usage& usage);  // summed over the request's parts
  nlohmann::json build() const;

 private:
  struct Choice {
    std::string text;
    std::vector<TokenLogprob> logprobs;
    std::vector<int64_t> offsets;  // completions: text_offset of each token
    TextCursor chars;              // the text so far, for offsets
    TextCursor prompt_chars;       // echo with logprobs: the prompt's tokens so far
    std::optional<FinishKind> finish;
  };
  ResponseMeta meta_;
  std::vector<Choice> choices_;
  Usage usage_;
};

// Turns the engine's deltas into SSE events ("data: {...}\n\n") of chat.completion.chunk or text_completion
// objects.
class StreamFormatter {
 public:
  StreamFormatter(ResponseMeta meta, bool include_usage);
  // First events: chat sends each choice's {"role":"assistant"} delta, completions with echo the prompt text.
  std::string start();
  // The event for one delta; empty when it carries nothing (no text, logprobs or finish).
  std::string delta(const ChoiceDelta& d);
  // The final usage chunk ("choices": []) when include_usage was asked for; empty otherwise.
  std::string usage(const Usage& total);
  static std::string done() { return "data: [DONE]\n\n"; }
  static std::string error(const ApiError& e);  // an error object as an SSE event

 private:
  nlohmann::json chunk(nlohmann::json choices) const;
  ResponseMeta meta_;
  bool include_usage_;
  std::vector<TextCursor> chars_;         // completions: the text sent per choice, for text_offset
  std::vector<TextCursor> prompt_chars_;  // echo with logprobs: the prompt's tokens so far
};

}  // namespace loom

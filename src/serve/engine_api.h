// The interface between the HTTP layer and the serving engine. One scheduler thread owns the model and
// the KV cache; HTTP threads only hand it plain structs and read plain structs back through queues.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/sampler.h"
#include "tokenizer/chat_template.h"

namespace loom {

struct Grammar;  // serve/grammar.h

// What went wrong in an engine call; the HTTP layer maps each code to a status and OpenAI error object.
enum class EngineErrc {
  invalid_request,          // 400: a value the engine rejects (token id out of range, ...)
  context_length_exceeded,  // 400: prompt + max_tokens over the model's length
  model_not_found,          // 404: no base model or adapter of that name
  adapter_exists,           // 400: load_adapter with a name already loaded (without load_inplace)
  adapter_not_found,        // 404: unload_adapter of an unknown name
  adapter_load_failed,      // 400: the adapter file is missing, corrupt or does not fit the model
  overloaded,               // 503: queue full
  shutting_down,            // 503: the engine no longer takes work
  internal,                 // 500
};

inline const char* engine_errc_name(EngineErrc code) {
  switch (code) {
    case EngineErrc::invalid_request:
      return "invalid_request";
    case EngineErrc::context_length_exceeded:
      return "context_length_exceeded";
    case EngineErrc::model_not_found:
      return "model_not_found";
    case EngineErrc::adapter_exists:
      return "adapter_exists";
    case EngineErrc::adapter_not_found:
      return "adapter_not_found";
    case EngineErrc::adapter_load_failed:
      return "adapter_load_failed";
    case EngineErrc::overloaded:
      return "overloaded";
    case EngineErrc::shutting_down:
      return "shutting_down";
    case EngineErrc::internal:
      return "internal";
  }
  return "internal";
}

// Typed error thrown by the synchronous engine calls and carried by error events.
class EngineError : public Error {
 public:
  EngineError(EngineErrc code, const std::string& message, std::string param = {})
      : Error(error_kind_of(code), message), code_(code), param_(std::move(param)) {}
  EngineErrc code() const { return code_; }
  // The request field at fault ("prompt", "messages", "max_tokens", "lora_name", ...); may be empty.
  const std::string& param() const { return param_; }

 private:
  static ErrorKind error_kind_of(EngineErrc code) {
    switch (code) {
      case EngineErrc::model_not_found:
      case EngineErrc::adapter_not_found:
        return ErrorKind::not_found;
      case EngineErrc::internal:
        return ErrorKind::internal;
      default:
        return ErrorKind::invalid_input;
    }
  }
  EngineErrc code_;
  std::string param_;
};

// embedding: the prompt's mean-pooled final hidden state, L2-normalized, instead of generated tokens.
enum class RequestKind { completion, chat, embedding };

// One prompt of a completion: text, or token ids when the client sent ids.
struct PromptInput {
  bool is_tokens = false;
  std::string text;
  std::vector<int32_t> tokens;
};

struct GenerationRequest {
  RequestKind kind = RequestKind::completion;
  std::string request_id;  // for logs; unique per HTTP request
  std::string model;       // the base model's name or a loaded adapter's name

  PromptInput prompt;                 // completion
  std::vector<ChatMessage> messages;  // chat: rendered with the model's chat template
  bool add_generation_prompt = true;  // chat

  // temperature, top_k (<= 0: off), top_p, min_p, penalties (repeat_last_n = -1: over the whole sequence).
  // `sampling.seed` is not read: the engine derives each choice's seed from `seed` (e.g. seed + choice) or
  // draws a fresh one when absent.
  SamplingParams sampling;
  std::optional<uint64_t> seed;
  int64_t max_tokens = -1;  // -1: until end of generation or the context is full
  // Generation ends at the first stop string (finish "stop"); the string itself is not part of the text.
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;  // extra end-of-generation ids
  bool ignore_eos = false;

  int32_t n = 1;  // choices sampled from the same prompt
  // Events number this request's choices first_choice_index .. first_choice_index + n - 1. A completion with
  // several prompts is submitted as one GenerationRequest per prompt sharing one RequestStream.
  int32_t first_choice_index = 0;

  // Structured output (response_format, grammar, ...): every choice's text must follow it; compiled by the
  // HTTP layer (serve/structured_output.h). Null: free text.
  std::shared_ptr<const Grammar> grammar;

  bool logprobs = false;     // report the sampled token's logprob
  int32_t top_logprobs = 0;  // and this many alternatives (0..20)
  // Completions with echo and logprobs (evaluation clients' loglikelihood, e.g. lm-evaluation-harness): every
  // prompt token's logprob too, in ChoiceDelta::prompt deltas sent before the first sampled token. The prompt
  // is then computed whole (no prefix-cache hit), in chunks of at most 64 rows (their logits are kept).
  bool prompt_logprobs = false;

  // Handled by the HTTP layer; the engine may ignore them.
  bool echo = false;
  bool stream = false;
  bool include_usage = false;
};

struct TopLogprob {
  int32_t token_id = 0;
  std::string token;  // the token's bytes (may be part of a UTF-8 sequence)
  float logprob = 0;
};

struct TokenLogprob {
  int32_t token_id = 0;
  std::string token;
  float logprob = 0;
  std::vector<TopLogprob> top;  // top_logprobs entries, best first
  bool known = true;            // false: the prompt's first token, which nothing predicts (null in responses)
};

enum class FinishKind { stop, length, abort };
inline const char* finish_kind_name(FinishKind kind) {
  switch (kind) {
    case FinishKind::stop:
      return "stop";
    case FinishKind::length:
      return "length";
    case FinishKind::abort:
      return "abort";
  }
  return "abort";
}

// New output of one choice since its previous delta.
struct ChoiceDelta {
  int32_t index = 0;
  // Whole UTF-8 characters; may be empty while text is held back (a possible stop string, a split character).
  std::string text;
  std::vector<int32_t> token_ids;      // tokens sampled since the previous delta
  std::vector<TokenLogprob> logprobs;  // one per token id when logprobs were requested
  // GenerationRequest::prompt_logprobs: `logprobs` are the prompt's tokens (text empty, token_ids too), the
  // first of them at the prompt's start; the choice's own tokens follow in later deltas.
  bool prompt = false;
  std::optional<FinishKind> finish;    // set on the choice's last delta
  std::vector<float> embedding;        // RequestKind::embedding: the vector (one delta, with finish)
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};

// What the scheduler sends back. Per submitted request: any number of deltas, then exactly one `done`
// (usage of that request) or one `error`; nothing after it.
struct GenerationEvent {
  enum class Kind { delta, done, error };
  Kind kind = Kind::delta;
  ChoiceDelta delta;                 // kind == delta
  Usage usage;                       // kind == done
  std::optional<EngineError> error;  // kind == error

  static GenerationEvent make_delta(ChoiceDelta d) {
    GenerationEvent e;
    e.delta = std::move(d);
    return e;
  }
  static GenerationEvent make_done(Usage u) {
    GenerationEvent e;
    e.kind = Kind::done;
    e.usage = u;
    return e;
  }
  static GenerationEvent make_error(EngineError err) {
    GenerationEvent e;
    e.kind = Kind::error;
    e.error = std::move(err);
    return e;
  }
};

// The channel of one HTTP request: the scheduler pushes events, the HTTP thread pops them. `cancel` is set
// by the HTTP thread (client gone, server stopping); the scheduler polls it each step, frees the request's
// sequences and still sends its final event (finish deltas may be skipped: the HTTP layer reports choices
// left open as "abort").
class RequestStream {
 public:
  void push(GenerationEvent ev) {
    {
      std::lock_guard lock(mu_);
      events_.push_back(std::move(ev));
    }
    cv_.notify_one();
  }
  // The next event, or nullopt after `timeout` without one.
  std::optional<GenerationEvent> pop(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
    GenerationEvent ev = std::move(events_.front());
    events_.pop_front();
    return ev;
  }
  void cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerationEvent> events_;
  std::atomic<bool> cancelled_{false};
};

struct ModelInfo {
  std::string id;       // the name clients put in "model"
  std::string parent;   // adapters: the base model's id; empty for the base model
  std::string path;     // file or folder it was loaded from
  int64_t created = 0;  // unix seconds
};

struct TokenizeRequest {
  std::string model;  // empty: the base model
  bool is_chat = false;
  std::string prompt;                 // !is_chat
  std::vector<ChatMessage> messages;  // is_chat: rendered with the chat template
  bool add_special_tokens = true;     // !is_chat: add BOS etc. as the model does
  bool add_generation_prompt = true;  // is_chat
};

struct EngineHealth {
  bool ok = true;
  std::string message;  // why not, when !ok
};

// Point-in-time numbers for /metrics gauges.
struct EngineStats {
  int64_t requests_running = 0;
  int64_t requests_waiting = 0;
  double kv_cache_usage = 0;  // fraction of KV blocks in use, 0..1
  int64_t adapters_loaded = 0;
  int64_t spec_draft_tokens = 0;     // since start: tokens speculation proposed
  int64_t spec_accepted_tokens = 0;  // and those the model agreed with
};

// vLLM's GET /tokenizer_info: what a client needs to tokenize as the server does (lm-evaluation-harness's
// remote tokenizer reads the special tokens and the chat template, then calls /tokenize).
struct TokenizerInfo {
  // The special tokens as text (each parses back to its one id).
  std::optional<std::string> bos_token, eos_token;
  bool add_bos_token = false;                // a text prompt gets bos_token first
  std::optional<std::string> chat_template;  // the model's Jinja template, if it has one
};

// Implemented by the scheduler. Every method is called from HTTP threads, concurrently, and must only
// exchange plain data with the scheduler thread. Synchronous failures throw EngineError.
class Engine {
 public:
  virtual ~Engine() = default;

  // Validates what needs the model (model name, prompt length against max_model_len, token ids) and queues
  // the request; events then arrive on `stream`. Throws EngineError before anything is queued.
  virtual void submit(GenerationRequest request, std::shared_ptr<RequestStream> stream) = 0;

  virtual std::vector<ModelInfo> list_models() = 0;  // the base model first, then adapters
  // Registers the adapter folder `path` as `name`; `replace` (vLLM's load_inplace): a name already loaded
  // gets the new version, requests already accepted keep the old one. Returns true when it replaced one.
  virtual bool load_adapter(const std::string& name, const std::string& path, bool replace) = 0;
  virtual void unload_adapter(const std::string& name) = 0;

  virtual std::vector<int32_t> tokenize(const TokenizeRequest& request) = 0;
  virtual std::string detokenize(const std::string& model, const std::vector<int32_t>& tokens) = 0;
  virtual TokenizerInfo tokenizer_info() = 0;

  virtual EngineHealth health() = 0;
  virtual EngineStats stats() = 0;
  virtual int64_t max_model_len() const = 0;  // tokens of context (prompt + generated)
};

}  // namespace loom

// OpenAI / vLLM request parsing with OpenAI's validation rules, error objects, response and chunk JSON.
#include "serve/openai_protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "serve/structured_output.h"
#include "tokenizer/unicode.h"

namespace loom {

using json = nlohmann::json;

ApiError::ApiError(int status, std::string type, std::string code, std::string param,
                   const std::string& message)
    : Error(status >= 500   ? ErrorKind::internal
            : status == 404 ? ErrorKind::not_found
                            : ErrorKind::invalid_input,
            message),
      status_(status),
      type_(std::move(type)),
      code_(std::move(code)),
      param_(std::move(param)) {}

ApiError invalid_request(std::string param, const std::string& message) {
  return ApiError(400, "invalid_request_error", "", std::move(param), message);
}

ApiError api_error_from(const EngineError& e) {
  switch (e.code()) {
    case EngineErrc::invalid_request:
    case EngineErrc::adapter_exists:
    case EngineErrc::adapter_load_failed:
      return ApiError(400, "invalid_request_error", engine_errc_name(e.code()), e.param(), e.what());
    case EngineErrc::context_length_exceeded:
      return ApiError(400, "invalid_request_error", "context_length_exceeded", e.param(), e.what());
    case EngineErrc::model_not_found:
    case EngineErrc::adapter_not_found:
      return ApiError(404, "invalid_request_error", engine_errc_name(e.code()), e.param(), e.what());
    case EngineErrc::overloaded:
    case EngineErrc::shutting_down:
      return ApiError(503, "server_error", engine_errc_name(e.code()), e.param(), e.what());
    case EngineErrc::internal:
      break;
  }
  return ApiError(500, "server_error", "internal_error", e.param(), e.what());
}

ApiError api_error_from(const Error& e) {
  if (const auto* api = dynamic_cast<const ApiError*>(&e)) return *api;
  if (const auto* eng = dynamic_cast<const EngineError*>(&e)) return api_error_from(*eng);
  switch (e.kind()) {
    case ErrorKind::invalid_input:
    case ErrorKind::unsupported:
      return invalid_request("", e.what());
    case ErrorKind::not_found:
      return ApiError(404, "invalid_request_error", "not_found", "", e.what());
    case ErrorKind::io:
    case ErrorKind::diverged:
    case ErrorKind::internal:
      break;
  }
  return ApiError(500, "server_error", "internal_error", "", e.what());
}

json error_json(const ApiError& e) {
  json err = {{"message", e.what()}, {"type", e.type()}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param().empty()) err["param"] = e.param();
  if (!e.code().empty()) err["code"] = e.code();
  return json{{"error", std::move(err)}};
}

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// ---------------------------------------------------------------------------------------------------------------
// Field access: absent and null mean "not given" (OpenAI accepts null for every optional field).
namespace {

json parse_body(std::string_view body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw invalid_request("", fmt::format("request body is not valid JSON: {}", e.what()));
  }
  if (!j.is_object()) throw invalid_request("", "request body must be a JSON object");
  return j;
}

const json* field(const json& o, const char* key) {
  const auto it = o.find(key);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

const char* json_type(const json& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

ApiError type_error(const std::string& param, const char* want, const json& got) {
  return invalid_request(param, fmt::format("'{}' must be {} (got {})", param, want, json_type(got)));
}

double get_number(const json& o, const char* key, double def) {
  const json* v = field(o, key);
  if (!v) return def;
  if (!v->is_number()) throw type_error(key, "a number", *v);
  return v->get<double>();
}

// Integers may be written as integral floats (2.0); anything else is a type error.
int64_t as_int(const json& v, const std::string& param) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw invalid_request(param, fmt::format("'{}' is too large", param));
    return v.get<int64_t>();
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
    if (std::isfinite(d) && d == std::floor(d))  // past 64 bits (JSON parses 2^64 as a float)
      throw invalid_request(param, fmt::format("'{}' is too large", param));
  }
  throw type_error(param, "an integer", v);
}

std::optional<int64_t> get_int(const json& o, const char* key) {
  const json* v = field(o, key);
  if (!v) return std::nullopt;
  return as_int(*v, key);
}

bool get_bool(const json& o, const char* key, bool def) {
  const json* v = field(o, key);
  if (!v) return def;
  if (!v->is_boolean()) throw type_error(key, "a boolean", *v);
  return v->get<bool>();
}

std::optional<std::string> get_string(const json& o, const char* key) {
  const json* v = field(o, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) throw type_error(key, "a string", *v);
  return v->get<std::string>();
}

void check_range(const char* param, double v, double lo, double hi, bool lo_open = false) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
  if (!ok)
    throw invalid_request(
        param, fmt::format("'{}' must be in {}{}, {}] (got {})", param, lo_open ? "(" : "[", lo, hi, v));
}

std::string resolve_model(const json& o, std::span<const std::string> models) {
  const auto name = get_string(o, "model");
  if (!name) return models.empty() ? std::string() : models.front();
  if (std::find(models.begin(), models.end(), *name) == models.end())
    throw ApiError(404, "invalid_request_error", "model_not_found", "model",
                   fmt::format("The model `{}` does not exist.", *name));
  return *name;
}

std::vector<int32_t> token_array(const json& a, const std::string& param) {
  std::vector<int32_t> ids;
  ids.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string p = fmt::format("{}[{}]", param, i);
    const int64_t id = as_int(a[i], p);
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      throw invalid_request(param, fmt::format("'{}' is not a valid token id ({})", p, id));
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

bool is_token_array(const json& a) { return a.is_array() && !a.empty() && a.front().is_number(); }

// `key`'s value: a string, a list of strings, token ids or lists of them ("prompt", embeddings' "input").
std::vector<PromptInput> parse_prompts(const json& o, const std::string& key, int64_t max_count) {
  const json* p = field(o, key.c_str());
  if (!p) throw invalid_request(key, fmt::format("'{}' is required", key));
  std::vector<PromptInput> prompts;
  auto add_text = [&](const json& s) { prompts.push_back({false, s.get<std::string>(), {}}); };
  auto add_tokens = [&](const json& a, const std::string& param) {
    if (a.empty()) throw invalid_request(key, fmt::format("'{}' must not be an empty token list", param));
    prompts.push_back({true, {}, token_array(a, param)});
  };
  if (p->is_string()) {
    add_text(*p);
  } else if (is_token_array(*p)) {
    add_tokens(*p, key);
  } else if (p->is_array()) {
    if (p->empty()) throw invalid_request(key, fmt::format("'{}' must not be an empty list", key));
    for (size_t i = 0; i < p->size(); ++i) {
      const json& item = (*p)[i];
      if (item.is_string())
        add_text(item);
      else if (item.is_array())
        add_tokens(item, fmt::format("{}[{}]", key, i));
      else
        throw invalid_request(key, fmt::format("'{}[{}]' must be a string or a list of token ids (got {})",
                                               key, i, json_type(item)));
    }
  } else {
    throw type_error(key, "a string, a list of strings or a list of token ids", *p);
  }
  if (static_cast<int64_t>(prompts.size()) > max_count)
    throw invalid_request(key,
                          fmt::format("at most {} {}s per request (got {})", max_count, key, prompts.size()));
  return prompts;
}

std::vector<std::string> parse_stop(const json& o, const ProtocolLimits& limits) {
  const json* s = field(o, "stop");
  std::vector<std::string> stops;
  if (!s) return stops;
  if (s->is_string()) {
    stops.push_back(s->get<std::string>());
  } else if (s->is_array()) {
    for (const auto& item : *s) {
      if (!item.is_string()) throw type_error("stop", "a string or a list of strings", item);
      stops.push_back(item.get<std::string>());
    }
  } else {
    throw type_error("stop", "a string or a list of strings", *s);
  }
  if (static_cast<int64_t>(stops.size()) > limits.max_stop)
    throw invalid_request("stop",
                          fmt::format("at most {} stop sequences (got {})", limits.max_stop, stops.size()));
  for (const auto& st : stops)
    if (st.empty()) throw invalid_request("stop", "stop sequences must not be empty");
  return stops;
}

// Options shared by completions and chat: sampling, lengths, n, stop, seed, stream.
void parse_common(const json& o, const ProtocolLimits& limits, GenerationRequest& r) {
  SamplingParams& s = r.sampling;
  // Range checks on the double as sent, before rounding to float.
  auto ranged = [&](const char* key, double def, double lo, double hi, bool lo_open = false) {
    const double v = get_number(o, key, def);
    check_range(key, v, lo, hi, lo_open);
    const auto f = static_cast<float>(v);
    if (lo_open && !(f > static_cast<float>(lo)))  // e.g. top_p 5e-324: in range as sent, 0 as a float
      throw invalid_request(
          key,
          fmt::format("'{}' must be in ({}, {}] (got {}, which is {} as a 32-bit float)", key, lo, hi, v, f));
    return f;
  };
  // OpenAI / vLLM defaults: plain softmax sampling at temperature 1, no filters.
  s.temperature = ranged("temperature", 1.0, 0, 2);
  s.top_p = ranged("top_p", 1.0, 0, 1, true);
  const int64_t top_k = get_int(o, "top_k").value_or(-1);
  if (top_k < -1)
    throw invalid_request("top_k", fmt::format("'top_k' must be -1 (off) or >= 0 (got {})", top_k));
  s.top_k =
      top_k <= 0 ? 0 : static_cast<int32_t>(std::min<int64_t>(top_k, std::numeric_limits<int32_t>::max()));
  s.min_p = ranged("min_p", 0.0, 0, 1);
  s.presence_penalty = ranged("presence_penalty", 0.0, -2, 2);
  s.frequency_penalty = ranged("frequency_penalty", 0.0, -2, 2);
  s.repeat_penalty = static_cast<float>(get_number(o, "repetition_penalty", 1.0));
  if (!(s.repeat_penalty > 0) || !std::isfinite(s.repeat_penalty))
    throw invalid_request("repetition_penalty",
                          fmt::format("'repetition_penalty' must be > 0 (got {})", s.repeat_penalty));
  s.repeat_last_n = -1;  // vLLM: penalties see the whole sequence

  if (const auto seed = get_int(o, "seed")) r.seed = static_cast<uint64_t>(*seed);

  const auto n = get_int(o, "n").value_or(1);
  if (n < 1 || n > limits.max_n)
    throw invalid_request("n", fmt::format("'n' must be in [1, {}] (got {})", limits.max_n, n));
  r.n = static_cast<int32_t>(n);
  if (const auto best_of = get_int(o, "best_of"); best_of && *best_of != n)
    throw invalid_request("best_of", "'best_of' other than n is not supported");

  r.stop = parse_stop(o, limits);
  if (const json* ids = field(o, "stop_token_ids")) {
    if (!ids->is_array()) throw type_error("stop_token_ids", "a list of token ids", *ids);
    r.stop_token_ids = token_array(*ids, "stop_token_ids");
  }
  r.ignore_eos = get_bool(o, "ignore_eos", false);

  r.stream = get_bool(o, "stream", false);
  if (const json* so = field(o, "stream_options")) {
    if (!so->is_object()) throw type_error("stream_options", "an object", *so);
    if (!r.stream)
      throw invalid_request("stream_options", "'stream_options' is only allowed when 'stream' is true");
    r.include_usage = get_bool(*so, "include_usage", false);
  }

  if (const json* bias = field(o, "logit_bias"); bias && !(bias->is_object() && bias->empty()))
    throw invalid_request("logit_bias", "'logit_bias' is not supported");
}

void check_max_tokens(const char* param, int64_t v, const ProtocolLimits& limits) {
  if (v < 1 || v > limits.max_model_len)
    throw invalid_request(param,
                          fmt::format("'{}' must be in [1, {}] (got {})", param, limits.max_model_len, v));
}

void check_logprobs(const char* param, int64_t v, const ProtocolLimits& limits) {
  if (v < 0 || v > limits.max_logprobs)
    throw invalid_request(param,
                          fmt::format("'{}' must be in [0, {}] (got {})", param, limits.max_logprobs, v));
}

// Message content: a string, or a list of {"type":"text","text":...} parts (joined with newlines as vLLM
// does).
std::string message_content(const json& m, size_t i, const std::string& role) {
  const std::string param = fmt::format("messages[{}].content", i);
  const json* c = field(m, "content");
  if (!c) {
    if (role == "assistant") return {};  // assistant turns that only made tool calls
    throw invalid_request(param, fmt::format("'{}' is required", param));
  }
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) throw type_error(param, "a string or a list of content parts", *c);
  std::string text;
  for (size_t k = 0; k < c->size(); ++k) {
    const json& part = (*c)[k];
    const std::string pp = fmt::format("{}[{}]", param, k);
    if (!part.is_object()) throw type_error(pp, "an object", part);
    const auto type = get_string(part, "type");
    if (!type || *type != "text")
      throw invalid_request(pp, fmt::format("'{}': only text content parts are supported (got type '{}')", pp,
                                            type.value_or("")));
    const json* t = field(part, "text");
    if (!t || !t->is_string()) throw invalid_request(pp, fmt::format("'{}.text' must be a string", pp));
    if (!text.empty()) text += '\n';
    text += t->get<std::string>();
  }
  return text;
}

std::vector<ChatMessage> parse_messages(const json& o) {
  const json* ms = field(o, "messages");
  if (!ms) throw invalid_request("messages", "'messages' is required");
  if (!ms->is_array()) throw type_error("messages", "a list of messages", *ms);
  if (ms->empty()) throw invalid_request("messages", "'messages' must not be empty");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < ms->size(); ++i) {
    const json& m = (*ms)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) throw type_error(param, "an object", m);
    const json* role = field(m, "role");
    if (!role || !role->is_string())
      throw invalid_request(param + ".role", fmt::format("'{}.role' must be a string", param));
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";  // OpenAI's newer name for the system role
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      throw invalid_request(
          param + ".role",
          fmt::format("'{}.role' must be system, developer, user, assistant or tool (got '{}')", param, r));
    std::string content = message_content(m, i, r);
    out.push_back({std::move(r), std::move(content)});
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

std::vector<GenerationRequest> parse_completion_request(std::string_view body, const ProtocolLimits& limits,
                                                        std::span<const std::string> models) {
  const json o = parse_body(body);
  GenerationRequest base;
  base.kind = RequestKind::completion;
  base.model = resolve_model(o, models);
  std::vector<PromptInput> prompts = parse_prompts(o, "prompt", limits.max_prompts);
  parse_common(o, limits, base);
  base.grammar = parse_structured_output(o, body);
  base.max_tokens = get_int(o, "max_tokens").value_or(16);  // OpenAI's completions default
  check_max_tokens("max_tokens", base.max_tokens, limits);
  if (const auto lp = get_int(o, "logprobs")) {
    check_logprobs("logprobs", *lp, limits);
    base.logprobs = true;
    base.top_logprobs = static_cast<int32_t>(*lp);
  }
  base.echo = get_bool(o, "echo", false);
  base.prompt_logprobs = base.echo && base.logprobs;  // as OpenAI's legacy completions and vLLM
  if (const auto suffix = get_string(o, "suffix"); suffix && !suffix->empty())
    throw invalid_request("suffix", "'suffix' is not supported");

  std::vector<GenerationRequest> out;
  out.reserve(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r = base;
    r.prompt = std::move(prompts[i]);
    r.first_choice_index = static_cast<int32_t>(i) * base.n;
    out.push_back(std::move(r));
  }
  return out;
}

GenerationRequest parse_chat_request(std::string_view body, const ProtocolLimits& limits,
                                     std::span<const std::string> models) {
  const json o = parse_body(body);
  GenerationRequest r;
  r.kind = RequestKind::chat;
  r.model = resolve_model(o, models);
  r.messages = parse_messages(o);
  r.add_generation_prompt = get_bool(o, "add_generation_prompt", true);
  parse_common(o, limits, r);
  r.grammar = parse_structured_output(o, body);
  // max_completion_tokens is the newer name; absent both: until the context is full.
  auto max_tokens = get_int(o, "max_completion_tokens");
  const char* param = "max_completion_tokens";
  if (!max_tokens) {
    max_tokens = get_int(o, "max_tokens");
    param = "max_tokens";
  }
  if (max_tokens) {
    check_max_tokens(param, *max_tokens, limits);
    r.max_tokens = *max_tokens;
  }
  r.logprobs = get_bool(o, "logprobs", false);
  if (const auto top = get_int(o, "top_logprobs")) {
    check_logprobs("top_logprobs", *top, limits);
    if (!r.logprobs && *top > 0)
      throw invalid_request("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
    r.top_logprobs = static_cast<int32_t>(*top);
  }
  if (const json* tools = field(o, "tools"); tools && !(tools->is_array() && tools->empty())) {
    const json* choice = field(o, "tool_choice");
    if (!(choice && choice->is_string() && choice->get<std::string>() == "none"))
      throw invalid_request("tools", "tool calling is not supported");
  }
  return r;
}

TokenizeRequest parse_tokenize_request(std::string_view body, std::span<const std::string> models) {
  const json o = parse_body(body);
  TokenizeRequest r;
  r.model = resolve_model(o, models);
  if (field(o, "messages")) {
    if (field(o, "prompt")) throw invalid_request("prompt", "give either 'prompt' or 'messages', not both");
    r.is_chat = true;
    r.messages = parse_messages(o);
    r.add_generation_prompt = get_bool(o, "add_generation_prompt", true);
    r.add_special_tokens = get_bool(o, "add_special_tokens", false);
    return r;
  }
  const auto prompt = get_string(o, "prompt");
  if (!prompt) throw invalid_request("prompt", "'prompt' (a string) or 'messages' is required");
  r.prompt = *prompt;
  r.add_special_tokens = get_bool(o, "add_special_tokens", true);
  return r;
}

DetokenizeRequest parse_detokenize_request(std::string_view body, std::span<const std::string> models) {
  const json o = parse_body(body);
  DetokenizeRequest r;
  r.model = resolve_model(o, models);
  const json* t = field(o, "tokens");
  if (!t) throw invalid_request("tokens", "'tokens' is required");
  if (!t->is_array()) throw type_error("tokens", "a list of token ids", *t);
  r.tokens = token_array(*t, "tokens");
  return r;
}

namespace {

std::string required_name(const json& o, const char* key) {
  const auto v = get_string(o, key);
  if (!v || v->empty()) throw invalid_request(key, fmt::format("'{}' is required (a non-empty string)", key));
  return *v;
}

}  // namespace

AdapterRequest parse_load_adapter_request(std::string_view body) {
  const json o = parse_body(body);
  AdapterRequest r;
  r.name = required_name(o, "lora_name");
  r.path = required_name(o, "lora_path");
  r.inplace = get_bool(o, "load_inplace", false);
  return r;
}

AdapterRequest parse_unload_adapter_request(std::string_view body) {
  const json o = parse_body(body);
  AdapterRequest r;
  r.name = required_name(o, "lora_name");
  return r;
}

json tokenize_response(std::span<const int32_t> tokens, int64_t max_model_len) {
  return json{{"tokens", std::vector<int32_t>(tokens.begin(), tokens.end())},
              {"count", tokens.size()},
              {"max_model_len", max_model_len}};
}

json detokenize_response(const std::string& text) { return json{{"prompt", text}}; }

json tokenizer_info_response(const TokenizerInfo& info, int64_t max_model_len) {
  auto text = [](const std::optional<std::string>& s) { return s ? json(*s) : json(nullptr); };
  // pad_token: vLLM's field, always null here (the server pads nothing).
  return json{{"tokenizer_class", "loom"},           {"bos_token", text(info.bos_token)},
              {"eos_token", text(info.eos_token)},   {"pad_token", nullptr},
              {"add_bos_token", info.add_bos_token}, {"chat_template", text(info.chat_template)},
              {"model_max_length", max_model_len}};
}

json models_response(std::span<const ModelInfo> models, int64_t max_model_len) {
  json data = json::array();
  for (const auto& m : models) {
    data.push_back({{"id", m.id},
                    {"object", "model"},
                    {"created", m.created},
                    {"owned_by", "loom"},
                    {"root", m.path.empty() ? m.id : m.path},
                    {"parent", m.parent.empty() ? json(nullptr) : json(m.parent)},
                    {"max_model_len", max_model_len}});
  }
  return json{{"object", "list"}, {"data", std::move(data)}};
}

// ---------------------------------------------------------------------------------------------------------------
// Responses.
namespace {

// A token's text as a JSON string: itself, or where its bytes are not UTF-8 (a piece of a character)
// OpenAI's spelling "bytes:\\xe6\\x97", so that two such tokens are never the same key of a legacy
// top_logprobs object (both would read "\ufffd"); the raw bytes stay in the chat form's "bytes".
std::string token_text(const std::string& token) {
  if (tok::utf8_valid(token)) return token;
  std::string out = "bytes:";
  for (unsigned char c : token) out += fmt::format("\\x{:02x}", c);
  return out;
}

// JSON has no -inf; vLLM reports impossible tokens as -9999.
double finite_logprob(float lp) { return std::isfinite(lp) ? lp : -9999.0; }

json byte_list(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

json chat_logprobs(std::span<const TokenLogprob> lps) {
  json content = json::array();
  for (const auto& t : lps) {
    json top = json::array();
    for (const auto& a : t.top)
      top.push_back({{"token", token_text(a.token)},
                     {"logprob", finite_logprob(a.logprob)},
                     {"bytes", byte_list(a.token)}});
    content.push_back({{"token", token_text(t.token)},
                       {"logprob", finite_logprob(t.logprob)},
                       {"bytes", byte_list(t.token)},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}};
}

// Legacy completions shape; `offsets` are text_offset values, one per token.
json completion_logprobs(std::span<const TokenLogprob> lps, std::span<const int64_t> offsets) {
  json tokens = json::array(), values = json::array(), tops = json::array();
  for (const auto& t : lps) {
    tokens.push_back(token_text(t.token));
    if (!t.known) {  // the prompt's first token (echo): null, as OpenAI and vLLM send it
      values.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    values.push_back(finite_logprob(t.logprob));
    json top = json::object();
    for (const auto& a : t.top) top[token_text(a.token)] = finite_logprob(a.logprob);
    top[token_text(t.token)] = finite_logprob(t.logprob);  // vLLM: the sampled token is always listed
    tops.push_back(std::move(top));
  }
  return json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(values)},
              {"top_logprobs", std::move(tops)},
              {"text_offset", std::vector<int64_t>(offsets.begin(), offsets.end())}};
}

json finish_json(const std::optional<FinishKind>& f) {
  return f ? json(finish_kind_name(*f)) : json(nullptr);
}

json usage_json(const Usage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

const char* object_name(RequestKind kind, bool chunk) {
  if (kind == RequestKind::chat) return chunk ? "chat.completion.chunk" : "chat.completion";
  return "text_completion";
}

std::string sse(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

// text_offset of each token: the characters before it, the cursor continuing from earlier deltas.
std::vector<int64_t> token_offsets(std::span<const TokenLogprob> lps, TextCursor& cursor) {
  std::vector<int64_t> offs;
  offs.reserve(lps.size());
  for (const auto& t : lps) {
    offs.push_back(cursor.offset());
    cursor.add(t.token);
  }
  return offs;
}

void check_index(int32_t index, int32_t n) {
  if (index < 0 || index >= n)
    throw ApiError(500, "server_error", "internal_error", "",
                   fmt::format("engine sent choice index {} outside [0, {})", index, n));
}

}  // namespace

void TextCursor::add(std::string_view bytes) {
  tail_ += bytes;
  const size_t done = tok::utf8_complete_prefix(tail_);
  chars_ +=
      static_cast<int64_t>(tok::utf8_length(tok::utf8_sanitize(std::string_view(tail_).substr(0, done))));
  tail_.erase(0, done);
}

ResponseAccumulator::ResponseAccumulator(ResponseMeta meta) : meta_(std::move(meta)) {
  choices_.resize(static_cast<size_t>(std::max(meta_.num_choices, 0)));
  for (size_t i = 0; i < choices_.size() && i < meta_.echo.size(); ++i) {
    choices_[i].text = meta_.echo[i];
    choices_[i].chars.add(meta_.echo[i]);
  }
}

void ResponseAccumulator::add(const ChoiceDelta& d) {
  check_index(d.index, meta_.num_choices);
  Choice& c = choices_[static_cast<size_t>(d.index)];
  c.text += d.text;
  if (meta_.logprobs) {
    // The prompt's tokens (echo) count their offsets from the prompt's start, the choice's own from its
    // text's end.
    const auto offs = token_offsets(d.logprobs, d.prompt ? c.prompt_chars : c.chars);
    c.offsets.insert(c.offsets.end(), offs.begin(), offs.end());
    c.logprobs.insert(c.logprobs.end(), d.logprobs.begin(), d.logprobs.end());
  }
  if (d.finish) c.finish = d.finish;
}

void ResponseAccumulator::add_usage(const Usage& u) {
  usage_.prompt_tokens += u.prompt_tokens;
  usage_.completion_tokens += u.completion_tokens;
}

json ResponseAccumulator::build() const {
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json ch = {{"index", i}};
    if (meta_.kind == RequestKind::chat) {
      ch["message"] = {{"role", "assistant"}, {"content", c.text}};
      ch["logprobs"] = meta_.logprobs ? chat_logprobs(c.logprobs) : json(nullptr);
    } else {
      ch["text"] = c.text;
      ch["logprobs"] = meta_.logprobs ? completion_logprobs(c.logprobs, c.offsets) : json(nullptr);
    }
    ch["finish_reason"] = finish_json(c.finish);
    choices.push_back(std::move(ch));
  }
  return json{{"id", meta_.id},
              {"object", object_name(meta_.kind, false)},
              {"created", meta_.created},
              {"model", meta_.model},
              {"choices", std::move(choices)},
              {"usage", usage_json(usage_)}};
}

StreamFormatter::StreamFormatter(ResponseMeta meta, bool include_usage)
    : meta_(std::move(meta)), include_usage_(include_usage) {
  chars_.assign(static_cast<size_t>(std::max(meta_.num_choices, 0)), TextCursor());
  prompt_chars_ = chars_;
}

json StreamFormatter::chunk(json choices) const {
  json j = {{"id", meta_.id},
            {"object", object_name(meta_.kind, true)},
            {"created", meta_.created},
            {"model", meta_.model},
            {"choices", std::move(choices)}};
  if (include_usage_) j["usage"] = nullptr;  // OpenAI: null on every chunk but the last
  return j;
}

std::string StreamFormatter::start() {
  std::string out;
  for (int32_t i = 0; i < meta_.num_choices; ++i) {
    const auto idx = static_cast<size_t>(i);
    if (meta_.kind == RequestKind::chat) {
      out += sse(chunk(json::array({{{"index", i},
                                     {"delta", {{"role", "assistant"}, {"content", ""}}},
                                     {"logprobs", nullptr},
                                     {"finish_reason", nullptr}}})));
    } else if (idx < meta_.echo.size() && !meta_.echo[idx].empty()) {
      chars_[idx].add(meta_.echo[idx]);
      out += sse(chunk(json::array(
          {{{"index", i}, {"text", meta_.echo[idx]}, {"logprobs", nullptr}, {"finish_reason", nullptr}}})));
    }
  }
  return out;
}

std::string StreamFormatter::delta(const ChoiceDelta& d) {
  check_index(d.index, meta_.num_choices);
  const bool has_logprobs = meta_.logprobs && !d.logprobs.empty();
  if (d.text.empty() && !has_logprobs && !d.finish) return {};
  json ch = {{"index", d.index}};
  if (meta_.kind == RequestKind::chat) {
    ch["delta"] = d.text.empty() && !has_logprobs ? json::object() : json{{"content", d.text}};
    ch["logprobs"] = has_logprobs ? chat_logprobs(d.logprobs) : json(nullptr);
  } else {
    ch["text"] = d.text;
    if (has_logprobs) {
      const auto idx = static_cast<size_t>(d.index);
      const auto offs = token_offsets(d.logprobs, d.prompt ? prompt_chars_[idx] : chars_[idx]);
      ch["logprobs"] = completion_logprobs(d.logprobs, offs);
    } else {
      ch["logprobs"] = nullptr;
    }
  }
  ch["finish_reason"] = finish_json(d.finish);
  return sse(chunk(json::array({std::move(ch)})));
}

std::string StreamFormatter::usage(const Usage& total) {
  if (!include_usage_) return {};
  json j = chunk(json::array());
  j["usage"] = usage_json(total);
  return sse(j);
}

std::string StreamFormatter::error(const ApiError& e) { return sse(error_json(e)); }

// ---------------------------------------------------------------------------------------------------------------
// /v1/embeddings

namespace {

std::string base64_encode(const uint8_t* data, size_t n) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  for (size_t i = 0; i < n; i += 3) {
    const uint32_t b = (uint32_t{data[i]} << 16) | (i + 1 < n ? uint32_t{data[i + 1]} << 8 : 0) |
                       (i + 2 < n ? uint32_t{data[i + 2]} : 0);
    out += kAlphabet[(b >> 18) & 63];
    out += kAlphabet[(b >> 12) & 63];
    out += i + 1 < n ? kAlphabet[(b >> 6) & 63] : '=';
    out += i + 2 < n ? kAlphabet[b & 63] : '=';
  }
  return out;
}

}  // namespace

std::vector<GenerationRequest> parse_embeddings_request(std::string_view body, const ProtocolLimits& limits,
                                                        std::span<const std::string> models, bool& base64) {
  const json o = parse_body(body);
  GenerationRequest base;
  base.kind = RequestKind::embedding;
  base.model = resolve_model(o, models);
  base.max_tokens = 0;
  const std::string format = get_string(o, "encoding_format").value_or("float");
  if (format != "float" && format != "base64")
    throw invalid_request(
        "encoding_format",
        fmt::format("'encoding_format' must be \"float\" or \"base64\" (got \"{}\")", format));
  base64 = format == "base64";
  // The size is the model's hidden size; Matryoshka truncation would change what the vectors mean.
  if (field(o, "dimensions"))
    throw invalid_request("dimensions",
                          "'dimensions' is not supported: the embedding size is the model's hidden size");
  std::vector<PromptInput> inputs = parse_prompts(o, "input", limits.max_embedding_inputs);
  std::vector<GenerationRequest> out;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].is_tokens && inputs[i].text.empty())
      throw invalid_request("input", inputs.size() == 1
                                         ? std::string("'input' must not be an empty string")
                                         : fmt::format("'input[{}]' must not be an empty string", i));
    GenerationRequest r = base;
    r.prompt = std::move(inputs[i]);
    r.first_choice_index = static_cast<int32_t>(i);
    out.push_back(std::move(r));
  }
  return out;
}

json embeddings_response(std::span<const std::vector<float>> vectors, bool base64, const std::string& model,
                         int64_t prompt_tokens) {
  json data = json::array();
  for (size_t i = 0; i < vectors.size(); ++i) {
    const std::vector<float>& v = vectors[i];
    json e = {{"object", "embedding"}, {"index", i}};
    if (base64)  // little-endian float32, as OpenAI's clients decode it (numpy.frombuffer(..., "float32"))
      e["embedding"] = base64_encode(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float));
    else
      e["embedding"] = v;
    data.push_back(std::move(e));
  }
  return json{{"object", "list"},
              {"data", std::move(data)},
              {"model", model},
              {"usage", {{"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens}}}};
}

}  // namespace loom

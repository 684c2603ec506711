// OpenAI protocol: request validation tables (status + error.param for every bad input), parsed values and
// defaults, error objects, and the JSON shape of responses and streamed chunks.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "serve/openai_protocol.h"

namespace loom {
namespace {

using json = nlohmann::json;

const std::vector<std::string> kModels = {"base", "adapter-a"};

struct BadCase {
  std::string body;
  int status;
  std::string param;  // expected error.param; "" means null
};

template <typename Fn>
void expect_api_error(Fn&& fn, const BadCase& c) {
  try {
    fn();
    ADD_FAILURE() << "accepted: " << c.body;
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), c.status) << c.body << " -> " << e.what();
    EXPECT_EQ(e.param(), c.param) << c.body << " -> " << e.what();
    const json j = error_json(e);
    EXPECT_EQ(j["error"]["message"], e.what());
    EXPECT_TRUE(j["error"]["type"].is_string());
    if (c.param.empty()) {
      EXPECT_TRUE(j["error"]["param"].is_null()) << c.body;
    } else {
      EXPECT_EQ(j["error"]["param"], c.param);
    }
  }
}

// Bad inputs both endpoints share, spliced into a valid body of either kind.
std::vector<BadCase> common_bad(const std::string& head) {
  auto b = [&](const std::string& extra) { return "{" + head + "," + extra + "}"; };
  return {
      {b(R"("temperature": -0.1)"), 400, "temperature"},
      {b(R"("temperature": 2.0001)"), 400, "temperature"},
      {b(R"("temperature": "hot")"), 400, "temperature"},
      {b(R"("top_p": 0)"), 400, "top_p"},
      {b(R"("top_p": 1.5)"), 400, "top_p"},
      {b(R"("top_p": -0.5)"), 400, "top_p"},
      {b(R"("top_p": 5e-324)"), 400, "top_p"},  // in range as a double, 0 as the float the sampler uses
      {b(R"("seed": 18446744073709551616)"), 400, "seed"},  // past 64 bits: "too large", not "not an integer"
      {b(R"("top_k": -2)"), 400, "top_k"},
      {b(R"("top_k": 1.5)"), 400, "top_k"},
      {b(R"("min_p": -0.01)"), 400, "min_p"},
      {b(R"("min_p": 1.01)"), 400, "min_p"},
      {b(R"("presence_penalty": 2.5)"), 400, "presence_penalty"},
      {b(R"("presence_penalty": -2.01)"), 400, "presence_penalty"},
      {b(R"("frequency_penalty": 3)"), 400, "frequency_penalty"},
      {b(R"("frequency_penalty": -7)"), 400, "frequency_penalty"},
      {b(R"("repetition_penalty": 0)"), 400, "repetition_penalty"},
      {b(R"("n": 0)"), 400, "n"},
      {b(R"("n": 17)"), 400, "n"},
      {b(R"("n": "2")"), 400, "n"},
      {b(R"("n": true)"), 400, "n"},
      {b(R"("max_tokens": 0)"), 400, "max_tokens"},
      {b(R"("max_tokens": -5)"), 400, "max_tokens"},
      {b(R"("max_tokens": 4097)"), 400, "max_tokens"},
      {b(R"("max_tokens": 2.5)"), 400, "max_tokens"},
      {b(R"("stop": ["a","b","c","d","e"])"), 400, "stop"},
      {b(R"("stop": 5)"), 400, "stop"},
      {b(R"("stop": ["a", 1])"), 400, "stop"},
      {b(R"("stop": "")"), 400, "stop"},
      {b(R"("stop_token_ids": [1, -1])"), 400, "stop_token_ids"},
      {b(R"("seed": "x")"), 400, "seed"},
      {b(R"("stream": "yes")"), 400, "stream"},
      {b(R"("stream_options": {"include_usage": true})"), 400, "stream_options"},
      {b(R"("stream": true, "stream_options": {"include_usage": 1})"), 400, "include_usage"},
      {b(R"("logit_bias": {"50256": -100})"), 400, "logit_bias"},
      {b(R"("best_of": 3)"), 400, "best_of"},
      {b(R"("model": "nope")"), 404, "model"},
      {b(R"("model": 7)"), 400, "model"},
  };
}

const ProtocolLimits kLimits = [] {
  ProtocolLimits l;
  l.max_model_len = 4096;
  l.max_n = 16;
  l.max_prompts = 3;
  return l;
}();

TEST(OpenAIProtocol, CompletionRejectsEveryBadInputWithStatusAndParam) {
  auto cases = common_bad(R"("prompt": "hi")");
  const std::vector<BadCase> specific = {
      {R"({"prompt": "hi")", 400, ""},                        // malformed JSON
      {R"({"prompt": "hi", "max_tokens": 1e400})", 400, ""},  // a number past double (was a 500)
      {R"([1, 2])", 400, ""},                                 // not an object
      {R"("prompt")", 400, ""},
      {R"({})", 400, "prompt"},
      {R"({"prompt": null})", 400, "prompt"},
      {R"({"prompt": 5})", 400, "prompt"},
      {R"({"prompt": []})", 400, "prompt"},
      {R"({"prompt": [[]]})", 400, "prompt"},
      {R"({"prompt": [1, "a"]})", 400, "prompt[1]"},
      {R"({"prompt": [-1]})", 400, "prompt"},
      {R"({"prompt": [1.5]})", 400, "prompt[0]"},
      {R"({"prompt": ["a", {"x": 1}]})", 400, "prompt"},
      {R"({"prompt": ["a", "b", "c", "d"]})", 400, "prompt"},  // over max_prompts
      {R"({"prompt": "hi", "logprobs": 21})", 400, "logprobs"},
      {R"({"prompt": "hi", "logprobs": -1})", 400, "logprobs"},
      {R"({"prompt": "hi", "logprobs": true})", 400, "logprobs"},
      {R"({"prompt": "hi", "echo": 1})", 400, "echo"},
      {R"({"prompt": "hi", "suffix": "x"})", 400, "suffix"},
  };
  cases.insert(cases.end(), specific.begin(), specific.end());
  for (const auto& c : cases)
    expect_api_error([&] { parse_completion_request(c.body, kLimits, kModels); }, c);
}

TEST(OpenAIProtocol, ChatRejectsEveryBadInputWithStatusAndParam) {
  auto cases = common_bad(R"("messages": [{"role": "user", "content": "hi"}])");
  const std::vector<BadCase> specific = {
      {R"({"messages": [{"role": "user", "content": "hi"})", 400, ""},
      {R"({})", 400, "messages"},
      {R"({"messages": "hi"})", 400, "messages"},
      {R"({"messages": []})", 400, "messages"},
      {R"({"messages": ["hi"]})", 400, "messages[0]"},
      {R"({"messages": [{"content": "hi"}]})", 400, "messages[0].role"},
      {R"({"messages": [{"role": "wizard", "content": "hi"}]})", 400, "messages[0].role"},
      {R"({"messages": [{"role": "user"}]})", 400, "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]})", 400,
       "messages[1].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
       400, "messages[0].content[0]"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", 400, "messages[0].content[0]"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", 400, "logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", 400, "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})", 400,
       "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -1})", 400,
       "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})", 400,
       "max_completion_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_xml"}})", 400,
       "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", 400, "tools"},
  };
  cases.insert(cases.end(), specific.begin(), specific.end());
  for (const auto& c : cases) expect_api_error([&] { parse_chat_request(c.body, kLimits, kModels); }, c);
}

TEST(OpenAIProtocol, UnknownModelIs404ModelNotFound) {
  try {
    parse_chat_request(R"({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})", kLimits,
                       kModels);
    FAIL();
  } catch (const ApiError& e) {
    const json j = error_json(e);
    EXPECT_EQ(e.status(), 404);
    EXPECT_EQ(j["error"]["code"], "model_not_found");
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_NE(std::string(e.what()).find("gpt-4"), std::string::npos);
  }
}

TEST(OpenAIProtocol, CompletionDefaultsFollowOpenAI) {
  const auto rs = parse_completion_request(R"({"prompt": "Hello"})", kLimits, kModels);
  ASSERT_EQ(rs.size(), 1u);
  const auto& r = rs[0];
  EXPECT_EQ(r.kind, RequestKind::completion);
  EXPECT_EQ(r.model, "base");  // absent: the first model
  EXPECT_FALSE(r.prompt.is_tokens);
  EXPECT_EQ(r.prompt.text, "Hello");
  EXPECT_EQ(r.max_tokens, 16);
  EXPECT_EQ(r.n, 1);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.0f);
  EXPECT_FLOAT_EQ(r.sampling.repeat_penalty, 1.0f);
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_FALSE(r.logprobs);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.echo);
  EXPECT_TRUE(r.stop.empty());
}

TEST(OpenAIProtocol, CompletionValuesAreCarriedThrough) {
  const auto rs = parse_completion_request(
      R"({"model": "adapter-a", "prompt": [[5, 6, 7], "text two"], "max_tokens": 4096, "temperature": 0,
          "top_p": 0.5, "top_k": 7, "min_p": 0.1, "presence_penalty": -2, "frequency_penalty": 2,
          "repetition_penalty": 1.3, "n": 3, "best_of": 3, "stop": ["\n\n", "END"], "seed": -1,
          "logprobs": 5, "stream": true, "stream_options": {"include_usage": true}, "stop_token_ids": [2],
          "ignore_eos": true, "user": "u", "some_future_field": {"x": 1}, "logit_bias": {}, "suffix": null,
          "echo": false})",
      kLimits, kModels);
  ASSERT_EQ(rs.size(), 2u);
  EXPECT_TRUE(rs[0].prompt.is_tokens);
  EXPECT_EQ(rs[0].prompt.tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(rs[1].prompt.text, "text two");
  EXPECT_EQ(rs[0].first_choice_index, 0);
  EXPECT_EQ(rs[1].first_choice_index, 3);
  for (const auto& r : rs) {
    EXPECT_EQ(r.model, "adapter-a");
    EXPECT_EQ(r.max_tokens, 4096);
    EXPECT_FLOAT_EQ(r.sampling.temperature, 0.0f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 0.5f);
    EXPECT_EQ(r.sampling.top_k, 7);
    EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
    EXPECT_FLOAT_EQ(r.sampling.presence_penalty, -2.0f);
    EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, 2.0f);
    EXPECT_FLOAT_EQ(r.sampling.repeat_penalty, 1.3f);
    EXPECT_EQ(r.n, 3);
    EXPECT_EQ(r.stop, (std::vector<std::string>{"\n\n", "END"}));
    EXPECT_EQ(r.seed, std::optional<uint64_t>(~0ull));
    EXPECT_TRUE(r.logprobs);
    EXPECT_EQ(r.top_logprobs, 5);
    EXPECT_TRUE(r.stream);
    EXPECT_TRUE(r.include_usage);
    EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{2}));
    EXPECT_TRUE(r.ignore_eos);
  }
  // Single forms: one token list, a stop string, integral floats, top_k -1, nulls for optional fields.
  const auto one = parse_completion_request(
      R"({"prompt": [1, 2], "stop": "x", "n": 2.0, "top_k": -1, "temperature": null, "max_tokens": null})",
      kLimits, kModels);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].prompt.tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(one[0].stop, (std::vector<std::string>{"x"}));
  EXPECT_EQ(one[0].n, 2);
  EXPECT_EQ(one[0].sampling.top_k, 0);
  EXPECT_FLOAT_EQ(one[0].sampling.temperature, 1.0f);
  EXPECT_EQ(one[0].max_tokens, 16);
}

TEST(OpenAIProtocol, ChatParsesMessagesAndLengths) {
  const auto r = parse_chat_request(
      R"({"messages": [{"role": "developer", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                        "name": "bob"},
                       {"role": "assistant", "content": null, "tool_calls": []},
                       {"role": "user", "content": "c"}],
          "logprobs": true, "top_logprobs": 3, "max_tokens": 9, "tools": [], "response_format": {"type": "text"}})",
      kLimits, kModels);
  EXPECT_EQ(r.kind, RequestKind::chat);
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[0].content, "be brief");
  EXPECT_EQ(r.messages[1].content, "a\nb");
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_TRUE(r.add_generation_prompt);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_EQ(r.max_tokens, 9);

  const auto d = parse_chat_request(R"({"messages": [{"role": "user", "content": "x"}]})", kLimits, kModels);
  EXPECT_EQ(d.max_tokens, -1);  // chat default: until the context is full
  const auto m = parse_chat_request(
      R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 7})",
      kLimits, kModels);
  EXPECT_EQ(m.max_tokens, 7);  // the newer name wins
}

TEST(OpenAIProtocol, VllmExtraEndpoints) {
  const auto t = parse_tokenize_request(R"({"prompt": "hello", "add_special_tokens": false})", kModels);
  EXPECT_FALSE(t.is_chat);
  EXPECT_EQ(t.prompt, "hello");
  EXPECT_FALSE(t.add_special_tokens);
  EXPECT_EQ(t.model, "base");
  const auto tc = parse_tokenize_request(
      R"({"model": "adapter-a", "messages": [{"role": "user", "content": "x"}]})", kModels);
  EXPECT_TRUE(tc.is_chat);
  EXPECT_EQ(tc.model, "adapter-a");
  ASSERT_EQ(tc.messages.size(), 1u);
  const auto d = parse_detokenize_request(R"({"tokens": [1, 2, 3]})", kModels);
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{1, 2, 3}));
  const auto l = parse_load_adapter_request(R"({"lora_name": "a", "lora_path": "/x/y"})");
  EXPECT_EQ(l.name, "a");
  EXPECT_EQ(l.path, "/x/y");
  EXPECT_FALSE(l.inplace);
  EXPECT_TRUE(parse_load_adapter_request(R"({"lora_name": "a", "lora_path": "/x", "load_inplace": true})").inplace);
  EXPECT_EQ(parse_unload_adapter_request(R"({"lora_name": "a", "lora_int_id": 3})").name, "a");

  const std::vector<BadCase> bad = {
      {R"({})", 400, "prompt"},
      {R"({"prompt": 3})", 400, "prompt"},
      {R"({"prompt": "x", "model": "zzz"})", 404, "model"},
  };
  for (const auto& c : bad) expect_api_error([&] { parse_tokenize_request(c.body, kModels); }, c);
  const std::vector<BadCase> bad_detok = {
      {R"({})", 400, "tokens"},
      {R"({"tokens": "abc"})", 400, "tokens"},
      {R"({"tokens": [1, -2]})", 400, "tokens"},
  };
  for (const auto& c : bad_detok) expect_api_error([&] { parse_detokenize_request(c.body, kModels); }, c);
  const std::vector<BadCase> bad_load = {
      {R"({"lora_path": "/x"})", 400, "lora_name"},
      {R"({"lora_name": "", "lora_path": "/x"})", 400, "lora_name"},
      {R"({"lora_name": "a"})", 400, "lora_path"},
      {R"({"lora_name": 1, "lora_path": "/x"})", 400, "lora_name"},
      {R"({"lora_name": "a", "lora_path": "/x", "load_inplace": 1})", 400, "load_inplace"},
  };
  for (const auto& c : bad_load) expect_api_error([&] { parse_load_adapter_request(c.body); }, c);
  expect_api_error([&] { parse_unload_adapter_request("{}"); }, {"{}", 400, "lora_name"});

  const json tr = tokenize_response(std::vector<int32_t>{4, 5}, 2048);
  EXPECT_EQ(tr, json::parse(R"({"tokens": [4, 5], "count": 2, "max_model_len": 2048})"));
  EXPECT_EQ(detokenize_response("hi"), json::parse(R"({"prompt": "hi"})"));
}

TEST(OpenAIProtocol, EngineErrorsMapToStatusAndCode) {
  struct Case {
    EngineErrc code;
    int status;
    const char* type;
  };
  const Case cases[] = {
      {EngineErrc::invalid_request, 400, "invalid_request_error"},
      {EngineErrc::context_length_exceeded, 400, "invalid_request_error"},
      {EngineErrc::model_not_found, 404, "invalid_request_error"},
      {EngineErrc::adapter_exists, 400, "invalid_request_error"},
      {EngineErrc::adapter_not_found, 404, "invalid_request_error"},
      {EngineErrc::adapter_load_failed, 400, "invalid_request_error"},
      {EngineErrc::overloaded, 503, "server_error"},
      {EngineErrc::shutting_down, 503, "server_error"},
      {EngineErrc::internal, 500, "server_error"},
  };
  for (const auto& c : cases) {
    const ApiError e = api_error_from(EngineError(c.code, "msg", "prompt"));
    EXPECT_EQ(e.status(), c.status) << engine_errc_name(c.code);
    EXPECT_EQ(e.type(), c.type);
    EXPECT_EQ(e.param(), "prompt");
    EXPECT_FALSE(e.code().empty());
    // Through the generic overload too (the HTTP layer catches loom::Error).
    const Error& base = EngineError(c.code, "msg");
    EXPECT_EQ(api_error_from(base).status(), c.status);
  }
  EXPECT_EQ(api_error_from(Error(ErrorKind::invalid_input, "x")).status(), 400);
  EXPECT_EQ(api_error_from(Error(ErrorKind::not_found, "x")).status(), 404);
  EXPECT_EQ(api_error_from(Error(ErrorKind::io, "x")).status(), 500);
  const json j = error_json(ApiError(401, "invalid_request_error", "invalid_api_key", "", "no key"));
  EXPECT_EQ(j, json::parse(R"({"error": {"message": "no key", "type": "invalid_request_error", "param": null,
                                         "code": "invalid_api_key"}})"));
}

ChoiceDelta delta(int32_t index, std::string text, std::vector<int32_t> ids,
                  std::optional<FinishKind> finish = {}) {
  ChoiceDelta d;
  d.index = index;
  d.text = std::move(text);
  d.token_ids = std::move(ids);
  d.finish = finish;
  return d;
}

TokenLogprob lp(int32_t id, std::string tok, float v, std::vector<TopLogprob> top = {}) {
  return TokenLogprob{id, std::move(tok), v, std::move(top)};
}

ResponseMeta meta(RequestKind kind, int32_t n) {
  ResponseMeta m;
  m.kind = kind;
  m.id = kind == RequestKind::chat ? "chatcmpl-1" : "cmpl-1";
  m.created = 1700000000;
  m.model = "base";
  m.num_choices = n;
  return m;
}

TEST(OpenAIProtocol, CompletionResponseShape) {
  ResponseMeta m = meta(RequestKind::completion, 2);
  m.logprobs = true;
  m.top_logprobs = 1;
  m.echo = {"Q: ", "Q: "};
  ResponseAccumulator acc(m);
  auto d0 = delta(0, "hé", {10, 11});
  d0.logprobs = {lp(10, "h", -0.5f, {{10, "h", -0.5f}}),
                 lp(11, "é", -std::numeric_limits<float>::infinity())};
  acc.add(d0);
  acc.add(delta(1, "x", {}, FinishKind::length));
  acc.add(delta(0, "", {}, FinishKind::stop));
  acc.add_usage({5, 2});
  acc.add_usage({0, 1});
  const json j = acc.build();
  EXPECT_EQ(j["id"], "cmpl-1");
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "base");
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["text"], "Q: hé");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][1]["text"], "Q: x");
  EXPECT_EQ(j["choices"][1]["finish_reason"], "length");
  const json& l = j["choices"][0]["logprobs"];
  EXPECT_EQ(l["tokens"], json::parse(R"(["h", "é"])"));
  EXPECT_EQ(l["token_logprobs"], json::parse("[-0.5, -9999.0]"));
  EXPECT_EQ(l["top_logprobs"][0], json::parse(R"({"h": -0.5})"));
  EXPECT_EQ(l["text_offset"], json::parse("[3, 4]"));  // after the echoed "Q: "
  EXPECT_EQ(j["usage"], json::parse(R"({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})"));
  EXPECT_THROW(acc.add(delta(2, "x", {})), ApiError);
}

// Tokens that are pieces of a character (byte-level BPE): each is its own key of top_logprobs, spelled
// "bytes:\\x.." as OpenAI does (two "\ufffd" keys collapsed into one, losing the sampled token's value),
// and text_offset counts the characters of the text as sent: a character at the token with its first
// byte, a run that forms none as one U+FFFD. Streaming gives the same offsets across chunks.
TEST(OpenAIProtocol, PiecesOfCharactersKeepTheirOwnKeysAndOffsets) {
  ResponseMeta m = meta(RequestKind::completion, 1);
  m.logprobs = true;
  m.top_logprobs = 2;
  const std::string ri = "\xe6\x97", pe = "\xa5", bad = "\xe6\x97";  // "日" is E6 97 A5
  auto d = delta(0, "日\xef\xbf\xbdA", {1, 2, 3, 4});
  d.logprobs = {lp(1, ri, -0.5f, {{1, ri, -0.5f}, {9, "\xe6", -1.5f}}), lp(2, pe, -0.25f), lp(3, bad, -1.0f),
                lp(4, "A", -2.0f)};
  ResponseAccumulator acc(m);
  acc.add(d);
  const json l = acc.build()["choices"][0]["logprobs"];
  EXPECT_EQ(l["tokens"], json::parse(R"(["bytes:\\xe6\\x97", "bytes:\\xa5", "bytes:\\xe6\\x97", "A"])"));
  EXPECT_EQ(l["top_logprobs"][0], json::parse(R"({"bytes:\\xe6\\x97": -0.5, "bytes:\\xe6": -1.5})"));
  EXPECT_EQ(l["text_offset"], json::parse("[0, 1, 1, 2]"));  // 日 | (its last byte) | U+FFFD | A
  StreamFormatter sf(m, false);
  auto first = d, second = d;
  first.logprobs.resize(1);
  second.logprobs.erase(second.logprobs.begin());
  const json a = json::parse(sf.delta(first).substr(6)), b = json::parse(sf.delta(second).substr(6));
  EXPECT_EQ(a["choices"][0]["logprobs"]["text_offset"], json::parse("[0]"));
  EXPECT_EQ(b["choices"][0]["logprobs"]["text_offset"], json::parse("[1, 1, 2]"));
}

TEST(OpenAIProtocol, ChatResponseShape) {
  ResponseMeta m = meta(RequestKind::chat, 1);
  ResponseAccumulator acc(m);
  acc.add(delta(0, "Hel", {1}));
  acc.add(delta(0, "lo", {2}, FinishKind::stop));
  acc.add_usage({7, 2});
  const json j = acc.build();
  EXPECT_EQ(j, json::parse(R"({"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
      "model": "base", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
      "logprobs": null, "finish_reason": "stop"}],
      "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}})"));

  ResponseMeta ml = meta(RequestKind::chat, 1);
  ml.logprobs = true;
  ml.top_logprobs = 1;
  ResponseAccumulator acc2(ml);
  auto d = delta(0, "A", {65});
  d.logprobs = {lp(65, "A", -0.25f, {{65, "A", -0.25f}})};
  acc2.add(d);
  EXPECT_EQ(acc2.build()["choices"][0]["logprobs"],
            json::parse(R"({"content": [{"token": "A", "logprob": -0.25,
      "bytes": [65], "top_logprobs": [{"token": "A", "logprob": -0.25, "bytes": [65]}]}]})"));
  EXPECT_TRUE(acc2.build()["choices"][0]["finish_reason"].is_null());
}

// Splits "data: ...\n\n" events and parses each JSON payload.
std::vector<json> events(const std::string& sse) {
  std::vector<json> out;
  size_t pos = 0;
  while (pos < sse.size()) {
    EXPECT_EQ(sse.compare(pos, 6, "data: "), 0) << sse.substr(pos);
    const size_t end = sse.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos);
    if (end == std::string::npos) break;
    const std::string payload = sse.substr(pos + 6, end - pos - 6);
    out.push_back(payload == "[DONE]" ? json("[DONE]") : json::parse(payload));
    pos = end + 2;
  }
  return out;
}

TEST(OpenAIProtocol, ChatStreamChunks) {
  StreamFormatter f(meta(RequestKind::chat, 2), /*include_usage=*/true);
  std::string sse = f.start();
  sse += f.delta(delta(1, "Hi", {1}));
  EXPECT_EQ(f.delta(delta(0, "", {2})), "");  // held-back text: nothing to send
  sse += f.delta(delta(0, "Yo", {2}, FinishKind::length));
  sse += f.delta(delta(1, "", {}, FinishKind::stop));
  sse += f.usage({3, 3});
  sse += StreamFormatter::done();
  const auto ev = events(sse);
  ASSERT_EQ(ev.size(), 7u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(ev[i]["object"], "chat.completion.chunk");
    EXPECT_EQ(ev[i]["id"], "chatcmpl-1");
    EXPECT_EQ(ev[i]["choices"][0]["index"], i);
    EXPECT_EQ(ev[i]["choices"][0]["delta"], json::parse(R"({"role": "assistant", "content": ""})"));
    EXPECT_TRUE(ev[i]["choices"][0]["finish_reason"].is_null());
    EXPECT_TRUE(ev[i]["usage"].is_null());
    EXPECT_TRUE(ev[i].contains("usage"));
  }
  EXPECT_EQ(ev[2]["choices"][0]["delta"], json::parse(R"({"content": "Hi"})"));
  EXPECT_EQ(ev[2]["choices"][0]["index"], 1);
  EXPECT_EQ(ev[3]["choices"][0]["delta"], json::parse(R"({"content": "Yo"})"));
  EXPECT_EQ(ev[3]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(ev[4]["choices"][0]["delta"], json::object());
  EXPECT_EQ(ev[4]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(ev[5]["choices"], json::array());
  EXPECT_EQ(ev[5]["usage"],
            json::parse(R"({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})"));
  EXPECT_EQ(ev[6], "[DONE]");
}

// echo with logprobs (lm-evaluation-harness's loglikelihood request): the prompt's tokens come first in
// the logprobs, the first with null logprob and top_logprobs, their text_offset counted from the prompt's
// start; the sampled tokens' offsets follow the echoed text. Streamed, the prompt's logprobs are an event
// with empty text after the echo.
TEST(OpenAIProtocol, EchoWithLogprobsListsThePromptTokensFirst) {
  const auto parsed = parse_completion_request(
      R"({"prompt": [[1, 2], [3]], "echo": true, "logprobs": 1, "max_tokens": 1})", kLimits, kModels);
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_TRUE(parsed[0].prompt_logprobs && parsed[0].echo && parsed[0].logprobs);
  EXPECT_FALSE(
      parse_completion_request(R"({"prompt": "hi", "logprobs": 1})", kLimits, kModels)[0].prompt_logprobs);
  EXPECT_FALSE(
      parse_completion_request(R"({"prompt": "hi", "echo": true})", kLimits, kModels)[0].prompt_logprobs);

  ResponseMeta m = meta(RequestKind::completion, 1);
  m.logprobs = true;
  m.top_logprobs = 1;
  m.echo = {"Q: a"};
  ChoiceDelta prompt = delta(0, "", {});
  prompt.prompt = true;
  TokenLogprob first = lp(7, "Q:", 0.0f);
  first.known = false;
  prompt.logprobs = {first, lp(8, " a", -2.0f, {{9, " b", -1.0f}})};
  auto sampled = delta(0, "!", {5}, FinishKind::length);
  sampled.logprobs = {lp(5, "!", -0.25f, {{5, "!", -0.25f}})};
  ResponseAccumulator acc(m);
  acc.add(prompt);
  acc.add(sampled);
  const json j = acc.build();
  EXPECT_EQ(j["choices"][0]["text"], "Q: a!");
  const json& l = j["choices"][0]["logprobs"];
  EXPECT_EQ(l["tokens"], json::parse(R"(["Q:", " a", "!"])"));
  EXPECT_EQ(l["token_logprobs"], json::parse("[null, -2.0, -0.25]"));
  EXPECT_EQ(l["top_logprobs"], json::parse(R"([null, {" b": -1.0, " a": -2.0}, {"!": -0.25}])"));
  EXPECT_EQ(l["text_offset"], json::parse("[0, 2, 4]"));

  StreamFormatter f(m, /*include_usage=*/false);
  std::string sse = f.start();
  sse += f.delta(prompt);
  sse += f.delta(sampled);
  const auto ev = events(sse);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0]["choices"][0]["text"], "Q: a");
  EXPECT_EQ(ev[1]["choices"][0]["text"], "");
  EXPECT_EQ(ev[1]["choices"][0]["logprobs"]["token_logprobs"], json::parse("[null, -2.0]"));
  EXPECT_EQ(ev[1]["choices"][0]["logprobs"]["text_offset"], json::parse("[0, 2]"));
  EXPECT_EQ(ev[2]["choices"][0]["logprobs"]["text_offset"], json::parse("[4]"));
}

TEST(OpenAIProtocol, CompletionStreamChunks) {
  ResponseMeta m = meta(RequestKind::completion, 1);
  m.echo = {"ab"};
  m.logprobs = true;
  StreamFormatter f(m, /*include_usage=*/false);
  std::string sse = f.start();
  auto d = delta(0, "c", {3});
  d.logprobs = {lp(3, "c", -1.0f)};
  sse += f.delta(d);
  sse += f.delta(delta(0, "", {}, FinishKind::stop));
  EXPECT_EQ(f.usage({1, 1}), "");  // not asked for
  const auto ev = events(sse);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0]["object"], "text_completion");
  EXPECT_EQ(ev[0]["choices"][0]["text"], "ab");
  EXPECT_FALSE(ev[0].contains("usage"));
  EXPECT_EQ(ev[1]["choices"][0]["text"], "c");
  EXPECT_EQ(ev[1]["choices"][0]["logprobs"]["text_offset"], json::parse("[2]"));
  EXPECT_EQ(ev[2]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(ev[2]["choices"][0]["text"], "");
  const auto err = events(StreamFormatter::error(invalid_request("x", "bad")));
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0]["error"]["param"], "x");
}

TEST(OpenAIProtocol, TokenPiecesWithBrokenUtf8StillSerialize) {
  ResponseMeta m = meta(RequestKind::chat, 1);
  m.logprobs = true;
  StreamFormatter f(m, false);
  auto d = delta(0, "", {1});
  d.logprobs = {lp(1, std::string("\xE2\x82"), -0.1f)};  // first two bytes of "€"
  std::string out;
  ASSERT_NO_THROW(out = f.delta(d));
  const auto ev = events(out);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["choices"][0]["logprobs"]["content"][0]["bytes"], json::parse("[226, 130]"));
}

TEST(OpenAIProtocol, ModelsList) {
  const std::vector<ModelInfo> models = {{"base", "", "/m/base.gguf", 1}, {"a", "base", "/ad/a", 2}};
  const json j = models_response(models, 2048);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["data"][0]["id"], "base");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_TRUE(j["data"][0]["parent"].is_null());
  EXPECT_EQ(j["data"][1]["parent"], "base");
  EXPECT_EQ(j["data"][1]["root"], "/ad/a");
  EXPECT_EQ(j["data"][1]["max_model_len"], 2048);
}

}  // namespace
}  // namespace loom

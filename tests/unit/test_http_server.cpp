// HttpServer end to end over a real socket against a fake engine whose scheduler thread echoes the prompt
// one character per step: streaming, auth, 413, errors, disconnect cancels, concurrency, logs, metrics, stop.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <thread>

#include "serve/http_server.h"
#include "serve_socket_util.h"

namespace loom {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;
using test::connect_to, test::post_message, test::read_until_closed, test::send_all;

// A stand-in for the scheduler: one thread owns all requests and, every `step`, emits the next character of
// the prompt (completions) or of the last message (chat) for each choice. Token id = the byte.
class FakeEngine : public Engine {
 public:
  void set_step(std::chrono::milliseconds step) {
    std::lock_guard lock(mu_);
    step_ = step;
  }

  FakeEngine() {
    worker_ = std::thread([this] { run(); });
  }
  ~FakeEngine() override {
    {
      std::lock_guard lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  void submit(GenerationRequest r, std::shared_ptr<RequestStream> stream) override {
    std::lock_guard lock(mu_);
    if (r.model != "base" && !adapters_.count(r.model))
      throw EngineError(EngineErrc::model_not_found, "no model " + r.model, "model");
    Active a;
    a.text = r.kind == RequestKind::chat ? r.messages.back().content
             : r.prompt.is_tokens        ? std::string(r.prompt.tokens.begin(), r.prompt.tokens.end())
                                         : r.prompt.text;
    if (a.text == "too long")
      throw EngineError(EngineErrc::context_length_exceeded, "prompt too long", "prompt");
    a.req = std::move(r);
    a.stream = std::move(stream);
    a.pos.assign(static_cast<size_t>(a.req.n), 0);
    a.done.assign(static_cast<size_t>(a.req.n), false);
    models_seen_.push_back(a.req.model);
    active_.push_back(std::move(a));
    submitted_++;
    cv_.notify_all();
  }

  std::vector<ModelInfo> list_models() override {
    std::lock_guard lock(mu_);
    std::vector<ModelInfo> out = {{"base", "", "/models/base.gguf", 1700000000}};
    for (const auto& [name, path] : adapters_) out.push_back({name, "base", path, 1700000001});
    return out;
  }
  bool load_adapter(const std::string& name, const std::string& path, bool replace) override {
    std::lock_guard lock(mu_);
    const bool exists = adapters_.count(name) > 0;
    if ((exists && !replace) || name == "base")
      throw EngineError(EngineErrc::adapter_exists, "adapter '" + name + "' is already loaded", "lora_name");
    if (path.find("missing") != std::string::npos)
      throw EngineError(EngineErrc::adapter_load_failed, "cannot read " + path, "lora_path");
    adapters_[name] = path;
    return exists;
  }
  void unload_adapter(const std::string& name) override {
    std::lock_guard lock(mu_);
    if (!adapters_.erase(name))
      throw EngineError(EngineErrc::adapter_not_found, "no adapter '" + name + "'", "lora_name");
  }
  std::vector<int32_t> tokenize(const TokenizeRequest& r) override {
    const std::string& s = r.is_chat ? r.messages.back().content : r.prompt;
    std::vector<int32_t> ids;
    if (r.add_special_tokens) ids.push_back(1);
    for (unsigned char c : s) ids.push_back(c);
    return ids;
  }
  TokenizerInfo tokenizer_info() override {
    TokenizerInfo info;
    info.eos_token = "</s>";
    info.chat_template = "{{ messages }}";
    return info;
  }
  std::string detokenize(const std::string&, const std::vector<int32_t>& ids) override {
    std::string s;
    for (int32_t id : ids) {
      if (id > 255) throw EngineError(EngineErrc::invalid_request, "token id out of range", "tokens");
      s += static_cast<char>(id);
    }
    return s;
  }
  EngineHealth health() override { return {healthy.load(), healthy ? "" : "model gone"}; }
  EngineStats stats() override {
    std::lock_guard lock(mu_);
    return {static_cast<int64_t>(active_.size()), 2, 0.5, static_cast<int64_t>(adapters_.size())};
  }
  int64_t max_model_len() const override { return 512; }

  std::atomic<bool> healthy{true};
  int cancelled() {
    std::lock_guard lock(mu_);
    return cancelled_;
  }
  int submitted() {
    std::lock_guard lock(mu_);
    return submitted_;
  }
  int max_active() {
    std::lock_guard lock(mu_);
    return max_active_;
  }
  int64_t tokens_emitted() {
    std::lock_guard lock(mu_);
    return tokens_;
  }
  std::vector<std::string> models_seen() {
    std::lock_guard lock(mu_);
    return models_seen_;
  }

 private:
  struct Active {
    GenerationRequest req;
    std::shared_ptr<RequestStream> stream;
    std::string text;
    std::vector<size_t> pos;
    std::vector<bool> done;
    int64_t generated = 0;
  };

  void run() {
    std::unique_lock lock(mu_);
    while (!quit_) {
      const auto step = step_;
      cv_.wait_for(lock, step, [&] { return quit_ || !active_.empty(); });
      max_active_ = std::max(max_active_, static_cast<int>(active_.size()));
      for (auto it = active_.begin(); it != active_.end();) {
        it = advance(*it) ? active_.erase(it) : std::next(it);
      }
      lock.unlock();
      std::this_thread::sleep_for(step);
      lock.lock();
    }
  }

  // One step of one request; true when it ended.
  bool advance(Active& a) {
    const Usage usage{static_cast<int64_t>(a.text.size()), a.generated};
    if (a.stream->cancelled()) {
      cancelled_++;
      a.stream->push(GenerationEvent::make_done(usage));
      return true;
    }
    if (a.text == "fail midway" && a.generated >= 2) {
      a.stream->push(GenerationEvent::make_error(EngineError(EngineErrc::internal, "the engine broke")));
      return true;
    }
    bool all_done = true;
    for (size_t c = 0; c < a.pos.size(); ++c) {
      if (a.done[c]) continue;
      ChoiceDelta d;
      d.index = a.req.first_choice_index + static_cast<int32_t>(c);
      if (a.pos[c] < a.text.size()) {
        const unsigned char ch = static_cast<unsigned char>(a.text[a.pos[c]++]);
        d.text = std::string(1, static_cast<char>(ch));
        d.token_ids = {ch};
        if (a.req.logprobs) d.logprobs = {{ch, d.text, -0.5f, {}}};
        a.generated++;
        tokens_++;
      }
      const auto n_out = static_cast<int64_t>(a.pos[c]);
      if (a.pos[c] >= a.text.size())
        d.finish = FinishKind::stop;
      else if (a.req.max_tokens > 0 && n_out >= a.req.max_tokens)
        d.finish = FinishKind::length;
      if (d.finish) a.done[c] = true;
      all_done = all_done && a.done[c];
      a.stream->push(GenerationEvent::make_delta(std::move(d)));
    }
    if (!all_done) return false;
    a.stream->push(GenerationEvent::make_done({static_cast<int64_t>(a.text.size()), a.generated}));
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::chrono::milliseconds step_{2};
  bool quit_ = false;
  std::vector<Active> active_;
  std::map<std::string, std::string> adapters_;
  std::vector<std::string> models_seen_;
  int cancelled_ = 0, submitted_ = 0, max_active_ = 0;
  int64_t tokens_ = 0;
  std::thread worker_;
};

// Server + fake engine + a log file, torn down in order.
struct Fixture {
  FakeEngine engine;
  MetricsRegistry registry;
  ServeMetrics metrics{registry};
  FILE* log = std::tmpfile();
  std::unique_ptr<HttpServer> server;

  explicit Fixture(std::string api_key = "", size_t max_body = 1 << 20,
                   const std::function<void(HttpServerOptions&)>& adjust = {}) {
    HttpServerOptions o;
    o.port = 0;
    o.connections.keep_threads = 16;
    o.api_key = std::move(api_key);
    o.max_body_bytes = max_body;
    o.log = log;
    o.poll_interval = 5ms;
    if (adjust) adjust(o);
    server = std::make_unique<HttpServer>(engine, metrics, o);
    server->start();
  }
  ~Fixture() {
    server.reset();
    std::fclose(log);
  }
  httplib::Client client(const std::string& key = "") const {
    httplib::Client c("127.0.0.1", server->port());
    c.set_read_timeout(10, 0);
    if (!key.empty()) c.set_bearer_token_auth(key);
    return c;
  }
  std::vector<json> log_lines() {
    std::fflush(log);
    std::rewind(log);
    std::vector<json> out;
    char buf[4096];
    while (std::fgets(buf, sizeof buf, log)) out.push_back(json::parse(buf));
    std::fseek(log, 0, SEEK_END);
    return out;
  }
};

// The JSON payloads of an SSE body ("[DONE]" as a string).
std::vector<json> sse_events(const std::string& body) {
  std::vector<json> out;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    if (end == std::string::npos || body.compare(pos, 6, "data: ") != 0) {
      ADD_FAILURE() << "not SSE at " << pos << ": " << body.substr(pos);
      break;
    }
    const std::string payload = body.substr(pos + 6, end - pos - 6);
    out.push_back(payload == "[DONE]" ? json("[DONE]") : json::parse(payload));
    pos = end + 2;
  }
  return out;
}

// Concatenated content per choice of a chat or completion stream.
std::map<int, std::string> stream_text(const std::vector<json>& ev, bool chat) {
  std::map<int, std::string> out;
  for (const auto& e : ev) {
    if (!e.is_object() || !e.contains("choices")) continue;
    for (const auto& c : e["choices"]) {
      const int i = c["index"];
      if (chat)
        out[i] += c["delta"].value("content", "");
      else
        out[i] += c["text"].get<std::string>();
    }
  }
  return out;
}

httplib::Result post(httplib::Client& c, const std::string& path, const json& body) {
  return c.Post(path.c_str(), body.dump(), "application/json");
}

TEST(HttpServer, HealthModelsAndUnknownRoute) {
  Fixture f;
  auto c = f.client();
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["status"], "ok");
  EXPECT_FALSE(r->get_header_value("X-Request-Id").empty());
  f.engine.healthy = false;
  EXPECT_EQ(c.Get("/health")->status, 503);
  f.engine.healthy = true;

  r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  const json m = json::parse(r->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "base");
  EXPECT_EQ(m["data"][0]["max_model_len"], 512);
  EXPECT_EQ(json::parse(c.Get("/v1/models/base")->body)["id"], "base");
  EXPECT_EQ(c.Get("/v1/models/nope")->status, 404);

  r = c.Get("/v2/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "not_found");
}

TEST(HttpServer, ApiKeyGuardsEverythingButHealth) {
  const std::string key = "sk-test-123";
  Fixture f(key);
  auto anon = f.client();
  auto wrong = f.client("sk-test-124");
  auto good = f.client(key);
  EXPECT_EQ(anon.Get("/health")->status, 200);
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  for (auto* c : {&anon, &wrong}) {
    std::vector<httplib::Result> rs;
    rs.push_back(c->Get("/v1/models"));
    rs.push_back(c->Get("/metrics"));
    rs.push_back(post(*c, "/v1/chat/completions", chat));
    rs.push_back(post(*c, "/v1/completions", {{"prompt", "x"}}));
    rs.push_back(post(*c, "/tokenize", {{"prompt", "x"}}));
    rs.push_back(post(*c, "/v1/load_lora_adapter", {{"lora_name", "a"}, {"lora_path", "/a"}}));
    for (auto& r : rs) {
      ASSERT_TRUE(r);
      EXPECT_EQ(r->status, 401);
      const json e = json::parse(r->body)["error"];
      EXPECT_EQ(e["code"], "invalid_api_key");
      EXPECT_EQ(e["type"], "invalid_request_error");
    }
  }
  httplib::Headers basic = {{"Authorization", "Basic " + key}};
  EXPECT_EQ(anon.Get("/v1/models", basic)->status, 401);
  EXPECT_EQ(good.Get("/v1/models")->status, 200);
  EXPECT_EQ(post(good, "/v1/chat/completions", chat)->status, 200);
  EXPECT_EQ(f.engine.submitted(), 1);  // the rejected ones never reached the engine
}

TEST(HttpServer, NonStreamingCompletionAndChat) {
  Fixture f;
  auto c = f.client();
  auto r = post(c, "/v1/completions", {{"prompt", "abcdef"}, {"max_tokens", 4}, {"n", 2}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "application/json");
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("cmpl-"));
  EXPECT_EQ(j["model"], "base");
  ASSERT_EQ(j["choices"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], "abcd");
    EXPECT_EQ(j["choices"][i]["finish_reason"], "length");
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);
  EXPECT_EQ(j["usage"]["total_tokens"], 14);

  r = post(c, "/v1/chat/completions",
           {{"messages", {{{"role", "user"}, {"content", "héllo"}}}}, {"logprobs", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("chatcmpl-"));
  // The fake emits one byte per token, so "é" arrives split; the text joins back whole.
  EXPECT_EQ(j["choices"][0]["message"]["content"], "héllo");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["logprobs"]["content"].size(), 6u);

  // Several prompts fan out into one engine request each; choices are numbered prompt * n + i.
  r = post(c, "/v1/completions", {{"prompt", {"xy", {65, 66, 67}}}, {"n", 2}, {"echo", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 4u);
  EXPECT_EQ(j["choices"][0]["text"], "xyxy");
  EXPECT_EQ(j["choices"][1]["text"], "xyxy");
  EXPECT_EQ(j["choices"][2]["text"], "ABCABC");
  EXPECT_EQ(j["choices"][3]["text"], "ABCABC");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
}

TEST(HttpServer, StreamingChatSendsSseChunksIncrementally) {
  Fixture f;
  f.engine.set_step(5ms);
  auto c = f.client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = json{{"messages", {{{"role", "user"}, {"content", "stream me"}}}},
                  {"stream", true},
                  {"n", 2},
                  {"stream_options", {{"include_usage", true}}}}
                 .dump();
  std::string body;
  std::vector<std::chrono::steady_clock::time_point> arrivals;
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    body.append(d, n);
    arrivals.push_back(std::chrono::steady_clock::now());
    return true;
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto r = c.send(req);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  ASSERT_GE(arrivals.size(), 5u);
  // Chunks arrive while generation runs (9 steps of 5 ms), not all at the end.
  EXPECT_LT(arrivals.front() - t0, arrivals.back() - t0 - 20ms);

  const auto ev = sse_events(body);
  ASSERT_GE(ev.size(), 4u);
  EXPECT_EQ(ev.back(), "[DONE]");
  const json& usage = ev[ev.size() - 2];
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 18);
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(ev[0]["object"], "chat.completion.chunk");
  const auto text = stream_text(ev, true);
  EXPECT_EQ(text.at(0), "stream me");
  EXPECT_EQ(text.at(1), "stream me");
  std::map<int, std::string> finish;
  for (const auto& e : ev)
    if (e.is_object() && !e["choices"].empty() && !e["choices"][0]["finish_reason"].is_null())
      finish[e["choices"][0]["index"]] = e["choices"][0]["finish_reason"];
  EXPECT_EQ(finish, (std::map<int, std::string>{{0, "stop"}, {1, "stop"}}));
}

TEST(HttpServer, StreamingCompletionWithoutUsage) {
  Fixture f;
  auto c = f.client();
  auto r = post(c, "/v1/completions", {{"prompt", "0123456789"}, {"max_tokens", 3}, {"stream", true}});
  ASSERT_TRUE(r);
  const auto ev = sse_events(r->body);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back(), "[DONE]");
  EXPECT_EQ(stream_text(ev, false).at(0), "012");
  for (const auto& e : ev) {
    if (!e.is_object()) continue;
    EXPECT_EQ(e["object"], "text_completion");
    EXPECT_FALSE(e.contains("usage"));
  }
  EXPECT_EQ(ev[ev.size() - 2]["choices"][0]["finish_reason"], "length");
}

TEST(HttpServer, BadRequestsGetOpenAIErrors) {
  Fixture f("", /*max_body=*/4096);
  auto c = f.client();
  struct Case {
    std::string path, body;
    int status;
    std::string param, code;
  };
  const std::vector<Case> cases = {
      {"/v1/chat/completions", "{not json", 400, "", ""},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "temperature": 3})", 400,
       "temperature", ""},
      {"/v1/completions", R"({"prompt": "x", "n": 0})", 400, "n", ""},
      {"/v1/completions", R"({"prompt": "x", "model": "gpt-9"})", 404, "model", "model_not_found"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 513})", 400, "max_tokens",
       ""},  // over max_model_len
      {"/v1/completions", R"({"prompt": "too long"})", 400, "prompt", "context_length_exceeded"},
      {"/detokenize", R"({"tokens": [300]})", 400, "tokens", "invalid_request"},
      {"/v1/completions", std::string(R"({"prompt": ")") + std::string(5000, 'a') + R"("})", 413, "",
       "request_too_large"},
  };
  for (const auto& k : cases) {
    auto r = c.Post(k.path.c_str(), k.body, "application/json");
    ASSERT_TRUE(r) << k.body.substr(0, 80);
    EXPECT_EQ(r->status, k.status) << k.body.substr(0, 80) << " -> " << r->body;
    const json e = json::parse(r->body)["error"];
    EXPECT_EQ(e["param"], k.param.empty() ? json(nullptr) : json(k.param)) << r->body;
    if (!k.code.empty()) {
      EXPECT_EQ(e["code"], k.code) << r->body;
    }
    EXPECT_FALSE(e["message"].get<std::string>().empty());
  }
  // The server keeps serving after a 413.
  EXPECT_EQ(post(c, "/v1/completions", {{"prompt", "ok"}})->status, 200);
}

TEST(HttpServer, EngineFailureMidwayEndsTheResponse) {
  Fixture f;
  auto c = f.client();
  auto r = post(c, "/v1/completions", {{"prompt", "fail midway"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 500);
  EXPECT_EQ(json::parse(r->body)["error"]["message"], "the engine broke");

  r = post(c, "/v1/completions", {{"prompt", "fail midway"}, {"stream", true}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);  // headers went out before the failure
  const auto ev = sse_events(r->body);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(ev.back(), "[DONE]");
  EXPECT_EQ(ev[ev.size() - 2]["error"]["type"], "server_error");
  EXPECT_EQ(stream_text(ev, false).at(0), "fa");
}

// Opens a raw connection, sends `body` as a streaming POST, reads until `want` bytes of SSE arrived, then
// closes the socket abruptly.
void stream_then_hang_up(int port, const std::string& body, size_t want) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string msg =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, msg.data(), msg.size(), 0), static_cast<ssize_t>(msg.size()));
  std::string got;
  char buf[1024];
  while (got.find("data: ") == std::string::npos || got.size() < want) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    got.append(buf, static_cast<size_t>(n));
  }
  EXPECT_NE(got.find("200 OK"), std::string::npos);
  linger lg{1, 0};  // reset, like a killed client
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  ::close(fd);
}

TEST(HttpServer, ClientDisconnectMidStreamCancelsTheEngineRequest) {
  Fixture f;
  f.engine.set_step(10ms);
  const std::string prompt(400, 'z');  // 400 steps: 4 s if never cancelled
  stream_then_hang_up(f.server->port(),
                      json{{"prompt", prompt}, {"max_tokens", 400}, {"stream", true}}.dump(), 300);
  const auto t0 = std::chrono::steady_clock::now();
  while (f.engine.cancelled() == 0 && std::chrono::steady_clock::now() - t0 < 3s)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(f.engine.cancelled(), 1);
  EXPECT_LT(f.engine.tokens_emitted(), 200);
  // The server is fine afterwards, and the log says the client left.
  auto c = f.client();
  EXPECT_EQ(post(c, "/v1/completions", {{"prompt", "ok"}})->status, 200);
  bool found = false;
  for (const auto& l : f.log_lines()) found = found || l.value("disconnected", false);
  EXPECT_TRUE(found);
  EXPECT_NE(f.registry.render().find("loom_requests_finished_total{finished_reason=\"abort\"} 1\n"),
            std::string::npos);
}

// A non-streaming request writes nothing until it ends, so only the socket tells that the client left: the
// engine request must be cancelled within a few scheduler steps, not run to max_tokens.
TEST(HttpServer, ClientDisconnectDuringNonStreamingRequestCancelsIt) {
  Fixture f;
  f.engine.set_step(10ms);
  const int fd = connect_to(f.server->port());
  ASSERT_GE(fd, 0);
  const std::string prompt(400, 'z');  // 400 steps: 4 s if never cancelled
  ASSERT_TRUE(send_all(fd, post_message("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 400}}.dump())));
  while (f.engine.submitted() == 0) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(f.engine.stats().requests_running, 1);
  ::close(fd);  // an orderly close (FIN), as a client that gives up does
  const auto t0 = std::chrono::steady_clock::now();
  while (f.engine.stats().requests_running > 0 && std::chrono::steady_clock::now() - t0 < 2s)
    std::this_thread::sleep_for(5ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 500ms);
  EXPECT_EQ(f.engine.stats().requests_running, 0);
  EXPECT_EQ(f.engine.cancelled(), 1);
  EXPECT_LT(f.engine.tokens_emitted(), 100);
  bool found = false;
  for (int i = 0; i < 100 && !found; ++i) {
    for (const auto& l : f.log_lines()) found = found || l.value("disconnected", false);
    if (!found) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(found);
  auto c = f.client();
  EXPECT_EQ(post(c, "/v1/completions", {{"prompt", "ok"}})->status, 200);
}

// 200 clients that trickle their headers, one line every 200 ms (bounded: they stop after 3 s), hold their
// connections open; a normal request is still answered at once.
TEST(HttpServer, SlowClientsDoNotStarveOthers) {
  Fixture f;
  constexpr int kSlow = 200;
  std::vector<int> fds;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = connect_to(f.server->port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(send_all(fd, "POST /v1/completions HTTP/1.1\r\n"));
    fds.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const auto until = std::chrono::steady_clock::now() + 3s;
    for (int line = 0; !stop && std::chrono::steady_clock::now() < until; ++line) {
      for (int fd : fds) send_all(fd, "X-Slow-" + std::to_string(line) + ": 1\r\n");
      std::this_thread::sleep_for(200ms);
    }
  });
  std::this_thread::sleep_for(300ms);  // every slow connection has been accepted and is mid-headers
  for (int i = 0; i < 3; ++i) {
    auto c = f.client();
    c.set_read_timeout(5, 0);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = c.Get("/health");
    const auto dt = std::chrono::steady_clock::now() - t0;
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_LT(dt, 1s) << "request " << i;
    auto p = post(c, "/v1/completions", {{"prompt", "ok"}});
    ASSERT_TRUE(p);
    EXPECT_EQ(p->status, 200);
  }
  stop = true;
  trickle.join();
  for (int fd : fds) ::close(fd);
}

// Headers or a body that do not arrive in time get 408 and the connection is closed; a connection that
// sends nothing is closed silently after the header timeout.
TEST(HttpServer, HeaderAndBodyTimeouts) {
  Fixture f("", 1 << 20, [](HttpServerOptions& o) {
    o.connections.header_timeout = 300ms;
    o.connections.body_timeout = 300ms;
  });
  const auto t0 = std::chrono::steady_clock::now();
  const int slow_headers = connect_to(f.server->port());
  const int slow_body = connect_to(f.server->port());
  const int silent = connect_to(f.server->port());
  ASSERT_GE(slow_headers, 0);
  ASSERT_GE(slow_body, 0);
  ASSERT_GE(silent, 0);
  ASSERT_TRUE(send_all(slow_headers, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"));
  ASSERT_TRUE(send_all(slow_body, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  "Content-Length: 100\r\n\r\n{\"prompt\": "));
  const std::string a = read_until_closed(slow_headers, 3s);
  const std::string b = read_until_closed(slow_body, 3s);
  const std::string c = read_until_closed(silent, 3s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_NE(a.find("HTTP/1.1 408"), std::string::npos) << a;
  EXPECT_NE(a.find("request_timeout"), std::string::npos) << a;
  EXPECT_NE(b.find("HTTP/1.1 408"), std::string::npos) << b;
  EXPECT_EQ(c, "");
  for (int fd : {slow_headers, slow_body, silent}) ::close(fd);
  EXPECT_EQ(f.engine.submitted(), 0);
  // A request sent promptly on a fresh connection is unaffected.
  auto cl = f.client();
  EXPECT_EQ(post(cl, "/v1/completions", {{"prompt", "ok"}})->status, 200);
}

// HTTP-level bad input is answered at once with an error object: a Content-Length that is no count (400) or
// over the body limit (413) before any body is read (httplib would wait out the body timeout reading the
// declared bytes), then the connection closes, so the unread body is never parsed as a request; request
// lines and headers past the limit get 431 (a long URI used to get no answer at all); a known path with
// the wrong method gets 405 and Allow.
TEST(HttpServer, HttpLevelBadInputIsAnsweredAtOnce) {
  Fixture f("", 1 << 20, [](HttpServerOptions& o) { o.connections.body_timeout = 10s; });
  const auto ask = [&](const std::string& request) {
    const int fd = connect_to(f.server->port());
    EXPECT_GE(fd, 0);
    EXPECT_TRUE(send_all(fd, request));
    const auto t0 = std::chrono::steady_clock::now();
    std::string got = read_until_closed(fd, 5s);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s) << request.substr(0, 80);
    ::close(fd);
    return got;
  };
  std::string got = ask(
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\nGET /health HTTP/1.1\r\n\r\n");
  EXPECT_EQ(got.rfind("HTTP/1.1 400", 0), 0u) << got;
  EXPECT_NE(got.find("Content-Length '-5' is not a byte count"), std::string::npos) << got;
  EXPECT_EQ(got.find("HTTP/1.1", 1), std::string::npos) << "the body was read as a request: " << got;
  got = ask("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n{");
  EXPECT_EQ(got.rfind("HTTP/1.1 413", 0), 0u) << got;
  EXPECT_NE(got.find("request_too_large"), std::string::npos) << got;
  got = ask("GET /" + std::string(100000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(got.rfind("HTTP/1.1 431", 0), 0u) << got.substr(0, 200);
  got = ask("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(70000, 'a') + "\r\n\r\n");
  EXPECT_EQ(got.rfind("HTTP/1.1 431", 0), 0u) << got.substr(0, 200);
  got = ask("GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(got.rfind("HTTP/1.1 405", 0), 0u) << got;
  EXPECT_NE(got.find("Allow: POST"), std::string::npos) << got;
  EXPECT_EQ(f.engine.submitted(), 0);
  auto c = f.client();
  EXPECT_EQ(post(c, "/v1/completions", {{"prompt", "ok"}})->status, 200);
}

// Over --max-connections a new connection gets 503 with an OpenAI error object; once others close, new ones
// are served again.
TEST(HttpServer, ConnectionCapRefusesWith503) {
  Fixture f("", 1 << 20, [](HttpServerOptions& o) { o.connections.max_connections = 4; });
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(connect_to(f.server->port()));
    ASSERT_GE(idle.back(), 0);
  }
  std::this_thread::sleep_for(100ms);  // accepted: each holds its slot
  const int extra = connect_to(f.server->port());
  ASSERT_GE(extra, 0);
  ASSERT_TRUE(send_all(extra, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  const std::string got = read_until_closed(extra, 3s);
  ::close(extra);
  EXPECT_NE(got.find("HTTP/1.1 503"), std::string::npos) << got;
  EXPECT_NE(got.find("too_many_connections"), std::string::npos) << got;
  for (int fd : idle) ::close(fd);
  std::this_thread::sleep_for(300ms);  // the server sees the closes
  auto c = f.client();
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(f.registry.render().find("loom_http_requests_total{code=\"503\"} 1\n"), std::string::npos);
}

// The connection pool starts a thread per waiting task up to its limit (then tasks queue), lets threads
// beyond `keep` stop when idle, and survives a task that throws.
TEST(ConnectionPool, GrowsOnDemandUpToItsLimitAndShrinksWhenIdle) {
  ConnectionPool pool(1, 4, 100ms);
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int running = 0, peak = 0, done = 0;
  for (int i = 0; i < 6; ++i)
    pool.enqueue([&] {
      std::unique_lock lock(mu);
      peak = std::max(peak, ++running);
      cv.notify_all();
      cv.wait(lock, [&] { return open; });
      --running;
      ++done;
      cv.notify_all();
    });
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 5s, [&] { return running == 4; }));
  }
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(pool.threads(), 4u);
  {
    std::unique_lock lock(mu);
    EXPECT_EQ(running, 4) << "two tasks wait for a thread";
    open = true;
    cv.notify_all();
    ASSERT_TRUE(cv.wait_for(lock, 5s, [&] { return done == 6; }));
  }
  EXPECT_EQ(peak, 4);
  for (int i = 0; i < 100 && pool.threads() > 1; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(pool.threads(), 1u) << "idle threads beyond keep stop";
  pool.enqueue([] { throw std::runtime_error("a failing connection"); });
  std::atomic<bool> ran{false};
  pool.enqueue([&] { ran = true; });
  for (int i = 0; i < 500 && !ran; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(ran);
  pool.shutdown();
  EXPECT_EQ(pool.threads(), 0u);
}

TEST(HttpServer, ConcurrentRequestsAreServedTogether) {
  Fixture f;
  f.engine.set_step(3ms);
  constexpr int kClients = 12;
  std::vector<std::thread> ts;
  std::vector<std::string> got(kClients);
  for (int i = 0; i < kClients; ++i) {
    ts.emplace_back([&, i] {
      auto c = f.client();
      const std::string prompt = "request-" + std::to_string(i) + std::string(static_cast<size_t>(i), '.');
      const bool stream = i % 2 == 0;
      auto r =
          post(c, i % 3 ? "/v1/completions" : "/v1/chat/completions",
               i % 3 ? json{{"prompt", prompt}, {"stream", stream}, {"max_tokens", 100}}
                     : json{{"messages", {{{"role", "user"}, {"content", prompt}}}}, {"stream", stream}});
      if (!r || r->status != 200) return;
      if (stream)
        got[i] = stream_text(sse_events(r->body), i % 3 == 0)[0];
      else if (i % 3)
        got[i] = json::parse(r->body)["choices"][0]["text"];
      else
        got[i] = json::parse(r->body)["choices"][0]["message"]["content"];
    });
  }
  for (auto& t : ts) t.join();
  for (int i = 0; i < kClients; ++i)
    EXPECT_EQ(got[i], "request-" + std::to_string(i) + std::string(static_cast<size_t>(i), '.')) << i;
  EXPECT_GE(f.engine.max_active(), 4);  // requests overlapped in the engine
  EXPECT_EQ(f.engine.submitted(), kClients);
}

// httplib listens with a backlog of 5; a burst of connections beyond it would wait out a 1 s SYN retransmit.
TEST(HttpServer, ConnectionBurstIsAcceptedPromptly) {
  Fixture f;
  constexpr int kClients = 48;
  std::vector<std::thread> ts;
  std::vector<double> ms(kClients, 1e9);
  for (int i = 0; i < kClients; ++i) {
    ts.emplace_back([&, i] {
      auto c = f.client();
      const auto t0 = std::chrono::steady_clock::now();
      auto r = c.Get("/health");
      if (r && r->status == 200)
        ms[i] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : ts) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_LT(ms[i], 900.0) << "client " << i;
}

TEST(HttpServer, TokenizeDetokenizeAndAdapters) {
  Fixture f;
  auto c = f.client();
  auto r = post(c, "/tokenize", {{"prompt", "AB"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body),
            json::parse(R"({"tokens": [1, 65, 66], "count": 3, "max_model_len": 512})"));
  r = post(c, "/v1/detokenize", {{"tokens", {72, 105}}});
  EXPECT_EQ(json::parse(r->body)["prompt"], "Hi");
  // vLLM's /tokenizer_info (lm-evaluation-harness's remote tokenizer checks for eos_token in it).
  for (const char* path : {"/tokenizer_info", "/v1/tokenizer_info"}) {
    auto info = c.Get(path);
    ASSERT_TRUE(info) << path;
    EXPECT_EQ(info->status, 200) << path;
    EXPECT_EQ(json::parse(info->body), json::parse(R"({"tokenizer_class": "loom", "bos_token": null,
        "eos_token": "</s>", "pad_token": null, "add_bos_token": false, "chat_template": "{{ messages }}",
        "model_max_length": 512})"))
        << path;
  }

  r = post(c, "/v1/load_lora_adapter", {{"lora_name", "sql"}, {"lora_path", "/adapters/sql"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("sql"), std::string::npos);
  r = post(c, "/v1/load_lora_adapter", {{"lora_name", "sql"}, {"lora_path", "/adapters/sql"}});
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "adapter_exists");
  r = post(c, "/v1/load_lora_adapter", {{"lora_name", "sql"}, {"lora_path", "/adapters/sql2"}, {"load_inplace", true}});
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("replaced"), std::string::npos) << r->body;
  r = post(c, "/v1/load_lora_adapter", {{"lora_name", "sql"}, {"lora_path", "/adapters/sql"}, {"load_inplace", "yes"}});
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["param"], "load_inplace");
  r = post(c, "/v1/load_lora_adapter", {{"lora_name", "x"}, {"lora_path", "/missing"}});
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["param"], "lora_path");
  r = post(c, "/v1/load_lora_adapter", {{"lora_name", "x"}});
  EXPECT_EQ(r->status, 400);

  const json models = json::parse(c.Get("/v1/models")->body);
  ASSERT_EQ(models["data"].size(), 2u);
  EXPECT_EQ(models["data"][1]["id"], "sql");
  EXPECT_EQ(models["data"][1]["root"], "/adapters/sql2");  // the replacement's folder
  EXPECT_EQ(models["data"][1]["parent"], "base");
  r = post(c, "/v1/completions", {{"model", "sql"}, {"prompt", "q"}});
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["model"], "sql");
  EXPECT_EQ(f.engine.models_seen().back(), "sql");

  EXPECT_EQ(post(c, "/v1/unload_lora_adapter", {{"lora_name", "sql"}})->status, 200);
  r = post(c, "/v1/unload_lora_adapter", {{"lora_name", "sql"}});
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "adapter_not_found");
  EXPECT_EQ(post(c, "/v1/completions", {{"model", "sql"}, {"prompt", "q"}})->status, 404);
}

TEST(HttpServer, MetricsAndLogLines) {
  Fixture f;
  auto c = f.client();
  ASSERT_EQ(post(c, "/v1/completions", {{"prompt", "hello"}})->status, 200);
  ASSERT_EQ(post(c, "/v1/completions", {{"prompt", "hey"}, {"stream", true}})->status, 200);
  ASSERT_EQ(post(c, "/v1/completions", {{"prompt", "x"}, {"top_p", 0}})->status, 400);
  // A request is logged (and counted by status) right after its last byte is written, so the client can be a
  // moment ahead: wait for those three before scraping.
  auto wait_lines = [&](size_t n) {
    std::vector<json> lines;
    for (int i = 0; i < 400 && lines.size() < n; ++i) {
      std::this_thread::sleep_for(5ms);
      lines = f.log_lines();
    }
    return lines;
  };
  ASSERT_EQ(wait_lines(3).size(), 3u);
  auto r = c.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type"), kPrometheusContentType);
  const std::string& m = r->body;
  EXPECT_NE(m.find("loom_generation_tokens_total 8\n"), std::string::npos) << m;
  EXPECT_NE(m.find("loom_prompt_tokens_total 8\n"), std::string::npos);
  EXPECT_NE(m.find("loom_requests_finished_total{finished_reason=\"stop\"} 2\n"), std::string::npos);
  EXPECT_NE(m.find("loom_time_to_first_token_seconds_count 2\n"), std::string::npos);
  EXPECT_NE(m.find("loom_inter_token_latency_seconds_count 6\n"), std::string::npos);
  EXPECT_NE(m.find("loom_e2e_request_latency_seconds_count 2\n"), std::string::npos);
  EXPECT_NE(m.find("loom_http_requests_total{code=\"200\"} 2\n"), std::string::npos);
  EXPECT_NE(m.find("loom_http_requests_total{code=\"400\"} 1\n"), std::string::npos);
  EXPECT_NE(m.find("loom_requests_waiting 2\n"), std::string::npos);  // engine stats at scrape time
  EXPECT_NE(m.find("loom_kv_cache_usage_ratio 0.5\n"), std::string::npos);

  const auto lines = wait_lines(4);
  ASSERT_EQ(lines.size(), 4u);
  std::set<std::string> ids;
  for (const auto& l : lines) {
    EXPECT_TRUE(l["time"].is_string());
    EXPECT_TRUE(l["latency_ms"].is_number());
    ids.insert(l["request_id"].get<std::string>());
  }
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_EQ(lines[0]["method"], "POST");
  EXPECT_EQ(lines[0]["path"], "/v1/completions");
  EXPECT_EQ(lines[0]["status"], 200);
  EXPECT_EQ(lines[0]["model"], "base");
  EXPECT_EQ(lines[0]["prompt_tokens"], 5);
  EXPECT_EQ(lines[0]["completion_tokens"], 5);
  // The streamed request is logged after its last chunk is written, so the next
  // request's line may come first: lines 1 and 2 are found by what they hold.
  const auto streamed =
      std::find_if(lines.begin() + 1, lines.begin() + 3, [](const json& l) { return l["status"] == 200; });
  const auto refused =
      std::find_if(lines.begin() + 1, lines.begin() + 3, [](const json& l) { return l["status"] == 400; });
  ASSERT_NE(streamed, lines.begin() + 3);
  ASSERT_NE(refused, lines.begin() + 3);
  EXPECT_EQ((*streamed)["completion_tokens"], 3);
  EXPECT_NE((*refused)["error"].get<std::string>().find("top_p"), std::string::npos);
  EXPECT_EQ(lines[3]["path"], "/metrics");
}

TEST(HttpServer, GracefulStopLetsStreamsFinish) {
  Fixture f;
  f.engine.set_step(5ms);
  std::string body;
  std::thread client([&] {
    auto c = f.client();
    auto r =
        post(c, "/v1/completions", {{"prompt", std::string(40, 'g')}, {"max_tokens", 40}, {"stream", true}});
    if (r) body = r->body;
  });
  while (f.engine.submitted() == 0) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);
  f.server->stop(5s);
  client.join();
  const auto ev = sse_events(body);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back(), "[DONE]");
  EXPECT_EQ(stream_text(ev, false).at(0), std::string(40, 'g'));  // ran to the end inside the grace period
  EXPECT_EQ(f.engine.cancelled(), 0);
  f.server->wait();  // returns at once: stopped
  auto c = f.client();
  EXPECT_FALSE(c.Get("/health"));  // no longer listening
}

TEST(HttpServer, StopPastTheDeadlineAbortsStreams) {
  Fixture f;
  f.engine.set_step(10ms);
  std::string body;
  std::thread client([&] {
    auto c = f.client();
    auto r = post(c, "/v1/completions",
                  {{"prompt", std::string(300, 'g')}, {"max_tokens", 300}, {"stream", true}});
    if (r) body = r->body;
  });
  while (f.engine.submitted() == 0) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(30ms);
  // A new request while draining is refused.
  std::thread late([&] {
    std::this_thread::sleep_for(10ms);
    auto c = f.client();
    auto r = c.Get("/v1/models");
    if (r) {
      EXPECT_EQ(r->status, 503);
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  f.server->stop(100ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  client.join();
  late.join();
  const auto ev = sse_events(body);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(ev.back(), "[DONE]");
  EXPECT_EQ(ev[ev.size() - 2]["choices"][0]["finish_reason"], "abort");
  EXPECT_LT(stream_text(ev, false).at(0).size(), 300u);
  EXPECT_EQ(f.engine.cancelled(), 1);
}

}  // namespace
}  // namespace loom

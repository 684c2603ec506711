// `loom serve`'s engine and HTTP server together (tiny llama, real sockets) under faults: a failure inside
// the scheduler reaches the client as an OpenAI error object (a 500 answer, or an SSE error event) and
// the server keeps serving; a client that leaves a non-streaming request frees its sequence and KV blocks
// within a few scheduler steps.
#include <gtest/gtest.h>
#include <httplib.h>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "serve/http_server.h"
#include "serve/scheduler.h"
#include "serve_socket_util.h"

namespace loom {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

const std::string kModel = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/model/tiny-llama.f32.gguf";

// max_tokens values the fault hook reacts to.
constexpr int64_t kFailForward = 13;  // the forward step throws
constexpr int64_t kFailLater = 17;    // sampling throws at the 6th token
constexpr int64_t kSlow = 200;        // each token takes 10 ms (the tiny model is otherwise too fast to watch)

struct Server {
  std::atomic<int> sampled_later{0};
  std::unique_ptr<ServingEngine> engine;
  MetricsRegistry registry;
  ServeMetrics metrics{registry};
  std::unique_ptr<HttpServer> http;

  Server() {
    ServeOptions o;
    o.model_path = kModel;
    o.model_name = "tiny";
    o.threads = 2;
    o.fault_hook = [this](FaultPoint p, const GenerationRequest& g) {
      if (p == FaultPoint::forward && g.max_tokens == kFailForward)
        throw std::runtime_error("injected kernel failure");
      if (p == FaultPoint::sample && g.max_tokens == kFailLater && ++sampled_later == 6)
        throw std::runtime_error("injected detokenizer failure");
      if (p == FaultPoint::sample && g.max_tokens == kSlow) std::this_thread::sleep_for(10ms);
    };
    engine = std::make_unique<ServingEngine>(o);
    HttpServerOptions h;
    h.port = 0;
    h.poll_interval = 5ms;
    http = std::make_unique<HttpServer>(*engine, metrics, h);
    http->start();
  }
  ~Server() {
    http.reset();
    engine.reset();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", http->port());
    c.set_read_timeout(30, 0);
    return c;
  }
};

json completion(int64_t max_tokens, bool stream) {
  return {{"prompt", {5, 6, 7, 8, 9}}, {"max_tokens", max_tokens}, {"ignore_eos", true}, {"stream", stream},
          {"temperature", 0}};
}

httplib::Result post(httplib::Client& c, const json& body) {
  return c.Post("/v1/completions", body.dump(), "application/json");
}

TEST(ServeFaults, FailureInTheSchedulerIsAnOpenAIErrorAndTheServerLivesOn) {
  Server s;
  auto c = s.client();
  auto r = post(c, completion(kFailForward, false));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 500);
  const json e = json::parse(r->body)["error"];
  EXPECT_EQ(e["type"], "server_error");
  EXPECT_NE(e["message"].get<std::string>().find("injected kernel failure"), std::string::npos) << r->body;

  r = post(c, completion(kFailForward, true));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);  // SSE: the headers go out before the first step
  EXPECT_NE(r->body.find("injected kernel failure"), std::string::npos) << r->body;
  EXPECT_NE(r->body.find("\"server_error\""), std::string::npos) << r->body;
  EXPECT_NE(r->body.find("data: [DONE]"), std::string::npos) << r->body;

  // A failure after some tokens streamed: those arrive, then the error event.
  r = post(c, completion(kFailLater, true));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("injected detokenizer failure"), std::string::npos) << r->body;
  EXPECT_NE(r->body.find("\"text\""), std::string::npos) << "tokens before the failure: " << r->body;

  // Subsequent requests succeed, and nothing was left allocated.
  for (bool stream : {false, true}) {
    r = post(c, completion(8, stream));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
  }
  EXPECT_EQ(json::parse(post(c, completion(8, false))->body)["usage"]["completion_tokens"], 8);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(s.engine->stats().requests_running, 0);
  EXPECT_EQ(s.engine->stats().kv_cache_usage, 0.0);
}

// The client sends a non-streaming request that would take 2 s (200 tokens, ignore_eos) and closes its
// socket: the sequence leaves the engine and its KV blocks are freed within a short, bounded time.
TEST(ServeFaults, ClientGoneDuringNonStreamingRequestFreesTheEngine) {
  Server s;
  const int fd = test::connect_to(s.http->port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(test::send_all(fd, test::post_message("/v1/completions", completion(kSlow, false).dump())));
  const auto t_sent = std::chrono::steady_clock::now();
  while (s.engine->stats().requests_running == 0 && std::chrono::steady_clock::now() - t_sent < 5s)
    std::this_thread::sleep_for(2ms);
  ASSERT_EQ(s.engine->stats().requests_running, 1);
  std::this_thread::sleep_for(100ms);
  EXPECT_GT(s.engine->stats().kv_cache_usage, 0.0);
  ::close(fd);
  const auto t0 = std::chrono::steady_clock::now();
  while ((s.engine->stats().requests_running > 0 || s.engine->stats().kv_cache_usage > 0) &&
         std::chrono::steady_clock::now() - t0 < 3s)
    std::this_thread::sleep_for(2ms);
  const auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(s.engine->stats().requests_running, 0);
  EXPECT_EQ(s.engine->stats().kv_cache_usage, 0.0);
  EXPECT_LT(dt, 300ms) << "cancelled within a few scheduler steps";
  // The server serves the next client as usual.
  auto c = s.client();
  auto r = post(c, completion(4, false));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

}  // namespace
}  // namespace loom

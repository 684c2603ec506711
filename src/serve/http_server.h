// The OpenAI-compatible HTTP front end of `loom serve` (cpp-httplib): routes, API key, body limit, SSE
// streaming, cancellation when a client disconnects (streamed or not), request deadlines and a connection
// cap, /metrics, one JSON log line per request, graceful stop.
// HTTP threads only parse, talk to the Engine through its queues, and format.
#pragma once

#include <chrono>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "core/trace.h"
#include "serve/engine_api.h"
#include "serve/http_connection.h"
#include "serve/metrics.h"
#include "serve/openai_protocol.h"

namespace loom {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port; HttpServer::port() says which
  // Each connection has a thread for its whole life (idle keep-alive time included); threads start on
  // demand up to connections.max_connections. Header and body deadlines keep slow clients from holding
  // them (http_connection.h).
  ConnectionLimits connections;
  std::string api_key;  // non-empty: every endpoint but /health needs "Authorization: Bearer <key>"
  size_t max_body_bytes = 16u << 20;  // larger bodies get 413
  // Request limits; max_model_len is taken from the engine.
  ProtocolLimits limits;
  // One JSON object per line per request (time, request_id, method, path, status, latency_ms, model,
  // tokens). Not owned; nullptr: no log.
  FILE* log = nullptr;
  // How often a handler waiting for engine events checks for a client disconnect or a stop deadline.
  std::chrono::milliseconds poll_interval{20};
  // Idle keep-alive connections close after this; stop() can wait this long for one to notice.
  int keep_alive_timeout_s = 5;
  // POST /profile/start and /profile/stop (guarded by api_key like the API):
  // the tracer the engine records into, and otherData.loom for the trace the
  // stop returns (docs/profiling.md). Null tracer: the endpoints answer 404.
  Tracer* tracer = nullptr;
  std::function<std::string()> profile_metadata;
};

class HttpServer {
 public:
  // `engine` and `metrics` must outlive the server.
  HttpServer(Engine& engine, ServeMetrics& metrics, HttpServerOptions options);
  ~HttpServer();  // stop(0) if still running
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port (throws io naming them when it cannot) and serves on a background thread.
  void start();
  int port() const;  // the bound port, after start()

  // Graceful stop: from now on new requests get 503; in-flight requests get `grace` to finish, after which
  // their engine requests are cancelled (streams end with finish_reason "abort"). Returns when the listener
  // and every HTTP thread have finished. Safe to call more than once and from any thread.
  void stop(std::chrono::milliseconds grace);
  // Blocks until the server has stopped (another thread called stop()).
  void wait();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom

// HttpServer: cpp-httplib routes for the OpenAI / vLLM endpoints, SSE streaming, auth, logging, metrics.
#include "serve/http_server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <ctime>
#include <mutex>
#include <random>
#include <regex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "core/error.h"

namespace loom {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// What the log line of one HTTP request reports; filled by the handler (and the stream, for SSE).
struct RequestRecord {
  std::string id;
  Clock::time_point start = Clock::now();
  std::string model;
  int64_t prompt_tokens = -1;
  int64_t completion_tokens = -1;
  std::string error;
  bool disconnected = false;
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// "2024-05-01T12:00:00.123Z"
std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, ms);
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Compares without an early exit, so response time does not reveal how much of a guessed key matched.
bool same_secret(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() != b.size();
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

void reply_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void reply_error(httplib::Response& res, const ApiError& e, RequestRecord* rec) {
  if (rec) rec->error = e.what();
  reply_json(res, e.status(), error_json(e));
}

// State of one generation request while its events come in; shared by the handler and the stream provider.
struct GenerationState {
  std::shared_ptr<RequestStream> stream = std::make_shared<RequestStream>();
  std::shared_ptr<RequestRecord> rec;
  std::shared_ptr<void> in_flight;  // keeps the server's in-flight count until the response is written
  int32_t parts = 0;                // submitted GenerationRequests; each ends with done or error
  int32_t parts_ended = 0;
  Usage usage;
  bool first_token = false;
  std::vector<std::optional<Clock::time_point>> last_delta;  // per choice, for inter-token latency
  std::vector<bool> finished;                                // per choice
  std::optional<Clock::time_point> cancelled_at;
  std::optional<ApiError> error;

  bool ended() const { return parts_ended >= parts || error.has_value(); }
  void cancel() {
    if (!cancelled_at) cancelled_at = Clock::now();
    stream->cancel();
  }
};

}  // namespace

struct HttpServer::Impl {
  Engine& engine;
  ServeMetrics& metrics;
  HttpServerOptions opt;
  ConnectionServer svr;
  std::thread listener;
  std::atomic<bool> listen_done{false};
  int bound_port = -1;

  std::atomic<bool> draining{false};  // new requests get 503
  std::atomic<bool> aborting{false};  // in-flight generations are cancelled

  std::mutex state_mu;
  std::condition_variable state_cv;
  int64_t in_flight = 0;
  bool started = false, stopped = false;
  std::mutex stop_mu;  // one stop() at a time

  std::mutex records_mu;
  std::unordered_map<const httplib::Request*, std::shared_ptr<RequestRecord>> records;
  std::vector<std::pair<std::string, std::regex>> routes;  // (method, pattern): 405 for a known path
  std::mutex log_mu;

  uint32_t id_nonce = 0;
  std::atomic<uint64_t> id_counter{0};

  Impl(Engine& e, ServeMetrics& m, HttpServerOptions o)
      : engine(e), metrics(m), opt(std::move(o)), svr(opt.connections) {
    opt.limits.max_model_len = engine.max_model_len();
    id_nonce = std::random_device{}();
  }

  std::string new_request_id() { return fmt::format("{:08x}{:08x}", id_nonce, ++id_counter); }

  // ---- bookkeeping
  // -------------------------------------------------------------------------------------------
  std::shared_ptr<RequestRecord> record_of(const httplib::Request& req) {
    std::lock_guard lock(records_mu);
    auto& r = records[&req];
    if (!r) {  // requests httplib answered before routing (malformed) have no record yet
      r = std::make_shared<RequestRecord>();
      r->id = new_request_id();
    }
    return r;
  }

  std::shared_ptr<void> enter() {
    {
      std::lock_guard lock(state_mu);
      in_flight++;
    }
    return std::shared_ptr<void>(nullptr, [this](void*) {
      std::lock_guard lock(state_mu);
      in_flight--;
      state_cv.notify_all();
    });
  }

  void write_log(const httplib::Request& req, const httplib::Response& res) {
    std::shared_ptr<RequestRecord> rec;
    {
      std::lock_guard lock(records_mu);
      auto it = records.find(&req);
      if (it != records.end()) {
        rec = it->second;
        records.erase(it);
      }
    }
    metrics.http_requests(res.status).inc();
    if (!opt.log) return;
    json line = {{"time", utc_now()},
                 {"request_id", rec ? rec->id : std::string()},
                 {"method", req.method},
                 {"path", req.path},
                 {"status", res.status},
                 {"latency_ms", rec ? std::round(seconds_since(rec->start) * 1e6) / 1e3 : 0.0},
                 {"remote_addr", req.remote_addr}};
    if (rec && !rec->model.empty()) line["model"] = rec->model;
    if (rec && rec->prompt_tokens >= 0) line["prompt_tokens"] = rec->prompt_tokens;
    if (rec && rec->completion_tokens >= 0) line["completion_tokens"] = rec->completion_tokens;
    if (rec && !rec->error.empty()) line["error"] = rec->error;
    if (rec && rec->disconnected) line["disconnected"] = true;
    const std::string text = dump_json(line) + "\n";
    std::lock_guard lock(log_mu);
    std::fwrite(text.data(), 1, text.size(), opt.log);
    std::fflush(opt.log);
  }

  // ---- routing
  // -----------------------------------------------------------------------------------------------
  using Route = std::function<void(const httplib::Request&, httplib::Response&, RequestRecord&)>;

  void check_auth(const httplib::Request& req) const {
    if (opt.api_key.empty()) return;
    const std::string h = req.get_header_value("Authorization");
    const std::string_view prefix = "Bearer ";
    if (h.empty())
      throw ApiError(401, "invalid_request_error", "invalid_api_key", "",
                     "Missing API key: send the header 'Authorization: Bearer <key>'.");
    if (!h.starts_with(prefix) || !same_secret(std::string_view(h).substr(prefix.size()), opt.api_key))
      throw ApiError(401, "invalid_request_error", "invalid_api_key", "", "Incorrect API key provided.");
  }

  void add(const std::string& method, const std::string& pattern, bool auth, Route fn) {
    httplib::Server::Handler h = [this, auth, fn = std::move(fn)](const httplib::Request& req,
                                                                  httplib::Response& res) {
      const auto rec = record_of(req);
      res.set_header("X-Request-Id", rec->id);
      try {
        if (auth) check_auth(req);
        if (draining.load()) {
          res.set_header("Connection", "close");
          throw ApiError(503, "server_error", "shutting_down", "", "The server is shutting down.");
        }
        fn(req, res, *rec);
      } catch (const Error& e) {
        reply_error(res, api_error_from(e), rec.get());
      } catch (const std::exception& e) {
        reply_error(res, ApiError(500, "server_error", "internal_error", "", e.what()), rec.get());
      }
    };
    if (method == "GET")
      svr.Get(pattern, h);
    else
      svr.Post(pattern, h);
    routes.emplace_back(method, std::regex(pattern));
  }

  // The methods the routes take for `path` ("GET, POST"); empty when no route matches it.
  std::string allowed_methods(const std::string& path) const {
    std::string out;
    for (const auto& [method, re] : routes)
      if (std::regex_match(path, re) && out.find(method) == std::string::npos)
        out += (out.empty() ? "" : ", ") + method;
    return out;
  }

  // A Content-Length that is no byte count, or over the body limit, is answered before the body is read
  // (httplib would read and discard the declared bytes first: a minute's wait for "-5"), and the
  // connection closes after the answer so the unread body is never taken for a request.
  bool refuse_content_length(const httplib::Request& req, httplib::Response& res, RequestRecord* rec) {
    if (!req.has_header("Content-Length")) return false;
    const std::string cl = req.get_header_value("Content-Length");
    const bool count = !cl.empty() && cl.size() <= 19 &&
                       std::all_of(cl.begin(), cl.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (count && std::stoull(cl) <= opt.max_body_bytes) return false;
    res.set_header("X-Request-Id", rec->id);
    reply_error(
        res,
        count ? ApiError(413, "invalid_request_error", "request_too_large", "",
                         fmt::format("The request body ({} bytes) is larger than the limit of {} bytes.", cl,
                                     opt.max_body_bytes))
              : ApiError(400, "invalid_request_error", "", "",
                         fmt::format("Content-Length '{}' is not a byte count.", cl)),
        rec);
    res.set_header("Connection", "close");
    svr.close_after_response();
    return true;
  }

  // A recording from /profile/start to /profile/stop; the stop answers with the
  // trace itself (Chrome Trace Event JSON: save it and run loom profile report).
  void add_profile_routes() {
    add("POST", "/profile/start", true, [this](auto&, auto& res, auto&) {
      Tracer* t = profile_tracer();
      if (t->recording())
        throw ApiError(409, "invalid_request_error", "profile_running", "",
                       "A profile is already recording: POST /profile/stop first.");
      t->start();
      reply_json(res, 200, {{"status", "recording"}});
    });
    add("POST", "/profile/stop", true, [this](auto&, auto& res, auto&) {
      Tracer* t = profile_tracer();
      if (!t->recording())
        throw ApiError(409, "invalid_request_error", "profile_not_running", "",
                       "No profile is recording: POST /profile/start first.");
      t->stop();
      std::ostringstream out;
      t->write_chrome_json(out, opt.profile_metadata ? opt.profile_metadata() : std::string("{}"));
      res.status = 200;
      res.set_content(out.str(), "application/json");
    });
  }

  Tracer* profile_tracer() const {
    if (!opt.tracer)
      throw ApiError(404, "invalid_request_error", "not_found", "", "This server was started without profiling.");
    return opt.tracer;
  }

  std::vector<std::string> model_names() {
    std::vector<std::string> names;
    for (const auto& m : engine.list_models()) names.push_back(m.id);
    return names;
  }

  void setup() {
    svr.on_refused = [this] { metrics.http_requests(503).inc(); };
    svr.set_payload_max_length(opt.max_body_bytes);
    svr.set_keep_alive_timeout(opt.keep_alive_timeout_s);
    svr.set_tcp_nodelay(true);  // SSE sends many small chunks; Nagle + delayed ACK would hold each ~40 ms
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      auto rec = std::make_shared<RequestRecord>();
      rec->id = new_request_id();
      {
        std::lock_guard lock(records_mu);
        records[&req] = rec;
      }
      return refuse_content_length(req, res, rec.get()) ? httplib::Server::HandlerResponse::Handled
                                                        : httplib::Server::HandlerResponse::Unhandled;
    });
    // Statuses httplib sets itself (404 no route, 413 body too large, 400 malformed) get an error object.
    svr.set_error_handler(
        httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty() || res.content_provider_) return httplib::Server::HandlerResponse::Unhandled;
          const auto rec = record_of(req);
          res.set_header("X-Request-Id", rec->id);
          if (res.status == 400 && svr.request_timed_out())
            reply_error(res,
                        ApiError(408, "invalid_request_error", "request_timeout", "",
                                 fmt::format("The request did not arrive within the time allowed (headers {} "
                                             "ms, body {} ms).",
                                             opt.connections.header_timeout.count(),
                                             opt.connections.body_timeout.count())),
                        rec.get());
          else if (res.status == 413)
            reply_error(res,
                        ApiError(413, "invalid_request_error", "request_too_large", "",
                                 fmt::format("The request body is larger than the limit of {} bytes.",
                                             opt.max_body_bytes)),
                        rec.get());
          else if (res.status == 400 && svr.request_headers_too_large())
            reply_error(res,
                        ApiError(431, "invalid_request_error", "request_too_large", "",
                                 fmt::format("The request line and headers are longer than {} bytes.",
                                             opt.connections.max_header_bytes)),
                        rec.get());
          else if (const std::string allow = res.status == 404 ? allowed_methods(req.path) : "";
                   !allow.empty()) {
            res.set_header("Allow", allow);
            reply_error(res,
                        ApiError(405, "invalid_request_error", "method_not_allowed", "",
                                 fmt::format("{} takes {}, not {}.", req.path, allow, req.method)),
                        rec.get());
          } else if (res.status == 404)
            reply_error(res,
                        ApiError(404, "invalid_request_error", "not_found", "",
                                 fmt::format("No route for {} {}.", req.method, req.path)),
                        rec.get());
          else if (res.status == 400) {
            // httplib could not read the request: what follows on the connection cannot be trusted either.
            reply_error(
                res,
                ApiError(400, "invalid_request_error", "", "",
                         "The request could not be read as HTTP/1.1 (a malformed request line, header or "
                         "chunked body, or an unsupported Content-Encoding)."),
                rec.get());
            res.set_header("Connection", "close");
            svr.close_after_response();
          } else
            reply_error(res,
                        ApiError(res.status, res.status >= 500 ? "server_error" : "invalid_request_error", "",
                                 "", fmt::format("HTTP error {}.", res.status)),
                        rec.get());
          return httplib::Server::HandlerResponse::Handled;
        }));
    svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
      reply_json(res, 500, error_json(ApiError(500, "server_error", "internal_error", "", "internal error")));
    });
    svr.set_logger(
        [this](const httplib::Request& req, const httplib::Response& res) { write_log(req, res); });

    add("GET", "/health", false, [this](auto&, auto& res, auto&) {
      const EngineHealth h = engine.health();
      if (h.ok)
        reply_json(res, 200, {{"status", "ok"}});
      else
        reply_json(res, 503, {{"status", "unhealthy"}, {"message", h.message}});
    });
    add("GET", "/v1/models", true, [this](auto&, auto& res, auto&) {
      const auto models = engine.list_models();
      reply_json(res, 200, models_response(models, opt.limits.max_model_len));
    });
    add("GET", R"(/v1/models/(.+))", true, [this](const httplib::Request& req, auto& res, auto&) {
      const std::string id = req.matches[1];
      for (const auto& m : engine.list_models()) {
        if (m.id != id) continue;
        reply_json(res, 200, models_response(std::span(&m, 1), opt.limits.max_model_len)["data"][0]);
        return;
      }
      throw ApiError(404, "invalid_request_error", "model_not_found", "model",
                     fmt::format("The model `{}` does not exist.", id));
    });
    add("POST", "/v1/completions", true,
        [this](auto& req, auto& res, auto& rec) { generate(req, res, rec, RequestKind::completion); });
    add("POST", "/v1/chat/completions", true,
        [this](auto& req, auto& res, auto& rec) { generate(req, res, rec, RequestKind::chat); });
    add("POST", "/v1/embeddings", true,
        [this](auto& req, auto& res, auto& rec) { embeddings(req, res, rec); });
    for (const std::string prefix : {"", "/v1"}) {
      add("POST", prefix + "/tokenize", true,
          [this](const httplib::Request& req, auto& res, RequestRecord& rec) {
            const TokenizeRequest r = parse_tokenize_request(req.body, model_names());
            rec.model = r.model;
            const auto ids = engine.tokenize(r);
            rec.prompt_tokens = static_cast<int64_t>(ids.size());
            reply_json(res, 200, tokenize_response(ids, opt.limits.max_model_len));
          });
      add("GET", prefix + "/tokenizer_info", true, [this](auto&, auto& res, auto&) {
        reply_json(res, 200, tokenizer_info_response(engine.tokenizer_info(), opt.limits.max_model_len));
      });
      add("POST", prefix + "/detokenize", true,
          [this](const httplib::Request& req, auto& res, RequestRecord& rec) {
            const DetokenizeRequest r = parse_detokenize_request(req.body, model_names());
            rec.model = r.model;
            reply_json(res, 200, detokenize_response(engine.detokenize(r.model, r.tokens)));
          });
    }
    add_profile_routes();
    add("POST", "/v1/load_lora_adapter", true,
        [this](const httplib::Request& req, auto& res, RequestRecord& rec) {
          const AdapterRequest r = parse_load_adapter_request(req.body);
          rec.model = r.name;
          const bool replaced = engine.load_adapter(r.name, r.path, r.inplace);
          res.status = 200;
          res.set_content(fmt::format("Success: LoRA adapter '{}' {} successfully.", r.name,
                                      replaced ? "replaced" : "added"),
                          "text/plain");
        });
    add("POST", "/v1/unload_lora_adapter", true,
        [this](const httplib::Request& req, auto& res, RequestRecord& rec) {
          const AdapterRequest r = parse_unload_adapter_request(req.body);
          rec.model = r.name;
          engine.unload_adapter(r.name);
          res.status = 200;
          res.set_content(fmt::format("Success: LoRA adapter '{}' removed successfully.", r.name),
                          "text/plain");
        });
    add("GET", "/metrics", true, [this](auto&, auto& res, auto&) {
      const EngineStats s = engine.stats();
      metrics.requests_running.set(static_cast<double>(s.requests_running));
      metrics.requests_waiting.set(static_cast<double>(s.requests_waiting));
      metrics.kv_cache_usage.set(s.kv_cache_usage);
      metrics.adapters_loaded.set(static_cast<double>(s.adapters_loaded));
      // The engine counts; the counters catch up to it (never down).
      auto catch_up = [](Counter& c, int64_t total) {
        c.inc(std::max(0.0, static_cast<double>(total) - c.value()));
      };
      catch_up(metrics.spec_draft_tokens, s.spec_draft_tokens);
      catch_up(metrics.spec_accepted_tokens, s.spec_accepted_tokens);
      res.status = 200;
      res.set_content(metrics.registry.render(), kPrometheusContentType);
    });
  }

  // ---- generation
  // --------------------------------------------------------------------------------------------
  void generate(const httplib::Request& req, httplib::Response& res, RequestRecord& rec, RequestKind kind);
  void embeddings(const httplib::Request& req, httplib::Response& res, RequestRecord& rec);
  void observe(GenerationState& st, GenerationEvent& ev);
  std::optional<GenerationEvent> next_event(GenerationState& st);
  void finish_unfinished(GenerationState& st, const std::function<void(const ChoiceDelta&)>& emit);
};

// Metrics and bookkeeping for one event; an error event becomes st.error.
void HttpServer::Impl::observe(GenerationState& st, GenerationEvent& ev) {
  const auto now = Clock::now();
  switch (ev.kind) {
    case GenerationEvent::Kind::delta: {
      const ChoiceDelta& d = ev.delta;
      const auto idx = static_cast<size_t>(d.index);
      if (idx >= st.finished.size()) break;  // the formatter reports the bad index
      const auto k = d.token_ids.size();
      if (k > 0) {
        if (!st.first_token) {
          st.first_token = true;
          metrics.time_to_first_token.observe(std::chrono::duration<double>(now - st.rec->start).count());
        }
        if (st.last_delta[idx]) {
          const double per_token =
              std::chrono::duration<double>(now - *st.last_delta[idx]).count() / double(k);
          for (size_t i = 0; i < k; ++i) metrics.inter_token_latency.observe(per_token);
        }
        st.last_delta[idx] = now;
        metrics.generation_tokens.inc(static_cast<double>(k));
        st.rec->completion_tokens = std::max<int64_t>(st.rec->completion_tokens, 0) + static_cast<int64_t>(k);
      }
      if (d.finish && !st.finished[idx]) {
        st.finished[idx] = true;
        metrics.requests_finished(finish_kind_name(*d.finish)).inc();
      }
      break;
    }
    case GenerationEvent::Kind::done:
      st.parts_ended++;
      st.usage.prompt_tokens += ev.usage.prompt_tokens;
      st.usage.completion_tokens += ev.usage.completion_tokens;
      metrics.prompt_tokens.inc(static_cast<double>(ev.usage.prompt_tokens));
      st.rec->prompt_tokens = st.usage.prompt_tokens;
      break;
    case GenerationEvent::Kind::error:
      st.parts_ended++;
      st.error = ev.error
                     ? api_error_from(*ev.error)
                     : ApiError(500, "server_error", "internal_error", "", "engine error without details");
      st.rec->error = st.error->what();
      for (size_t i = 0; i < st.finished.size(); ++i) {
        if (st.finished[i]) continue;
        st.finished[i] = true;
        metrics.requests_finished("error").inc();
      }
      st.cancel();  // the other parts of a multi-prompt request
      break;
  }
}

// The next event, or nullopt after a poll interval without one. Starts cancelling when the server's stop
// deadline passed; gives up on an engine that does not confirm a cancellation within a few seconds.
std::optional<GenerationEvent> HttpServer::Impl::next_event(GenerationState& st) {
  if (aborting.load() && !st.cancelled_at) st.cancel();
  auto ev = st.stream->pop(opt.poll_interval);
  if (ev)
    observe(st, *ev);
  else if (st.cancelled_at && Clock::now() - *st.cancelled_at > std::chrono::seconds(3))
    st.parts_ended = st.parts;  // stop waiting
  return ev;
}

// Choices a cancellation left open end with "abort".
void HttpServer::Impl::finish_unfinished(GenerationState& st,
                                         const std::function<void(const ChoiceDelta&)>& emit) {
  for (size_t i = 0; i < st.finished.size(); ++i) {
    if (st.finished[i]) continue;
    st.finished[i] = true;
    metrics.requests_finished("abort").inc();
    ChoiceDelta d;
    d.index = static_cast<int32_t>(i);
    d.finish = FinishKind::abort;
    emit(d);
  }
}

void HttpServer::Impl::generate(const httplib::Request& req, httplib::Response& res, RequestRecord& rec,
                                RequestKind kind) {
  const auto names = model_names();
  std::vector<GenerationRequest> parts;
  if (kind == RequestKind::chat)
    parts.push_back(parse_chat_request(req.body, opt.limits, names));
  else
    parts = parse_completion_request(req.body, opt.limits, names);
  LOOM_ASSERT(!parts.empty());
  const GenerationRequest& first = parts.front();
  rec.model = first.model;

  ResponseMeta meta;
  meta.kind = kind;
  meta.id = (kind == RequestKind::chat ? "chatcmpl-" : "cmpl-") + rec.id;
  meta.created = unix_now();
  meta.model = first.model;
  meta.num_choices = first.n * static_cast<int32_t>(parts.size());
  meta.logprobs = first.logprobs;
  meta.top_logprobs = first.top_logprobs;
  if (first.echo) {
    for (const auto& p : parts) {
      const std::string text =
          p.prompt.is_tokens ? engine.detokenize(p.model, p.prompt.tokens) : p.prompt.text;
      for (int32_t i = 0; i < p.n; ++i) meta.echo.push_back(text);
    }
  }
  const bool stream = first.stream, include_usage = first.include_usage;

  auto st = std::make_shared<GenerationState>();
  st->rec = record_of(req);
  st->in_flight = enter();
  st->last_delta.resize(static_cast<size_t>(meta.num_choices));
  st->finished.assign(static_cast<size_t>(meta.num_choices), false);
  try {
    for (auto& p : parts) {
      p.request_id = rec.id;
      engine.submit(std::move(p), st->stream);
      st->parts++;
    }
  } catch (...) {
    st->cancel();  // parts already queued
    throw;
  }

  if (!stream) {
    ResponseAccumulator acc(meta);
    try {
      auto checked = Clock::now();
      while (!st->ended()) {
        auto ev = next_event(*st);
        if (ev && ev->kind == GenerationEvent::Kind::delta) acc.add(ev->delta);
        // Nothing is written until the end, so look at the socket: a client that left cancels the work.
        if (!st->cancelled_at && Clock::now() - checked >= opt.poll_interval) {
          checked = Clock::now();
          if (svr.client_gone()) {
            st->cancel();
            st->rec->disconnected = true;
          }
        }
      }
    } catch (...) {  // a malformed event: stop the engine's work before answering 500
      st->cancel();
      throw;
    }
    if (st->error) throw *st->error;
    finish_unfinished(*st, [&](const ChoiceDelta& d) { acc.add(d); });
    acc.add_usage(st->usage);
    metrics.e2e_request_latency.observe(seconds_since(st->rec->start));
    reply_json(res, 200, acc.build());
    return;
  }

  auto fmt_ = std::make_shared<StreamFormatter>(meta, include_usage);
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, st, fmt_](size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& s) { return s.empty() || sink.write(s.data(), s.size()); };
        auto gone = [&] {  // the client went away: cancel the engine's work, close the connection
          st->cancel();
          st->rec->disconnected = true;
          finish_unfinished(*st, [](const ChoiceDelta&) {});
          return false;
        };
        if (!write(fmt_->start())) return gone();
        while (!st->ended()) {
          auto ev = next_event(*st);
          if (!ev) {
            if (!sink.is_writable()) return gone();
            continue;
          }
          if (ev->kind == GenerationEvent::Kind::delta) {
            std::string event;
            try {
              event = fmt_->delta(ev->delta);
            } catch (const ApiError& e) {
              st->error = e;
              st->cancel();
              break;
            } catch (const std::exception& e) {  // this runs after the handler: nothing else would catch it
              st->error = ApiError(500, "server_error", "internal_error", "", e.what());
              st->cancel();
              break;
            }
            if (!write(event)) return gone();
          }
        }
        if (st->error) {
          if (!write(StreamFormatter::error(*st->error))) return gone();
        } else {
          bool ok = true;
          finish_unfinished(*st, [&](const ChoiceDelta& d) { ok = ok && write(fmt_->delta(d)); });
          if (!ok || !write(fmt_->usage(st->usage))) return gone();
          metrics.e2e_request_latency.observe(seconds_since(st->rec->start));
        }
        if (!write(StreamFormatter::done())) return gone();
        sink.done();
        return true;
      },
      [st](bool success) {
        if (!success) st->cancel();
      });
}

// One engine request per input, run like a prompt's prefill; the answer comes whole at the end.
void HttpServer::Impl::embeddings(const httplib::Request& req, httplib::Response& res, RequestRecord& rec) {
  bool base64 = false;
  std::vector<GenerationRequest> parts =
      parse_embeddings_request(req.body, opt.limits, model_names(), base64);
  LOOM_ASSERT(!parts.empty());
  rec.model = parts.front().model;
  const std::string model = parts.front().model;
  auto st = std::make_shared<GenerationState>();
  st->rec = record_of(req);
  st->in_flight = enter();
  st->last_delta.resize(parts.size());
  st->finished.assign(parts.size(), false);
  std::vector<std::vector<float>> vectors(parts.size());
  try {
    for (auto& p : parts) {
      p.request_id = rec.id;
      engine.submit(std::move(p), st->stream);
      st->parts++;
    }
    auto checked = Clock::now();
    while (!st->ended()) {
      auto ev = next_event(*st);
      if (ev && ev->kind == GenerationEvent::Kind::delta) {
        const auto i = static_cast<size_t>(ev->delta.index);
        if (i >= vectors.size())
          throw ApiError(500, "server_error", "internal_error", "", "bad embedding index");
        vectors[i] = std::move(ev->delta.embedding);
      }
      if (!st->cancelled_at && Clock::now() - checked >= opt.poll_interval) {
        checked = Clock::now();
        if (svr.client_gone()) {
          st->cancel();
          st->rec->disconnected = true;
        }
      }
    }
  } catch (...) {
    st->cancel();  // parts already queued
    throw;
  }
  if (st->error) throw *st->error;
  for (const auto& v : vectors)
    if (v.empty()) throw ApiError(500, "server_error", "internal_error", "", "the request was cancelled");
  metrics.e2e_request_latency.observe(seconds_since(st->rec->start));
  reply_json(res, 200, embeddings_response(vectors, base64, model, st->usage.prompt_tokens));
}

// ---------------------------------------------------------------------------------------------------------------

HttpServer::HttpServer(Engine& engine, ServeMetrics& metrics, HttpServerOptions options)
    : impl_(std::make_unique<Impl>(engine, metrics, std::move(options))) {
  impl_->setup();
}

HttpServer::~HttpServer() { stop(std::chrono::milliseconds(0)); }

void HttpServer::start() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.state_mu);
    if (s.started) fail(ErrorKind::invalid_input, "http server: start() called twice");
  }
  int port = s.opt.port;
  if (port == 0) {
    port = s.svr.bind_to_any_port(s.opt.host);
    if (port < 0) fail(ErrorKind::io, "http server: cannot bind {} on any port", s.opt.host);
  } else if (!s.svr.bind_to_port(s.opt.host, port)) {
    fail(ErrorKind::io, "http server: cannot bind {}:{} (in use, or not an address of this machine?)",
         s.opt.host, port);
  }
  s.bound_port = port;
  s.svr.raise_backlog(SOMAXCONN);
  {
    std::lock_guard lock(s.state_mu);
    s.started = true;
  }
  s.listener = std::thread([&s] {
    s.svr.listen_after_bind();
    s.listen_done = true;
  });
}

int HttpServer::port() const { return impl_->bound_port; }

void HttpServer::stop(std::chrono::milliseconds grace) {
  Impl& s = *impl_;
  std::lock_guard stop_lock(s.stop_mu);
  {
    std::lock_guard lock(s.state_mu);
    if (!s.started || s.stopped) return;
  }
  s.draining = true;
  {
    std::unique_lock lock(s.state_mu);
    s.state_cv.wait_for(lock, grace, [&] { return s.in_flight == 0; });
  }
  // Past the deadline: cancel what still runs; each stream ends within a poll interval once the engine
  // confirms, or after next_event's give-up time.
  s.aborting = true;
  {
    std::unique_lock lock(s.state_mu);
    s.state_cv.wait_for(lock, std::chrono::seconds(10), [&] { return s.in_flight == 0; });
  }
  // httplib ignores stop() until listen has started running; wait for that (or for it to have failed).
  while (!s.listen_done && !s.svr.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s.svr.stop();
  if (s.listener.joinable()) s.listener.join();
  {
    std::lock_guard lock(s.state_mu);
    s.stopped = true;
  }
  s.state_cv.notify_all();
}

void HttpServer::wait() {
  Impl& s = *impl_;
  std::unique_lock lock(s.state_mu);
  s.state_cv.wait(lock, [&] { return s.stopped || !s.started; });
}

}  // namespace loom

// The metrics endpoint and live page of `loom train` (apps/train_monitor.h).
#include "apps/train_monitor.h"

#include <httplib.h>

#include <chrono>
#include <thread>

#include "core/error.h"
#include "core/prometheus.h"

namespace loom::app {

namespace {

// The page and its script are inline, and the browser is told to load nothing
// from anywhere else (connect-src: the JSON from this server only).
const char* kPageSecurity =
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:";

const char kPage[] =
#include "apps/train_monitor_page.inc"
    ;

std::string host_in_url(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

}  // namespace

const std::string& train_monitor_page() {
  static const std::string page(kPage);
  return page;
}

struct TrainMonitor::Impl {
  const TrainMetrics& metrics;
  std::string host;
  int port = 0;
  httplib::Server svr;
  std::thread listener;
  std::atomic<bool> listen_done{false};
  std::mutex stop_mu;
  bool stopped = false;

  Impl(const TrainMetrics& m, std::string h, int p) : metrics(m), host(std::move(h)), port(p) {}

  void routes() {
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics.render(), kPrometheusContentType);
    });
    svr.Get("/curves.json", [this](const httplib::Request&, httplib::Response& res) {
      res.set_header("Cache-Control", "no-store");
      res.set_content(metrics.curves_json(), "application/json");
    });
    for (const char* path : {"/", "/index.html"}) {
      svr.Get(path, [](const httplib::Request&, httplib::Response& res) {
        res.set_header("Content-Security-Policy", kPageSecurity);
        res.set_header("Cache-Control", "no-store");
        res.set_content(train_monitor_page(), "text/html; charset=utf-8");
      });
    }
    // A scraper or a browser tab is all this serves: few threads, short timeouts, so a
    // stuck client never holds the trainer's exit.
    svr.new_task_queue = [] { return new httplib::ThreadPool(4); };
    svr.set_read_timeout(5, 0);
    svr.set_write_timeout(5, 0);
    svr.set_keep_alive_timeout(2);
  }
};

TrainMonitor::TrainMonitor(const TrainMetrics& metrics, const std::string& host, int port)
    : impl_(std::make_unique<Impl>(metrics, host, port)) {
  Impl& s = *impl_;
  s.routes();
  if (port <= 0 || port > 65535)
    fail(ErrorKind::invalid_input, "metrics_port (--metrics-port) {}: not a port (1..65535)", port);
  if (!s.svr.bind_to_port(host, port))
    fail(ErrorKind::invalid_input,
         "metrics_port (--metrics-port) {}: cannot listen on {}:{} (the port is in use, or metrics_host '{}' is "
         "not an address of this machine)",
         port, host, port, host);
  s.listener = std::thread([&s] {
    s.svr.listen_after_bind();
    s.listen_done = true;
  });
}

TrainMonitor::~TrainMonitor() { stop(); }

std::string TrainMonitor::url() const { return fmt::format("http://{}:{}/", host_in_url(impl_->host), impl_->port); }

void TrainMonitor::stop() {
  Impl& s = *impl_;
  std::lock_guard lock(s.stop_mu);
  if (s.stopped) return;
  // httplib ignores stop() until listen has started running; wait for that (or for it to have failed).
  while (!s.listen_done && !s.svr.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s.svr.stop();
  if (s.listener.joinable()) s.listener.join();
  s.stopped = true;
}

}  // namespace loom::app

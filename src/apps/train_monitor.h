// `loom train --metrics-port`: a small HTTP server (cpp-httplib) on the
// trainer's TrainMetrics while the run goes on:
//   GET /metrics       the loom_train_ series, Prometheus text format 0.0.4
//   GET /              the live page (train_monitor_page.inc): loss, eval
//                      token accuracy, learning rate and gradient norm against
//                      the step, drawn in SVG by inline JS; nothing from outside
//   GET /curves.json   what the page draws (TrainMetrics::curves_json)
// The listener threads only read TrainMetrics (thread-safe); they never touch
// the trainer.
#pragma once

#include <memory>
#include <string>

#include "train/train_metrics.h"

namespace loom::app {

class TrainMonitor {
 public:
  // Binds host:port at once and serves on background threads. Throws
  // invalid_input naming metrics_port / --metrics-port when the port cannot be
  // bound (in use, or host not an address of this machine). `metrics` must
  // outlive the monitor.
  TrainMonitor(const TrainMetrics& metrics, const std::string& host, int port);
  ~TrainMonitor();  // stop()
  TrainMonitor(const TrainMonitor&) = delete;
  TrainMonitor& operator=(const TrainMonitor&) = delete;

  // "http://127.0.0.1:9100/" ("http://[::1]:9100/" for IPv6 hosts).
  std::string url() const;
  // Closes the listener and waits for the HTTP threads; safe to call twice.
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The live page served at `/`.
const std::string& train_monitor_page();

}  // namespace loom::app

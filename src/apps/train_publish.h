// `loom train --publish URL`: loads the adapter a run writes into a running
// `loom serve` (or vLLM) through POST /v1/load_lora_adapter with
// "load_inplace": true, so the server serves it without a restart. The trainer
// calls it through TrainHooks::after_adapter_written (rank 0 only).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace loom::app {

struct PublishOptions {
  std::string url;           // the server's base: http[s]://host[:port][/prefix], with or without /v1
  std::string name;          // lora_name; empty: the output folder's name
  std::string api_key_file;  // empty: no Authorization header
  bool every_checkpoint = false;
  std::chrono::seconds connect_timeout{5}, read_timeout{60};
};

// What one load request got back.
struct PublishOutcome {
  bool ok = false;
  int status = 0;       // HTTP status; 0: no answer (connection refused, timeout, ...)
  std::string message;  // the server's reply (its error message for an error), or why there was none
};

class AdapterPublisher {
 public:
  // Validates the URL and reads the key file now, so a typo fails before training. `output_dir`
  // gives the default name. Throws loom::Error (invalid_input, not_found) naming the flag.
  AdapterPublisher(PublishOptions options, const std::string& output_dir);

  // GET /v1/models with the key: throws loom::Error(invalid_input) when the server answers 401 / 403 (a
  // wrong key) or 404 (a wrong URL); returns a warning when it cannot be reached or answers otherwise
  // (it may start later), nullopt when all is well.
  std::optional<std::string> probe() const;
  // POST {"lora_name", "lora_path": path, "load_inplace": true} to the load endpoint.
  PublishOutcome publish(const std::string& path) const;

  const std::string& name() const { return name_; }
  const std::string& endpoint() const { return endpoint_; }  // the load endpoint's full URL
  bool every_checkpoint() const { return opt_.every_checkpoint; }

 private:
  PublishOptions opt_;
  std::string name_;
  std::string origin_;  // scheme://host:port
  std::string prefix_;  // the path before /v1 ("" or "/something")
  std::string endpoint_;
  std::string api_key_;
};

}  // namespace loom::app

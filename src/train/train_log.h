// Everything `loom train` reports, as records: a human line on stderr (or a
// progress bar on a terminal) and, for every record, a JSON twin with Elastic
// Common Schema field names (one object per line) for log_file and
// `--log-format json`. Filebeat / Logstash read the JSON without a custom
// parser: docs/training.md ("Logs") gives the fields and a Filebeat input.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace loom {

enum class LogLevel { debug, info, warning, error };
const char* log_level_name(LogLevel level);  // ECS log.level: "debug", "info", "warn", "error"

struct TrainLogOptions {
  std::FILE* console = stderr;  // human lines (or JSON when console_json); nullptr: nothing
  bool console_json = false;    // --log-format json: the console gets the JSON lines instead
  std::string log_file;         // ECS JSON lines appended here; empty: none
  int64_t log_interval = 10;    // steps between step lines when the console is not a terminal
};

// One step's figures, for the progress line and its JSON twin.
struct StepLine {
  int64_t step = 0, total = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0;
  double elapsed_s = 0, eta_s = 0;
  int64_t tokens = 0;  // input tokens so far
};

class TrainLog {
 public:
  // Opens log_file for appending (its folder is created); throws loom::Error
  // (io) naming the file when it cannot be written.
  explicit TrainLog(TrainLogOptions options);
  ~TrainLog();
  TrainLog(const TrainLog&) = delete;
  TrainLog& operator=(const TrainLog&) = delete;

  // A record: `message` is the human line; `action` its ECS event.action
  // ("start", "eval", "checkpoint", "memory_alarm", ...); `fields` go under
  // loom.* in the JSON twin; `kind` is ECS event.kind (event, metric, alert,
  // state). Thread-safe.
  void record(LogLevel level, std::string_view action, std::string_view message,
              const nlohmann::json& fields = nlohmann::json::object(), std::string_view kind = "event");
  // An error record: as record(error, ...) plus ECS error.type / error.message.
  void error(std::string_view action, std::string_view message, std::string_view error_type,
             const nlohmann::json& fields = nlohmann::json::object());
  // One optimizer step: a progress bar on a terminal, else a line every
  // log_interval steps (and the first and last); the JSON twin every step.
  void step(const StepLine& s, const nlohmann::json& extra = nlohmann::json::object());

  // The JSON line a record becomes (no trailing newline); exposed for tests.
  static std::string ecs_json(LogLevel level, std::string_view action, std::string_view message,
                              const nlohmann::json& fields, std::string_view kind,
                              std::chrono::system_clock::time_point when, const nlohmann::json* error = nullptr);

 private:
  void write_json(const std::string& line);
  void human_line(std::string_view text);

  TrainLogOptions opt_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_{nullptr, &std::fclose};
  bool tty_ = false;
  bool bar_open_ = false;  // a progress bar is on the console's last line
  std::mutex mu_;
};

// "1m05s", "2h03m": for ETA and elapsed times in human lines.
std::string format_duration(double seconds);

}  // namespace loom

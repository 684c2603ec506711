// TrainLog: human lines and their ECS JSON twins (see train_log.h).
#include "train/train_log.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"

namespace loom {

namespace {

// ECS's @timestamp: ISO 8601 in UTC with milliseconds.
std::string iso_timestamp(std::chrono::system_clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                     tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms % 1000));
}

// JSON has no NaN or infinity: such a figure is written as null.
nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

const char* log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::debug: return "debug";
    case LogLevel::info: return "info";
    case LogLevel::warning: return "warn";
    case LogLevel::error: return "error";
  }
  return "info";
}

std::string format_duration(double s) {
  const auto t = static_cast<int64_t>(std::max(0.0, std::isfinite(s) ? s : 0.0) + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, t / 60 % 60);
  return fmt::format("{}m{:02}s", t / 60, t % 60);
}

TrainLog::TrainLog(TrainLogOptions options) : opt_(std::move(options)) {
  tty_ = opt_.console && !opt_.console_json && isatty(fileno(opt_.console));
  if (opt_.log_interval < 1) opt_.log_interval = 1;
  if (opt_.log_file.empty()) return;
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(opt_.log_file).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  file_.reset(std::fopen(opt_.log_file.c_str(), "a"));
  if (!file_) fail(ErrorKind::io, "log_file '{}' cannot be written: {}", opt_.log_file, std::strerror(errno));
}

TrainLog::~TrainLog() {
  if (bar_open_ && opt_.console) std::fputc('\n', opt_.console);
}

std::string TrainLog::ecs_json(LogLevel level, std::string_view action, std::string_view message,
                               const nlohmann::json& fields, std::string_view kind,
                               std::chrono::system_clock::time_point when, const nlohmann::json* error) {
  nlohmann::ordered_json j;
  j["@timestamp"] = iso_timestamp(when);
  j["log.level"] = log_level_name(level);
  j["message"] = std::string(message);
  j["ecs.version"] = "8.11.0";
  j["event"] = {{"kind", std::string(kind)}, {"dataset", "loom.train"}, {"action", std::string(action)}};
  j["service"] = {{"name", "loom"}, {"type", "train"}};
  j["process"] = {{"pid", static_cast<int64_t>(getpid())}};
  if (error) j["error"] = *error;
  if (fields.is_object() && !fields.empty()) j["loom"] = fields;
  // Invalid UTF-8 (a file name, a data line) is replaced, never a throw.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void TrainLog::write_json(const std::string& line) {
  if (file_) {
    std::fprintf(file_.get(), "%s\n", line.c_str());
    std::fflush(file_.get());
  }
  if (opt_.console && opt_.console_json) {
    std::fprintf(opt_.console, "%s\n", line.c_str());
    std::fflush(opt_.console);
  }
}

void TrainLog::human_line(std::string_view text) {
  if (!opt_.console || opt_.console_json) return;
  if (bar_open_) std::fputc('\n', opt_.console);
  bar_open_ = false;
  std::fprintf(opt_.console, "%.*s\n", static_cast<int>(text.size()), text.data());
  std::fflush(opt_.console);
}

void TrainLog::record(LogLevel level, std::string_view action, std::string_view message, const nlohmann::json& fields,
                      std::string_view kind) {
  const std::string line = ecs_json(level, action, message, fields, kind, std::chrono::system_clock::now());
  std::lock_guard lock(mu_);
  human_line(level == LogLevel::warning ? fmt::format("warning: {}", message)
             : level == LogLevel::error ? fmt::format("error: {}", message)
                                        : std::string(message));
  write_json(line);
}

void TrainLog::error(std::string_view action, std::string_view message, std::string_view error_type,
                     const nlohmann::json& fields) {
  const nlohmann::json err = {{"type", std::string(error_type)}, {"message", std::string(message)}};
  const std::string line =
      ecs_json(LogLevel::error, action, message, fields, "event", std::chrono::system_clock::now(), &err);
  std::lock_guard lock(mu_);
  human_line(fmt::format("error: {}", message));
  write_json(line);
}

void TrainLog::step(const StepLine& s, const nlohmann::json& extra) {
  const std::string human =
      fmt::format("step {}/{} loss {:.4f} lr {:.3e} grad_norm {:.3f} {:.0f} tok/s elapsed {} ETA {}", s.step, s.total,
                  s.loss, s.lr, s.grad_norm, s.tokens_per_s, format_duration(s.elapsed_s), format_duration(s.eta_s));
  nlohmann::json f = {{"step", s.step},
                      {"total_steps", s.total},
                      {"loss", finite_or_null(s.loss)},
                      {"lr", finite_or_null(s.lr)},
                      {"grad_norm", finite_or_null(s.grad_norm)},
                      {"tokens_per_s", finite_or_null(s.tokens_per_s)},
                      {"tokens", s.tokens},
                      {"elapsed_s", finite_or_null(s.elapsed_s)},
                      {"eta_s", finite_or_null(s.eta_s)}};
  if (extra.is_object()) f.update(extra);
  const std::string line = ecs_json(LogLevel::info, "step", human, f, "metric", std::chrono::system_clock::now());
  std::lock_guard lock(mu_);
  write_json(line);
  if (!opt_.console || opt_.console_json) return;
  if (tty_) {
    const int width = 24;
    const int fill = s.total > 0 ? static_cast<int>(width * std::min<int64_t>(s.step, s.total) / s.total) : 0;
    std::fprintf(opt_.console, "\r\033[K[%s%s] %lld/%lld loss %.4f lr %.2e %.0f tok/s ETA %s",
                 std::string(static_cast<size_t>(fill), '#').c_str(),
                 std::string(static_cast<size_t>(width - fill), '.').c_str(), static_cast<long long>(s.step),
                 static_cast<long long>(s.total), s.loss, s.lr, s.tokens_per_s, format_duration(s.eta_s).c_str());
    std::fflush(opt_.console);
    bar_open_ = true;
  } else if (s.step % opt_.log_interval == 0 || s.step == s.total || s.step == 1) {
    human_line(human);
  }
}

}  // namespace loom

// TrainLog: every record's ECS JSON twin (field names, nesting, non-finite
// numbers, invalid UTF-8), the human line, --log-format json on the console,
// and log_file errors.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "temp_dir.h"
#include "train/train_log.h"

namespace loom {
namespace {

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string read_all(std::FILE* f) {
  std::rewind(f);
  std::string s;
  for (int ch; (ch = std::fgetc(f)) != EOF;) s.push_back(static_cast<char>(ch));
  return s;
}

TEST(TrainLog, EcsFieldNames) {
  const auto when = std::chrono::system_clock::time_point(std::chrono::milliseconds(1764597600123));
  const nlohmann::json j = nlohmann::json::parse(
      TrainLog::ecs_json(LogLevel::warning, "checkpoint", "checkpoint written", {{"step", 5}}, "event", when));
  EXPECT_EQ(j["@timestamp"], "2025-12-01T14:00:00.123Z");
  EXPECT_EQ(j["log.level"], "warn");
  EXPECT_EQ(j["message"], "checkpoint written");
  EXPECT_EQ(j["event"]["kind"], "event");
  EXPECT_EQ(j["event"]["dataset"], "loom.train");
  EXPECT_EQ(j["event"]["action"], "checkpoint");
  EXPECT_EQ(j["service"]["name"], "loom");
  EXPECT_TRUE(j["process"]["pid"].is_number_integer());
  EXPECT_EQ(j["loom"]["step"], 5);
  EXPECT_FALSE(j.contains("error"));
}

TEST(TrainLog, FileGetsEveryRecordAndErrorsCarryEcsError) {
  test_util::TempDir dir("train_log");
  const std::string path = dir.str() + "/logs/train.jsonl";  // the folder is created
  std::FILE* console = std::tmpfile();
  {
    TrainLog log({.console = console, .console_json = false, .log_file = path, .log_interval = 2});
    log.record(LogLevel::info, "start", "training: 3 steps");
    for (int64_t s = 1; s <= 3; ++s)
      log.step({.step = s, .total = 3, .loss = s == 2 ? std::numeric_limits<double>::quiet_NaN() : 1.5, .lr = 1e-4});
    log.error("error", "disk full", "io", {{"step", 3}});
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 5u);  // every step has a JSON twin, whatever log_interval says
  EXPECT_EQ(lines[1]["event"]["kind"], "metric");
  EXPECT_EQ(lines[1]["loom"]["step"], 1);
  EXPECT_EQ(lines[1]["loom"]["loss"], 1.5);
  EXPECT_TRUE(lines[2]["loom"]["loss"].is_null());  // NaN is not JSON
  EXPECT_EQ(lines[4]["log.level"], "error");
  EXPECT_EQ(lines[4]["error"]["type"], "io");
  EXPECT_EQ(lines[4]["error"]["message"], "disk full");
  const std::string human = read_all(console);
  std::fclose(console);
  EXPECT_NE(human.find("training: 3 steps\n"), std::string::npos);
  EXPECT_NE(human.find("step 1/3"), std::string::npos);  // the first, every log_interval, the last
  EXPECT_NE(human.find("step 2/3"), std::string::npos);
  EXPECT_NE(human.find("step 3/3"), std::string::npos);
  EXPECT_NE(human.find("error: disk full"), std::string::npos);
  EXPECT_EQ(human.find("{\"@timestamp\""), std::string::npos);
}

TEST(TrainLog, JsonConsoleHasOnlyJsonLines) {
  std::FILE* console = std::tmpfile();
  {
    TrainLog log({.console = console, .console_json = true, .log_file = "", .log_interval = 10});
    log.record(LogLevel::info, "data", "bad \xff utf-8 in a file name");
    log.step({.step = 1, .total = 1, .loss = 2.0});
  }
  const std::string out = read_all(console);
  std::fclose(console);
  size_t lines = 0;
  for (size_t p = 0, q; (q = out.find('\n', p)) != std::string::npos; p = q + 1, ++lines)
    EXPECT_NO_THROW(nlohmann::json::parse(out.substr(p, q - p)));
  EXPECT_EQ(lines, 2u);
}

TEST(TrainLog, UnwritableLogFileNamed) {
  test_util::expect_error([] { TrainLog log({.console = nullptr, .console_json = false, .log_file = "/proc/no/such/train.jsonl"}); },
                          ErrorKind::io, {"log_file", "/proc/no/such/train.jsonl"});
}

}  // namespace
}  // namespace loom

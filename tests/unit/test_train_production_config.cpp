// The production-training keys of `loom train` configs (checkpoints,
// divergence, memory, metrics port, logs), byte sizes, and run_identity: the
// keys a resumed run must keep.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "expect_error.h"
#include "train/train_config.h"

namespace loom {
namespace {

using test_util::expect_error;

const std::string kMinimal =
    "model: m.gguf\n"
    "data:\n"
    "  train: t.jsonl\n"
    "steps: 10\n"
    "output_dir: out\n";

TrainConfig parse(const std::string& yaml, std::vector<std::string> sets = {}) {
  return parse_train_config(yaml, "cfg.yaml", sets);
}

void expect_bad(const std::vector<std::string>& sets, const std::vector<std::string>& needles) {
  expect_error([&] { parse(kMinimal, sets); }, ErrorKind::invalid_input, needles);
}

TEST(TrainProductionConfig, Defaults) {
  const TrainConfig c = parse(kMinimal);
  EXPECT_EQ(c.checkpoint_interval, 0);
  EXPECT_EQ(c.checkpoint_minutes, 0);
  EXPECT_TRUE(c.checkpoint_dir.empty());
  EXPECT_EQ(c.keep_checkpoints, 3);
  EXPECT_EQ(c.max_bad_steps, 5);
  EXPECT_EQ(c.on_divergence, TrainConfig::OnDivergence::rollback);
  EXPECT_EQ(c.memory_limit, 0);
  EXPECT_EQ(c.memory_alarm, (std::vector<double>{0.80, 0.95}));
  EXPECT_EQ(c.metrics_port, 0);
  EXPECT_EQ(c.metrics_host, "127.0.0.1");
  EXPECT_EQ(c.log_format, TrainConfig::LogFormat::text);
}

TEST(TrainProductionConfig, EveryKeyRead) {
  const TrainConfig c = parse(kMinimal + "checkpoint_interval: 50\ncheckpoint_minutes: 7.5\ncheckpoint_dir: ck\n"
                                         "keep_checkpoints: 2\nmax_bad_steps: 3\non_divergence: stop\n"
                                         "rollback_lr_factor: 0.25\nmax_rollbacks: 1\nmemory_limit: 1.5GiB\n"
                                         "memory_alarm: [0.5, 0.9]\nmetrics_port: 9100\nmetrics_host: 0.0.0.0\n"
                                         "log_file: logs/train.jsonl\nlog_format: json\n");
  EXPECT_EQ(c.checkpoint_interval, 50);
  EXPECT_DOUBLE_EQ(c.checkpoint_minutes, 7.5);
  EXPECT_EQ(c.checkpoint_dir, "ck");
  EXPECT_EQ(c.keep_checkpoints, 2);
  EXPECT_EQ(c.max_bad_steps, 3);
  EXPECT_EQ(c.on_divergence, TrainConfig::OnDivergence::stop);
  EXPECT_DOUBLE_EQ(c.rollback_lr_factor, 0.25);
  EXPECT_EQ(c.max_rollbacks, 1);
  EXPECT_EQ(c.memory_limit, int64_t{3} << 29);
  EXPECT_EQ(c.memory_alarm, (std::vector<double>{0.5, 0.9}));
  EXPECT_EQ(c.metrics_port, 9100);
  EXPECT_EQ(c.metrics_host, "0.0.0.0");
  EXPECT_EQ(c.log_file, "logs/train.jsonl");
  EXPECT_EQ(c.log_format, TrainConfig::LogFormat::json);
}

TEST(TrainProductionConfig, BadValuesNamed) {
  expect_bad({"on_divergence=retry"}, {"on_divergence", "retry", "rollback or stop"});
  expect_bad({"log_format=xml"}, {"log_format", "text or json"});
  expect_bad({"memory_limit=lots"}, {"memory_limit", "8GiB"});
  expect_bad({"memory_limit=-3G"}, {"memory_limit"});
  expect_bad({"memory_alarm=[0.9, 0.8]"}, {"memory_alarm", "increasing"});
  expect_bad({"memory_alarm=[1.5]"}, {"memory_alarm", "(0, 1]"});
  expect_bad({"metrics_port=70000"}, {"metrics_port", "out of range"});
  expect_bad({"rollback_lr_factor=1"}, {"rollback_lr_factor", "out of range"});
  expect_bad({"keep_checkpoints=0"}, {"keep_checkpoints", "out of range"});
  expect_bad({"checkpoint_interval=-1"}, {"checkpoint_interval"});
}

TEST(TrainProductionConfig, ByteSizes) {
  EXPECT_EQ(parse_byte_size("8GiB"), int64_t{8} << 30);
  EXPECT_EQ(parse_byte_size("8 gib"), int64_t{8} << 30);
  EXPECT_EQ(parse_byte_size("1.5G"), 1500000000);
  EXPECT_EQ(parse_byte_size("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_byte_size("2000000000"), 2000000000);
  EXPECT_EQ(parse_byte_size("3kb"), 3000);
  EXPECT_FALSE(parse_byte_size(""));
  EXPECT_FALSE(parse_byte_size("G"));
  EXPECT_FALSE(parse_byte_size("1.2.3G"));
  EXPECT_FALSE(parse_byte_size("4 parsecs"));
  EXPECT_FALSE(parse_byte_size("0"));
}

std::string identity_value(const TrainConfig& c, const std::string& key) {
  for (const auto& [k, v] : run_identity(c))
    if (k == key) return v;
  ADD_FAILURE() << "run_identity has no key " << key;
  return {};
}

TEST(TrainProductionConfig, RunIdentityHasWhatChangesTheRun) {
  const TrainConfig base = parse(kMinimal);
  // A change of any of these changes what the run computes.
  const std::vector<std::pair<std::string, std::string>> changes = {
      {"model", "other.gguf"}, {"data.train", "u.jsonl"}, {"data.seq_len", "64"}, {"lora.r", "16"},
      {"lora.target_modules", "[q_proj]"}, {"batch_size", "2"}, {"grad_accum", "3"}, {"seed", "7"},
      {"optim.lr", "1e-3"}, {"method", "full"}, {"schedule.kind", "cosine"}};
  for (const auto& [key, value] : changes) {
    SCOPED_TRACE(key);
    const TrainConfig changed = parse(kMinimal, {key + "=" + value});
    EXPECT_NE(identity_value(base, key), identity_value(changed, key));
  }
  // These do not: a resumed run may change them.
  const TrainConfig free = parse(kMinimal, {"steps=20", "log_interval=1", "threads=3", "checkpoint_interval=5"});
  EXPECT_EQ(run_identity(base), run_identity(free));
  for (const auto& [k, v] : run_identity(base))
    EXPECT_TRUE(k != "steps" && k != "threads" && k != "log_interval" && k != "eval_interval") << k;
}

}  // namespace
}  // namespace loom

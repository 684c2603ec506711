// Memory accounting of training (train/memory.h): the /proc and cgroup
// parsers, the alarm levels with hysteresis, the estimate before step 1 against
// the buffers a step allocates and the RSS it reaches, the refusal above
// memory_limit, the alarm records and checkpoint, and RSS staying flat.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "cgroup_fixtures.h"
#include "expect_error.h"
#include "temp_dir.h"
#include "train/memory.h"
#include "train/trainer.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("train_memory_test") {}
};

void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

TEST(TrainMemory, ParsesMeminfoAndCgroupFiles) {
  EXPECT_EQ(parse_meminfo_available("MemTotal:  16000 kB\nMemFree:   100 kB\nMemAvailable:    2048 kB\n"),
            int64_t{2048} * 1024);
  EXPECT_FALSE(parse_meminfo_available("MemTotal:  16000 kB\n"));
  EXPECT_FALSE(parse_meminfo_available("XMemAvailable: 5 kB\n"));
  EXPECT_EQ(parse_cgroup_limit("1073741824\n"), int64_t{1} << 30);
  EXPECT_FALSE(parse_cgroup_limit("max\n"));
  EXPECT_FALSE(parse_cgroup_limit("9223372036854771712\n"));  // cgroup v1: no limit
  EXPECT_FALSE(parse_cgroup_limit("12abc"));
  EXPECT_FALSE(parse_cgroup_limit(""));
}

using test_util::kMountCgroup2;
using test_util::kMountHybrid;

// The limit of a process in `proc_self_cgroup` with files under `prefix`.
std::optional<int64_t> limit_of(const fs::path& prefix, std::string_view proc_self_cgroup,
                                std::string_view mountinfo) {
  return cgroup_memory_limit(find_cgroup("memory", proc_self_cgroup, mountinfo), prefix.string());
}

TEST(TrainMemory, CgroupLimitIsTheTightestOfTheProcessCgroupAndItsAncestors) {
  TempDir tmp;
  const fs::path& p = tmp.path;
  // v2: the process's own cgroup has none, its parent 3000, the root 5000.
  write_file(p / "sys/fs/cgroup/memory.max", "5000\n");
  write_file(p / "sys/fs/cgroup/a/memory.max", "3000\n");
  write_file(p / "sys/fs/cgroup/a/b/memory.max", "max\n");
  EXPECT_EQ(limit_of(p, "0::/a/b\n", kMountCgroup2), 3000);
  // A container with its own cgroup namespace sees its cgroup as "/": the mount's top.
  EXPECT_EQ(limit_of(p, "0::/\n", kMountCgroup2), 5000);
  // v1: the memory controller's hierarchy (its root's "no limit" is 2^63 - 4096).
  write_file(p / "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  write_file(p / "sys/fs/cgroup/memory/job/memory.limit_in_bytes", "2000\n");
  EXPECT_EQ(limit_of(p, "5:cpu,cpuacct:/job\n4:memory:/job\n", kMountHybrid), 2000);
  EXPECT_FALSE(limit_of(p, "5:cpu,cpuacct:/job\n4:memory:/other\n", kMountHybrid));
  // Both hierarchies limit: the tighter wins.
  write_file(p / "sys/fs/cgroup/unified/a/memory.max", "3000\n");
  EXPECT_EQ(limit_of(p, "0::/a/b\n4:memory:/job\n", kMountHybrid), 2000);
  EXPECT_EQ(limit_of(p, "0::/a/b\n4:memory:/other\n", kMountHybrid), 3000);
  // Nothing set anywhere, nothing readable, nothing mounted, no cgroup lines.
  EXPECT_FALSE(limit_of(p / "none", "0::/\n", kMountCgroup2));
  EXPECT_FALSE(limit_of(p, "0::/a/b\n", ""));
  EXPECT_FALSE(limit_of(p, "garbage", kMountCgroup2));
}

// Where the hierarchy is mounted comes from mountinfo, not from a fixed
// /sys/fs/cgroup: a v2 mount elsewhere, and a v1 container whose mount shows
// only its own cgroup (mount root /docker/abc) at the top.
TEST(TrainMemory, CgroupLimitFollowsMountinfo) {
  TempDir tmp;
  const fs::path& p = tmp.path;
  write_file(p / "sys/fs/cgroup/job/memory.max", "1000\n");  // not where this system mounts it
  write_file(p / "run/cg two/job/memory.max", "7000\n");
  EXPECT_EQ(limit_of(p, "0::/job\n", "30 24 0:26 / /run/cg\\040two rw - cgroup2 cgroup2 rw\n"), 7000);
  write_file(p / "sys/fs/cgroup/memory/memory.limit_in_bytes", "4096\n");
  EXPECT_EQ(limit_of(p, "4:memory:/docker/abc\n",
                     "29 25 0:26 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"),
            4096);
}

TEST(TrainMemory, ResolvedLimitPrefersTheConfiguredOne) {
  const MemoryLimit l = resolve_memory_limit(123456789);
  EXPECT_EQ(l.bytes, 123456789);
  EXPECT_EQ(l.source, MemoryLimitSource::config);
  const MemoryLimit d = resolve_memory_limit(0);  // cgroup or MemAvailable: some memory, at least this process
  EXPECT_GT(d.bytes, process_rss_bytes());
  EXPECT_NE(d.source, MemoryLimitSource::config);
}

TEST(TrainMemory, AlarmRisesAtEachThresholdAndFallsBackWithHysteresis) {
  MemoryAlarm a({0.80, 0.95}, 1000, 0.02);
  EXPECT_FALSE(a.update(700));
  auto c = a.update(800);  // reaches 80%
  ASSERT_TRUE(c);
  EXPECT_EQ(c->from, 0);
  EXPECT_EQ(c->to, 1);
  EXPECT_DOUBLE_EQ(c->threshold, 0.80);
  EXPECT_DOUBLE_EQ(c->fraction, 0.8);
  EXPECT_FALSE(a.update(850));
  EXPECT_FALSE(a.update(790));  // below 80% but inside the 2% band: no new record
  EXPECT_FALSE(a.update(780));
  c = a.update(779);  // below 78%: cleared
  ASSERT_TRUE(c);
  EXPECT_EQ(c->to, 0);
  EXPECT_DOUBLE_EQ(c->threshold, 0.80);
  EXPECT_FALSE(a.update(790));  // back up but below 80%
  c = a.update(960);  // both at once
  ASSERT_TRUE(c);
  EXPECT_EQ(c->from, 0);
  EXPECT_EQ(c->to, 2);
  EXPECT_DOUBLE_EQ(c->threshold, 0.95);
  EXPECT_EQ(a.level(), 2);
  EXPECT_FALSE(a.update(935));
  c = a.update(929);  // below 93%: down to level 1 only
  ASSERT_TRUE(c);
  EXPECT_EQ(c->to, 1);
  EXPECT_DOUBLE_EQ(c->threshold, 0.95);
  c = a.update(100);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->to, 0);
  MemoryAlarm none({0.8}, 0);  // no limit known: never an alarm
  EXPECT_FALSE(none.update(int64_t{1} << 40));
}

MemoryEstimate example_estimate() {
  MemoryEstimate e;
  const int64_t GiB = int64_t{1} << 30;
  for (const char* n : kMemoryArenaNames) e.arenas.push_back({n, 0});
  e.arenas[0].bytes = GiB / 10;
  e.arenas[6].bytes = GiB;
  e.other = GiB / 20;
  e.total = GiB / 10 + GiB + GiB / 20;
  e.seq_len = 512;
  e.batch_rows = 2;
  return e;
}

TEST(TrainMemory, EstimateTextAndRefusalNameTheKeysThatLowerIt) {
  const MemoryEstimate e = example_estimate();
  EXPECT_EQ(format_memory_estimate(e),
            "needs about 1.15 GiB: weights 0.100, activations 1.000, other 0.050 (GiB; micro-batches of 2 x 512 "
            "tokens)");
  MemoryEstimate small = e;
  small.arenas[6].bytes = int64_t{300} << 20;
  small.total = (int64_t{1} << 30) / 10 + (int64_t{300} << 20);
  EXPECT_EQ(format_memory_estimate(small),
            "needs about 402.4 MiB: weights 102.4, activations 300.0, other 51.2 (MiB; micro-batches of 2 x 512 tokens)");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(int64_t{3} << 20), "3.0 MiB");
  EXPECT_NO_THROW(check_memory_estimate(e, {e.total, MemoryLimitSource::config}, "x.yaml"));
  EXPECT_NO_THROW(check_memory_estimate(e, {0, MemoryLimitSource::available}, "x.yaml"));  // unknown: no check
  test_util::expect_error([&] { check_memory_estimate(e, {e.total - 1, MemoryLimitSource::cgroup}, "x.yaml"); },
                          ErrorKind::invalid_input, {"x.yaml: the run needs about 1.15 GiB", "the cgroup's memory limit"});
  try {
    check_memory_estimate(e, {int64_t{1} << 30, MemoryLimitSource::config}, "x.yaml");
    FAIL();
  } catch (const Error& err) {
    const std::string m = err.what();
    for (const char* key : {"data.seq_len", "batch_size", "grad_accum", "method: lora", "backward", "gradient_checkpointing", "activation_dtype: bf16",
                            "memory_limit", "1.00 GiB"})
      EXPECT_NE(m.find(key), std::string::npos) << key << " missing from: " << m;
  }
}

TrainConfig tiny_config(const TempDir& tmp, std::vector<std::string> overrides = {}) {
  const std::string yaml = fmt::format(
      "model: {}\n"
      "data:\n  train: {}\n  eval: {}\n  seq_len: 48\n  pack: false\n"
      "lora:\n  r: 4\n  dropout: 0\n"
      "optim:\n  lr: 1e-3\n"
      "batch_size: 3\n"
      "grad_accum: 2\n"
      "steps: 6\n"
      "output_dir: {}\n"
      "seed: 3\n"
      "threads: 2\n",
      src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
      src("tests/fixtures/train_data/eval.jsonl"), (tmp.path / "adapter").string());
  return parse_train_config(yaml, "tiny.yaml", overrides);
}

const MemoryArena& arena(const std::vector<MemoryArena>& v, const std::string& name) {
  for (const MemoryArena& a : v)
    if (a.name == name) return a;
  throw std::runtime_error("no arena " + name);
}

// The estimate is computed from the same sizes the step allocates: after the
// steps, every arena that was planned equals (buffers) or bounds (the backend's
// scratch) what is there.
void expect_estimate_matches_buffers(const std::vector<std::string>& overrides) {
  TempDir tmp;
  const std::string extra = fmt::format("{}", fmt::join(overrides, " "));
  Trainer t(tiny_config(tmp, overrides), nullptr);
  t.setup();
  const MemoryEstimate e = t.memory_estimate();
  for (int s = 0; s < 4; ++s) t.train_step();  // 2 epochs
  t.evaluate();
  const MemoryReport r = t.memory_report();
  ASSERT_EQ(r.arenas.size(), static_cast<size_t>(kMemoryArenaCount));
  for (const char* exact : {"weights", "weights_prepared", "weights_backward", "trainable", "gradients", "optimizer",
                            "activations"})
    EXPECT_EQ(arena(e.arenas, exact).bytes, r.bytes(exact)) << exact << " " << extra;
  EXPECT_GT(r.bytes("activations"), 0);
  EXPECT_GT(r.bytes("trainable"), 0);
  EXPECT_GT(r.bytes("loss"), 0);
  for (const char* bounded : {"backward_scratch", "loss", "data"}) {
    EXPECT_GE(arena(e.arenas, bounded).bytes, r.bytes(bounded)) << bounded << " " << extra;
    EXPECT_LE(arena(e.arenas, bounded).bytes, 2 * r.bytes(bounded) + 65536) << bounded << " " << extra;
  }
  int64_t sum = 0;
  for (const MemoryArena& a : r.arenas) sum += a.bytes;
  EXPECT_EQ(r.accounted, sum);
  EXPECT_GT(r.rss, 0);
  EXPECT_EQ(r.alarm_level, 0);
}

TEST(TrainMemory, EstimateEqualsTheBuffersOfTheSteps) {
  expect_estimate_matches_buffers({"backward=bf16"});
  expect_estimate_matches_buffers({"backward=f16", "lora.dropout=0.1"});
  expect_estimate_matches_buffers({"backward=int8"});
  expect_estimate_matches_buffers({"backward=exact"});
  expect_estimate_matches_buffers({"method=full", "backward=f16"});
}

TEST(TrainMemory, RefusesToStartAboveMemoryLimit) {
  TempDir tmp;
  Trainer t(tiny_config(tmp, {"memory_limit=1MiB"}), nullptr);
  try {
    t.setup();
    FAIL() << "setup() accepted a run above memory_limit";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
    const std::string m = e.what();
    EXPECT_NE(m.find("tiny.yaml: the run needs about"), std::string::npos) << m;
    EXPECT_NE(m.find("more than the limit of 1.0 MiB (memory_limit)"), std::string::npos) << m;
    EXPECT_NE(m.find("data.seq_len"), std::string::npos) << m;
  }
}

std::vector<nlohmann::json> json_lines(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream f(p);
  for (std::string line; std::getline(f, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// memory_alarm thresholds the tiny run's RSS is sure to pass (0.1% and 0.2% of
// 64 GiB): both raise at step 1 in one record; the top one writes a checkpoint.
TEST(TrainMemory, AlarmLogsAnAlertAndCheckpointsAtTheTopThreshold) {
  TempDir tmp;
  const fs::path log = tmp.path / "train.log.json";
  Trainer t(tiny_config(tmp, {"memory_limit=64GiB", "memory_alarm=[0.0001, 0.0002]", "log_file=" + log.string(),
                              "checkpoint_dir=" + (tmp.path / "ckpt").string()}),
            nullptr);
  t.setup();
  EXPECT_EQ(t.memory_report().alarm_level, 0);
  EXPECT_EQ(t.memory_report().limit, int64_t{64} << 30);
  EXPECT_EQ(t.memory_report().limit_source, MemoryLimitSource::config);
  t.train_step();
  EXPECT_EQ(t.memory_report().alarm_level, 2);
  t.train_step();  // still above: no second record
  int alarms = 0;
  for (const nlohmann::json& j : json_lines(log)) {
    if (j["event"]["action"] == "memory") {
      EXPECT_GT(j["loom"]["memory"]["estimate"].get<int64_t>(), 0);
      EXPECT_TRUE(j["loom"]["memory"]["arenas"].contains("activations"));
    }
    if (j["event"]["action"] != "memory_alarm") continue;
    ++alarms;
    EXPECT_EQ(j["event"]["kind"], "alert");
    EXPECT_EQ(j["log.level"], "warn");
    EXPECT_EQ(j["loom"]["step"], 1);
    EXPECT_EQ(j["loom"]["memory"]["alarm_level"], 2);
    EXPECT_NE(j["message"].get<std::string>().find("writing a checkpoint"), std::string::npos);
  }
  EXPECT_EQ(alarms, 1);
  EXPECT_FALSE(t.last_checkpoint().empty());
  EXPECT_TRUE(fs::exists(t.last_checkpoint())) << t.last_checkpoint();
}

TEST(TrainMemory, LowerAlarmOnlyLogsWithoutCheckpoint) {
  TempDir tmp;
  Trainer t(tiny_config(tmp, {"memory_limit=64GiB", "memory_alarm=[0.0001, 0.99]",
                              "checkpoint_dir=" + (tmp.path / "ckpt").string()}),
            nullptr);
  t.setup();
  t.train_step();
  EXPECT_EQ(t.memory_report().alarm_level, 1);
  EXPECT_TRUE(t.last_checkpoint().empty());
}

// 200 steps of the tiny model: RSS after step 200 within 1% of RSS after step 10.
TEST(TrainMemory, RssStaysFlatOver200Steps) {
  TempDir tmp;
  Trainer t(tiny_config(tmp, {"steps=210"}), nullptr);
  t.setup();
  for (int s = 0; s < 10; ++s) t.train_step();
  const int64_t rss0 = process_rss_bytes();
  int64_t peak = rss0;
  for (int s = 0; s < 200; ++s) {
    t.train_step();
    if (s % 50 == 49) t.evaluate();
    peak = std::max(peak, process_rss_bytes());
  }
  const int64_t rss1 = process_rss_bytes();
  EXPECT_LE(std::abs(static_cast<double>(rss1 - rss0)), 0.01 * static_cast<double>(rss0))
      << "RSS " << rss0 << " -> " << rss1;
  EXPECT_LE(static_cast<double>(peak - rss0), 0.01 * static_cast<double>(rss0)) << "peak " << peak;
}

}  // namespace
}  // namespace loom

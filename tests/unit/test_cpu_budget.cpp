// The CPU budget (affinity mask, cgroup v1/v2 quotas) and the thread-count cap
// every command uses. cgroup files come from fixture trees in a temp folder
// (finding the cgroups: test_cgroup.cpp).
#include <gtest/gtest.h>
#include <sched.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "cgroup_fixtures.h"
#include "core/cpu_budget.h"
#include "expect_error.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

class TempTree {
 public:
  TempTree() {
    std::random_device rd;
    root_ = fs::temp_directory_path() / ("loom-cgroup-" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(root_);
  }
  ~TempTree() { fs::remove_all(root_); }
  void write(const std::string& rel, const std::string& text) const {
    const fs::path p = root_ / rel.substr(1);
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string prefix() const { return root_.string(); }

 private:
  fs::path root_;
};

using test_util::kMountCgroup2;
using test_util::kMountHybrid;

}  // namespace

TEST(CpuBudget, ParsesCgroup2CpuMax) {
  EXPECT_FALSE(parse_cgroup2_cpu_max("max 100000\n").has_value());
  EXPECT_DOUBLE_EQ(*parse_cgroup2_cpu_max("150000 100000\n"), 1.5);
  EXPECT_DOUBLE_EQ(*parse_cgroup2_cpu_max("400000 100000"), 4.0);
  EXPECT_FALSE(parse_cgroup2_cpu_max("").has_value());
  EXPECT_FALSE(parse_cgroup2_cpu_max("150000").has_value());
  EXPECT_FALSE(parse_cgroup2_cpu_max("abc 100000").has_value());
  EXPECT_FALSE(parse_cgroup2_cpu_max("0 100000").has_value());
  EXPECT_FALSE(parse_cgroup2_cpu_max("100000 0").has_value());
}

TEST(CpuBudget, ParsesCgroup1Cfs) {
  EXPECT_FALSE(parse_cgroup1_cfs("-1\n", "100000\n").has_value());
  EXPECT_DOUBLE_EQ(*parse_cgroup1_cfs("200000\n", "100000\n"), 2.0);
  EXPECT_DOUBLE_EQ(*parse_cgroup1_cfs("50000", "100000"), 0.5);
  EXPECT_FALSE(parse_cgroup1_cfs("x", "100000").has_value());
  EXPECT_FALSE(parse_cgroup1_cfs("200000", "").has_value());
}

TEST(CpuBudget, Cgroup2QuotaIsTheTightestOnThePath) {
  TempTree t;
  t.write("/sys/fs/cgroup/cpu.max", "max 100000\n");  // (the root has none; a stray one must not matter)
  t.write("/sys/fs/cgroup/a/cpu.max", "200000 100000\n");
  t.write("/sys/fs/cgroup/a/b/cpu.max", "300000 100000\n");
  t.write("/sys/fs/cgroup/a/b/c/cpu.max", "max 100000\n");
  const CgroupPaths p = find_cgroup("cpu", "0::/a/b/c\n", kMountCgroup2);
  EXPECT_DOUBLE_EQ(*cgroup_cpu_quota(p, t.prefix()), 2.0);
  EXPECT_FALSE(cgroup_cpu_quota(find_cgroup("cpu", "0::/other\n", kMountCgroup2), t.prefix()).has_value());
  // A container with its own cgroup namespace sees its cgroup as "/".
  t.write("/sys/fs/cgroup/cpu.max", "150000 100000\n");
  EXPECT_DOUBLE_EQ(*cgroup_cpu_quota(find_cgroup("cpu", "0::/\n", kMountCgroup2), t.prefix()), 1.5);
}

TEST(CpuBudget, Cgroup1QuotaAndMountRoots) {
  TempTree t;
  t.write("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n");
  t.write("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  t.write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  t.write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  const CgroupPaths p = find_cgroup("cpu", "4:cpu,cpuacct:/docker/abc\n", kMountHybrid);
  EXPECT_DOUBLE_EQ(*cgroup_cpu_quota(p, t.prefix()), 1.5);
  // A container that sees only its own cgroup mounted at the top (mount root
  // /docker/abc): the files at the mount's top are its limits.
  TempTree u;
  u.write("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "300000\n");
  u.write("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n");
  const CgroupPaths q = find_cgroup("cpu", "3:cpu:/docker/abc\n",
                                    "28 25 0:25 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n");
  EXPECT_EQ(q.v1.mount_root, "/docker/abc");
  EXPECT_DOUBLE_EQ(*cgroup_cpu_quota(q, u.prefix()), 3.0);
  // Both hierarchies limit: the tighter wins.
  t.write("/sys/fs/cgroup/unified/docker/abc/cpu.max", "100000 100000\n");
  const CgroupPaths both = find_cgroup("cpu", "4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n", kMountHybrid);
  EXPECT_DOUBLE_EQ(*cgroup_cpu_quota(both, t.prefix()), 1.0);
}

TEST(CpuBudget, AffinityMaskOfTheCallingThread) {
  cpu_set_t all;
  CPU_ZERO(&all);
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  EXPECT_EQ(affinity_cpu_count(), CPU_COUNT(&all));
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  int pinned_count = 0, budget_usable = 0;
  std::thread th([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    if (sched_setaffinity(0, sizeof(one), &one) != 0) return;
    pinned_count = affinity_cpu_count();
    budget_usable = cpu_budget().usable;
  });
  th.join();
  EXPECT_EQ(pinned_count, 1);
  EXPECT_EQ(budget_usable, 1);
  const CpuBudget b = cpu_budget();
  EXPECT_GE(b.usable, 1);
  EXPECT_LE(b.usable, b.affinity);
  EXPECT_LE(default_thread_count(), b.usable);
}

TEST(CpuBudget, ChooseThreadCountCapsAndRejects) {
  EXPECT_EQ(choose_thread_count(64, 2, 2).threads, 2);
  EXPECT_TRUE(choose_thread_count(64, 2, 2).capped);
  EXPECT_EQ(choose_thread_count(1, 2, 2).threads, 1);
  EXPECT_FALSE(choose_thread_count(2, 2, 2).capped);
  EXPECT_EQ(choose_thread_count(0, 8, 4).threads, 4);  // a default above the quota is capped silently
  EXPECT_FALSE(choose_thread_count(0, 8, 4).capped);
  EXPECT_EQ(choose_thread_count(3, 1, 0).threads, 1);  // usable is at least one CPU
  test_util::expect_error([] { choose_thread_count(-1, 2, 2); }, ErrorKind::invalid_input, {">= 1", "-1"});
  test_util::expect_error([] { resolve_thread_count(-4, "-t"); }, ErrorKind::invalid_input, {"-t", "-4"});
}

TEST(CpuBudget, ResolveWarnsWhenCapping) {
  const int usable = cpu_budget().usable;
  testing::internal::CaptureStderr();
  const int n = resolve_thread_count(1 << 20, "-t");
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(n, usable);
  EXPECT_NE(err.find("warning: -t 1048576"), std::string::npos) << err;
  EXPECT_NE(err.find("using " + std::to_string(usable) + " threads"), std::string::npos) << err;
  testing::internal::CaptureStderr();
  EXPECT_EQ(resolve_thread_count(1, "-t"), 1);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

}  // namespace loom

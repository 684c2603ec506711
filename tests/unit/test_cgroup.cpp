// Finding a controller's cgroup (core/cgroup.h): the process's path in each
// hierarchy from /proc/self/cgroup, where mountinfo mounts it, and the folders
// from the process's cgroup up to the mount's top. The limits read from them:
// test_cpu_budget.cpp (CPU quota) and test_train_memory.cpp (memory limit).
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cgroup_fixtures.h"
#include "core/cgroup.h"

namespace loom {
namespace {

using Dirs = std::vector<std::string>;

using test_util::kMountCgroup2;
using test_util::kMountHybrid;
constexpr const char* kCgroupHybrid =
    "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n";

}  // namespace

TEST(Cgroup, FindsPathsAndMounts) {
  const CgroupPaths v2 = find_cgroup("cpu", "0::/user.slice/session-3.scope\n", kMountCgroup2);
  EXPECT_EQ(v2.v2.path, "/user.slice/session-3.scope");
  EXPECT_EQ(v2.v2.mount, "/sys/fs/cgroup");
  EXPECT_EQ(v2.v2.mount_root, "/");
  EXPECT_TRUE(v2.v1.mount.empty());

  const CgroupPaths cpu = find_cgroup("cpu", kCgroupHybrid, kMountHybrid);
  EXPECT_EQ(cpu.v1.path, "/docker/abc");
  EXPECT_EQ(cpu.v1.mount, "/sys/fs/cgroup/cpu,cpuacct");
  EXPECT_EQ(cpu.v2.mount, "/sys/fs/cgroup/unified");
  EXPECT_EQ(cpu.v2.path, "/docker/abc");
  // The controller picks the v1 hierarchy: "memory", not a prefix of another name.
  const CgroupPaths mem = find_cgroup("memory", "12:memory:/m\n4:cpu,cpuacct:/c\n", kMountHybrid);
  EXPECT_EQ(mem.v1.path, "/m");
  EXPECT_EQ(mem.v1.mount, "/sys/fs/cgroup/memory");
  EXPECT_TRUE(
      find_cgroup("cpuacct", "4:cpu:/c\n", "28 25 0:25 / /x rw - cgroup cgroup rw,cpu\n").v1.path.empty());
  // "name=systemd" is a v1 line without controllers, not the v2 one.
  EXPECT_TRUE(find_cgroup("cpu", "1:name=systemd:/s\n", kMountHybrid).v2.path.empty());

  // A mount point with a space is escaped as \040.
  const CgroupPaths esc =
      find_cgroup("cpu", "0::/\n", "30 24 0:26 / /mnt/cg\\040two rw - cgroup2 cgroup2 rw\n");
  EXPECT_EQ(esc.v2.mount, "/mnt/cg two");
  // Lines that are not cgroup lines are skipped.
  const CgroupPaths junk = find_cgroup("cpu", "garbage\n\n", "not a mount line\n");
  EXPECT_TRUE(junk.v2.path.empty() && junk.v2.mount.empty() && junk.v1.path.empty() && junk.v1.mount.empty());
}

TEST(Cgroup, DirsUpFromTheProcessCgroupToTheMountTop) {
  EXPECT_EQ(cgroup_dirs_up({"/sys/fs/cgroup", "/", "/a/b"}, "/fx"),
            (Dirs{"/fx/sys/fs/cgroup/a/b", "/fx/sys/fs/cgroup/a", "/fx/sys/fs/cgroup"}));
  EXPECT_EQ(cgroup_dirs_up({"/sys/fs/cgroup", "/", "/"}), (Dirs{"/sys/fs/cgroup"}));
  // A mount of a subtree: the process's path relative to it; outside it: the top only.
  EXPECT_EQ(cgroup_dirs_up({"/cg", "/kubepods/pod1", "/kubepods/pod1/c1"}), (Dirs{"/cg/c1", "/cg"}));
  EXPECT_EQ(cgroup_dirs_up({"/cg", "/kubepods/pod1", "/kubepods/pod1"}), (Dirs{"/cg"}));
  EXPECT_EQ(cgroup_dirs_up({"/cg", "/kubepods/pod1", "/kubepods/pod10/c"}), (Dirs{"/cg"}));
  // Not mounted, or the process in no cgroup of it.
  EXPECT_TRUE(cgroup_dirs_up({"", "", "/a"}).empty());
  EXPECT_TRUE(cgroup_dirs_up({"/cg", "/", ""}).empty());
}

TEST(Cgroup, TightestLimitOverBothHierarchies) {
  const CgroupPaths p{{"/v2", "/", "/a/b"}, {"/v1", "/", "/j"}};
  // Limits by folder: the least wins, whichever hierarchy holds it.
  auto at = [](std::vector<std::pair<std::string, int>> limits) {
    return [limits](const std::string& dir) -> std::optional<int> {
      for (const auto& [d, v] : limits)
        if (d == dir) return v;
      return std::nullopt;
    };
  };
  EXPECT_EQ(tightest_cgroup_limit<int>(p, "", at({{"/v2/a", 5}, {"/v2", 9}}), at({})), 5);
  EXPECT_EQ(tightest_cgroup_limit<int>(p, "", at({{"/v2/a/b", 8}}), at({{"/v1", 3}, {"/v1/j", 4}})), 3);
  EXPECT_FALSE(tightest_cgroup_limit<int>(p, "", at({{"/v2/x", 1}}), at({{"/v1/a", 1}})));
}

TEST(Cgroup, SmallFileHelpers) {
  EXPECT_EQ(trim_blank(" \t12\n"), "12");
  EXPECT_EQ(parse_trimmed_int(" -1\n"), -1);
  EXPECT_EQ(parse_trimmed_int("9223372036854771712"), int64_t{9223372036854771712});
  EXPECT_FALSE(parse_trimmed_int("12abc"));
  EXPECT_FALSE(parse_trimmed_int(""));
  EXPECT_FALSE(parse_trimmed_int("99999999999999999999"));
  EXPECT_EQ(split_on("a,b,", ','), (std::vector<std::string_view>{"a", "b", ""}));
  EXPECT_EQ(split_on("", ','), (std::vector<std::string_view>{""}));
  EXPECT_FALSE(read_small_file("/nonexistent/loom/cgroup/file"));
}

}  // namespace loom

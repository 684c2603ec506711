// Linux cgroups, v1 and v2, for the limits a process runs under: which cgroup
// the process is in for a controller (/proc/self/cgroup), where that hierarchy
// is mounted (/proc/self/mountinfo), and the walk from the process's cgroup up
// to the mount's top that keeps the tightest limit (parents limit children).
// The CPU budget (core/cpu_budget.h: cpu.max, cpu.cfs_quota_us) and the
// training memory limit (train/memory.h: memory.max, memory.limit_in_bytes)
// read their own files through it. Also the small-file readers they share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/text.h"  // trim_blank, split_on

namespace loom {

// ---- small /proc and /sys files ----------------------------------------------

// The whole text of a small file; nullopt when it cannot be read.
std::optional<std::string> read_small_file(const std::string& path);
// The trimmed text as one decimal integer (sign allowed); nullopt for anything else.
std::optional<int64_t> parse_trimmed_int(std::string_view s);

// ---- where a controller's cgroup is ------------------------------------------

// One hierarchy: where it is mounted, the cgroup path the mount shows as its
// top, and the process's cgroup path in it. Empty mount or path: not there.
struct CgroupHierarchy {
  std::string mount, mount_root, path;
};
// The unified v2 hierarchy and the v1 hierarchy holding the controller.
struct CgroupPaths {
  CgroupHierarchy v2, v1;
};

// From the texts of /proc/self/cgroup and /proc/self/mountinfo; `controller`
// picks the v1 hierarchy ("cpu", "memory"; v2 serves every controller).
CgroupPaths find_cgroup(std::string_view controller, std::string_view proc_self_cgroup,
                        std::string_view mountinfo);
// find_cgroup for this process now; all empty when /proc cannot be read.
CgroupPaths own_cgroup(std::string_view controller);

// The folders from the process's cgroup up to the top of the hierarchy's mount,
// the process's own first, each under `fs_prefix` (empty for the live system,
// a fixture folder in tests). A process outside the mount's subtree (a
// container's own cgroup bound at the top) gets the top only. Empty when the
// hierarchy is not there.
std::vector<std::string> cgroup_dirs_up(const CgroupHierarchy& h, const std::string& fs_prefix = "");

// The least of the limits `read_v2(dir)` and `read_v1(dir)` (each an
// std::optional<T>, nullopt: no limit there) over both hierarchies'
// cgroup_dirs_up; nullopt when none limits.
template <class T, class ReadV2, class ReadV1>
std::optional<T> tightest_cgroup_limit(const CgroupPaths& p, const std::string& fs_prefix, ReadV2 read_v2,
                                       ReadV1 read_v1) {
  std::optional<T> best;
  auto keep = [&](const std::optional<T>& v) {
    if (v) best = best ? std::min(*best, *v) : *v;
  };
  for (const std::string& dir : cgroup_dirs_up(p.v2, fs_prefix)) keep(read_v2(dir));
  for (const std::string& dir : cgroup_dirs_up(p.v1, fs_prefix)) keep(read_v1(dir));
  return best;
}

}  // namespace loom

// How many CPUs this process may really use (its affinity mask and its cgroup's
// CPU bandwidth quota), and the one function every command resolves its thread
// count with: loom's pools spin briefly between operations, so more threads than
// usable CPUs only makes every operation wait for descheduled threads.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "core/cgroup.h"

namespace loom {

// CPUs in the calling thread's affinity mask (sched_getaffinity, any CPU count);
// at least 1.
int affinity_cpu_count();

// cgroup v2 cpu.max ("max 100000" or "150000 100000"): the quota in CPUs, or
// nullopt for no limit or text that is not a cpu.max line.
std::optional<double> parse_cgroup2_cpu_max(std::string_view text);
// cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us: the quota in CPUs, or nullopt
// for no limit (-1) or unreadable text.
std::optional<double> parse_cgroup1_cfs(std::string_view quota_us, std::string_view period_us);

// The tightest CPU quota from the process's cgroup up to the hierarchy's root
// (parents limit children), v1 and v2 alike, for the cgroups of
// find_cgroup("cpu", ...) (core/cgroup.h); files are read under `fs_prefix`
// (empty for the live system, a fixture folder in tests). nullopt: no quota.
std::optional<double> cgroup_cpu_quota(const CgroupPaths& paths, const std::string& fs_prefix = "");

struct CpuBudget {
  int affinity = 1;             // CPUs in the affinity mask
  std::optional<double> quota;  // cgroup quota in CPUs, if any
  int usable = 1;               // min(affinity, ceil(quota)), at least 1
};
// This process, now (reads /proc and /sys; cheap, but not free: call it once per command).
CpuBudget cpu_budget();

// Physical cores in the affinity mask, at most the usable CPUs: what -t defaults to.
int default_thread_count();

// Threads to run with: 0 means the default; more than `usable` CPUs is capped to
// `usable` (capped = true). Negative counts throw loom::Error(invalid_input).
struct ThreadChoice {
  int threads = 1;
  bool capped = false;
};
ThreadChoice choose_thread_count(int requested, int default_threads, int usable);

// choose_thread_count with this process's budget; a cap prints one warning on
// stderr naming `source` (e.g. "-t" or "threads"), the requested and the used
// counts and why.
int resolve_thread_count(int requested, std::string_view source);

}  // namespace loom

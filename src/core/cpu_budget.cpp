#include "core/cpu_budget.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <utility>
#include <vector>

#include "core/error.h"

namespace loom {

int affinity_cpu_count() {
  // Grow the mask until the kernel accepts it (machines with more than 1024 CPUs).
  for (int n = 1024; n <= (1 << 20); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) return 1;
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    const int rc = sched_getaffinity(0, bytes, set);
    const int err = errno, count = rc == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (rc == 0) return std::max(1, count);
    if (err != EINVAL) return 1;
  }
  return 1;
}

std::optional<double> parse_cgroup2_cpu_max(std::string_view text) {
  const std::vector<std::string_view> f = split_on(trim_blank(text), ' ');
  if (f.size() != 2 || f[0] == "max") return std::nullopt;
  const auto quota = parse_trimmed_int(f[0]), period = parse_trimmed_int(f[1]);
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;
  return static_cast<double>(*quota) / static_cast<double>(*period);
}

std::optional<double> parse_cgroup1_cfs(std::string_view quota_us, std::string_view period_us) {
  const auto quota = parse_trimmed_int(quota_us), period = parse_trimmed_int(period_us);
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;  // -1: no limit
  return static_cast<double>(*quota) / static_cast<double>(*period);
}

std::optional<double> cgroup_cpu_quota(const CgroupPaths& p, const std::string& fs_prefix) {
  return tightest_cgroup_limit<double>(
      p, fs_prefix,
      [](const std::string& dir) -> std::optional<double> {
        const auto t = read_small_file(dir + "/cpu.max");
        return t ? parse_cgroup2_cpu_max(*t) : std::nullopt;
      },
      [](const std::string& dir) -> std::optional<double> {
        const auto q = read_small_file(dir + "/cpu.cfs_quota_us");
        const auto per = read_small_file(dir + "/cpu.cfs_period_us");
        return q && per ? parse_cgroup1_cfs(*q, *per) : std::nullopt;
      });
}

CpuBudget cpu_budget() {
  CpuBudget b;
  b.affinity = affinity_cpu_count();
  b.quota = cgroup_cpu_quota(own_cgroup("cpu"));
  b.usable = b.affinity;
  // A quota of 1.5 CPUs runs two threads at 75%: round up, as Go and the JVM do.
  if (b.quota) b.usable = std::min(b.usable, std::max(1, static_cast<int>(std::ceil(*b.quota - 1e-9))));
  return b;
}

int default_thread_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int physical = 1;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    std::set<std::pair<int, int>> cores;  // (package, core) pairs
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &set)) continue;
      const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
      std::ifstream core_f(base + "core_id"), pkg_f(base + "physical_package_id");
      int core = -1, pkg = -1;
      if (!(core_f >> core) || !(pkg_f >> pkg)) { cores.insert({-1, cpu}); continue; }
      cores.insert({pkg, core});
    }
    physical = std::max<int>(1, static_cast<int>(cores.size()));
  }
  return std::min(physical, cpu_budget().usable);
}

ThreadChoice choose_thread_count(int requested, int default_threads, int usable) {
  if (requested < 0) fail(ErrorKind::invalid_input, "thread count must be >= 1 (got {})", requested);
  usable = std::max(1, usable);
  if (requested == 0) return {std::clamp(default_threads, 1, usable), false};
  if (requested > usable) return {usable, true};
  return {requested, false};
}

int resolve_thread_count(int requested, std::string_view source) {
  if (requested < 0)
    fail(ErrorKind::invalid_input, "{}: thread count must be >= 1 (got {})", source, requested);
  const CpuBudget b = cpu_budget();
  const ThreadChoice c = choose_thread_count(requested, requested == 0 ? default_thread_count() : 1, b.usable);
  if (c.capped) {
    const std::string quota = b.quota ? fmt::format("{:.2f} CPUs", *b.quota) : std::string("none");
    std::fprintf(stderr,
                 "loom: warning: %.*s %d asks for %d threads, but this process may use %d CPUs "
                 "(affinity mask: %d, cgroup quota: %s); using %d threads\n",
                 static_cast<int>(source.size()), source.data(), requested, requested, b.usable, b.affinity,
                 quota.c_str(), c.threads);
  }
  return c.threads;
}

}  // namespace loom

#include "core/cpu_budget.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "core/error.h"

namespace loom {
namespace {

std::optional<std::string> read_small_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

std::optional<long long> parse_int(std::string_view s) {
  s = trim(s);
  long long v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (size_t b = 0;;) {
    const size_t e = s.find(sep, b);
    out.push_back(s.substr(b, e == std::string_view::npos ? std::string_view::npos : e - b));
    if (e == std::string_view::npos) return out;
    b = e + 1;
  }
}

bool has_item(std::string_view comma_list, std::string_view item) {
  for (std::string_view x : split(comma_list, ','))
    if (x == item) return true;
  return false;
}

// mountinfo escapes spaces and the like as \ooo.
std::string unescape_mount(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      const std::string_view o = s.substr(i + 1, 3);
      if (std::all_of(o.begin(), o.end(), [](char c) { return c >= '0' && c <= '7'; })) {
        out.push_back(static_cast<char>((o[0] - '0') * 64 + (o[1] - '0') * 8 + (o[2] - '0')));
        i += 3;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

// The process's cgroup path relative to a mount whose root is `mount_root`: a
// mount of an unrelated subtree (a container's own cgroup bound at the top)
// is read from its top.
std::string relative_to_mount(const std::string& path, const std::string& mount_root) {
  if (mount_root.empty() || mount_root == "/") return path.empty() ? "/" : path;
  if (path.compare(0, mount_root.size(), mount_root) == 0 &&
      (path.size() == mount_root.size() || path[mount_root.size()] == '/')) {
    const std::string rest = path.substr(mount_root.size());
    return rest.empty() ? "/" : rest;
  }
  return "/";
}

// Min over the limits `read(dir)` finds from `path` up to the mount's top.
template <class Read>
std::optional<double> tightest_on_path(const std::string& dir_prefix, std::string path, Read read) {
  std::optional<double> best;
  for (;;) {
    if (const auto q = read(dir_prefix + (path == "/" ? "" : path))) best = best ? std::min(*best, *q) : *q;
    if (path == "/" || path.empty()) return best;
    const size_t slash = path.rfind('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
}

}  // namespace

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
  const std::vector<std::string_view> f = split(trim(text), ' ');
  if (f.size() != 2 || f[0] == "max") return std::nullopt;
  const auto quota = parse_int(f[0]), period = parse_int(f[1]);
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;
  return static_cast<double>(*quota) / static_cast<double>(*period);
}

std::optional<double> parse_cgroup1_cfs(std::string_view quota_us, std::string_view period_us) {
  const auto quota = parse_int(quota_us), period = parse_int(period_us);
  if (!quota || !period || *quota <= 0 || *period <= 0) return std::nullopt;  // -1: no limit
  return static_cast<double>(*quota) / static_cast<double>(*period);
}

CgroupCpuPaths parse_cgroup_paths(std::string_view proc_self_cgroup, std::string_view mountinfo) {
  CgroupCpuPaths p;
  for (std::string_view line : split(proc_self_cgroup, '\n')) {
    const size_t a = line.find(':'), b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, a), ctl = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (id == "0" && ctl.empty())
      p.v2_path = std::string(path);
    else if (has_item(ctl, "cpu"))
      p.v1_path = std::string(path);
  }
  for (std::string_view line : split(mountinfo, '\n')) {
    const size_t dash = line.find(" - ");
    if (dash == std::string_view::npos) continue;
    const std::vector<std::string_view> pre = split(line.substr(0, dash), ' ');
    const std::vector<std::string_view> post = split(line.substr(dash + 3), ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    if (post[0] == "cgroup2" && p.v2_mount.empty()) {
      p.v2_mount = unescape_mount(pre[4]);
      p.v2_mount_root = unescape_mount(pre[3]);
    } else if (post[0] == "cgroup" && has_item(post[2], "cpu") && p.v1_mount.empty()) {
      p.v1_mount = unescape_mount(pre[4]);
      p.v1_mount_root = unescape_mount(pre[3]);
    }
  }
  return p;
}

std::optional<double> cgroup_cpu_quota(const CgroupCpuPaths& p, const std::string& fs_prefix) {
  std::optional<double> best;
  auto keep = [&](std::optional<double> q) {
    if (q) best = best ? std::min(*best, *q) : *q;
  };
  if (!p.v2_mount.empty() && !p.v2_path.empty())
    keep(tightest_on_path(fs_prefix + p.v2_mount, relative_to_mount(p.v2_path, p.v2_mount_root),
                          [](const std::string& dir) -> std::optional<double> {
                            const auto t = read_small_file(dir + "/cpu.max");
                            return t ? parse_cgroup2_cpu_max(*t) : std::nullopt;
                          }));
  if (!p.v1_mount.empty() && !p.v1_path.empty())
    keep(tightest_on_path(fs_prefix + p.v1_mount, relative_to_mount(p.v1_path, p.v1_mount_root),
                          [](const std::string& dir) -> std::optional<double> {
                            const auto q = read_small_file(dir + "/cpu.cfs_quota_us");
                            const auto per = read_small_file(dir + "/cpu.cfs_period_us");
                            return q && per ? parse_cgroup1_cfs(*q, *per) : std::nullopt;
                          }));
  return best;
}

CpuBudget cpu_budget() {
  CpuBudget b;
  b.affinity = affinity_cpu_count();
  const auto cg = read_small_file("/proc/self/cgroup"), mi = read_small_file("/proc/self/mountinfo");
  if (cg && mi) b.quota = cgroup_cpu_quota(parse_cgroup_paths(*cg, *mi));
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

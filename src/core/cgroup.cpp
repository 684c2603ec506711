// cgroup discovery and the walk to the tightest limit (cgroup.h).
#include "core/cgroup.h"

#include <charconv>
#include <fstream>
#include <sstream>

namespace loom {
namespace {

bool has_item(std::string_view comma_list, std::string_view item) {
  for (std::string_view x : split_on(comma_list, ','))
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
  if (mount_root.empty() || mount_root == "/") return path;
  if (path.compare(0, mount_root.size(), mount_root) == 0 &&
      (path.size() == mount_root.size() || path[mount_root.size()] == '/')) {
    const std::string rest = path.substr(mount_root.size());
    return rest.empty() ? "/" : rest;
  }
  return "/";
}

}  // namespace

std::optional<std::string> read_small_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::optional<int64_t> parse_trimmed_int(std::string_view s) {
  s = trim_blank(s);
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

CgroupPaths find_cgroup(std::string_view controller, std::string_view proc_self_cgroup,
                        std::string_view mountinfo) {
  CgroupPaths p;
  // Lines "id:controllers:path": v2 is "0::/path"; a v1 line lists its controllers.
  for (std::string_view line : split_on(proc_self_cgroup, '\n')) {
    const size_t a = line.find(':'), b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, a), ctl = line.substr(a + 1, b - a - 1);
    const std::string_view raw = line.substr(b + 1);
    std::string path = raw.empty() || raw[0] != '/' ? "/" : "";
    path += raw;
    if (id == "0" && ctl.empty())
      p.v2.path = std::move(path);
    else if (has_item(ctl, controller))
      p.v1.path = std::move(path);
  }
  // Lines "id parent major:minor root mount-point options ... - fstype source super-options".
  for (std::string_view line : split_on(mountinfo, '\n')) {
    const size_t dash = line.find(" - ");
    if (dash == std::string_view::npos) continue;
    const std::vector<std::string_view> pre = split_on(line.substr(0, dash), ' ');
    const std::vector<std::string_view> post = split_on(line.substr(dash + 3), ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    CgroupHierarchy* h = post[0] == "cgroup2"                                   ? &p.v2
                         : post[0] == "cgroup" && has_item(post[2], controller) ? &p.v1
                                                                                : nullptr;
    if (h == nullptr || !h->mount.empty()) continue;  // the first mount of a hierarchy
    h->mount = unescape_mount(pre[4]);
    h->mount_root = unescape_mount(pre[3]);
  }
  return p;
}

CgroupPaths own_cgroup(std::string_view controller) {
  const auto cg = read_small_file("/proc/self/cgroup"), mi = read_small_file("/proc/self/mountinfo");
  if (!cg || !mi) return {};
  return find_cgroup(controller, *cg, *mi);
}

std::vector<std::string> cgroup_dirs_up(const CgroupHierarchy& h, const std::string& fs_prefix) {
  std::vector<std::string> dirs;
  if (h.mount.empty() || h.path.empty()) return dirs;
  const std::string top = fs_prefix + h.mount;
  for (std::string path = relative_to_mount(h.path, h.mount_root);;) {
    dirs.push_back(path == "/" ? top : top + path);
    if (path == "/") return dirs;
    const size_t slash = path.rfind('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
}

}  // namespace loom

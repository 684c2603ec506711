#include "core/cache_dir.h"

#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>

namespace loom {

std::string user_cache_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return (std::filesystem::path(x) / "loom").string();
  if (const char* h = std::getenv("HOME"); h && *h) return (std::filesystem::path(h) / ".cache" / "loom").string();
  return {};
}

std::string file_identity(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p = fs::canonical(path, ec);
  if (ec) return "unknown";
  const auto size = fs::is_regular_file(p, ec) ? fs::file_size(p, ec) : 0;
  const auto time = fs::last_write_time(p, ec);
  if (ec) return "unknown";
  return fmt::format("{}:{}:{}", p.string(), size, time.time_since_epoch().count());
}

std::string executable_identity() { return file_identity("/proc/self/exe"); }

}  // namespace loom

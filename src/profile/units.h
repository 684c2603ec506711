// How the report and the advice write numbers: shares as percentages, times in
// ms or s, bytes in MiB / GiB.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <string>

namespace loom {

inline std::string pct(double share) { return fmt::format("{:.1f}%", 100 * share); }

inline std::string ms(double us) {
  if (us >= 1e6) return fmt::format("{:.2f} s", us / 1e6);
  if (us >= 1e3) return fmt::format("{:.1f} ms", us / 1e3);
  if (us >= 10) return fmt::format("{:.0f} us", us);
  return fmt::format("{:.2f} us", us);
}

inline std::string mib(double bytes) {
  if (bytes >= double(1 << 30)) return fmt::format("{:.2f} GiB", bytes / double(1 << 30));
  return fmt::format("{:.1f} MiB", bytes / double(1 << 20));
}

}  // namespace loom

// Memory accounting of a training run (memory.h): /proc and cgroup readers,
// the estimate's text and check, and the alarm levels.
#include "train/memory.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/cgroup.h"
#include "core/error.h"

namespace loom {

const char* memory_limit_source_name(MemoryLimitSource s) {
  switch (s) {
    case MemoryLimitSource::config: return "memory_limit";
    case MemoryLimitSource::cgroup: return "cgroup";
    case MemoryLimitSource::available: return "MemAvailable";
  }
  return "?";
}

int64_t MemoryReport::bytes(std::string_view arena) const {
  for (const MemoryArena& a : arenas)
    if (a.name == arena) return a.bytes;
  return 0;
}

int64_t process_rss_bytes() {
  // statm: size resident shared text lib data dt, in pages. A read of a small
  // file: ~10 us, cheap enough after every optimizer step.
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  if (n != 2) return 0;
  return static_cast<int64_t>(resident) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

std::optional<int64_t> parse_meminfo_available(std::string_view meminfo) {
  constexpr std::string_view key = "MemAvailable:";
  const size_t at = meminfo.find(key);
  if (at == std::string_view::npos || (at > 0 && meminfo[at - 1] != '\n')) return std::nullopt;
  std::string_view line = meminfo.substr(at + key.size());
  line = line.substr(0, line.find('\n'));
  line = trim_blank(line);
  const size_t kb = line.find(" kB");
  if (kb == std::string_view::npos) return std::nullopt;
  const auto v = parse_trimmed_int(line.substr(0, kb));
  if (!v || *v < 0) return std::nullopt;
  return *v * 1024;
}

std::optional<int64_t> parse_cgroup_limit(std::string_view text) {
  text = trim_blank(text);
  if (text == "max") return std::nullopt;
  const auto v = parse_trimmed_int(text);
  // cgroup v1 writes "no limit" as the largest page-aligned int64 (2^63 - 4096).
  if (!v || *v < 0 || *v >= (int64_t{1} << 62)) return std::nullopt;
  return v;
}

std::optional<int64_t> cgroup_memory_limit(const CgroupPaths& p, const std::string& fs_prefix) {
  auto read = [](const char* file) {
    return [file](const std::string& dir) -> std::optional<int64_t> {
      const auto t = read_small_file(dir + "/" + file);
      return t ? parse_cgroup_limit(*t) : std::nullopt;
    };
  };
  return tightest_cgroup_limit<int64_t>(p, fs_prefix, read("memory.max"), read("memory.limit_in_bytes"));
}

MemoryLimit resolve_memory_limit(int64_t configured) {
  if (configured > 0) return {configured, MemoryLimitSource::config};
  if (const auto v = cgroup_memory_limit(own_cgroup("memory"))) return {*v, MemoryLimitSource::cgroup};
  const auto info = read_small_file("/proc/meminfo");
  const auto avail = info ? parse_meminfo_available(*info) : std::nullopt;
  // What is free for the run: available memory plus what this process already holds.
  return {avail.value_or(0) + process_rss_bytes(), MemoryLimitSource::available};
}

std::string format_bytes(int64_t bytes) {
  const auto b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / (1 << 20));
  return fmt::format("{:.1f} KiB", b / 1024);
}

std::string format_memory_estimate(const MemoryEstimate& e) {
  // Arenas in the total's unit: GiB from 1 GiB on, else MiB.
  const bool gib = e.total >= (int64_t{1} << 30);
  const double unit = gib ? double(1 << 30) : double(1 << 20);
  const char* fmt_arena = gib ? "{}{} {:.3f}" : "{}{} {:.1f}";
  std::string s = fmt::format("needs about {}:", format_bytes(e.total));
  const char* sep = " ";
  auto add = [&](const std::string& name, int64_t bytes) {
    s += fmt::format(fmt::runtime(fmt_arena), sep, name, static_cast<double>(bytes) / unit);
    sep = ", ";
  };
  for (const MemoryArena& a : e.arenas)
    if (a.bytes > 0) add(a.name, a.bytes);
  if (e.other > 0) add("other", e.other);
  return s + fmt::format(" ({}; micro-batches of {} x {} tokens)", gib ? "GiB" : "MiB", e.batch_rows, e.seq_len);
}

void check_memory_estimate(const MemoryEstimate& e, const MemoryLimit& limit, const std::string& source) {
  if (limit.bytes <= 0 || e.total <= limit.bytes) return;
  fail(ErrorKind::invalid_input,
       "{}: the run {}, more than the limit of {} ({}); lower data.seq_len or batch_size (raise grad_accum to keep "
       "the rows per step), or use method: lora, or backward: exact (no transposed weight copies), or "
       "gradient_checkpointing: N (only every Nth layer's input kept) and activation_dtype: bf16. Set "
       "memory_limit to override the limit",
       source, format_memory_estimate(e), format_bytes(limit.bytes),
       limit.source == MemoryLimitSource::config ? "memory_limit"
       : limit.source == MemoryLimitSource::cgroup ? "the cgroup's memory limit"
                                                    : "the memory available at start");
}

MemoryAlarm::MemoryAlarm(std::vector<double> thresholds, int64_t limit, double hysteresis)
    : thresholds_(std::move(thresholds)), limit_(limit), hysteresis_(hysteresis) {
  LOOM_ASSERT(std::is_sorted(thresholds_.begin(), thresholds_.end()) && hysteresis_ >= 0);
}

std::optional<MemoryAlarm::Change> MemoryAlarm::update(int64_t rss) {
  if (limit_ <= 0) return std::nullopt;
  const double f = static_cast<double>(rss) / static_cast<double>(limit_);
  int level = level_;
  while (level < levels() && f >= thresholds_[static_cast<size_t>(level)]) ++level;
  if (level == level_)
    while (level > 0 && f < thresholds_[static_cast<size_t>(level - 1)] - hysteresis_) --level;
  if (level == level_) return std::nullopt;
  Change c{.from = level_, .to = level, .threshold = 0, .fraction = f};
  c.threshold = thresholds_[static_cast<size_t>(level > level_ ? level - 1 : level)];
  level_ = level;
  return c;
}

}  // namespace loom

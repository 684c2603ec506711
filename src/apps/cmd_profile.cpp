// `loom profile report|advise OUT.json`: the hot spots of a --profile trace
// (time by phase, op kind, layer; matmul classes against this machine's
// measured peak) and rules that name the setting to change
// (docs/profiling.md). The peak is measured once per machine, thread count and
// loom build, and cached.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "core/cache_dir.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "profile/advice.h"
#include "profile/analysis.h"
#include "profile/peak.h"
#include "profile/report.h"
#include "profile/trace_file.h"

namespace loom::app {
namespace {

struct PeakFlags {
  std::string cache;  // empty: the default folder
  bool none = false, remeasure = false;
};

void add_common_flags(CLI::App& cmd, std::string& trace, bool& json, PeakFlags& peak) {
  cmd.add_option("trace", trace, "a trace written by --profile (Chrome Trace Event JSON)")->required();
  cmd.add_flag("--json", json, "print one JSON object instead of text");
  auto* cache =
      cmd.add_option("--peak-cache", peak.cache,
                     "the peak file to read or write (default: $XDG_CACHE_HOME/loom or ~/.cache/loom, "
                     "peak-<hash of cpu, threads, build>.json)");
  cmd.add_flag("--no-peak", peak.none, "do not measure or read this machine's peak (no % of peak)")
      ->excludes(cache);
  cmd.add_flag("--remeasure", peak.remeasure, "measure the peak again even when a cached one fits");
}

// This build of loom, for the peak's cache key: the executable's size and
// time, so that a rebuilt loom (other kernels) measures again.
// The peak for the trace's thread count, cached; null with --no-peak.
std::optional<PeakTable> load_peak(const Trace& t, const Analysis& a, const PeakFlags& flags) {
  if (flags.none) return std::nullopt;
  const int threads =
      resolve_thread_count(static_cast<int>(std::max<int64_t>(a.threads, 1)), "the trace's threads");
  PeakKey key;
  key.cpu = cpu_model_name();
  key.threads = threads;
  key.build = executable_identity();
  if (const char* mask = std::getenv("LOOM_CPU")) key.cpu_mask = mask;
  if (!t.meta.cpu.empty() && t.meta.cpu != key.cpu)
    std::fprintf(stderr,
                 "loom profile: warning: the trace was recorded on '%s'; peaks are measured here, on '%s'\n",
                 t.meta.cpu.c_str(), key.cpu.c_str());
  std::string path = flags.cache;
  if (path.empty()) {
    const std::string dir = default_peak_cache_dir();
    if (!dir.empty()) path = peak_cache_path(dir, key);
  }
  ThreadPool pool(threads);
  bool told = false;
  const auto progress = [&](const std::string&) {
    if (!told)
      std::fprintf(
          stderr,
          "loom profile: measuring this machine's peak with %d threads (once, about 20 s; then cached)\n",
          threads);
    told = true;
  };
  CachedPeak c = cached_peak(pool, key, path, flags.remeasure, PeakOptions{}, progress);
  if (!c.note.empty()) std::fprintf(stderr, "loom profile: note: %s\n", c.note.c_str());
  std::fprintf(stderr, "loom profile: peak %s (%s, %lld threads)\n",
               path.empty() ? "(not cached)" : path.c_str(),
               c.measured ? fmt::format("measured in {:.1f} s", c.table.seconds).c_str() : "cached",
               static_cast<long long>(c.table.key.threads));
  return std::move(c.table);
}

void print_json(const nlohmann::ordered_json& j) { std::printf("%s\n", j.dump(2).c_str()); }

// read_trace, refusing a trace no loom run recorded (a Chrome trace of another tool, an empty one) before
// the peak is measured for it: its report would be zeros.
Trace read_loom_trace(const std::string& path) {
  Trace t = read_trace(path);
  if (t.phases.empty())
    fail(ErrorKind::invalid_input,
         "{}: no loom phase events ({} op events, {} others): not a trace `loom ... --profile` recorded, or "
         "one "
         "that ended before its first phase",
         path, t.ops.size(), t.skipped);
  return t;
}

int run_report(const std::string& path, bool json, const PeakFlags& flags, int top) {
  const Trace t = read_loom_trace(path);
  const Analysis a = analyze(t);
  const std::optional<PeakTable> peak = load_peak(t, a, flags);
  if (json)
    print_json(report_json(t, a, peak ? &*peak : nullptr));
  else
    std::fputs(format_report(t, a, peak ? &*peak : nullptr, top).c_str(), stdout);
  return 0;
}

int run_advise(const std::string& path, bool json, const PeakFlags& flags) {
  const Trace t = read_loom_trace(path);
  const Analysis a = analyze(t);
  const std::optional<PeakTable> peak = load_peak(t, a, flags);
  const Advice advice = advise(t, a, peak ? &*peak : nullptr);
  if (json)
    print_json(advice_json(t, a, advice));
  else
    std::fputs(format_advice(t, a, advice).c_str(), stdout);
  return 0;
}

int run_profile(int argc, char** argv) {
  CLI::App app("Read a --profile trace: where the time went, and what to change.", "profile");
  app.require_subcommand(1);
  std::string trace;
  bool json = false;
  PeakFlags peak;
  int top = 10;
  auto* report = app.add_subcommand("report",
                                    "time by phase, op kind and layer; matmul classes against this "
                                    "machine's peak");
  add_common_flags(*report, trace, json, peak);
  report->add_option("--top", top, "op kinds shown (the JSON has all)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  auto* advise_cmd = app.add_subcommand("advise",
                                        "rules with the numbers behind them: the setting to change and the "
                                        "gain to expect");
  add_common_flags(*advise_cmd, trace, json, peak);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  return report->parsed() ? run_report(trace, json, peak, top) : run_advise(trace, json, peak);
}

}  // namespace

extern const Command kProfileCommand = {"profile", run_profile};

}  // namespace loom::app

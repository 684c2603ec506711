// Fault injection for tests (LOOM_FAILPOINTS), modelled on etcd's gofail and
// TiKV's fail-rs. Built into release binaries; the app parses the variable once
// and passes the Failpoints object down explicitly (no global state). A site
// that gets a null or empty Failpoints costs one branch.
//
// Grammar (docs/training.md "Faults"):
//   spec   := entry { "," entry }
//   entry  := action [ "=" int ] "@" site [ "=" range ] { ":" cond }
//   cond   := ( "step" | "hit" ) "=" range
//   range  := int | int ".." int | int ".."          (inclusive; "A.." has no end)
// "@site=R" is short for "@site:step=R". `step` is the number the site passes
// (kFailpointSites says which); `hit` counts, per entry, the times its site was
// reached with its step condition true (1 = the first such time).
// Examples: nan_grad@step=12, crash@checkpoint_write, nan_loss@step=3..5,
// throw@step=7, sleep_ms=50@step, nan_grad@step=4:hit=1..2.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

// What an entry does when it fires. crash, throw, io_error and sleep_ms are
// done by Failpoints::eval itself and are accepted at every site; the others
// are returned to the site, which must list them in kFailpointSites.
enum class FailAction {
  crash,     // SIGKILL to this process (no cleanup, no checkpoint: as the OOM killer)
  throw_,    // "throw": a loom::Error of kind internal
  io_error,  // a loom::Error of kind io, as a failed write would give
  sleep_ms,  // "sleep_ms=N": sleep N ms, then go on (timing and signal tests)
  nan_grad,  // the step's gradient arena gets a NaN
  inf_grad,  // the step's gradient arena gets an inf
  nan_loss,  // the step's loss is NaN
  return_,   // "return=N": the site uses N instead of what it measured
};

struct FailpointSite {
  std::string_view name;
  std::string_view actions;  // site-specific actions it takes besides the common four, space-separated
  std::string_view step;     // what step= means there
  std::string_view where;    // where it is evaluated
};

// Every failpoint site in the code. parse() refuses any other name, so a typo
// in LOOM_FAILPOINTS is an error, never a test that silently injects nothing.
// Adding a site: a row here, the eval() call, a line in docs/training.md
// (Failpoints.DocsListEverySite checks the docs).
inline constexpr FailpointSite kFailpointSites[] = {
    {"step", "nan_grad inf_grad nan_loss",
     "the step attempt: the number of the step run, counting skipped attempts (the n-th step this process "
     "starts after the step it resumed at; a rollback never goes back)",
     "Trainer::train_step, after the backward, before the non-finite check"},
    {"checkpoint_write", "", "the step the checkpoint is for",
     "Trainer::write_checkpoint, after every file of the staged folder is written, before its manifest.json"},
};

struct FailpointFire {
  FailAction action;
  int64_t value = 0;  // return=N: N
};

class Failpoints {
 public:
  Failpoints();  // empty: nothing fires
  ~Failpoints();
  Failpoints(Failpoints&&) noexcept;
  Failpoints& operator=(Failpoints&&) noexcept;

  // Parses `spec` ("" gives an empty set). Throws loom::Error (invalid_input)
  // naming `source` (the variable) and the bad entry.
  static Failpoints parse(std::string_view spec, std::string_view source = "LOOM_FAILPOINTS");
  // Parses the LOOM_FAILPOINTS environment variable (unset: empty). The app calls it once.
  static Failpoints from_env();

  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }

  // The site `site` (a kFailpointSites name) is reached with `step` (-1: the
  // site has no step; step conditions never hold). Every entry of that site
  // whose conditions hold fires in order: sleep_ms sleeps; crash, throw and
  // io_error end there; the first site-specific action is returned. Thread-safe.
  std::optional<FailpointFire> eval(std::string_view site, int64_t step = -1) const;

 private:
  struct Range {
    int64_t lo = 0, hi = INT64_MAX;
    bool contains(int64_t v) const { return v >= lo && v <= hi; }
  };
  struct Entry {
    FailAction action;
    int64_t value = 0;
    std::string site;
    std::optional<Range> step, hit;
    std::string text;  // as written, for messages
  };

  std::vector<Entry> entries_;
  std::unique_ptr<std::atomic<int64_t>[]> hits_;  // per entry: times its step condition held
};

// The one-branch check for sites: nullptr or an empty set costs nothing.
inline std::optional<FailpointFire> fail_point(const Failpoints* fp, std::string_view site, int64_t step = -1) {
  if (!fp || fp->empty()) return std::nullopt;
  return fp->eval(site, step);
}

const char* fail_action_name(FailAction a);

}  // namespace loom

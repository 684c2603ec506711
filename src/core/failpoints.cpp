// LOOM_FAILPOINTS: parsing and evaluation (grammar in failpoints.h).
#include "core/failpoints.h"

#include <signal.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "core/text.h"

namespace loom {

namespace {

struct ActionName {
  std::string_view name;
  FailAction action;
  bool takes_value;
  bool common;  // done by eval() itself, accepted at every site
};

constexpr ActionName kActions[] = {
    {"crash", FailAction::crash, false, true},       {"throw", FailAction::throw_, false, true},
    {"io_error", FailAction::io_error, false, true}, {"sleep_ms", FailAction::sleep_ms, true, true},
    {"nan_grad", FailAction::nan_grad, false, false}, {"inf_grad", FailAction::inf_grad, false, false},
    {"nan_loss", FailAction::nan_loss, false, false}, {"return", FailAction::return_, true, false},
};

template <typename T>
std::string join_names(const T& table) {
  std::string out;
  for (const auto& t : table) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

const FailpointSite* find_site(std::string_view name) {
  for (const FailpointSite& s : kFailpointSites)
    if (s.name == name) return &s;
  return nullptr;
}

bool site_takes(const FailpointSite& site, std::string_view action) {
  for (std::string_view a : split_on(site.actions, ' '))
    if (a == action) return true;
  return false;
}

// Parses one entry; `bad` throws naming the variable and the entry.
class EntryParser {
 public:
  EntryParser(std::string_view source, std::string_view text) : source_(source), text_(text) {}

  [[noreturn]] void bad(const std::string& why) const {
    fail(ErrorKind::invalid_input, "{}: failpoint '{}': {} (grammar: ACTION[=N]@SITE[=STEP][:step=A..B][:hit=N]; "
         "see docs/training.md, Faults)", source_, text_, why);
  }

  int64_t integer(std::string_view s, std::string_view what) const {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < 0)
      bad(fmt::format("{} '{}' is not a non-negative integer", what, s));
    return v;
  }

  // N, A..B or A..
  std::pair<int64_t, int64_t> range(std::string_view s, std::string_view what) const {
    const size_t dots = s.find("..");
    if (dots == std::string_view::npos) {
      const int64_t v = integer(s, what);
      return {v, v};
    }
    const int64_t lo = integer(s.substr(0, dots), what);
    const std::string_view rest = s.substr(dots + 2);
    const int64_t hi = rest.empty() ? INT64_MAX : integer(rest, what);
    if (hi < lo) bad(fmt::format("{} range '{}' ends before it starts", what, s));
    return {lo, hi};
  }

  const ActionName& action(std::string_view s, int64_t& value) const {
    const size_t eq = s.find('=');
    const std::string_view name = s.substr(0, eq);
    for (const ActionName& a : kActions) {
      if (a.name != name) continue;
      if (a.takes_value && eq == std::string_view::npos) bad(fmt::format("action '{}' needs a value: {}=N", name, name));
      if (!a.takes_value && eq != std::string_view::npos) bad(fmt::format("action '{}' takes no value", name));
      if (a.takes_value) value = integer(s.substr(eq + 1), fmt::format("the value of {}", name));
      return a;
    }
    bad(fmt::format("unknown action '{}' (known: {})", name,
                    join_names(kActions)));
  }

 private:
  std::string_view source_, text_;
};

}  // namespace

const char* fail_action_name(FailAction a) {
  for (const ActionName& n : kActions)
    if (n.action == a) return n.name.data();  // literals: NUL-terminated
  return "?";
}

Failpoints::Failpoints() = default;
Failpoints::~Failpoints() = default;
Failpoints::Failpoints(Failpoints&&) noexcept = default;
Failpoints& Failpoints::operator=(Failpoints&&) noexcept = default;

Failpoints Failpoints::parse(std::string_view spec, std::string_view source) {
  Failpoints fp;
  if (trim_blank(spec).empty()) return fp;
  for (std::string_view raw : split_on(spec, ',')) {
    const std::string_view text = trim_blank(raw);
    const EntryParser p(source, text);
    if (text.empty()) p.bad("empty entry (two commas, or one at an end)");
    const size_t at = text.find('@');
    if (at == std::string_view::npos) p.bad("no '@SITE' (which site it fires at)");
    Entry e;
    e.text = std::string(text);
    const ActionName& action = p.action(text.substr(0, at), e.value);
    e.action = action.action;
    const std::vector<std::string_view> parts = split_on(text.substr(at + 1), ':');
    const size_t eq = parts[0].find('=');
    e.site = std::string(parts[0].substr(0, eq));
    const FailpointSite* site = find_site(e.site);
    if (!site)
      p.bad(fmt::format("unknown site '{}' (known: {})", e.site,
                        join_names(kFailpointSites)));
    if (!action.common && !site_takes(*site, action.name))
      p.bad(fmt::format("site '{}' does not take '{}' (it takes crash, throw, io_error, sleep_ms{}{})", e.site,
                        action.name, site->actions.empty() ? "" : ", ", site->actions));
    auto set = [&](std::optional<Range>& r, std::string_view key, std::string_view value) {
      if (r) p.bad(fmt::format("{} is given twice", key));
      const auto [lo, hi] = p.range(value, key);
      r = Range{lo, hi};
    };
    if (eq != std::string_view::npos) set(e.step, "step", parts[0].substr(eq + 1));
    for (size_t i = 1; i < parts.size(); ++i) {
      const size_t ceq = parts[i].find('=');
      const std::string_view key = parts[i].substr(0, ceq);
      if (ceq == std::string_view::npos || (key != "step" && key != "hit"))
        p.bad(fmt::format("condition '{}' is not step=RANGE or hit=RANGE", parts[i]));
      set(key == "step" ? e.step : e.hit, key, parts[i].substr(ceq + 1));
    }
    if (e.hit && e.hit->lo < 1) p.bad("hit counts from 1");
    fp.entries_.push_back(std::move(e));
  }
  fp.hits_ = std::make_unique<std::atomic<int64_t>[]>(fp.entries_.size());
  for (size_t i = 0; i < fp.entries_.size(); ++i) fp.hits_[i].store(0);
  return fp;
}

Failpoints Failpoints::from_env() {
  const char* v = std::getenv("LOOM_FAILPOINTS");
  return v ? parse(v, "LOOM_FAILPOINTS") : Failpoints();
}

std::optional<FailpointFire> Failpoints::eval(std::string_view site, int64_t step) const {
  std::optional<FailpointFire> out;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.site != site) continue;
    if (e.step && (step < 0 || !e.step->contains(step))) continue;
    const int64_t hit = hits_[i].fetch_add(1) + 1;
    if (e.hit && !e.hit->contains(hit)) continue;
    const std::string at = step >= 0 ? fmt::format(" at step {}", step) : std::string();
    switch (e.action) {
      case FailAction::crash:
        ::kill(::getpid(), SIGKILL);
        std::abort();  // not reached
      case FailAction::throw_:
        fail(ErrorKind::internal, "failpoint '{}' fired{} (LOOM_FAILPOINTS)", e.text, at);
      case FailAction::io_error:
        fail(ErrorKind::io, "injected I/O error{}: failpoint '{}' (LOOM_FAILPOINTS)", at, e.text);
      case FailAction::sleep_ms:
        std::this_thread::sleep_for(std::chrono::milliseconds(e.value));
        break;
      default:
        if (!out) out = FailpointFire{e.action, e.value};
    }
  }
  return out;
}

}  // namespace loom

#include "core/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>

namespace loom {
namespace {

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Microseconds with nanosecond digits, as the format's "ts" and "dur" take them.
void put_us(std::string& s, int64_t ns) { fmt::format_to(std::back_inserter(s), "{}.{:03}", ns / 1000, ns % 1000); }

void put_event(std::string& s, const TraceEvent& e, const std::vector<TraceArg>& args) {
  auto out = std::back_inserter(s);
  fmt::format_to(out, R"({{"name":"{}","cat":"{}","ph":"X","pid":0,"tid":{},"ts":)", e.name, e.cat, e.tid);
  put_us(s, e.ts_ns);
  s += ",\"dur\":";
  put_us(s, e.dur_ns);
  s += ",\"args\":{";
  bool first = true;
  auto key = [&](const char* k) {
    fmt::format_to(out, R"({}"{}":)", first ? "" : ",", k);
    first = false;
  };
  if (e.phase) key("phase"), fmt::format_to(out, R"("{}")", e.phase);
  if (e.layer >= 0) key("layer"), fmt::format_to(out, "{}", e.layer);
  if (e.T >= 0) key("T"), fmt::format_to(out, "{}", e.T);
  if (e.N >= 0) key("N"), fmt::format_to(out, "{}", e.N);
  if (e.K >= 0) key("K"), fmt::format_to(out, "{}", e.K);
  if (e.dtype) key("dtype"), fmt::format_to(out, R"("{}")", e.dtype);
  if (e.flops > 0) key("flops"), fmt::format_to(out, "{:.0f}", e.flops);
  if (e.bytes > 0) key("bytes"), fmt::format_to(out, "{:.0f}", e.bytes);
  if (e.threads > 0) key("threads"), fmt::format_to(out, "{}", e.threads);
  if (e.busy_ns >= 0) key("busy_us"), put_us(s, e.busy_ns);
  for (uint32_t i = 0; i < e.n_args; ++i) {  // JSON has no inf or nan
    const TraceArg& a = args[e.args_at + i];
    key(a.first), fmt::format_to(out, "{}", std::isfinite(a.second) ? a.second : 0.0);
  }
  s += "}}";
}

}  // namespace

Tracer::Tracer() = default;

void Tracer::start() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
  args_.clear();
  dropped_ = 0;
  origin_ns_.store(steady_ns(), std::memory_order_relaxed);
  recording_.store(true, std::memory_order_release);
}

void Tracer::stop() { recording_.store(false, std::memory_order_release); }

int64_t Tracer::now_ns() const { return steady_ns() - origin_ns_.load(std::memory_order_relaxed); }

uint32_t Tracer::thread_index() {
  const std::thread::id me = std::this_thread::get_id();
  if (me == last_thread_ && !tids_.empty()) return last_tid_;
  const auto [it, added] = tids_.try_emplace(me, static_cast<uint32_t>(tids_.size()));
  last_thread_ = me;
  last_tid_ = it->second;
  return last_tid_;
}

void Tracer::push(TraceEvent& e) {
  e.tid = thread_index();
  events_.push_back(e);
}

void Tracer::add(TraceEvent e) {
  if (!recording()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  e.n_args = 0;
  push(e);
}

void Tracer::add_phase(TraceEvent e, const TraceArgs& args, uint32_t n_args) {
  if (!recording()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  e.args_at = args_.size();
  e.n_args = n_args;
  args_.insert(args_.end(), args.begin(), args.begin() + n_args);
  push(e);
}

size_t Tracer::event_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

size_t Tracer::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

void Tracer::write_chrome_json(std::ostream& out, std::string_view other_data_json) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const TraceEvent*> order;
  order.reserve(events_.size());
  for (const TraceEvent& e : events_) order.push_back(&e);
  // Start order (a phase is added when it ends, after the ops inside it).
  std::stable_sort(order.begin(), order.end(), [](const TraceEvent* a, const TraceEvent* b) {
    return a->ts_ns != b->ts_ns ? a->ts_ns < b->ts_ns : a->dur_ns > b->dur_ns;
  });
  out << "{\"traceEvents\":[\n";
  std::string line;
  std::vector<std::pair<uint32_t, std::thread::id>> threads;
  for (const auto& [id, index] : tids_) threads.emplace_back(index, id);
  std::sort(threads.begin(), threads.end());
  for (const auto& [index, id] : threads)
    out << fmt::format(R"({{"name":"thread_name","ph":"M","pid":0,"tid":{},"args":{{"name":"{}"}}}},)", index,
                       index == 0 ? "main" : fmt::format("thread {}", index))
        << '\n';
  for (size_t i = 0; i < order.size(); ++i) {
    line.clear();
    put_event(line, *order[i], args_);
    out << line << (i + 1 < order.size() ? ",\n" : "\n");
  }
  out << "],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"loom\":" << other_data_json
      << ",\"events\":" << events_.size() << ",\"dropped_events\":" << dropped_ << "}}\n";
}

TraceScope::TraceScope(Tracer* tracer, const char* name, std::initializer_list<TraceArg> args) {
  if (!tracer || !tracer->recording()) return;
  t_ = tracer;
  e_.name = name;
  e_.cat = "phase";
  for (const TraceArg& a : args)
    if (n_args_ < args_.size()) args_[n_args_++] = a;
  t_->push_phase(name);
  e_.ts_ns = t_->now_ns();
}

void TraceScope::arg(const char* name, double value) {
  if (!t_) return;
  for (uint32_t i = 0; i < n_args_; ++i)
    if (std::string_view(args_[i].first) == name) {
      args_[i].second = value;
      return;
    }
  if (n_args_ < args_.size()) args_[n_args_++] = {name, value};
}

TraceScope::~TraceScope() {
  if (!t_) return;
  e_.dur_ns = t_->now_ns() - e_.ts_ns;
  t_->pop_phase();
  e_.phase = t_->phase();  // the enclosing phase
  t_->add_phase(e_, args_, n_args_);
}

}  // namespace loom

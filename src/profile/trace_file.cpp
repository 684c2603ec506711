// Reading a profiler trace (trace_file.h): complete events of the phase and op
// categories with their arguments checked, everything else skipped.
#include "profile/trace_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace loom {

namespace {

using json = nlohmann::json;

// nlohmann's message without its "[json.exception.parse_error.101] " prefix.
std::string parse_message(const json::exception& e) {
  std::string m = e.what();
  const size_t p = m.find("] ");
  return p == std::string::npos ? m : m.substr(p + 2);
}

// Where an event sits, for messages: `file: traceEvents[7] ("matmul")`.
std::string where(const std::string& path, size_t i, const json& e) {
  const auto n = e.find("name");
  if (n != e.end() && n->is_string())
    return fmt::format("{}: traceEvents[{}] (\"{}\")", path, i, n->get<std::string>());
  return fmt::format("{}: traceEvents[{}]", path, i);
}

double number_field(const json& e, const char* key, const std::string& at) {
  const auto v = e.find(key);
  if (v == e.end())
    fail(ErrorKind::invalid_input, "{}: no \"{}\" (a complete event needs ts and dur, in microseconds)", at,
         key);
  if (!v->is_number())
    fail(ErrorKind::invalid_input, "{}: \"{}\" must be a number, got {}", at, key, v->type_name());
  return v->get<double>();
}

std::string string_arg(const json& args, const char* key, const std::string& at) {
  const auto v = args.find(key);
  if (v == args.end() || v->is_null()) return {};
  if (!v->is_string())
    fail(ErrorKind::invalid_input, "{}: arg \"{}\" must be a string, got {}", at, key, v->type_name());
  return v->get<std::string>();
}

// The op arguments of docs/profiling.md; every numeric one also lands in `values`.
void read_args(const json& args, const std::string& at, ProfileEvent& ev) {
  if (!args.is_object())
    fail(ErrorKind::invalid_input, "{}: \"args\" must be an object, got {}", at, args.type_name());
  for (const auto& [key, v] : args.items())
    if (v.is_number()) ev.values[key] = v.get<double>();
  ev.phase = string_arg(args, "phase", at);
  ev.dtype = string_arg(args, "dtype", at);
  for (const char* key : {"layer", "T", "N", "K", "flops", "bytes", "threads", "busy_us"}) {
    const auto v = args.find(key);
    if (v != args.end() && !v->is_number() && !v->is_null())
      fail(ErrorKind::invalid_input, "{}: arg \"{}\" must be a number, got {}", at, key, v->type_name());
  }
  ev.layer = static_cast<int64_t>(ev.value("layer", -1));
  ev.T = static_cast<int64_t>(ev.value("T", -1));
  ev.N = static_cast<int64_t>(ev.value("N", -1));
  ev.K = static_cast<int64_t>(ev.value("K", -1));
  ev.flops = ev.value("flops");
  ev.bytes = ev.value("bytes");
  ev.threads = static_cast<int64_t>(ev.value("threads"));
  ev.busy_us = ev.value("busy_us", -1);
}

void read_event(const json& e, size_t i, Trace& t) {
  const std::string at = where(t.path, i, e);
  if (!e.is_object())
    fail(ErrorKind::invalid_input, "{}: an event must be an object, got {}", at, e.type_name());
  const auto ph = e.find("ph"), cat = e.find("cat");
  const bool complete = ph != e.end() && ph->is_string() && ph->get<std::string>() == "X";
  const std::string category = cat != e.end() && cat->is_string() ? cat->get<std::string>() : "";
  if (!complete || (category != "phase" && category != "op")) {
    ++t.skipped;  // thread names, instant events, other tools' categories
    return;
  }
  ProfileEvent ev;
  ev.kind = category == "op" ? TraceEventKind::op : TraceEventKind::phase;
  ev.index = i;
  const auto name = e.find("name");
  if (name == e.end() || !name->is_string() || name->get<std::string>().empty())
    fail(ErrorKind::invalid_input, "{}: no \"name\"", at);
  ev.name = name->get<std::string>();
  ev.ts = number_field(e, "ts", at);
  ev.dur = number_field(e, "dur", at);
  if (!(ev.dur >= 0)) fail(ErrorKind::invalid_input, "{}: \"dur\" must be >= 0, got {}", at, ev.dur);
  const auto tid = e.find("tid");
  if (tid != e.end() && tid->is_number()) ev.tid = tid->get<int64_t>();
  const auto args = e.find("args");
  if (args != e.end()) read_args(*args, at, ev);
  (ev.kind == TraceEventKind::op ? t.ops : t.phases).push_back(std::move(ev));
}

std::map<std::string, double> numbers_of(const json& o) {
  std::map<std::string, double> out;
  if (!o.is_object()) return out;
  for (const auto& [k, v] : o.items())
    if (v.is_number()) out[k] = v.get<double>();
  return out;
}

template <typename T>
T get_or(const json& o, const char* key, T fallback) {
  const auto v = o.find(key);
  if (v == o.end()) return fallback;
  if constexpr (std::is_same_v<T, std::string>)
    return v->is_string() ? v->get<std::string>() : fallback;
  else
    return v->is_number() ? v->get<T>() : fallback;
}

// otherData.loom, leniently: the events are the trace; metadata only adds context.
TraceMeta read_meta(const json& root) {
  TraceMeta m;
  const auto other = root.find("otherData");
  if (other == root.end() || !other->is_object()) return m;
  const auto loom = other->find("loom");
  if (loom == other->end() || !loom->is_object()) return m;
  const json& l = *loom;
  m.command = get_or<std::string>(l, "command", "");
  m.version = get_or<std::string>(l, "version", "");
  m.cpu = get_or<std::string>(l, "cpu", "");
  m.threads = get_or<int64_t>(l, "threads", 0);
  if (const auto isa = l.find("isa"); isa != l.end() && isa->is_array())
    for (const json& x : *isa)
      if (x.is_string()) m.isa.push_back(x.get<std::string>());
  m.bf16_dot = get_or<std::string>(l, "bf16_dot", "");
  if (const auto model = l.find("model"); model != l.end() && model->is_object()) {
    m.model_path = get_or<std::string>(*model, "path", "");
    m.model_type = get_or<std::string>(*model, "type", "");
    m.model_layers = get_or<int64_t>(*model, "layers", 0);
    m.model_hidden = get_or<int64_t>(*model, "hidden", 0);
  }
  if (const auto c = l.find("config"); c != l.end() && c->is_object()) m.config = *c;
  if (const auto mem = l.find("memory"); mem != l.end()) m.memory = numbers_of(*mem);
  if (const auto s = l.find("serve"); s != l.end()) m.serve = numbers_of(*s);
  return m;
}

}  // namespace

double ProfileEvent::value(const std::string& key, double fallback) const {
  const auto it = values.find(key);
  return it == values.end() ? fallback : it->second;
}

std::string TraceMeta::config_string(const std::string& key, const std::string& fallback) const {
  const auto v = config.find(key);
  if (v == config.end()) return fallback;
  if (v->is_string()) return v->get<std::string>();
  if (v->is_boolean() || v->is_number()) return v->dump();
  return fallback;
}

double TraceMeta::config_number(const std::string& key, double fallback) const {
  const auto v = config.find(key);
  if (v == config.end()) return fallback;
  if (v->is_number()) return v->get<double>();
  if (v->is_boolean()) return v->get<bool>() ? 1 : 0;
  return fallback;
}

Trace parse_trace(std::string_view text, const std::string& path) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail(ErrorKind::invalid_input, "{}: not JSON: {}", path, parse_message(e));
  }
  if (root.is_array())
    fail(ErrorKind::invalid_input,
         "{}: a JSON array; loom reads the JSON object form {{\"traceEvents\": [...], \"otherData\": ...}}",
         path);
  if (!root.is_object())
    fail(ErrorKind::invalid_input, "{}: a JSON {}, not a trace object", path, root.type_name());
  const auto events = root.find("traceEvents");
  if (events == root.end() || !events->is_array())
    fail(ErrorKind::invalid_input, "{}: no \"traceEvents\" array (is it a loom --profile trace?)", path);
  Trace t;
  t.path = path;
  t.meta = read_meta(root);
  for (size_t i = 0; i < events->size(); ++i) read_event((*events)[i], i, t);
  return t;
}

Trace read_trace(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(ErrorKind::not_found, "trace file '{}' does not exist", path);
  if (std::filesystem::is_directory(path, ec))
    fail(ErrorKind::invalid_input, "trace file '{}' is a folder, not a JSON file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorKind::io, "trace file '{}' cannot be read", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_trace(ss.str(), path);
}

}  // namespace loom

// TrainConfig from YAML: the document is flattened to dotted keys ("optim.lr"),
// each checked against the schema below, then read with its type and range.
#include "train/train_config.h"

#include "tokenizer/chat_template.h"

#include <yaml-cpp/yaml.h>

#include <cctype>
#include <cmath>
#include <string>
#include <functional>
#include <map>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"

namespace loom {

namespace {

// Groups whose children are keys; everything else is a leaf.
const char* const kGroups[] = {"data", "lora", "optim", "schedule", "qat", "dist"};
const char* const kLeaves[] = {
    "model",          "data.train",         "data.eval",           "data.eval_fraction", "data.format",
    "data.seq_len",   "data.pack",          "data.train_on_prompt", "data.skip_bad_lines", "data.cache_dir",
    "data.chat_template", "method",         "backward",            "metrics_file",       "eval_at_start",      "output_dtype",
    "lora.r",         "lora.alpha",         "lora.dropout",        "lora.target_modules", "lora.use_rslora",
    "optim.lr",       "optim.weight_decay", "optim.betas",         "optim.eps",          "optim.max_grad_norm",
    "optim.lora_plus_ratio", "optim.mlp_lr", "schedule.kind",      "schedule.warmup_steps", "batch_size",
    "grad_accum",     "steps",              "epochs",              "eval_interval",      "log_interval",
    "output_dir",     "overwrite",          "seed",               "threads",
    "device",         "checkpoint_interval", "checkpoint_minutes", "checkpoint_dir",    "keep_checkpoints",
    "max_bad_steps",  "on_divergence",      "rollback_lr_factor",  "max_rollbacks",     "memory_limit",
    "memory_alarm",   "metrics_port",       "metrics_host",        "log_file",          "log_format",
    "gradient_checkpointing", "activation_dtype", "optim.kind",       "precision",         "quantize_base",
    "qat.bits",       "qat.group_size",     "qat.scheme",          "qat.start_step",    "sparsity_mask",
    "dist.bucket_mb", "dist.overlap",       "dist.deterministic",  "dist.compression",  "dist.ratio",
    "dist.rank",      "dist.algorithm",     "dist.timeout",        "dist.zero",        "dist.tp",          "dist.compression_warmup", "dist.pp",
    "dist.lazy_adam"};

bool is_group(const std::string& k) {
  for (const char* g : kGroups)
    if (k == g) return true;
  return false;
}
bool is_leaf(const std::string& k) {
  for (const char* l : kLeaves)
    if (k == l) return true;
  return false;
}

struct Entry {
  YAML::Node node;
  std::string where;  // "file:line:col" or "--set k=v"
};
using Entries = std::map<std::string, Entry>;

std::string mark_of(const std::string& name, const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  if (m.line < 0) return name;
  return fmt::format("{}:{}:{}", name, m.line + 1, m.column + 1);
}

void flatten(const YAML::Node& map, const std::string& prefix, const std::string& name, Entries& out) {
  for (const auto& kv : map) {
    if (!kv.first.IsScalar())
      fail(ErrorKind::invalid_input, "{}: keys must be plain names", mark_of(name, kv.first));
    const std::string key = prefix.empty() ? kv.first.Scalar() : prefix + "." + kv.first.Scalar();
    const std::string where = mark_of(name, kv.first);
    if (is_group(key)) {
      if (kv.second.IsNull()) continue;
      if (!kv.second.IsMap())
        fail(ErrorKind::invalid_input, "{}: key '{}' must be a mapping of {}.* keys", where, key, key);
      flatten(kv.second, key, name, out);
      continue;
    }
    if (!is_leaf(key)) fail(ErrorKind::invalid_input, "{}: unknown key '{}'", where, key);
    if (out.count(key)) fail(ErrorKind::invalid_input, "{}: key '{}' is given twice", where, key);
    out[key] = {kv.second, where};
  }
}

// Typed reads of one entry; every failure names key and location.
class Reader {
 public:
  explicit Reader(const Entries& e) : e_(e) {}

  const Entry* find(const std::string& key) const {
    auto it = e_.find(key);
    if (it == e_.end() || it->second.node.IsNull()) return nullptr;  // null: keep the default
    return &it->second;
  }
  [[noreturn]] void bad(const std::string& key, const std::string& what) const {
    const Entry& en = e_.at(key);
    fail(ErrorKind::invalid_input, "{}: key '{}': {}", en.where, key, what);
  }
  std::string where(const std::string& key) const {
    auto it = e_.find(key);
    return it == e_.end() ? std::string() : it->second.where;
  }

  template <typename T>
  bool get(const std::string& key, T& out, const char* type_name) const {
    const Entry* en = find(key);
    if (!en) return false;
    if (!en->node.IsScalar()) bad(key, fmt::format("expected {}, got a {}", type_name, kind(en->node)));
    try {
      out = en->node.as<T>();
    } catch (const YAML::Exception&) {
      bad(key, fmt::format("expected {}, got '{}'", type_name, en->node.Scalar()));
    }
    return true;
  }
  bool str(const std::string& key, std::string& out) const {
    if (!get(key, out, "a string")) return false;
    if (out.empty()) bad(key, "must not be empty");
    return true;
  }
  bool boolean(const std::string& key, bool& out) const { return get(key, out, "true or false"); }
  bool integer(const std::string& key, int64_t& out, int64_t lo, int64_t hi) const {
    if (!get(key, out, "an integer")) return false;
    if (out < lo || out > hi) bad(key, fmt::format("{} is out of range [{}, {}]", out, lo, hi));
    return true;
  }
  // `lo_open`: the lower bound is excluded.
  bool number(const std::string& key, double& out, double lo, bool lo_open, double hi, bool hi_open) const {
    if (!get(key, out, "a number")) return false;
    const bool ok = std::isfinite(out) && (lo_open ? out > lo : out >= lo) && (hi_open ? out < hi : out <= hi);
    if (!ok)
      bad(key, fmt::format("{} is out of range {}{}, {}{}", out, lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]"));
    return true;
  }
  bool string_list(const std::string& key, std::vector<std::string>& out) const {
    const Entry* en = find(key);
    if (!en) return false;
    if (!en->node.IsSequence()) bad(key, fmt::format("expected a list of strings, got a {}", kind(en->node)));
    out.clear();
    for (const auto& item : en->node) {
      if (!item.IsScalar()) bad(key, "expected a list of strings");
      out.push_back(item.Scalar());
    }
    return true;
  }
  bool number_list(const std::string& key, std::vector<double>& out) const {
    const Entry* en = find(key);
    if (!en) return false;
    if (!en->node.IsSequence()) bad(key, fmt::format("expected a list of numbers, got a {}", kind(en->node)));
    out.clear();
    for (const auto& item : en->node) {
      try {
        if (!item.IsScalar()) throw YAML::Exception(YAML::Mark::null_mark(), "");
        out.push_back(item.as<double>());
      } catch (const YAML::Exception&) {
        bad(key, "expected a list of numbers");
      }
    }
    return true;
  }

 private:
  static const char* kind(const YAML::Node& n) {
    if (n.IsSequence()) return "list";
    if (n.IsMap()) return "mapping";
    return "scalar";
  }
  const Entries& e_;
};

// Line `line` (0-based) of `text`.
std::string_view line_of(std::string_view text, int line) {
  for (int i = 0; i < line && !text.empty(); ++i) {
    const size_t nl = text.find('\n');
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
  }
  return text.substr(0, text.find('\n'));
}

// The 1-based line of a "---" that starts a second YAML document (a "---" at column 0 after some content
// always does), 0 when there is none. By hand: yaml-cpp's LoadAll loops forever on some malformed input
// (found by fuzz_train_config with ","), and Load reads the first document and drops the rest.
int second_document_line(std::string_view text) {
  bool content = false;
  for (int line = 1; !text.empty(); ++line) {
    const size_t nl = text.find('\n');
    std::string_view l = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    const bool marker = l.starts_with("---") && (l.size() == 3 || l[3] == ' ' || l[3] == '\t');
    if (marker && content) return line;
    const size_t first = l.find_first_not_of(" \t");
    if (!marker && first != std::string_view::npos && l[first] != '#' && l[first] != '%') content = true;
  }
  return 0;
}

YAML::Node parse_yaml(std::string_view text, const std::string& name) {
  YAML::Node doc;
  try {
    doc = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    // yaml-cpp says "illegal map value" for a tab that indents: name the cause.
    const bool tab = e.mark.line >= 0 && line_of(text, e.mark.line).find('\t') != std::string_view::npos;
    fail(ErrorKind::invalid_input, "{}:{}:{}: invalid YAML: {}{}", name, e.mark.line + 1, e.mark.column + 1,
         e.msg, tab ? " (the line holds a tab: YAML indents with spaces only)" : "");
  }
  if (const int line = second_document_line(text); line > 0)
    fail(ErrorKind::invalid_input, "{}:{}: a second YAML document (after '---'); a config is one document",
         name, line);
  return doc;
}

void apply_override(const std::string& arg, Entries& entries) {
  const auto eq = arg.find('=');
  if (eq == std::string::npos || eq == 0)
    fail(ErrorKind::invalid_input, "--set {}: expected key=value (e.g. optim.lr=1e-4)", arg);
  const std::string key = arg.substr(0, eq);
  const std::string where = "--set " + arg;
  if (!is_leaf(key)) fail(ErrorKind::invalid_input, "{}: unknown key '{}'", where, key);
  YAML::Node value;
  try {
    value = YAML::Load(arg.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    fail(ErrorKind::invalid_input, "{}: invalid YAML value: {}", where, e.msg);
  }
  entries[key] = {value, where};
}

void read_memory_keys(const Reader& r, TrainConfig& c) {
  if (const Entry* en = r.find("gradient_checkpointing")) {
    // true | false | N (every Nth layer's input kept)
    bool on = false;
    int64_t n = 0;
    if (en->node.IsScalar() && YAML::convert<bool>::decode(en->node, on))
      c.gradient_checkpointing = on ? 1 : 0;
    else if (r.integer("gradient_checkpointing", n, 0, 1 << 20))
      c.gradient_checkpointing = n;
  }
  std::string s;
  if (r.str("activation_dtype", s)) {
    if (s == "f32")
      c.activation_dtype = TrainConfig::ActivationDType::f32;
    else if (s == "bf16")
      c.activation_dtype = TrainConfig::ActivationDType::bf16;
    else
      r.bad("activation_dtype", fmt::format("unknown value '{}' (expected f32 or bf16)", s));
  }
  if (r.str("optim.kind", s)) {
    if (s == "adamw")
      c.optimizer = OptimizerKind::adamw;
    else if (s == "adamw8bit")
      c.optimizer = OptimizerKind::adamw8bit;
    else
      r.bad("optim.kind", fmt::format("unknown optimizer '{}' (expected adamw or adamw8bit)", s));
  }
  if (r.str("precision", s)) {
    if (const auto p = train_precision_from_name(s))
      c.precision = *p;
    else
      r.bad("precision", fmt::format("unknown value '{}' (expected fp32, bf16 or fp16)", s));
  }
  if (r.str("quantize_base", s)) {
    bool found = false;
    for (auto q : {TrainConfig::BaseQuant::none, TrainConfig::BaseQuant::nf4, TrainConfig::BaseQuant::q4_0,
                   TrainConfig::BaseQuant::q8_0})
      if (s == base_quant_name(q)) {
        c.quantize_base = q;
        found = true;
      }
    if (!found) r.bad("quantize_base", fmt::format("unknown value '{}' (expected none, nf4, q4_0 or q8_0)", s));
  }
  int64_t bits = 0;
  if (r.integer("qat.bits", bits, 0, 8)) {
    if (bits != 0 && bits != 4 && bits != 8) r.bad("qat.bits", fmt::format("{}: expected 4 or 8 (0: off)", bits));
    c.qat.bits = static_cast<int>(bits);
  }
  r.integer("qat.group_size", c.qat.group_size, 0, int64_t{1} << 20);
  if (c.qat.group_size > 0 && c.qat.group_size % 32 != 0)
    r.bad("qat.group_size", fmt::format("{}: expected a multiple of 32 (or 0: one scale per row)", c.qat.group_size));
  r.integer("qat.start_step", c.qat.start_step, 0, int64_t{1} << 40);
  if (r.str("qat.scheme", s)) {
    if (s != "sym" && s != "asym") r.bad("qat.scheme", fmt::format("unknown value '{}' (expected sym or asym)", s));
    c.qat.symmetric = s == "sym";
  }
  if (r.str("sparsity_mask", s)) {
    if (s == "auto") c.sparsity_mask = TrainConfig::SparsityMask::automatic;
    else if (s == "on") c.sparsity_mask = TrainConfig::SparsityMask::on;
    else if (s == "off") c.sparsity_mask = TrainConfig::SparsityMask::off;
    else r.bad("sparsity_mask", fmt::format("unknown value '{}' (expected auto, on or off)", s));
  }
}

// dist.*: how data-parallel ranks (mpirun) exchange gradients; ignored by one process.
void read_dist_keys(const Reader& r, TrainConfig& c) {
  TrainConfig::Dist& d = c.dist;
  double mb = 0;
  if (r.number("dist.bucket_mb", mb, 0, true, 1 << 16, false))
    d.sync.bucket_bytes = std::max<size_t>(sizeof(float), static_cast<size_t>(mb * 1024 * 1024));
  r.boolean("dist.overlap", d.sync.overlap);
  r.boolean("dist.deterministic", d.sync.deterministic);
  std::string s;
  if (r.str("dist.compression", s)) {
    if (const GradCompression* g = grad_compression_from_name(s))
      d.sync.compression = *g;
    else
      r.bad("dist.compression", fmt::format("unknown value '{}' (expected none, topk or powersgd)", s));
  }
  r.number("dist.ratio", d.sync.topk_ratio, 0, true, 1, false);
  int64_t rank = d.sync.powersgd_rank;
  if (r.integer("dist.rank", rank, 1, 1024)) d.sync.powersgd_rank = static_cast<int>(rank);
  if (r.str("dist.algorithm", s)) {
    if (const CollectiveAlgorithm* a = collective_algorithm_from_name(s))
      d.algorithm = *a;
    else
      r.bad("dist.algorithm", fmt::format("unknown value '{}' (expected auto, ring, tree, rabenseifner or "
                                          "recursive_doubling)", s));
  }
  r.number("dist.timeout", d.timeout_s, 0, true, 1e7, false);
  int64_t zero = 0;
  if (r.integer("dist.zero", zero, 0, 1)) d.zero1 = zero == 1;
  int64_t tp = 1;
  if (r.integer("dist.tp", tp, 1, 1024)) d.tp = static_cast<int>(tp);
  r.integer("dist.compression_warmup", d.compression_warmup, 0, int64_t{1} << 40);
  r.boolean("dist.lazy_adam", d.lazy_adam);
  int64_t pp = 1;
  if (r.integer("dist.pp", pp, 1, 1024)) d.pp = static_cast<int>(pp);
}

void read_production_keys(const Reader& r, TrainConfig& c) {
  constexpr int64_t kMax = int64_t{1} << 40;
  r.integer("checkpoint_interval", c.checkpoint_interval, 0, kMax);
  r.number("checkpoint_minutes", c.checkpoint_minutes, 0, false, 1e7, false);
  r.str("checkpoint_dir", c.checkpoint_dir);
  r.integer("keep_checkpoints", c.keep_checkpoints, 1, 1 << 20);
  r.integer("max_bad_steps", c.max_bad_steps, 1, kMax);
  std::string s;
  if (r.str("on_divergence", s)) {
    if (s == "rollback")
      c.on_divergence = TrainConfig::OnDivergence::rollback;
    else if (s == "stop")
      c.on_divergence = TrainConfig::OnDivergence::stop;
    else
      r.bad("on_divergence", fmt::format("unknown value '{}' (expected rollback or stop)", s));
  }
  r.number("rollback_lr_factor", c.rollback_lr_factor, 0, true, 1, true);
  r.integer("max_rollbacks", c.max_rollbacks, 0, 1000);
  if (const Entry* en = r.find("memory_limit")) {
    const std::optional<int64_t> b = en->node.IsScalar() ? parse_byte_size(en->node.Scalar()) : std::nullopt;
    if (!b) r.bad("memory_limit", "expected a size such as 8GiB, 1.5G, 512MiB or a number of bytes");
    c.memory_limit = *b;
  }
  std::vector<double> alarms;
  if (r.number_list("memory_alarm", alarms)) {
    for (size_t i = 0; i < alarms.size(); ++i) {
      if (!(alarms[i] > 0 && alarms[i] <= 1))
        r.bad("memory_alarm", fmt::format("{} is out of range (0, 1] (a fraction of memory_limit)", alarms[i]));
      if (i > 0 && alarms[i] <= alarms[i - 1]) r.bad("memory_alarm", "thresholds must be strictly increasing");
    }
    c.memory_alarm = alarms;
  }
  int64_t n = 0;
  if (r.integer("metrics_port", n, 0, 65535)) c.metrics_port = static_cast<int>(n);
  r.str("metrics_host", c.metrics_host);
  r.str("log_file", c.log_file);
  if (r.str("log_format", s)) {
    if (s == "text")
      c.log_format = TrainConfig::LogFormat::text;
    else if (s == "json")
      c.log_format = TrainConfig::LogFormat::json;
    else
      r.bad("log_format", fmt::format("unknown value '{}' (expected text or json)", s));
  }
}

TrainConfig read_config(const Entries& e, const std::string& name) {
  const Reader r(e);
  TrainConfig c;
  c.source = name;
  constexpr int64_t kMax = int64_t{1} << 40;

  r.str("model", c.model);
  r.str("data.train", c.train_file);
  r.str("data.eval", c.eval_file);
  r.number("data.eval_fraction", c.eval_fraction, 0, false, 1, true);
  std::string s;
  if (r.str("data.format", s)) {
    const auto f = data_format_from_name(s);
    if (!f) r.bad("data.format", fmt::format("unknown format '{}' (expected auto, text, prompt_completion, messages or alpaca)", s));
    c.format = *f;
  }
  r.integer("data.seq_len", c.seq_len, 2, 1 << 20);
  r.boolean("data.pack", c.pack);
  r.boolean("data.train_on_prompt", c.train_on_prompt);
  r.boolean("data.skip_bad_lines", c.skip_bad_lines);
  r.str("data.cache_dir", c.cache_dir);
  if (r.str("data.chat_template", s)) {
    if (!chat_template_kind_from_name(s))
      r.bad("data.chat_template", fmt::format("unknown template '{}' (expected chatml, llama3, llama2 or mistral)", s));
    c.chat_template = s;
  }
  if (r.str("method", s)) {
    if (s == "lora")
      c.method = TrainMethod::lora;
    else if (s == "full")
      c.method = TrainMethod::full;
    else
      r.bad("method", fmt::format("unknown method '{}' (expected lora or full)", s));
  }
  if (r.str("backward", s)) {
    if (const auto m = backward_mode_from_name(s))
      c.backward = *m;
    else
      r.bad("backward", fmt::format("unknown value '{}' (expected auto, exact, f16, int8 or bf16)", s));
  }
  r.str("metrics_file", c.metrics_file);
  if (r.str("output_dtype", s)) {
    if (s == "f32" || s == "float32")
      c.output_dtype = safetensors::StDType::f32;
    else if (s == "bf16" || s == "bfloat16")
      c.output_dtype = safetensors::StDType::bf16;
    else if (s == "f16" || s == "float16")
      c.output_dtype = safetensors::StDType::f16;
    else
      r.bad("output_dtype", fmt::format("unknown dtype '{}' (expected f32, bf16 or f16)", s));
  }
  if (!c.eval_file.empty() && c.eval_fraction > 0)
    r.bad("data.eval_fraction", "set either data.eval or data.eval_fraction, not both");

  r.integer("lora.r", c.lora.r, 1, 1 << 16);
  r.number("lora.alpha", c.lora.alpha, 0, true, 1e9, false);
  r.number("lora.dropout", c.lora.dropout, 0, false, 1, true);
  std::vector<std::string> names;
  if (r.string_list("lora.target_modules", names)) {
    try {
      c.lora.set_targets(names);
    } catch (const Error& err) {
      r.bad("lora.target_modules", err.what());
    }
  }
  r.boolean("lora.use_rslora", c.lora.use_rslora);

  r.number("optim.lr", c.lr, 0, true, 1, false);
  r.number("optim.weight_decay", c.weight_decay, 0, false, 1e6, false);
  std::vector<double> betas;
  if (r.number_list("optim.betas", betas)) {
    if (betas.size() != 2) r.bad("optim.betas", fmt::format("expected 2 numbers [beta1, beta2], got {}", betas.size()));
    for (double b : betas)
      if (!(b >= 0 && b < 1)) r.bad("optim.betas", fmt::format("{} is out of range [0, 1)", b));
    c.adam.beta1 = betas[0];
    c.adam.beta2 = betas[1];
  }
  r.number("optim.eps", c.adam.eps, 0, true, 1, false);
  r.number("optim.max_grad_norm", c.adam.max_grad_norm, 0, false, 1e12, false);
  double v = 0;
  if (r.number("optim.lora_plus_ratio", v, 0, true, 1e6, false)) c.lora_plus_ratio = v;
  if (r.number("optim.mlp_lr", v, 0, true, 1, false)) c.mlp_lr = v;

  if (r.str("schedule.kind", s)) {
    try {
      c.schedule = lr_schedule_from_name(s);
    } catch (const Error& err) {
      r.bad("schedule.kind", err.what());
    }
  }
  r.integer("schedule.warmup_steps", c.warmup_steps, 0, kMax);

  r.integer("batch_size", c.batch_size, 1, 1 << 20);
  r.integer("grad_accum", c.grad_accum, 1, 1 << 20);
  r.integer("steps", c.steps, 1, kMax);
  r.number("epochs", c.epochs, 0, true, 1e6, false);
  r.integer("eval_interval", c.eval_interval, 0, kMax);
  r.boolean("eval_at_start", c.eval_at_start);
  r.integer("log_interval", c.log_interval, 1, kMax);
  r.str("output_dir", c.output_dir);
  r.boolean("overwrite", c.overwrite);
  int64_t n = 0;
  if (r.integer("seed", n, 0, kMax)) c.seed = static_cast<uint64_t>(n);
  if (r.integer("threads", n, 0, 1024)) c.threads = static_cast<int>(n);
  std::string device;
  if (r.str("device", device)) {
    const std::optional<Device> d = parse_device(device);
    if (!d) r.bad("device", fmt::format("'{}' is not a device (cpu, cuda, cuda:N, npu, npu:N)", device));
    c.device = *d;
  }
  c.lora.seed = c.seed;
  read_production_keys(r, c);
  read_dist_keys(r, c);
  read_memory_keys(r, c);
  if (c.qat.enabled() && c.method == TrainMethod::lora && c.lora.dropout > 0) {
    c.warnings.push_back(fmt::format("{}: lora.dropout {} has no effect with qat: the adapters act inside the "
                                     "fake-quantized W + s B A, where no dropout applies (dropout set to 0)",
                                     c.source, c.lora.dropout));
    c.lora.dropout = 0;
  }

  if (c.steps > 0 && c.epochs > 0) r.bad("epochs", "set either steps or epochs, not both");
  // Evaluation needs an eval split; the trainer has one exactly when data.eval or data.eval_fraction is set.
  const bool has_eval = !c.eval_file.empty() || c.eval_fraction > 0;
  if (c.eval_interval > 0 && !has_eval)
    r.bad("eval_interval", "there is no eval split to evaluate: set data.eval or data.eval_fraction");
  if (c.eval_at_start && !has_eval)
    r.bad("eval_at_start", "there is no eval split to evaluate: set data.eval or data.eval_fraction");
  if (c.steps > 0 && c.warmup_steps >= c.steps)  // (with epochs the step count is known after the data)
    c.warnings.push_back(
        fmt::format("{}: schedule.warmup_steps {} is not below steps {}: the learning rate never "
                    "reaches optim.lr",
                    r.find("schedule.warmup_steps") ? r.where("schedule.warmup_steps") : c.source,
                    c.warmup_steps, c.steps));
  if (c.method == TrainMethod::lora && r.find("output_dtype"))
    c.warnings.push_back(fmt::format("{}: key 'output_dtype' applies to method: full only; a LoRA adapter is "
                                     "written in f32", r.where("output_dtype")));
  const auto required = [&](const std::string& value, const char* key) {
    if (!value.empty()) return;
    const std::string at = r.where(key);  // given, but null or empty (e.g. "--set data.train=")
    if (!at.empty()) fail(ErrorKind::invalid_input, "{}: key '{}' is required and has no value", at, key);
    fail(ErrorKind::invalid_input, "{}: missing required key '{}'", name, key);
  };
  required(c.model, "model");
  required(c.train_file, "data.train");
  required(c.output_dir, "output_dir");
  if (c.steps == 0 && c.epochs == 0)
    fail(ErrorKind::invalid_input, "{}: missing required key 'steps' or 'epochs' (how long to train)", name);
  return c;
}

}  // namespace

TrainConfig parse_train_config(std::string_view yaml, const std::string& name,
                               std::span<const std::string> overrides) {
  const YAML::Node root = parse_yaml(yaml, name);
  Entries entries;
  if (root.IsMap()) {
    flatten(root, "", name, entries);
  } else if (!root.IsNull()) {
    fail(ErrorKind::invalid_input, "{}: the config must be a mapping of keys (model:, data:, ...)", name);
  }
  for (const std::string& o : overrides) apply_override(o, entries);
  TrainConfig c = read_config(entries, name);
  c.overrides.assign(overrides.begin(), overrides.end());
  c.text = std::string(yaml);
  if (!c.text.empty() && c.text.back() != '\n') c.text += '\n';
  for (const std::string& o : overrides) c.text += "# --set " + o + "\n";
  return c;
}

TrainConfig load_train_config(const std::string& path, std::span<const std::string> overrides) {
  return parse_train_config(read_text_file(path), path, overrides);
}

std::optional<int64_t> parse_byte_size(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) return std::nullopt;
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(std::string(text.substr(0, i)), &used);
    if (used != i) return std::nullopt;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const size_t u = text.find_first_not_of(' ', i);
  std::string unit(u == std::string_view::npos ? std::string_view() : text.substr(u));
  for (char& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},          {"b", 1},          {"k", 1e3},        {"kb", 1e3},       {"kib", 1024.0},
      {"m", 1e6},       {"mb", 1e6},       {"mib", 1048576.0}, {"g", 1e9},       {"gb", 1e9},
      {"gib", 1073741824.0}, {"t", 1e12},  {"tb", 1e12},      {"tib", 1099511627776.0}};
  for (const auto& [name, mult] : kUnits)
    if (unit == name) {
      const double bytes = v * mult;
      if (!std::isfinite(bytes) || bytes < 1 || bytes > 9e18) return std::nullopt;
      return static_cast<int64_t>(bytes);
    }
  return std::nullopt;
}

namespace {
std::string lora_targets_text(const LoraConfig& l) {
  std::string out;
  for (LoraTarget t : kAllLoraTargets)
    if (l.targets_module(t)) {
      if (!out.empty()) out += ',';
      out += lora_target_peft_name(t);
    }
  return out;
}
}  // namespace

std::vector<std::pair<std::string, std::string>> run_identity(const TrainConfig& c) {
  const auto num = [](double v) { return fmt::format("{:.17g}", v); };
  std::vector<std::pair<std::string, std::string>> id = {
      {"model", c.model},
      {"method", c.method == TrainMethod::full ? "full" : "lora"},
      {"backward", backward_mode_name(c.backward)},
      {"data.train", c.train_file},
      {"data.eval", c.eval_file},
      {"data.eval_fraction", num(c.eval_fraction)},
      {"data.format", data_format_name(c.format)},
      {"data.seq_len", std::to_string(c.seq_len)},
      {"data.pack", c.pack ? "true" : "false"},
      {"data.train_on_prompt", c.train_on_prompt ? "true" : "false"},
      {"data.chat_template", c.chat_template},
      {"lora.r", std::to_string(c.lora.r)},
      {"lora.alpha", num(c.lora.alpha)},
      {"lora.dropout", num(c.lora.dropout)},
      {"lora.target_modules", lora_targets_text(c.lora)},
      {"lora.use_rslora", c.lora.use_rslora ? "true" : "false"},
      {"optim.lr", num(c.lr)},
      {"optim.weight_decay", num(c.weight_decay)},
      {"optim.betas", num(c.adam.beta1) + "," + num(c.adam.beta2)},
      {"optim.eps", num(c.adam.eps)},
      {"optim.max_grad_norm", num(c.adam.max_grad_norm)},
      {"optim.lora_plus_ratio", c.lora_plus_ratio ? num(*c.lora_plus_ratio) : ""},
      {"optim.mlp_lr", c.mlp_lr ? num(*c.mlp_lr) : ""},
      {"schedule.kind", lr_schedule_name(c.schedule)},
      {"schedule.warmup_steps", std::to_string(c.warmup_steps)},
      {"batch_size", std::to_string(c.batch_size)},
      {"grad_accum", std::to_string(c.grad_accum)},
      {"seed", std::to_string(c.seed)},
      {"activation_dtype", activation_dtype_name(c.activation_dtype)},
      {"optim.kind", optimizer_kind_name(c.optimizer)},
      {"precision", train_precision_name(c.precision)},
      {"quantize_base", base_quant_name(c.quantize_base)},
      {"qat", c.qat.enabled() ? fmt::format("int{} g{} {} from step {}", c.qat.bits, c.qat.group_size,
                                            c.qat.symmetric ? "sym" : "asym", c.qat.start_step) : "off"},
  };
  return id;
}

const char* activation_dtype_name(TrainConfig::ActivationDType d) {
  return d == TrainConfig::ActivationDType::bf16 ? "bf16" : "f32";
}

const char* base_quant_name(TrainConfig::BaseQuant q) {
  switch (q) {
    case TrainConfig::BaseQuant::none: return "none";
    case TrainConfig::BaseQuant::nf4: return "nf4";
    case TrainConfig::BaseQuant::q4_0: return "q4_0";
    case TrainConfig::BaseQuant::q8_0: return "q8_0";
  }
  return "?";
}

}  // namespace loom

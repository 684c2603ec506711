// Measuring and caching a machine's step cost; the prefill budget (step_cost.h).
#include "serve/step_cost.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/file_write.h"
#include "serve/batch_forward.h"
#include "serve/kv_pool.h"

namespace loom {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kFormat = 1;
constexpr int kRuns = 3;  // each point: the fastest of this many steps, after one warm-up
// Marks the scratch sequences' blocks in the prefix cache; no adapter load gets it (ids start at 1).
constexpr int64_t kScratchAdapterId = -1;

// Sizes 1, 2, 4, ... below `max`, then `max` itself.
std::vector<int64_t> doubling_sizes(int64_t max) {
  std::vector<int64_t> n;
  for (int64_t s = 1; s < max; s *= 2) n.push_back(s);
  n.push_back(max);
  return n;
}

// Token ids spread over the vocabulary (their values do not change the time).
std::vector<int32_t> scratch_tokens(int64_t n, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % vocab);
  return t;
}

double fastest_ms(BatchForward& forward, std::span<const BatchChunk> chunks) {
  auto t0 = Clock::now();
  forward.step(chunks);  // warm-up: caches, first-touch pages
  double best = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  // Long steps vary little and cost much: fewer runs.
  const int runs = best > 500 ? 1 : kRuns;
  for (int r = 0; r < runs; ++r) {
    t0 = Clock::now();
    forward.step(chunks);
    best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return best;
}

// Forces a measured curve to be non-decreasing (timing noise can make a
// larger step look faster), so the budget search sees a monotone cost.
void make_monotone(CostCurve& c) {
  for (size_t i = 1; i < c.ms.size(); ++i) c.ms[i] = std::max(c.ms[i], c.ms[i - 1]);
}

struct ScratchSequences {
  KvPool& kv;
  std::vector<BlockTable> tables;
  ~ScratchSequences() {
    for (BlockTable& t : tables) kv.release(t);
    kv.clear_cache();
  }
};

// One chunk of T tokens at position 0, for T doubling up to max_rows or until
// a step takes more than stop_ms (the curve is extended beyond by its slope).
CostCurve measure_prefill(BatchForward& forward, KvPool& kv, std::span<const int32_t> tokens, int64_t max_rows,
                          double stop_ms) {
  CostCurve c;
  ScratchSequences s{kv, std::vector<BlockTable>(1)};
  if (!kv.reserve(s.tables[0], max_rows))
    fail(ErrorKind::invalid_input, "step cost: the KV cache cannot hold one {}-token step", max_rows);
  for (int64_t n : doubling_sizes(max_rows)) {
    const BatchChunk chunk{.table = &s.tables[0], .n_past = 0, .tokens = tokens.first(static_cast<size_t>(n))};
    c.n.push_back(n);
    c.ms.push_back(fastest_ms(forward, std::span(&chunk, 1)));
    if (c.ms.back() > stop_ms && c.n.size() >= 2) break;
  }
  make_monotone(c);
  return c;
}

// R one-token rows at position 0 with logits, R doubling up to max_rows or
// until a step takes more than stop_ms.
CostCurve measure_decode(BatchForward& forward, KvPool& kv, std::span<const int32_t> tokens, int64_t max_rows,
                         double stop_ms) {
  CostCurve c;
  ScratchSequences s{kv, std::vector<BlockTable>(static_cast<size_t>(max_rows))};
  std::vector<BatchChunk> chunks;
  for (int64_t i = 0; i < max_rows; ++i) {
    BlockTable& t = s.tables[static_cast<size_t>(i)];
    if (!kv.reserve(t, 1)) break;
    chunks.push_back({.table = &t, .n_past = 0, .tokens = tokens.subspan(static_cast<size_t>(i), 1), .want_logits = true});
  }
  if (chunks.empty()) fail(ErrorKind::invalid_input, "step cost: the KV cache has no free block");
  for (int64_t n : doubling_sizes(static_cast<int64_t>(chunks.size()))) {
    c.n.push_back(n);
    c.ms.push_back(fastest_ms(forward, std::span(chunks).first(static_cast<size_t>(n))));
    if (c.ms.back() > stop_ms && c.n.size() >= 2) break;
  }
  make_monotone(c);
  return c;
}

// ms per (row, cached position) pair: `rows` decode rows, each behind a shared
// cached context, against as many rows at position 0. The context is computed
// once (a scratch prefill) and shared through the prefix cache. 0 when the
// cache is too small to tell (attention is then cheap anyway).
double measure_attention(BatchForward& forward, KvPool& kv, std::span<const int32_t> tokens, int64_t max_rows,
                         int64_t max_context, const CostCurve& prefill) {
  const int64_t bs = kv.block_size();
  int64_t context = std::min({int64_t{1024}, (max_context - 1) / bs * bs, (kv.free_blocks() - 2) / 2 * bs});
  while (context >= 128 && prefill.at(static_cast<double>(context)) > 2000) context /= 2;  // a big model: keep it short
  context = context / bs * bs;
  const int64_t rows = std::min<int64_t>(8, (kv.free_blocks() - context / bs) / 2);
  if (context < 64 || rows < 1) return 0;
  // Tables: [0, rows) behind the context, [rows, 2 rows) at position 0, then the context's own.
  ScratchSequences s{kv, std::vector<BlockTable>(static_cast<size_t>(2 * rows + 1))};
  BlockTable& prefix = s.tables.back();
  prefix.adapter_id = kScratchAdapterId;
  if (!kv.reserve(prefix, context)) return 0;
  for (int64_t done = 0; done < context;) {
    const int64_t len = std::min(max_rows, context - done);
    const BatchChunk c{.table = &prefix, .n_past = done,
                       .tokens = tokens.subspan(static_cast<size_t>(done), static_cast<size_t>(len))};
    forward.step(std::span(&c, 1));
    done += len;
  }
  const auto context_tokens = tokens.first(static_cast<size_t>(context));
  kv.commit_full_blocks(prefix, context_tokens, context);
  std::vector<BatchChunk> behind, fresh;
  for (int64_t i = 0; i < rows; ++i) {
    BlockTable& b = s.tables[static_cast<size_t>(i)];
    BlockTable& f = s.tables[static_cast<size_t>(rows + i)];
    b.adapter_id = kScratchAdapterId;
    if (kv.match_prefix(b, context_tokens) != context || !kv.reserve(b, context + 1) || !kv.reserve(f, 1)) return 0;
    const auto token = tokens.subspan(static_cast<size_t>(i), 1);
    behind.push_back({.table = &b, .n_past = context, .tokens = token, .want_logits = true});
    fresh.push_back({.table = &f, .n_past = 0, .tokens = token, .want_logits = true});
  }
  const double slow = fastest_ms(forward, behind);
  const double quick = fastest_ms(forward, fresh);
  return std::max(0.0, (slow - quick) / (static_cast<double>(rows) * static_cast<double>(context)));
}

double number(const json& o, const char* field, const std::string& where) {
  const auto it = o.find(field);
  if (it == o.end() || !it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0)
    fail(ErrorKind::invalid_input, "{}: \"{}\" must be a non-negative number", where, field);
  return it->get<double>();
}

std::string text(const json& o, const char* field, const std::string& where) {
  const auto it = o.find(field);
  if (it == o.end() || !it->is_string()) fail(ErrorKind::invalid_input, "{}: \"{}\" must be a string", where, field);
  return it->get<std::string>();
}

json curve_json(const CostCurve& c) {
  json a = json::array();
  for (size_t i = 0; i < c.n.size(); ++i) a.push_back(json::array({c.n[i], c.ms[i]}));
  return a;
}

CostCurve curve_from(const json& o, const char* field, const std::string& where) {
  const auto it = o.find(field);
  if (it == o.end() || !it->is_array() || it->empty())
    fail(ErrorKind::invalid_input, "{}: \"{}\" must be a non-empty array of [size, ms]", where, field);
  CostCurve c;
  for (const json& p : *it) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number() ||
        p[0].get<int64_t>() < 1 || !(p[1].get<double>() >= 0) || !std::isfinite(p[1].get<double>()) ||
        (!c.n.empty() && (p[0].get<int64_t>() <= c.n.back() || p[1].get<double>() < c.ms.back())))
      fail(ErrorKind::invalid_input, "{}: \"{}\": each entry must be [size, ms] with sizes increasing and ms not "
           "decreasing", where, field);
    c.n.push_back(p[0].get<int64_t>());
    c.ms.push_back(p[1].get<double>());
  }
  return c;
}

}  // namespace

std::string StepCostKey::hash() const {
  const std::string all = fmt::format("{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}", cpu, cpu_mask, build, model, threads,
                                      kv_dtype, block_size, max_rows, max_decode_rows);
  return fmt::format("{:016x}", fnv1a64(all));
}

double CostCurve::at(double size) const {
  LOOM_ASSERT(!n.empty() && n.size() == ms.size());
  if (size <= 0) return 0;
  // Below the first point: a straight line from (0, 0).
  if (size <= static_cast<double>(n[0])) return ms[0] * size / static_cast<double>(n[0]);
  size_t i = 1;
  while (i + 1 < n.size() && static_cast<double>(n[i]) < size) ++i;
  if (n.size() == 1) return ms[0] * size / static_cast<double>(n[0]);
  const double x0 = static_cast<double>(n[i - 1]), x1 = static_cast<double>(n[i]);
  const double slope = (ms[i] - ms[i - 1]) / (x1 - x0);
  return ms[i - 1] + slope * (size - x0);
}

double StepCost::predict_ms(int64_t decode_rows, int64_t prefill_tokens, double attended) const {
  const auto r = static_cast<double>(decode_rows);
  const double extra = prefill_tokens > 0 ? prefill.at(r + static_cast<double>(prefill_tokens)) - prefill.at(r) : 0;
  return decode.at(r) + extra + attend_ms_per_kpos * attended / 1000.0;
}

void StepShape::add(int64_t len, int64_t past) {
  if (len == 1)
    ++decode_rows;
  else
    prefill_tokens += len;
  const auto l = static_cast<double>(len);
  attended += l * static_cast<double>(past) + l * (l + 1) / 2;
}

void StepCostCorrection::observe(double predicted_ms, double actual_ms) {
  if (!(predicted_ms >= 1) || !(actual_ms > 0)) return;
  // Each step moves the average a tenth of the way; one odd step (a page fault,
  // a preempted thread) moves it little, a lasting change within ~20 steps.
  const double ratio = std::clamp(actual_ms / predicted_ms, 0.2, 5.0);
  scale_ += 0.1 * (ratio - scale_);
}

int64_t prefill_budget(const StepCost& cost, const StepLoad& load, double target_ms, int64_t cap,
                       int64_t min_chunk) {
  if (cap <= 0) return 0;
  const auto fits = [&](int64_t p) {
    const double past = static_cast<double>(load.prefill_past);
    const double pairs = static_cast<double>(p) * past + static_cast<double>(p) * static_cast<double>(p + 1) / 2;
    return cost.predict_ms(load.decode_rows, p, load.decode_attended + pairs) <= target_ms;
  };
  int64_t lo = 0, hi = cap;  // largest p in [0, cap] that fits (the cost grows with p)
  if (fits(hi)) return cap;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return std::max(lo, std::min(min_chunk, cap));
}

StepCost measure_step_cost(BatchForward& forward, KvPool& kv, int64_t vocab, int64_t max_context,
                           const StepCostKey& key, double stop_ms) {
  LOOM_ASSERT(key.max_rows >= 1 && key.max_rows <= forward.max_batch_tokens() && key.max_decode_rows >= 1);
  const auto t0 = Clock::now();
  const std::vector<int32_t> tokens = scratch_tokens(std::max<int64_t>(key.max_rows, 1024), vocab);
  StepCost cost;
  cost.key = key;
  cost.decode = measure_decode(forward, kv, tokens, std::min(key.max_decode_rows, key.max_rows), stop_ms);
  cost.prefill = measure_prefill(forward, kv, tokens, key.max_rows, stop_ms);
  const double per_pair = measure_attention(forward, kv, tokens, key.max_rows, max_context, cost.prefill);
  cost.attend_ms_per_kpos = 1000.0 * per_pair;
  // The prefill points include their own attention (T (T + 1) / 2 pairs), which predict_ms counts apart.
  for (size_t i = 0; i < cost.prefill.n.size(); ++i) {
    const auto n = static_cast<double>(cost.prefill.n[i]);
    cost.prefill.ms[i] = std::max(0.0, cost.prefill.ms[i] - per_pair * n * (n + 1) / 2);
  }
  make_monotone(cost.prefill);
  cost.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return cost;
}

std::string step_cost_to_json(const StepCost& c) {
  json o;
  o["loom_step_cost"] = kFormat;
  const StepCostKey& k = c.key;
  o["key"] = {{"cpu", k.cpu},         {"cpu_mask", k.cpu_mask},     {"build", k.build},
              {"model", k.model},     {"threads", k.threads},       {"kv_dtype", k.kv_dtype},
              {"block_size", k.block_size}, {"max_rows", k.max_rows}, {"max_decode_rows", k.max_decode_rows}};
  o["decode_ms"] = curve_json(c.decode);
  o["prefill_ms"] = curve_json(c.prefill);
  o["attend_ms_per_kpos"] = c.attend_ms_per_kpos;
  o["seconds"] = c.seconds;
  return o.dump(1) + "\n";
}

StepCost step_cost_from_json(std::string_view text_in, const std::string& path) {
  json o;
  try {
    o = json::parse(text_in);
  } catch (const json::exception& e) {
    fail(ErrorKind::invalid_input, "{}: not JSON ({})", path, e.what());
  }
  if (!o.is_object() || !o.contains("loom_step_cost") || o["loom_step_cost"] != kFormat)
    fail(ErrorKind::invalid_input, "{}: not a loom step-cost file of format {}", path, kFormat);
  const auto k = o.find("key");
  if (k == o.end() || !k->is_object()) fail(ErrorKind::invalid_input, "{}: no \"key\" object", path);
  StepCost c;
  const std::string kw = path + ": key";
  c.key.cpu = text(*k, "cpu", kw);
  c.key.cpu_mask = text(*k, "cpu_mask", kw);
  c.key.build = text(*k, "build", kw);
  c.key.model = text(*k, "model", kw);
  c.key.kv_dtype = text(*k, "kv_dtype", kw);
  c.key.threads = static_cast<int64_t>(number(*k, "threads", kw));
  c.key.block_size = static_cast<int64_t>(number(*k, "block_size", kw));
  c.key.max_rows = static_cast<int64_t>(number(*k, "max_rows", kw));
  c.key.max_decode_rows = static_cast<int64_t>(number(*k, "max_decode_rows", kw));
  c.decode = curve_from(o, "decode_ms", path);
  c.prefill = curve_from(o, "prefill_ms", path);
  c.attend_ms_per_kpos = number(o, "attend_ms_per_kpos", path);
  c.seconds = number(o, "seconds", path);
  return c;
}

std::string step_cost_cache_path(const std::string& dir, const StepCostKey& key) {
  return (std::filesystem::path(dir) / ("step-cost-" + key.hash() + ".json")).string();
}

CachedStepCost load_or_measure_step_cost(BatchForward& forward, KvPool& kv, int64_t vocab, int64_t max_context,
                                         const StepCostKey& key, double stop_ms, const std::string& dir,
                                         bool remeasure) {
  CachedStepCost out;
  if (!dir.empty()) out.path = step_cost_cache_path(dir, key);
  if (!out.path.empty() && !remeasure && std::filesystem::exists(out.path)) {
    try {
      std::ifstream in(out.path, std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      StepCost c = step_cost_from_json(ss.str(), out.path);
      if (c.key == key) {
        out.cost = std::move(c);
        return out;
      }
    } catch (const Error&) {
      // A damaged or foreign file is measured over.
    }
  }
  out.cost = measure_step_cost(forward, kv, vocab, max_context, key, stop_ms);
  out.measured = true;
  if (!out.path.empty()) {
    try {
      std::filesystem::create_directories(dir);
      write_file_atomic(out.path, step_cost_to_json(out.cost));
    } catch (const std::exception&) {
      out.path.clear();  // not cached; the next start measures again
    }
  }
  return out;
}

}  // namespace loom

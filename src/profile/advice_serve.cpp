// The serving rules of `loom profile advise` (advice.h): what the scheduler's
// `serve_step` phases say about prefill / decode balance, adapter slots and
// the KV cache. Gains come from a straight-line fit of a step's duration
// against its rows (a fixed cost a plus b per row), made on the trace itself.
#include <algorithm>
#include <cmath>

#include "profile/advice.h"
#include "profile/units.h"

namespace loom {

namespace {

struct ServeStep {
  double dur = 0, prefill = 0, decode = 0, sequences = 0, adapters = 0, groups = 0, preempted = 0;
  double free_blocks = 0, total_blocks = 0, waiting = 0;
  double rows() const { return prefill + decode; }
};

std::vector<ServeStep> serve_steps(const Trace& t) {
  std::vector<ServeStep> out;
  for (const ProfileEvent& e : t.phases)
    if (e.name == "serve_step")
      out.push_back({e.dur, e.value("prefill_tokens"), e.value("decode_rows"), e.value("sequences"),
                     e.value("adapters"), e.value("lora_groups"), e.value("preempted"),
                     e.value("kv_blocks_free"), e.value("kv_blocks_total"), e.value("waiting")});
  return out;
}

// dur = a + b * rows by least squares (b = 0 when every step has the same rows).
struct StepCost {
  double a = 0, b = 0;
  bool fitted = false;  // false: every step had the same rows, so b is unknown (taken as 0)
  double at(double rows) const { return a + b * rows; }
  std::string describe() const {
    return fitted ? fmt::format("step time fitted on this trace: {} + {} a row", ms(a), ms(b))
                  : fmt::format(
                        "every step had the same rows, so no cost a row could be fitted: the step taken as "
                        "{} whatever its rows (an upper bound on the gain)",
                        ms(a));
  }
};
StepCost fit_cost(const std::vector<ServeStep>& steps) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const ServeStep& s : steps) {
    n += 1;
    sx += s.rows();
    sy += s.dur;
    sxx += s.rows() * s.rows();
    sxy += s.rows() * s.dur;
  }
  StepCost c;
  const double var = n * sxx - sx * sx;
  c.fitted = var > 1e-9;
  c.b = c.fitted ? std::max(0.0, (n * sxy - sx * sy) / var) : 0;
  c.a = n > 0 ? std::max(0.0, (sy - c.b * sx) / n) : 0;
  return c;
}

double budget(const Trace& t, const char* key) {
  const auto it = t.meta.serve.find(key);
  return it == t.meta.serve.end() ? 0 : it->second;
}

template <typename P>
std::vector<ServeStep> select(const std::vector<ServeStep>& steps, P pred) {
  std::vector<ServeStep> out;
  for (const ServeStep& s : steps)
    if (pred(s)) out.push_back(s);
  return out;
}

double mean_of(const std::vector<ServeStep>& v, double (*f)(const ServeStep&)) {
  double s = 0;
  for (const ServeStep& x : v) s += f(x);
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}
double dur_of(const ServeStep& s) { return s.dur; }
double rows_of(const ServeStep& s) { return s.rows(); }
double decode_of(const ServeStep& s) { return s.decode; }
double held_tokens_per_seq(const ServeStep& s) {
  return s.sequences > 0 ? (s.total_blocks - s.free_blocks) / s.sequences : 0;
}

// Decode rows ride in the same step as prefill chunks: a step with a large
// chunk delays every running sequence's next token.
void prefill_stall(const Trace& t, const std::vector<ServeStep>& steps, const StepCost& cost,
                   const AdviceThresholds& th, Advice& out) {
  const auto mixed = select(steps, [](const ServeStep& s) { return s.prefill > 0 && s.decode > 0; });
  const auto decode_only = select(steps, [](const ServeStep& s) { return s.prefill == 0 && s.decode > 0; });
  const double with_decode = static_cast<double>(mixed.size() + decode_only.size());
  if (decode_only.empty() || mixed.empty() ||
      static_cast<double>(mixed.size()) < th.serve_min_steps_share * with_decode)
    return;
  const double d_mixed = mean_of(mixed, dur_of), d_decode = mean_of(decode_only, dur_of);
  if (d_mixed < th.prefill_stall_ratio * d_decode) return;
  const double max_tokens = budget(t, "max_batch_tokens");
  const double decode_rows = mean_of(decode_only, decode_of);
  // The rows at which a step takes the stall ratio times a decode-only step.
  double suggest = cost.b > 0 ? (th.prefill_stall_ratio * d_decode - cost.a) / cost.b : max_tokens / 2;
  suggest = std::max(suggest, decode_rows + 16);
  if (max_tokens > 0) suggest = std::min(suggest, max_tokens / 2);
  const auto value = std::max<int64_t>(16, static_cast<int64_t>(suggest) / 16 * 16);
  Finding f;
  f.rule = "serve_prefill_stall";
  f.summary = fmt::format(
      "{} of {} decoding steps also prefill; they take {} against {} for decode-only steps "
      "({:.1f}x): running sequences wait for prompts (--max-batch-tokens {:.0f})",
      mixed.size(), static_cast<size_t>(with_decode), ms(d_mixed), ms(d_decode), d_mixed / d_decode,
      max_tokens);
  f.numbers = {{"mixed_steps", double(mixed.size())},
               {"decode_steps", double(decode_only.size())},
               {"mixed_step_us", d_mixed},
               {"decode_step_us", d_decode},
               {"max_batch_tokens", max_tokens},
               {"cost_fixed_us", cost.a},
               {"cost_per_row_us", cost.b}};
  f.change.push_back(fmt::format("--max-batch-tokens {}", value));
  const double after = cost.at(std::min<double>(static_cast<double>(value), mean_of(mixed, rows_of)));
  f.gain = fmt::format(
      "a decode token during prefill in about {} instead of {}; prompts take more steps to prefill "
      "(time to first token grows)",
      ms(after), ms(d_mixed));
  f.model = cost.describe();
  out.findings.push_back(std::move(f));
}

// Requests queue while steps run far below the token budget: the sequence cap
// (or the KV cache, serve_kv_cache) keeps them out.
void decode_underfilled(const Trace& t, const std::vector<ServeStep>& steps, const StepCost& cost,
                        const AdviceThresholds& th, Advice& out) {
  const double max_tokens = budget(t, "max_batch_tokens"), max_seqs = budget(t, "max_seqs");
  if (max_tokens <= 0 || max_seqs <= 0) return;
  const auto starved = select(steps, [&](const ServeStep& s) {
    return s.waiting > 0 && s.rows() < th.underfilled_rows * max_tokens && s.sequences >= max_seqs;
  });
  if (static_cast<double>(starved.size()) < th.serve_min_steps_share * static_cast<double>(steps.size()))
    return;
  const double d = std::max(1.0, mean_of(starved, decode_of));
  const double gain = cost.at(d) > 0 ? 1 - cost.at(2 * d) / (2 * cost.at(d)) : 0;
  Finding f;
  f.rule = "serve_decode_underfilled";
  f.summary = fmt::format(
      "in {} of {} steps requests queue while {:.0f} sequences (--max-seqs) fill {:.0f} of "
      "{:.0f} token rows",
      starved.size(), steps.size(), max_seqs, mean_of(starved, rows_of), max_tokens);
  f.numbers = {{"starved_steps", double(starved.size())},
               {"steps", double(steps.size())},
               {"max_seqs", max_seqs},
               {"mean_rows", mean_of(starved, rows_of)},
               {"cost_fixed_us", cost.a},
               {"cost_per_row_us", cost.b}};
  f.change.push_back(
      fmt::format("--max-seqs {:.0f} (with the KV cache to hold them: --kv-cache-memory)", 2 * max_seqs));
  f.gain_share = gain;
  f.gain = fmt::format("about {} less time a generated token while requests queue", pct(gain));
  f.model = cost.describe() + "; twice the decode rows a step";
  out.findings.push_back(std::move(f));
}

void adapters(const Trace& t, const Analysis& a, const std::vector<ServeStep>& steps,
              const AdviceThresholds& th, Advice& out) {
  const double max_loras = budget(t, "max_loras");
  const double n = static_cast<double>(steps.size());
  const auto full = select(
      steps, [&](const ServeStep& s) { return max_loras > 0 && s.adapters >= max_loras && s.waiting > 0; });
  const auto split = select(steps, [](const ServeStep& s) { return s.groups > s.adapters; });
  const TimeRow* lora = a.op("lora");
  const double lora_share = lora ? a.share(lora->us) : 0;
  if (static_cast<double>(full.size()) >= th.serve_min_steps_share * n) {
    Finding f;
    f.rule = "serve_adapters";
    f.summary = fmt::format(
        "in {} of {} steps all {:.0f} adapter slots (--max-loras) are in use while requests "
        "queue: requests for another adapter wait for a slot",
        full.size(), steps.size(), max_loras);
    f.numbers = {{"slot_bound_steps", double(full.size())},
                 {"steps", n},
                 {"max_loras", max_loras},
                 {"lora_share", lora_share}};
    f.change.push_back(
        fmt::format("--max-loras {:.0f} (each resident adapter costs its memory; --lora-bits 4 "
                    "holds ~8x more in the same)",
                    2 * max_loras));
    f.gain = "queued requests for other adapters start without waiting for a slot to free";
    f.model = "admission waits while every resident adapter is busy (serve/scheduler.cpp)";
    out.findings.push_back(std::move(f));
  }
  if (static_cast<double>(split.size()) >= th.serve_min_steps_share * n) {
    double groups = 0, adapters_n = 0;
    for (const ServeStep& s : split) {
      groups += s.groups;
      adapters_n += s.adapters;
    }
    Finding f;
    f.rule = "serve_adapters";
    f.summary = fmt::format(
        "in {} of {} steps an adapter's rows ran as several groups ({:.0f} groups for {:.0f} "
        "adapters); lora is {} of the time",
        split.size(), steps.size(), groups, adapters_n, pct(lora_share));
    f.numbers = {{"split_steps", double(split.size())},
                 {"steps", n},
                 {"lora_groups", groups},
                 {"adapters", adapters_n},
                 {"lora_share", lora_share}};
    f.change.push_back(
        "none: loom's BatchForward puts each adapter's rows together; report this trace as a bug");
    f.gain_share = groups > 0 ? lora_share * (1 - adapters_n / groups) : 0;
    f.gain = fmt::format("about {} of the time, were each adapter one group", pct(f.gain_share));
    f.model = "the lora op's time taken as proportional to its groups (each reads its factors once)";
    out.findings.push_back(std::move(f));
  }
}

void kv_cache(const Trace& t, const Analysis& a, const std::vector<ServeStep>& steps, const StepCost& cost,
              Advice& out) {
  double preempted = 0, min_free = 1e300, total_blocks = 0, min_seqs = 1e300;
  std::vector<ServeStep> at_preemption;
  for (const ServeStep& s : steps) {
    preempted += s.preempted;
    min_free = std::min(min_free, s.free_blocks);
    total_blocks = std::max(total_blocks, s.total_blocks);
    if (s.preempted > 0) {
      at_preemption.push_back(s);
      min_seqs = std::min(min_seqs, s.sequences);
    }
  }
  if (preempted <= 0) return;
  const double block_size = std::max(1.0, budget(t, "block_size"));
  const double tokens = mean_of(at_preemption, held_tokens_per_seq) * block_size;
  const double lost_us = preempted * tokens * cost.b;
  Finding f;
  f.rule = "serve_kv_cache";
  f.summary = fmt::format(
      "{:.0f} sequences preempted in {} steps (KV cache of {:.0f} blocks of {:.0f} tokens, at "
      "least {:.0f} free): each drops its blocks and recomputes about {:.0f} tokens later",
      preempted, at_preemption.size(), total_blocks, block_size, min_free, tokens);
  f.numbers = {{"preempted", preempted},          {"preemption_steps", double(at_preemption.size())},
               {"kv_blocks_total", total_blocks}, {"kv_blocks_free_min", min_free},
               {"block_size", block_size},        {"tokens_per_preemption", tokens}};
  f.change.push_back(fmt::format("--kv-cache-memory 1.5x the current ({:.0f} blocks instead of {:.0f})",
                                 std::ceil(1.5 * total_blocks), total_blocks));
  if (min_seqs > 1 && min_seqs < 1e300)
    f.change.push_back(fmt::format("--max-seqs {:.0f} (fewer sequences share the cache)", min_seqs - 1));
  f.gain_share = a.share(lost_us);
  f.gain = fmt::format("about {} of the serving time ({}) spent recomputing preempted sequences",
                       pct(f.gain_share), ms(lost_us));
  f.model = "preemptions x tokens a sequence held (blocks in use / sequences) x the cost of a row; " +
            cost.describe();
  out.findings.push_back(std::move(f));
}

}  // namespace

void advise_serve(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out) {
  const std::vector<ServeStep> steps = serve_steps(t);
  if (steps.empty()) return;
  const StepCost cost = fit_cost(steps);
  prefill_stall(t, steps, cost, th, out);
  decode_underfilled(t, steps, cost, th, out);
  adapters(t, a, steps, th, out);
  kv_cache(t, a, steps, cost, out);
}

}  // namespace loom

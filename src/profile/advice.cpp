// The rules of `loom profile advise` that read any trace or a training one
// (advice.h); the serving rules are in advice_serve.cpp.
#include "profile/advice.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>

#include "core/dtype.h"
#include "profile/units.h"

namespace loom {

namespace {

// The training rules read the step phases; a trace without metadata may still have them.
bool training(const Trace& t) { return t.meta.command == "train" || t.meta.command.empty(); }

// The thread count's setting: the config key for train, the flag elsewhere.
std::string threads_setting(const Trace& t, int64_t n) {
  return t.meta.command == "train" ? fmt::format("threads: {}", n) : fmt::format("-t {}", n);
}

std::string lower_no_underscore(std::string s) {
  std::string o;
  for (char c : s)
    if (c != '_' && c != '-') o += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return o;
}

bool has_isa(const std::vector<std::string>& isa, const char* name) {
  const std::string want = lower_no_underscore(name);
  return std::any_of(isa.begin(), isa.end(),
                     [&](const std::string& s) { return lower_no_underscore(s) == want; });
}

// The mode `backward` runs in: the config's, `auto` resolved for this CPU.
std::string backward_mode(const Trace& t, const BackwardSpeeds& sp) {
  const std::string m = t.meta.config_string("backward", "auto");
  return m == "auto" ? sp.auto_mode : m;
}

// The fastest mode on this CPU class whose gradient error is at most bf16's
// (never int8, as `auto` decides), or int8 when the current mode is already that.
struct BackwardChoice {
  std::string mode;
  double speed = 0, current_speed = 0;
  bool less_exact = false;  // int8: 3x bf16's gradient error
};
std::optional<BackwardChoice> faster_backward(const std::string& current, const BackwardSpeeds& sp) {
  BackwardChoice c;
  c.current_speed = sp.of(current);
  if (c.current_speed <= 0) return std::nullopt;
  for (const char* m : {"bf16", "f16", "exact"})
    if (sp.of(m) > c.speed) {
      c.mode = m;
      c.speed = sp.of(m);
    }
  if (c.mode == current || c.speed <= c.current_speed * 1.02) {
    if (current == "int8" || sp.int8 <= c.current_speed * 1.02) return std::nullopt;
    c.mode = "int8";
    c.speed = sp.int8;
    c.less_exact = true;
  }
  return c;
}

std::string backward_gain_text(const BackwardChoice& c, const BackwardSpeeds& sp,
                               const std::string& current) {
  return fmt::format(
      "on the main job (docs/training.md, \"Backward speed by CPU\") this CPU class ({}) trains at {:.0f} "
      "tokens/s "
      "with backward: {} against {:.0f} with {} (+{:.0f}%){}",
      sp.cpu_class, c.speed, c.mode, c.current_speed, current, 100 * (c.speed / c.current_speed - 1),
      c.less_exact ? "; int8's gradient error is 3x bf16's (why auto never picks it)" : "");
}

double bits_per_weight(const std::string& dtype) {
  const auto t = dtype_from_name(dtype);
  if (!t) return 0;
  const DTypeTraits& tr = dtype_traits(*t);
  return 8.0 * static_cast<double>(tr.block_bytes) / static_cast<double>(tr.block_size);
}

// How to get a model whose products use `dtype`: the `loom quantize` call,
// from the model's f16 / bf16 source. Empty: none. (Training's quantize_base
// makes only types with fewer bits than its f16 / bf16 source, which
// faster_type never offers.)
std::string how_to_get(const std::string& dtype) {
  if (dtype == "nf4") return {};  // made at load by quantize_base, or read from bitsandbytes folders
  if (dtype == "i8_ch")
    return "the model as INT8 W8A8: loom quantize -m SOURCE --method int8 (from its f16/bf16 source)";
  static const std::pair<const char*, const char*> kFileTypes[] = {
      {"f32", "F32"},     {"f16", "F16"},     {"bf16", "BF16"}, {"q8_0", "Q8_0"}, {"q4_0", "Q4_0"},
      {"q4_1", "Q4_1"},   {"q5_0", "Q5_0"},   {"q5_1", "Q5_1"}, {"q2_k", "Q2_K"}, {"q3_k", "Q3_K_M"},
      {"q4_k", "Q4_K_M"}, {"q5_k", "Q5_K_M"}, {"q6_k", "Q6_K"}};
  for (const auto& [name, type] : kFileTypes)
    if (dtype == name)
      return fmt::format("the model as {}: loom quantize -m SOURCE --type {} (from its f16/bf16 source)",
                         dtype, type);
  return {};
}

// A measured weight type at least as precise as `dtype` (bits per weight),
// that loom can make, whose forward products run >= 1.2x faster here in
// `regime` (only `matmul`: the model's type is what its weights are stored in).
const GemmPeak* faster_type(const PeakTable& peak, const std::string& dtype, const std::string& regime) {
  const GemmPeak* cur = peak.find("matmul", dtype, regime);
  const double bits = bits_per_weight(dtype);
  if (!cur || bits <= 0) return nullptr;
  const GemmPeak* best = nullptr;
  for (const GemmPeak& g : peak.gemm)
    if (g.op == "matmul" && g.regime == regime && g.dtype != dtype &&
        bits_per_weight(g.dtype) >= bits - 1e-9 && g.gflops >= 1.2 * cur->gflops &&
        (!best || g.gflops > best->gflops) && !how_to_get(g.dtype).empty())
      best = &g;
  return best;
}

void matmul_finding(const Trace& t, const Analysis& a, const PeakTable& peak, const MatmulClass& c,
                    const GemmPeak& p, double frac, Advice& out) {
  const double share = a.share(c.us);
  Finding f;
  f.rule = "matmul_under_peak";
  const bool decode = c.regime == "decode";
  f.summary = fmt::format(
      "{} {} ({}, mean T {:.0f}) is {} of the time at {:.1f} GFLOP/s, {:.1f} GB/s: {} of this machine's {} "
      "{}{} peak ({:.1f} {} with {} threads)",
      c.op, c.dtype, c.regime, c.mean_T(), pct(share), c.gflops(), c.gbps(), pct(frac), p.op, p.dtype,
      p.precision.empty() ? "" : " (" + p.precision + ")", decode ? p.gbps : p.gflops,
      decode ? "GB/s" : "GFLOP/s", peak.key.threads);
  f.numbers = {{"share", share},
               {"gflops", c.gflops()},
               {"gbps", c.gbps()},
               {"peak", decode ? p.gbps : p.gflops},
               {"fraction_of_peak", frac},
               {"mean_T", c.mean_T()},
               {"calls", static_cast<double>(c.count)}};
  if (c.op == "linear_backward_input" && t.meta.command == "train") {
    const BackwardSpeeds sp = backward_speeds(t.meta.isa, t.meta.bf16_dot);
    const std::string current = backward_mode(t, sp);
    if (const auto choice = faster_backward(current, sp)) {
      f.change.push_back(fmt::format("backward: {}{}", choice->mode,
                                     choice->less_exact ? " (3x bf16's gradient error)" : ""));
      f.gain_share = share * (1 - choice->current_speed / choice->speed);
      f.gain = fmt::format("about {} of the step; {}", pct(f.gain_share),
                           backward_gain_text(*choice, sp, current));
      f.model =
          "the product's time shrinks by the main job's tokens/s ratio of the two modes on this CPU class";
    }
  } else if (const GemmPeak* faster = c.op == "matmul" ? faster_type(peak, c.dtype, c.regime) : nullptr) {
    const GemmPeak& cur = *peak.find("matmul", c.dtype, c.regime);
    f.change.push_back(how_to_get(faster->dtype));
    f.gain_share = share * (1 - cur.gflops / faster->gflops);
    f.gain = fmt::format(
        "about {} of the time: {} products run at {:.1f} GFLOP/s here against {:.1f} for {} ({}, "
        "at least as many bits a weight)",
        pct(f.gain_share), faster->dtype, faster->gflops, cur.gflops, c.dtype, c.regime);
    f.model = "the product keeps its fraction of peak, at the other type's measured peak";
  }
  if (f.change.empty()) {
    f.change.push_back(
        fmt::format("none in loom's settings for {} {}: compare {} (the peak's thread count), and look "
                    "for other processes on the machine while it ran",
                    c.op, c.dtype, threads_setting(t, peak.key.threads)));
    f.gain_share = share * (1 - frac);
    f.gain = fmt::format("at most {} of the time, were the product at peak", pct(f.gain_share));
    f.model = "upper bound: the class's time at the measured peak";
  }
  out.findings.push_back(std::move(f));
}

}  // namespace

double BackwardSpeeds::of(const std::string& mode) const {
  if (mode == "bf16") return bf16;
  if (mode == "f16") return f16;
  if (mode == "int8") return int8;
  if (mode == "exact") return exact;
  return 0;
}

std::string trace_backward_mode(const Trace& t) {
  return t.meta.command == "train" ? backward_mode(t, backward_speeds(t.meta.isa, t.meta.bf16_dot))
                                   : std::string();
}

std::string class_precision(const Trace& t, const MatmulClass& c) {
  if (!op_has_precision(c.op)) return {};
  if (c.op == "linear_backward_input" && c.dtype == "f32" && t.meta.config_string("method", "lora") == "lora")
    return "exact";
  return trace_backward_mode(t);
}

BackwardSpeeds backward_speeds(const std::vector<std::string>& isa, const std::string& bf16_dot) {
  // docs/training.md, "Backward speed by CPU": main job tokens/s by mode (bf16, f16, int8, exact).
  const bool f = has_isa(isa, "avx512f"), vnni = has_isa(isa, "avx512_vnni"),
             bf = has_isa(isa, "avx512_bf16");
  if (has_isa(isa, "amx_bf16") && f && vnni) return {"amx", "bf16", 520, 363, 0, 243};
  if (f && vnni && bf && bf16_dot == "fma")
    return {"avx512_bf16", "f16", 386, 545, 589, 475};  // Emerald Rapids
  if (f && vnni && bf) return {"avx512_bf16", "bf16", 654, 473, 698, 426};
  if (f && vnni) return {"avx512", "f16", 451, 473, 698, 431};
  if (f) return {"avx512f", "f16", 350, 255, 351, 332};
  return {"avx2", "f16", 349, 253, 353, 319};
}

void advise_waiting(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out) {
  const double share = a.share(a.waiting_us);
  if (a.total_us <= 0 || share < th.waiting_share) return;
  Finding f;
  f.rule = "thread_waiting";
  const int64_t n = std::max<int64_t>(a.threads, 1);
  const double efficiency = a.op_us > 0 ? 1 - a.waiting_us / a.op_us : 1;
  std::vector<TimeRow> by_wait = a.ops;
  std::sort(by_wait.begin(), by_wait.end(),
            [](const TimeRow& x, const TimeRow& y) { return x.waiting_us > y.waiting_us; });
  std::string top;
  double small_ops_wait = 0;
  for (size_t i = 0; i < by_wait.size(); ++i) {
    if (i < 3 && by_wait[i].waiting_us > 0)
      top += fmt::format("{}{} {} (mean {})", top.empty() ? "" : ", ", by_wait[i].name,
                         pct(by_wait[i].waiting_us / a.waiting_us), ms(by_wait[i].mean_us()));
    if (by_wait[i].mean_us() < 200) small_ops_wait += by_wait[i].waiting_us;
  }
  const std::string phase = a.waiting_by_phase.empty() ? "-" : a.waiting_by_phase.front().name;
  f.summary = fmt::format(
      "the {} pool threads waited {} of the time inside ops (ops run at {} parallel efficiency); most in {}; "
      "by op: {}",
      n, pct(share), pct(efficiency), phase, top);
  f.numbers = {{"waiting_share", share},
               {"threads", static_cast<double>(n)},
               {"efficiency", efficiency},
               {"small_ops_waiting_share", a.waiting_us > 0 ? small_ops_wait / a.waiting_us : 0}};
  const bool train = t.meta.command == "train";
  if (train && phase == "backward") {
    const BackwardSpeeds sp = backward_speeds(t.meta.isa, t.meta.bf16_dot);
    if (const auto c = faster_backward(backward_mode(t, sp), sp))
      f.change.push_back("backward: " + c->mode + (c->less_exact ? " (3x bf16's gradient error)" : ""));
  }
  if (small_ops_wait > 0.5 * a.waiting_us) {
    if (train) {
      const auto bs = static_cast<int64_t>(t.meta.config_number("batch_size", 4));
      const auto ga = static_cast<int64_t>(t.meta.config_number("grad_accum", 1));
      f.change.push_back(
          ga >= 2 ? fmt::format("batch_size: {} with grad_accum: {} (the same rows a step, fewer and "
                                "larger ops)",
                                bs * 2, (ga + 1) / 2)
                  : fmt::format("batch_size: {} (larger ops; more activation memory)", bs * 2));
    } else if (t.meta.command == "serve") {
      f.change.push_back("--max-batch-tokens / --max-seqs higher (more rows an op)");
    }
  }
  const int64_t fewer =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(efficiency * static_cast<double>(n))));
  if (fewer < n)
    f.change.push_back(
        fmt::format("{} (the ops' work at this efficiency fits in {} threads; frees CPUs, rarely "
                    "faster alone)",
                    threads_setting(t, fewer), fewer));
  if (f.change.empty()) f.change.push_back(threads_setting(t, std::max<int64_t>(1, n - 1)));
  f.gain_share = share;
  f.gain = fmt::format("at most {} of the time (the idle thread time, were all of it turned into work)",
                       pct(share));
  f.model = "upper bound: waiting = sum over ops of (threads * dur - busy_us) / threads";
  out.findings.push_back(std::move(f));
}

void advise_matmul(const Trace& t, const Analysis& a, const PeakTable* peak, const AdviceThresholds& th,
                   Advice& out) {
  if (!peak) {
    out.notes.push_back("matmul_under_peak: not checked (no peak: --no-peak)");
    return;
  }
  int found = 0;
  for (const MatmulClass& c : a.matmuls) {
    if (found == 3 || a.share(c.us) < th.matmul_min_share) continue;
    if (c.mean_weights() < th.matmul_min_weights)
      continue;  // LoRA factors and the like: never at a GEMM's peak
    const GemmPeak* p = peak->find_class(c.op, c.dtype, c.regime, class_precision(t, c));
    if (!p) {
      out.notes.push_back(fmt::format("matmul_under_peak: {} {} ({}): no peak measured for {} over {}", c.op,
                                      c.dtype, c.regime, c.op, c.dtype));
      continue;
    }
    const double frac =
        c.regime == "decode" ? (p->gbps > 0 ? c.gbps() / p->gbps : 1) : c.gflops() / p->gflops;
    if (frac >= th.matmul_peak_fraction) continue;
    matmul_finding(t, a, *peak, c, *p, frac, out);
    ++found;
  }
}

void advise_data(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out) {
  const TimeRow* in_steps = a.unit == "step" ? a.phase("data") : nullptr;
  const TimeRow* setup = a.outside_phase("data");
  const double step_share = in_steps ? a.share(in_steps->us) : 0;
  const double setup_share = setup && a.span_us > 0 ? setup->us / a.span_us : 0;
  if (step_share < th.data_step_share && setup_share < th.data_setup_share) return;
  const std::string cache = t.meta.config_string("data.cache_dir");
  Finding f;
  f.rule = "data_loading";
  f.summary = fmt::format(
      "data loading is {} of the step time ({} a step) and {} outside the steps ({} of the "
      "recording: tokenizing at setup); data.cache_dir {}",
      pct(step_share), ms(in_steps ? in_steps->mean_us() : 0), ms(setup ? setup->us : 0), pct(setup_share),
      cache.empty() ? "not set" : "= " + cache);
  f.numbers = {{"step_share", step_share}, {"setup_us", setup ? setup->us : 0}, {"setup_share", setup_share}};
  if (cache.empty()) {
    f.change.push_back("data.cache_dir: a folder for the token cache (docs/training.md)");
    f.gain_share = step_share;
    f.gain = fmt::format(
        "runs after the first read the tokenized samples instead of tokenizing: about {} of setup "
        "({} of this recording) and up to {} of the step time",
        ms(setup ? setup->us : 0), pct(setup_share), pct(step_share));
    f.model =
        "the cache replaces tokenizing by reading the cached ids (taken as free); the cache's key covers the "
        "file, tokenizer, template and data options";
  } else {
    f.change.push_back(
        fmt::format("data.cache_dir is set ({}): if this run built the cache, the next one reads it; "
                    "the data time inside the steps is batch assembly, which the cache does not change",
                    cache));
    f.gain = "none from the cache beyond the first run";
    f.model = "the cache only removes tokenizing";
  }
  out.findings.push_back(std::move(f));
}

void advise_activations(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out) {
  const auto& mem = t.meta.memory;
  const auto act_it = mem.find("activations");
  if (act_it == mem.end() || act_it->second <= 0) return;
  double total = 0;
  if (const auto it = mem.find("total"); it != mem.end() && it->second > 0) {
    total = it->second;
  } else {
    for (const auto& [k, v] : mem) total += v;
  }
  const double act = act_it->second, share = total > 0 ? act / total : 0;
  if (share < th.activation_share) return;
  Finding f;
  f.rule = "activation_memory";
  const double gc = t.meta.config_number("gradient_checkpointing", 0);
  const int64_t L = t.meta.model_layers > 0 ? t.meta.model_layers : 0;
  f.summary = fmt::format("activations are {} of the memory estimate ({} of {}); gradient_checkpointing {}",
                          pct(share), mib(act), mib(total), gc > 0 ? fmt::format("{:.0f}", gc) : "off");
  f.numbers = {{"activations_bytes", act}, {"total_bytes", total}, {"share", share}};
  const TimeRow* fwd = a.phase("forward");
  const double fwd_share = fwd ? a.share(fwd->us) : 0;
  if (gc <= 0 && L > 1) {
    const auto N = std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(L))));
    const double rows = t.meta.config_number("batch_size", 0) * t.meta.config_number("data.seq_len", 0);
    const double checkpoints =
        static_cast<double>((L + N - 1) / N - 1) * rows * static_cast<double>(t.meta.model_hidden) * 4;
    const double after = act * static_cast<double>(N) / static_cast<double>(L) + checkpoints;
    f.change.push_back(fmt::format("gradient_checkpointing: {}", N));
    f.change.push_back("activation_dtype: bf16 (no recompute; -40 to -44% activations, docs/training.md)");
    f.gain = fmt::format(
        "activations about {} instead of {} (total about {}), for about +{} step time (the "
        "forward, {} of the step, again for {} of {} layers)",
        mib(after), mib(act), mib(total - act + after),
        pct(fwd_share * static_cast<double>(L - N) / static_cast<double>(L)), pct(fwd_share), L - N, L);
    f.model =
        "activations x N/L plus (ceil(L/N) - 1) checkpoints of batch_size x seq_len x hidden f32; the "
        "recompute "
        "costs L - N layer forwards";
  } else {
    const auto bs = static_cast<int64_t>(t.meta.config_number("batch_size", 4));
    const auto ga = static_cast<int64_t>(t.meta.config_number("grad_accum", 1));
    if (bs >= 2) {
      f.change.push_back(
          fmt::format("batch_size: {} with grad_accum: {} (the same rows a step)", bs / 2, ga * 2));
      f.gain = fmt::format("activations about {} instead of {}", mib(act * static_cast<double>(bs / 2) / bs),
                           mib(act));
      f.model = "activations scale with the rows of a micro-batch";
    } else {
      f.change.push_back("data.seq_len lower (activations scale with the rows of a micro-batch)");
      f.gain = "activations in proportion to data.seq_len";
      f.model = "activations scale with the rows of a micro-batch";
    }
  }
  out.findings.push_back(std::move(f));
}

void advise_optimizer(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out) {
  const TimeRow* opt = a.unit == "step" ? a.phase("optimizer") : nullptr;
  if (!opt || a.total_us <= 0) return;
  const double o = a.share(opt->us);
  if (o < th.optimizer_share || o >= 1) return;
  const double r = 1 - o;  // the rest of the step, which grows with the micro-batches
  const auto m = std::max<int64_t>(
      2, static_cast<int64_t>(std::ceil(o * (1 - th.optimizer_target) / (th.optimizer_target * r))));
  const auto ga = static_cast<int64_t>(t.meta.config_number("grad_accum", 1));
  const double after = o / (o + static_cast<double>(m) * r);
  Finding f;
  f.rule = "optimizer_time";
  f.summary = fmt::format("the optimizer is {} of the step ({} a step; grad_accum {}, optim.kind {})", pct(o),
                          ms(opt->mean_us()), ga, t.meta.config_string("optim.kind", "adamw"));
  f.numbers = {{"optimizer_share", o}, {"optimizer_us_per_step", opt->mean_us()}, {"grad_accum", double(ga)}};
  f.change.push_back(
      fmt::format("grad_accum: {} (one update for {}x the tokens; the effective batch grows {}x, so "
                  "steps and lr change with it)",
                  ga * m, m, m));
  f.change.push_back(
      "fewer trainable parameters: lora.r, lora.target_modules (the update's time is proportional)");
  f.gain_share = 1 - (o / static_cast<double>(m) + r);
  f.gain = fmt::format("the optimizer falls to about {} of a step; about {} less time a token", pct(after),
                       pct(f.gain_share));
  f.model =
      "the update costs the same per step whatever grad_accum; the rest scales with the micro-batches. "
      "optim.kind: adamw8bit saves 72% of the optimizer's memory but is not faster (23.7 against 20.5 ms for "
      "4.88M parameters, docs/training.md); the AdamW update is already one fused pass per group";
  out.findings.push_back(std::move(f));
}

Advice advise(const Trace& trace, const Analysis& a, const PeakTable* peak, const AdviceThresholds& th) {
  Advice out;
  advise_waiting(trace, a, th, out);
  advise_matmul(trace, a, peak, th, out);
  if (training(trace)) {
    advise_data(trace, a, th, out);
    advise_activations(trace, a, th, out);
    advise_optimizer(trace, a, th, out);
  }
  advise_serve(trace, a, th, out);
  std::stable_sort(out.findings.begin(), out.findings.end(),
                   [](const Finding& x, const Finding& y) { return x.gain_share > y.gain_share; });
  return out;
}

}  // namespace loom

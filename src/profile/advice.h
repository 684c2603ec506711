// `loom profile advise`: rules over a trace's aggregates, each naming what it
// saw (with the numbers), the config key or flag to change and the gain to
// expect, with how that gain is estimated. Thresholds and gain models are
// written down in docs/profiling.md ("Advice"), one subsection per rule.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "profile/analysis.h"
#include "profile/peak.h"
#include "profile/trace_file.h"

namespace loom {

// When the rules fire (docs/profiling.md states the same values).
struct AdviceThresholds {
  double waiting_share = 0.10;         // thread_waiting: idle thread time / accounted time
  double matmul_min_share = 0.05;      // matmul_under_peak: a class this much of the time ...
  double matmul_peak_fraction = 0.50;  // ... running under this fraction of its measured peak
  double matmul_min_weights = 65536;   // ... with N*K at least this (smaller products never reach a peak)
  double data_step_share = 0.05;       // data_loading: `data` inside the steps
  double data_setup_share = 0.10;      // data_loading: `data` outside the steps, of the recording
  double activation_share = 0.50;      // activation_memory: activations / the memory estimate's total
  double optimizer_share = 0.20;       // optimizer_time: `optimizer` phase / step
  double optimizer_target = 0.10;      // the share the suggested grad_accum brings it to
  // serve_prefill_stall: steps with prefill and decode rows this much longer than decode-only ones.
  double prefill_stall_ratio = 2.0;
  // The serving rules: their situation in at least this share of the steps.
  double serve_min_steps_share = 0.10;
  // serve_decode_underfilled: rows under this fraction of --max-batch-tokens.
  double underfilled_rows = 0.5;
};

struct Finding {
  std::string rule;     // thread_waiting, matmul_under_peak, data_loading, activation_memory, optimizer_time,
                        // serve_prefill_stall, serve_decode_underfilled, serve_adapters, serve_kv_cache
  std::string summary;  // what the trace shows, with its numbers
  std::vector<std::pair<std::string, double>> numbers;  // the same numbers by name (--json)
  std::vector<std::string> change;                      // key or flag and value; first the main one
  std::string gain;                                     // the expected gain, in words with numbers
  double gain_share = 0;  // that gain as a share of the accounted time (0: not a time gain)
  std::string model;      // how the gain was estimated
};

struct Advice {
  std::vector<Finding> findings;   // largest gain_share first
  std::vector<std::string> notes;  // rules that could not be checked, and why
};

// `peak` may be null (--no-peak): matmul_under_peak is then skipped with a note.
Advice advise(const Trace& trace, const Analysis& a, const PeakTable* peak, const AdviceThresholds& th = {});

// The rules one by one (advice.cpp: training and all commands; advice_serve.cpp: serving).
void advise_waiting(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out);
void advise_matmul(const Trace& t, const Analysis& a, const PeakTable* peak, const AdviceThresholds& th,
                   Advice& out);
void advise_data(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out);
void advise_activations(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out);
void advise_optimizer(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out);
void advise_serve(const Trace& t, const Analysis& a, const AdviceThresholds& th, Advice& out);

// The `backward` mode `auto` resolves to on a CPU with these instructions and
// this way of multiplying bf16 pairs (TraceMeta::bf16_dot) (docs/training.md,
// "Backward precision"), and training's tokens/s of each mode there on the main
// job (its "Backward speed by CPU" table; 0: not measured).
struct BackwardSpeeds {
  const char* cpu_class;  // "amx", "avx512_bf16", "avx512", "avx2"
  const char* auto_mode;
  double bf16, f16, int8, exact;
  double of(const std::string& mode) const;
};
BackwardSpeeds backward_speeds(const std::vector<std::string>& isa, const std::string& bf16_dot);
// The `backward` mode a training trace ran in: its config's, `auto` resolved
// by its instructions as above; empty for a trace of another command.
std::string trace_backward_mode(const Trace& t);
// The precision to look a class's peak up at (PeakTable::find_class): empty
// for ops without one; trace_backward_mode, except `exact` for a LoRA run's
// f32 linear_backward_input (the factors' input gradients, which read W as
// stored in every mode; a LoRA run of an f32 model mixes its frozen weights'
// W^T into that class).
std::string class_precision(const Trace& t, const MatmulClass& c);

}  // namespace loom

// `loom profile advise`'s rules: for each, a synthetic trace made to trigger
// it (the finding, the setting it names and the gain's numbers) and one that
// does not.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "profile/advice.h"
#include "profile/analysis.h"
#include "profile/report.h"
#include "profile_trace_builder.h"

namespace loom {
namespace {

using json = nlohmann::json;
using test_util::TraceBuilder;

struct StepShape {
  double step = 1000, data = 50, forward = 300, backward = 500, optimizer = 100;
};

// `n` training steps of the given phase lengths on thread 0, back to back from ts 1000.
TraceBuilder train_trace(int n, StepShape s = {}) {
  TraceBuilder b;
  for (int i = 0; i < n; ++i) {
    const double t0 = 1000 + i * s.step;
    b.phase("step", t0, s.step, {{"step", i + 1}});
    b.phase("data", t0, s.data);
    b.phase("forward", t0 + s.data, s.forward);
    b.phase("backward", t0 + s.data + s.forward, s.backward);
    b.phase("optimizer", t0 + s.data + s.forward + s.backward, s.optimizer);
  }
  return b;
}

Advice advice_of(const TraceBuilder& b, const PeakTable* peak = nullptr) {
  const Trace t = b.trace();
  return advise(t, analyze(t), peak);
}

// A copy: the Advice is often a temporary.
std::optional<Finding> find(const Advice& a, const std::string& rule) {
  for (const Finding& f : a.findings)
    if (f.rule == rule) return f;
  return std::nullopt;
}

double number(const Finding& f, const std::string& name) {
  for (const auto& [k, v] : f.numbers)
    if (k == name) return v;
  ADD_FAILURE() << "no number " << name << " in " << f.rule;
  return 0;
}

bool changes(const Finding& f, const std::string& needle) {
  for (const std::string& c : f.change)
    if (c.find(needle) != std::string::npos) return true;
  return false;
}

// ---- thread_waiting

TEST(ProfileAdvice, ThreadWaitingFiresAboveTenPercent) {
  TraceBuilder b = train_trace(2);
  b.loom["threads"] = 4;
  // 4 threads, 600 us ops, 1600 us busy: (4 * 600 - 1600) / 4 = 200 us waiting of each 1000 us step.
  for (int i = 0; i < 2; ++i)
    b.op("matmul", 1050 + i * 1000, 600,
         TraceBuilder::product("forward", 0, 64, 1024, 1024, "q4_0", 0.5625, 4, 1600));
  const Advice a = advice_of(b);
  const auto f = find(a, "thread_waiting");
  ASSERT_TRUE(f);
  EXPECT_DOUBLE_EQ(number(*f, "waiting_share"), 0.2);
  EXPECT_NEAR(number(*f, "efficiency"), 2.0 / 3, 1e-12);
  EXPECT_TRUE(changes(*f, "threads: 3")) << f->change[0];  // ceil(2/3 * 4)
  EXPECT_DOUBLE_EQ(f->gain_share, 0.2);
  EXPECT_NE(f->summary.find("20.0%"), std::string::npos) << f->summary;
}

TEST(ProfileAdvice, ThreadWaitingOnSmallOpsNamesTheBatchSize) {
  TraceBuilder b = train_trace(1);
  b.loom["config"] = {{"batch_size", 2}, {"grad_accum", 4}};
  // 50 ops of 10 us in the forward, each with half the thread time idle: 250 us of 1000.
  for (int i = 0; i < 50; ++i)
    b.op("rmsnorm", 1050 + 5 * i, 10, {{"phase", "forward"}, {"T", 2}, {"threads", 2}, {"busy_us", 10}});
  const auto f = find(advice_of(b), "thread_waiting");
  ASSERT_TRUE(f);
  EXPECT_DOUBLE_EQ(number(*f, "waiting_share"), 0.25);
  EXPECT_TRUE(changes(*f, "batch_size: 4 with grad_accum: 2")) << f->change[0];
}

TEST(ProfileAdvice, ThreadWaitingQuietBelowTenPercent) {
  TraceBuilder b = train_trace(2);
  b.loom["threads"] = 4;
  for (int i = 0; i < 2; ++i)  // (2400 - 2200) / 4 = 50 us: 5%
    b.op("matmul", 1050 + i * 1000, 600,
         TraceBuilder::product("forward", 0, 64, 1024, 1024, "q4_0", 0.5625, 4, 2200));
  EXPECT_FALSE(find(advice_of(b), "thread_waiting"));
}

// ---- matmul_under_peak

PeakTable synthetic_peak() {
  PeakTable p;
  p.key.cpu = "Test CPU";
  p.key.threads = 2;
  p.read_gbps = 20;
  p.gemm = {{"matmul", "q4_0", "batch", "", 256, 1024, 2048, 100, 10, 0.01},
            {"matmul", "q8_0", "batch", "", 256, 1024, 2048, 300, 30, 0.01},
            {"matmul", "q2_k", "batch", "", 256, 1024, 2048, 900, 30,
             0.01},  // fewer bits: never suggested for q4_0
            {"matmul", "q4_0", "decode", "", 1, 90000, 2048, 40, 12, 0.01},
            // The backward's own figure (f16 mode over a q4_0 class: W read as stored, exact's).
            {"linear_backward_input", "q4_0", "batch", "exact", 256, 1536, 576, 100, 10, 0.01}};
  return p;
}

// One forward product a 10 ms step: q4_0, T 64, 1024 x 1024, at `gflops`.
TraceBuilder product_trace(const std::string& op, const std::string& phase, double gflops) {
  StepShape s{.step = 10000, .data = 100, .forward = 4900, .backward = 4900, .optimizer = 100};
  TraceBuilder b = train_trace(1, s);
  json args = TraceBuilder::product(phase, 0, 64, 1024, 1024, "q4_0", 0.5625, 2, 0);
  const double dur = args["flops"].get<double>() / gflops / 1e3;
  args["busy_us"] = 2 * dur;  // no waiting
  b.op(op, 1100, dur, args);
  b.loom["model"] = {{"path", "m.gguf"}, {"layers", 2}, {"hidden", 1024}, {"type", "q4_0"}};
  return b;
}

TEST(ProfileAdvice, MatmulFarUnderPeakNamesAFasterTypeOfAsManyBits) {
  const PeakTable peak = synthetic_peak();
  const TraceBuilder b = product_trace("matmul", "forward", 20);  // 20% of q4_0's 100 GFLOP/s
  const Advice a = advice_of(b, &peak);
  const auto f = find(a, "matmul_under_peak");
  ASSERT_TRUE(f);
  EXPECT_NEAR(number(*f, "fraction_of_peak"), 0.2, 1e-9);
  EXPECT_DOUBLE_EQ(number(*f, "peak"), 100);
  EXPECT_TRUE(changes(*f, "loom quantize -m SOURCE --type Q8_0")) << f->change[0];
  const double share = number(*f, "share");
  EXPECT_NEAR(share, 134217728.0 / 20 / 1e3 / 10000, 1e-9);
  EXPECT_NEAR(f->gain_share, share * (1 - 100.0 / 300), 1e-9);
}

TEST(ProfileAdvice, MatmulBackwardNamesTheBackwardMode) {
  const PeakTable peak = synthetic_peak();
  TraceBuilder b = product_trace("linear_backward_input", "backward", 20);
  b.loom["isa"] = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"};
  b.loom["config"] = {{"backward", "f16"}};
  const auto f = find(advice_of(b, &peak), "matmul_under_peak");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->change[0], "backward: bf16");
  EXPECT_NE(f->gain.find("654"), std::string::npos) << f->gain;  // docs/training.md, AVX512-BF16 row
  EXPECT_NEAR(f->gain_share, number(*f, "share") * (1 - 473.0 / 654), 1e-9);
}

// Where vdpbf16ps is slower than two FMAs (the trace's bf16_dot: "fma"), bf16 is the slow mode.
TEST(ProfileAdvice, MatmulBackwardWithSlowVdpbf16psNamesF16) {
  const PeakTable peak = synthetic_peak();
  TraceBuilder b = product_trace("linear_backward_input", "backward", 20);
  b.loom["isa"] = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"};
  b.loom["bf16_dot"] = "fma";
  b.loom["config"] = {{"backward", "bf16"}};
  const auto f = find(advice_of(b, &peak), "matmul_under_peak");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->change[0], "backward: f16");
  EXPECT_NEAR(f->gain_share, number(*f, "share") * (1 - 386.0 / 545), 1e-9);
}

TEST(ProfileAdvice, MatmulNearPeakOrWithoutPeakIsQuiet) {
  const PeakTable peak = synthetic_peak();
  EXPECT_FALSE(find(advice_of(product_trace("matmul", "forward", 80), &peak), "matmul_under_peak"));
  const Advice none = advice_of(product_trace("matmul", "forward", 20), nullptr);
  EXPECT_FALSE(find(none, "matmul_under_peak"));
  ASSERT_FALSE(none.notes.empty());
  EXPECT_NE(none.notes[0].find("--no-peak"), std::string::npos);
}

// ---- data_loading

TEST(ProfileAdvice, DataLoadingWithoutCacheNamesTheTokenCache) {
  TraceBuilder b = train_trace(2);
  b.phase("data", 0, 900, {{"rows", 1000}});  // tokenizing at setup: 900 of 3000 us recorded
  const auto f = find(advice_of(b), "data_loading");
  ASSERT_TRUE(f);
  EXPECT_NEAR(number(*f, "setup_share"), 0.3, 1e-12);
  EXPECT_NEAR(number(*f, "step_share"), 0.05, 1e-12);
  EXPECT_EQ(f->change[0].rfind("data.cache_dir", 0), 0u) << f->change[0];
}

TEST(ProfileAdvice, DataLoadingQuietWhenSmall) {
  TraceBuilder b = train_trace(2, {.data = 10});
  b.phase("data", 0, 50);
  b.loom["config"] = {{"data.cache_dir", "/tmp/cache"}};
  EXPECT_FALSE(find(advice_of(b), "data_loading"));
}

// ---- activation_memory

TraceBuilder memory_trace(double activations, double total, json gc) {
  TraceBuilder b = train_trace(1);
  b.loom["model"] = {{"path", "m.gguf"}, {"layers", 30}, {"hidden", 576}, {"type", "q4_1"}};
  b.loom["config"] = {
      {"gradient_checkpointing", gc}, {"batch_size", 2}, {"grad_accum", 1}, {"data.seq_len", 512}};
  b.loom["memory"] = {{"weights", total - activations}, {"activations", activations}, {"total", total}};
  return b;
}

TEST(ProfileAdvice, ActivationMemoryNamesGradientCheckpointing) {
  const double mib = 1 << 20;
  const Advice a = advice_of(memory_trace(1645 * mib, 2000 * mib, false));
  const auto f = find(a, "activation_memory");
  ASSERT_TRUE(f);
  EXPECT_NEAR(number(*f, "share"), 1645.0 / 2000, 1e-12);
  EXPECT_EQ(f->change[0], "gradient_checkpointing: 5");  // round(sqrt(30))
  // 1645 MiB x 5/30 + 5 checkpoints of 2 x 512 x 576 f32 (11.25 MiB): about 285.4 MiB.
  EXPECT_NE(f->gain.find("285.4 MiB"), std::string::npos) << f->gain;
  // Already checkpointing: halve the micro-batch.
  const auto g = find(advice_of(memory_trace(1645 * mib, 2000 * mib, 4)), "activation_memory");
  ASSERT_TRUE(g);
  EXPECT_EQ(g->change[0], "batch_size: 1 with grad_accum: 2 (the same rows a step)");
}

TEST(ProfileAdvice, ActivationMemoryQuietBelowHalf) {
  EXPECT_FALSE(find(advice_of(memory_trace(300, 1000, false)), "activation_memory"));
}

// ---- optimizer_time

TEST(ProfileAdvice, OptimizerTimeNamesGradAccum) {
  TraceBuilder b = train_trace(3, {.data = 50, .forward = 250, .backward = 400, .optimizer = 300});
  b.loom["config"] = {{"grad_accum", 1}, {"optim.kind", "adamw"}};
  const auto f = find(advice_of(b), "optimizer_time");
  ASSERT_TRUE(f);
  EXPECT_DOUBLE_EQ(number(*f, "optimizer_share"), 0.3);
  // ceil(0.3 * 0.9 / (0.1 * 0.7)) = 4 micro-batches an update: 1 - (0.3 / 4 + 0.7) less time a token.
  EXPECT_EQ(f->change[0].rfind("grad_accum: 4", 0), 0u) << f->change[0];
  EXPECT_NEAR(f->gain_share, 0.225, 1e-12);
  EXPECT_NE(f->model.find("adamw8bit"), std::string::npos);  // says 8-bit is not the time lever
}

TEST(ProfileAdvice, OptimizerTimeQuietWhenSmall) {
  EXPECT_FALSE(find(advice_of(train_trace(3, {.optimizer = 50})), "optimizer_time"));
}

// ---- serving

struct ServeStepArgs {
  double dur, prefill = 0, decode = 0, sequences = 0, adapters = 0, groups = 0, preempted = 0, free = 100,
              total = 100, waiting = 0;
};

TraceBuilder serve_trace(const std::vector<ServeStepArgs>& steps, json budgets) {
  TraceBuilder b;
  b.loom["command"] = "serve";
  b.loom["serve"] = std::move(budgets);
  double t = 0;
  for (const ServeStepArgs& s : steps) {
    b.phase("serve_step", t, s.dur,
            {{"prefill_tokens", s.prefill},
             {"decode_rows", s.decode},
             {"sequences", s.sequences},
             {"adapters", s.adapters},
             {"lora_groups", s.groups},
             {"preempted", s.preempted},
             {"kv_blocks_free", s.free},
             {"kv_blocks_total", s.total},
             {"waiting", s.waiting}});
    t += s.dur + 10;
  }
  return b;
}

const json kBudgets = {
    {"max_batch_tokens", 256}, {"max_seqs", 8}, {"max_loras", 2}, {"kv_blocks", 100}, {"block_size", 16}};

// Steps cost 1000 + 100 us a row: 8 decode rows alone 1.8 ms; with a 248-token chunk 26.6 ms.
std::vector<ServeStepArgs> stall_steps(double chunk) {
  std::vector<ServeStepArgs> v;
  for (int i = 0; i < 10; ++i) {
    v.push_back({1000 + 100 * 8.0, 0, 8, 8});
    if (i % 3 == 0) v.push_back({1000 + 100 * (8 + chunk), chunk, 8, 9});
  }
  return v;
}

TEST(ProfileAdvice, ServePrefillStallNamesMaxBatchTokens) {
  const auto f = find(advice_of(serve_trace(stall_steps(248), kBudgets)), "serve_prefill_stall");
  ASSERT_TRUE(f);
  EXPECT_NEAR(number(*f, "cost_fixed_us"), 1000, 1e-6);
  EXPECT_NEAR(number(*f, "cost_per_row_us"), 100, 1e-9);
  // Rows at twice a decode-only step: (2 * 1800 - 1000) / 100 = 26, rounded down to 16.
  EXPECT_EQ(f->change[0], "--max-batch-tokens 16");
}

TEST(ProfileAdvice, ServePrefillStallQuietForSmallChunks) {
  EXPECT_FALSE(find(advice_of(serve_trace(stall_steps(4), kBudgets)), "serve_prefill_stall"));
}

TEST(ProfileAdvice, ServeDecodeUnderfilledNamesMaxSeqs) {
  std::vector<ServeStepArgs> v;
  for (int i = 0; i < 20; ++i) {
    const double rows = i % 2 ? 6 : 8;  // 1000 + 100 us a row
    v.push_back({1000 + 100 * rows, 0, rows, 8, 0, 0, 0, 50, 100, /*waiting=*/5});
  }
  const auto f = find(advice_of(serve_trace(v, kBudgets)), "serve_decode_underfilled");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->change[0].rfind("--max-seqs 16", 0), 0u) << f->change[0];
  // 7 rows on average: 1700 us; 14: 2400 us for twice the tokens -> 1 - 2400 / 3400.
  EXPECT_NEAR(f->gain_share, 1 - 2400.0 / 3400, 1e-9);
  for (auto& s : v) s.waiting = 0;
  EXPECT_FALSE(find(advice_of(serve_trace(v, kBudgets)), "serve_decode_underfilled"));
}

TEST(ProfileAdvice, ServeAdaptersSlotsFullNamesMaxLoras) {
  std::vector<ServeStepArgs> v;
  for (int i = 0; i < 10; ++i)
    v.push_back({1000, 0, 4, 4, /*adapters=*/2, /*groups=*/2, 0, 50, 100, /*waiting=*/3});
  const auto f = find(advice_of(serve_trace(v, kBudgets)), "serve_adapters");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->change[0].rfind("--max-loras 4", 0), 0u) << f->change[0];
  EXPECT_DOUBLE_EQ(number(*f, "slot_bound_steps"), 10);
}

TEST(ProfileAdvice, ServeAdaptersSplitGroupsAreReported) {
  std::vector<ServeStepArgs> v;
  for (int i = 0; i < 10; ++i) v.push_back({1000, 0, 4, 4, /*adapters=*/1, /*groups=*/3});
  TraceBuilder b = serve_trace(v, kBudgets);
  for (int i = 0; i < 10; ++i) b.op("lora", i * 1010 + 100, 300, {{"phase", "serve_step"}, {"T", 4}});
  const auto f = find(advice_of(b), "serve_adapters");
  ASSERT_TRUE(f);
  EXPECT_DOUBLE_EQ(number(*f, "lora_share"), 0.3);
  EXPECT_NEAR(f->gain_share, 0.3 * (1 - 1.0 / 3), 1e-12);
}

TEST(ProfileAdvice, ServeAdaptersQuietWhenGrouped) {
  std::vector<ServeStepArgs> v;
  for (int i = 0; i < 10; ++i) v.push_back({1000, 0, 4, 4, 1, 1, 0, 50, 100, 0});
  EXPECT_FALSE(find(advice_of(serve_trace(v, kBudgets)), "serve_adapters"));
}

TEST(ProfileAdvice, ServeKvCachePreemptionsNameKvCacheMemory) {
  std::vector<ServeStepArgs> v;
  for (int i = 0; i < 10; ++i) {
    const double rows = i % 2 ? 6 : 8;  // 1000 + 100 us a row
    v.push_back({1000 + 100 * rows, 0, rows, 8, 0, 0, 0, 20, 100});
  }
  v.push_back({1000 + 100 * 8.0, 0, 8, 8, 0, 0, /*preempted=*/2, /*free=*/0, 100});
  const auto f = find(advice_of(serve_trace(v, kBudgets)), "serve_kv_cache");
  ASSERT_TRUE(f);
  EXPECT_DOUBLE_EQ(number(*f, "preempted"), 2);
  // 100 blocks in use by 8 sequences: 12.5 blocks of 16 = 200 tokens each, recomputed at 100 us a token.
  EXPECT_DOUBLE_EQ(number(*f, "tokens_per_preemption"), 200);
  EXPECT_EQ(f->change[0], "--kv-cache-memory 1.5x the current (150 blocks instead of 100)");
  EXPECT_TRUE(changes(*f, "--max-seqs 7"));
  const double total = 6 * 1800.0 + 5 * 1600;
  EXPECT_NEAR(f->gain_share, 2 * 200 * 100 / total, 1e-9);
  v.back().preempted = 0;
  EXPECT_FALSE(find(advice_of(serve_trace(v, kBudgets)), "serve_kv_cache"));
}

TEST(ProfileAdvice, JsonListsFindingsAndNotes) {
  TraceBuilder b = train_trace(3, {.data = 50, .forward = 250, .backward = 400, .optimizer = 300});
  const Trace t = b.trace();
  const Analysis a = analyze(t);
  const Advice adv = advise(t, a, nullptr);
  const auto j = advice_json(t, a, adv);
  ASSERT_EQ(j["findings"].size(), adv.findings.size());
  EXPECT_EQ(j["findings"][0]["rule"], "optimizer_time");
  EXPECT_DOUBLE_EQ(j["findings"][0]["numbers"]["optimizer_share"].get<double>(), 0.3);
  EXPECT_TRUE(j["findings"][0]["change"].is_array());
  EXPECT_EQ(j["notes"].size(), 1u);
  const std::string text = format_advice(t, a, adv);
  EXPECT_NE(text.find("[optimizer_time]"), std::string::npos) << text;
  EXPECT_NE(text.find("change: grad_accum: 4"), std::string::npos) << text;
}

}  // namespace
}  // namespace loom

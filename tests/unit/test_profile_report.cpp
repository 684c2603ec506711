// `loom profile report`'s pieces: reading a trace (every bad input named by
// file and event), the aggregates of a small trace computed by hand (phases,
// op kinds, layers, waiting, matmul classes), and the text and JSON output.
#include <gtest/gtest.h>

#include <string>

#include "expect_error.h"
#include "profile/analysis.h"
#include "profile/report.h"
#include "profile/trace_file.h"
#include "profile_trace_builder.h"
#include "temp_dir.h"

namespace loom {
namespace {

using json = nlohmann::json;
using test_util::TraceBuilder;

// Two training steps and what runs around them, every number chosen by hand:
//   setup data [0, 500); step 1 [1000, 2000): data 100, forward 300 (a nested
//   recompute forward inside the backward does not count twice), backward 400,
//   optimizer 150, other 50; step 2 [2000, 3000): data 50, forward 300,
//   backward 500, optimizer 100, other 50; eval [3500, 3700) with an op.
TraceBuilder hand_trace() {
  TraceBuilder b;
  b.phase("data", 0, 500, {{"rows", 100}});
  b.phase("step", 1000, 1000, {{"step", 1}});
  b.phase("data", 1000, 100).phase("forward", 1100, 300).phase("backward", 1400, 400);
  b.phase("forward", 1450, 50);  // recompute inside the backward
  b.phase("optimizer", 1800, 150, {{"params", 1000}});
  b.phase("step", 2000, 1000, {{"step", 2}});
  b.phase("data", 2000, 50)
      .phase("forward", 2050, 300)
      .phase("backward", 2350, 500)
      .phase("optimizer", 2850, 100);
  b.phase("eval", 3500, 200);
  // waiting (threads*dur - busy)/threads: 50, 0, 20, 0, 50, 0 -> 120 us.
  b.op("matmul", 1100, 200, TraceBuilder::product("forward", 0, 64, 256, 512, "q4_0", 0.5625, 2, 300));
  b.op("rmsnorm", 1300, 50, {{"phase", "forward"}, {"layer", 0}, {"T", 64}, {"threads", 2}, {"busy_us", 60}});
  b.op("linear_backward_input", 1400, 300,
       TraceBuilder::product("backward", 0, 64, 256, 512, "q4_0", 0.5625, 2, 500));
  b.op("adamw", 1800, 100, {{"phase", "optimizer"}, {"threads", 2}, {"busy_us", 200}});
  b.op("matmul", 2050, 200, TraceBuilder::product("forward", 1, 64, 256, 512, "q4_0", 0.5625, 2, 400));
  b.op("matmul", 2260, 40, TraceBuilder::product("forward", 1, 1, 256, 512, "q4_0", 0.5625, 2, 80));
  b.op("matmul", 3500, 100, TraceBuilder::product("eval", 0, 64, 256, 512, "q4_0", 0.5625, 2, 200));
  b.events.push_back(
      {{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 0}, {"args", {{"name", "main"}}}});
  return b;
}

TEST(ProfileTrace, ReadsEventsArgsAndMetadata) {
  TraceBuilder b = hand_trace();
  b.loom["model"] = {{"path", "m.gguf"}, {"layers", 2}, {"hidden", 256}, {"type", "q4_0"}};
  b.loom["config"] = {{"backward", "auto"}, {"gradient_checkpointing", false}, {"batch_size", 4}};
  b.loom["memory"] = {{"activations", 1000}, {"total", 4000}};
  const Trace t = b.trace();
  EXPECT_EQ(t.phases.size(), 13u);
  EXPECT_EQ(t.ops.size(), 7u);
  EXPECT_EQ(t.skipped, 1u);  // the thread name
  EXPECT_EQ(t.meta.command, "train");
  EXPECT_EQ(t.meta.threads, 2);
  EXPECT_EQ(t.meta.model_layers, 2);
  EXPECT_EQ(t.meta.config_string("backward"), "auto");
  EXPECT_EQ(t.meta.config_number("gradient_checkpointing", 7), 0);
  EXPECT_EQ(t.meta.config_number("batch_size"), 4);
  EXPECT_EQ(t.meta.memory.at("total"), 4000);
  const ProfileEvent& m = t.ops[0];
  EXPECT_EQ(m.name, "matmul");
  EXPECT_EQ(m.phase, "forward");
  EXPECT_EQ(m.dtype, "q4_0");
  EXPECT_EQ(m.layer, 0);
  EXPECT_EQ(m.T, 64);
  EXPECT_EQ(m.N, 256);
  EXPECT_EQ(m.K, 512);
  EXPECT_EQ(m.threads, 2);
  EXPECT_EQ(m.busy_us, 300);
  EXPECT_EQ(t.ops[3].layer, -1);  // adamw: no layer
  EXPECT_EQ(t.phases[0].value("rows"), 100);
}

TEST(ProfileTrace, BadInputIsNamedByFileAndEvent) {
  test_util::TempDir tmp("profile_trace");
  const std::string missing = (tmp.path / "nope.json").string();
  test_util::expect_error([&] { read_trace(missing); }, ErrorKind::not_found, {missing, "does not exist"});
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string p = (tmp.path / name).string();
    std::ofstream(p) << text;
    return p;
  };
  const std::string bad = write("bad.json", "{\"traceEvents\": [");
  test_util::expect_error([&] { read_trace(bad); }, ErrorKind::invalid_input, {bad, "not JSON"});
  const std::string huge = write("huge.json", "{\"traceEvents\": [], \"ts\": 1e999}");  // overflows double
  test_util::expect_error([&] { read_trace(huge); }, ErrorKind::invalid_input,
                          {huge, "not JSON", "overflow"});
  const std::string none = write("none.json", "{\"otherData\": {}}");
  test_util::expect_error([&] { read_trace(none); }, ErrorKind::invalid_input, {none, "no \"traceEvents\""});
  const std::string array = write("array.json", "[]");
  test_util::expect_error([&] { read_trace(array); }, ErrorKind::invalid_input, {array, "object form"});
  const std::string no_dur = write("nodur.json",
                                   R"({"traceEvents": [{"name":"step","cat":"phase","ph":"X","ts":0,"dur":5},
                          {"name":"matmul","cat":"op","ph":"X","ts":1}]})");
  test_util::expect_error([&] { read_trace(no_dur); }, ErrorKind::invalid_input,
                          {no_dur, "traceEvents[1]", "\"matmul\"", "no \"dur\""});
  const std::string no_ts =
      write("nots.json", R"({"traceEvents": [{"name":"step","cat":"phase","ph":"X","dur":5}]})");
  test_util::expect_error([&] { read_trace(no_ts); }, ErrorKind::invalid_input,
                          {no_ts, "traceEvents[0]", "no \"ts\""});
  const std::string bad_arg =
      write("arg.json",
            R"({"traceEvents": [{"name":"matmul","cat":"op","ph":"X","ts":0,"dur":1,"args":{"T":"64"}}]})");
  test_util::expect_error([&] { read_trace(bad_arg); }, ErrorKind::invalid_input,
                          {bad_arg, "traceEvents[0]", "arg \"T\" must be a number"});
  const std::string negative =
      write("neg.json", R"({"traceEvents": [{"name":"step","cat":"phase","ph":"X","ts":0,"dur":-1}]})");
  test_util::expect_error([&] { read_trace(negative); }, ErrorKind::invalid_input,
                          {negative, "\"dur\" must be >= 0"});
}

TEST(ProfileAnalysis, HandComputedTrace) {
  const Analysis a = analyze(hand_trace().trace());
  EXPECT_EQ(a.unit, "step");
  EXPECT_EQ(a.units, 2);
  EXPECT_DOUBLE_EQ(a.total_us, 2000);
  EXPECT_DOUBLE_EQ(a.span_us, 3700);
  auto phase = [&](const char* n) { return a.phase(n) ? a.phase(n)->us : -1; };
  EXPECT_DOUBLE_EQ(phase("backward"), 900);
  EXPECT_DOUBLE_EQ(phase("forward"), 600);
  EXPECT_DOUBLE_EQ(phase("optimizer"), 250);
  EXPECT_DOUBLE_EQ(phase("data"), 150);
  EXPECT_DOUBLE_EQ(phase("other"), 100);
  EXPECT_EQ(a.phases.front().name, "backward");  // longest first
  EXPECT_EQ(a.phase("forward")->count, 2);
  ASSERT_TRUE(a.outside_phase("data"));
  EXPECT_DOUBLE_EQ(a.outside_phase("data")->us, 500);
  EXPECT_DOUBLE_EQ(a.outside_phase("eval")->us, 200);
  // Ops inside the steps only (the eval matmul is outside).
  EXPECT_DOUBLE_EQ(a.op_us, 890);
  EXPECT_DOUBLE_EQ(a.waiting_us, 120);
  EXPECT_DOUBLE_EQ(a.share(a.waiting_us), 0.06);
  ASSERT_EQ(a.ops.size(), 4u);
  EXPECT_EQ(a.ops[0].name, "matmul");
  EXPECT_EQ(a.ops[0].count, 3);
  EXPECT_DOUBLE_EQ(a.ops[0].us, 440);
  EXPECT_DOUBLE_EQ(a.ops[0].waiting_us, 50);
  EXPECT_DOUBLE_EQ(a.op("linear_backward_input")->us, 300);
  EXPECT_DOUBLE_EQ(a.op("rmsnorm")->waiting_us, 20);
  ASSERT_EQ(a.waiting_by_phase.size(), 2u);
  EXPECT_EQ(a.waiting_by_phase[0].name, "forward");
  EXPECT_DOUBLE_EQ(a.waiting_by_phase[0].us, 70);
  EXPECT_DOUBLE_EQ(a.waiting_by_phase[1].us, 50);
  ASSERT_EQ(a.layers.size(), 3u);
  EXPECT_EQ(a.layers[0].layer, 0);
  EXPECT_DOUBLE_EQ(a.layers[0].us, 550);
  EXPECT_EQ(a.layers[0].count, 3);
  EXPECT_DOUBLE_EQ(a.layers[1].us, 240);
  EXPECT_EQ(a.layers[2].layer, -1);
  EXPECT_DOUBLE_EQ(a.layers[2].us, 100);
  ASSERT_EQ(a.matmuls.size(), 3u);
  const MatmulClass& batch = a.matmuls[0];
  EXPECT_EQ(batch.op, "matmul");
  EXPECT_EQ(batch.regime, "batch");
  EXPECT_EQ(batch.count, 2);
  EXPECT_DOUBLE_EQ(batch.us, 400);
  EXPECT_DOUBLE_EQ(batch.gflops(), 2.0 * 2 * 64 * 256 * 512 / 400 / 1e3);
  EXPECT_DOUBLE_EQ(batch.mean_T(), 64);
  EXPECT_EQ(a.matmuls[1].op, "linear_backward_input");
  const MatmulClass& decode = a.matmuls[2];
  EXPECT_EQ(decode.regime, "decode");
  EXPECT_DOUBLE_EQ(decode.gflops(), 2.0 * 256 * 512 / 40 / 1e3);
  EXPECT_DOUBLE_EQ(decode.gbps(), (0.5625 * 256 * 512 + 4.0 * (256 + 512)) / 40 / 1e3);
  EXPECT_EQ(a.threads, 2);
}

TEST(ProfileAnalysis, WithoutStepsTheTopLevelPhasesCount) {
  TraceBuilder b;
  b.loom["command"] = "generate";
  b.phase("prefill", 0, 800, {{"tokens", 64}});
  for (int i = 0; i < 4; ++i) b.phase("decode", 1000 + 100 * i, 50, {{"tokens", 1}});
  b.op("matmul", 10, 700, TraceBuilder::product("prefill", 0, 64, 256, 512, "q8_0", 1.0625, 2, 1400));
  const Analysis a = analyze(b.trace());
  EXPECT_EQ(a.unit, "prefill+decode");
  EXPECT_EQ(a.units, 5);
  EXPECT_DOUBLE_EQ(a.total_us, 1000);
  EXPECT_DOUBLE_EQ(a.phase("prefill")->us, 800);
  EXPECT_DOUBLE_EQ(a.phase("decode")->us, 200);
  EXPECT_EQ(a.phase("decode")->count, 4);
  EXPECT_DOUBLE_EQ(a.op_us, 700);
}

TEST(ProfileAnalysis, OpsOnAnotherThreadAreNotInTheSteps) {
  TraceBuilder b;
  b.phase("step", 0, 100);
  b.op("matmul", 10, 50, TraceBuilder::product("forward", 0, 64, 64, 64, "f32", 4, 1, 50), /*tid=*/1);
  const Analysis a = analyze(b.trace());
  EXPECT_DOUBLE_EQ(a.op_us, 0);
  EXPECT_DOUBLE_EQ(a.phase("other")->us, 100);
}

PeakTable test_peak() {
  PeakTable p;
  p.key.cpu = "Test CPU";
  p.key.threads = 2;
  p.read_gbps = 20;
  p.gemm.push_back({"matmul", "q4_0", "batch", "", 256, 1024, 2048, 100, 10, 0.01});
  p.gemm.push_back({"matmul", "q4_0", "decode", "", 1, 90000, 2048, 40, 11, 0.01});
  return p;
}

TEST(ProfileReport, TextAndJsonCarryTheSameNumbers) {
  const Trace t = hand_trace().trace();
  const Analysis a = analyze(t);
  const PeakTable peak = test_peak();
  const std::string text = format_report(t, a, &peak, 2);
  EXPECT_NE(text.find("2 steps: 2.0 ms, 1.0 ms a step"), std::string::npos) << text;
  EXPECT_NE(text.find("by phase"), std::string::npos);
  EXPECT_NE(text.find("waiting (threads idle inside ops)"), std::string::npos);
  EXPECT_NE(text.find("op kinds (top 2 of 4)"), std::string::npos) << text;
  EXPECT_NE(text.find("(2 more)"), std::string::npos);
  EXPECT_NE(text.find("matmul q4_0 batch"), std::string::npos);
  EXPECT_NE(text.find("100.0 GFLOP/s"), std::string::npos) << text;
  const auto j = report_json(t, a, &peak);
  EXPECT_EQ(j["unit"], "step");
  EXPECT_EQ(j["units"], 2);
  EXPECT_DOUBLE_EQ(j["total_us"].get<double>(), 2000);
  EXPECT_EQ(j["ops"].size(), 4u);  // all of them, whatever --top
  EXPECT_DOUBLE_EQ(j["waiting"]["share"].get<double>(), 0.06);
  EXPECT_TRUE(j["layers"][2]["layer"].is_null());
  const auto& c = j["matmuls"][0];
  EXPECT_EQ(c["op"], "matmul");
  EXPECT_DOUBLE_EQ(c["peak"].get<double>(), 100);
  EXPECT_NEAR(c["fraction_of_peak"].get<double>(), 2.0 * 2 * 64 * 256 * 512 / 400 / 1e3 / 100, 1e-12);
  EXPECT_TRUE(c["peak_precision"].is_null());
  // The backward's class: only matmul was measured, so no peak (never the forward's figure).
  EXPECT_EQ(j["matmuls"][1]["op"], "linear_backward_input");
  EXPECT_TRUE(j["matmuls"][1]["peak"].is_null());
  const auto& d = j["matmuls"][2];
  EXPECT_EQ(d["peak_unit"], "GB/s");
  EXPECT_DOUBLE_EQ(d["peak"].get<double>(), 11);
  // Roofline: min(batch peak, read bandwidth x flops per byte).
  const MatmulClass& dc = a.matmuls[2];
  EXPECT_DOUBLE_EQ(d["roofline_gflops"].get<double>(), std::min(100.0, 20 * dc.flops / dc.bytes));
  const auto no_peak = report_json(t, a, nullptr);
  EXPECT_TRUE(no_peak["peak"].is_null());
  EXPECT_TRUE(no_peak["matmuls"][0]["peak"].is_null());
  EXPECT_EQ(text.find("above 115% of the peak"), std::string::npos) << text;
}

// A serving trace's steps by kind: decode-only steps by their rows, steps that
// also prefill, each kind's mean time in each op kind, in the text and the JSON
// alike; a training trace has none.
TEST(ProfileReport, ServeStepsByKind) {
  TraceBuilder b;
  b.loom["command"] = "serve";
  auto step = [&](double ts, double dur, int prefill, int decode) {
    b.phase("serve_step", ts, dur, {{"prefill_tokens", prefill}, {"decode_rows", decode}});
  };
  step(0, 1000, 0, 16);
  b.op("matmul", 10, 400, TraceBuilder::product("forward", 0, 16, 64, 64, "q4_0", 0.5625, 2, 800));
  b.op("lora", 420, 300,
       {{"phase", "forward"}, {"T", 16}, {"flops", 1000}, {"dtype", "bf16"}, {"bytes", 4000}});
  step(2000, 1200, 0, 16);
  b.op("matmul", 2010, 500, TraceBuilder::product("forward", 0, 16, 64, 64, "q4_0", 0.5625, 2, 1000));
  b.op("lora", 2520, 500,
       {{"phase", "forward"}, {"T", 16}, {"flops", 1000}, {"dtype", "bf16"}, {"bytes", 4000}});
  step(4000, 3000, 64, 16);
  b.op("matmul", 4010, 2500, TraceBuilder::product("forward", 0, 80, 64, 64, "q4_0", 0.5625, 2, 5000));
  step(8000, 100, 0, 0);
  const Trace t = b.trace();
  const Analysis a = analyze(t);
  ASSERT_EQ(a.step_kinds.size(), 3u);
  EXPECT_EQ(a.step_kinds[0].kind, "decode, 16 rows");
  EXPECT_EQ(a.step_kinds[0].count, 2);
  EXPECT_DOUBLE_EQ(a.step_kinds[0].mean_us(), 1100);
  EXPECT_DOUBLE_EQ(a.step_kinds[0].op_mean_us("matmul"), 450);
  EXPECT_DOUBLE_EQ(a.step_kinds[0].op_mean_us("lora"), 400);
  EXPECT_EQ(a.step_kinds[1].kind, "prefill + decode");
  EXPECT_DOUBLE_EQ(a.step_kinds[1].op_mean_us("matmul"), 2500);
  EXPECT_DOUBLE_EQ(a.step_kinds[1].op_mean_us("lora"), 0);
  EXPECT_EQ(a.step_kinds[2].kind, "empty");
  const std::string text = format_report(t, a, nullptr, 10);
  EXPECT_NE(text.find("serve steps by kind (mean)"), std::string::npos) << text;
  EXPECT_NE(text.find("  decode, 16 rows                2      1.1 ms"), std::string::npos) << text;
  const auto j = report_json(t, a, nullptr);
  ASSERT_EQ(j["serve_step_kinds"].size(), 3u);
  EXPECT_EQ(j["serve_step_kinds"][0]["kind"], "decode, 16 rows");
  EXPECT_DOUBLE_EQ(j["serve_step_kinds"][0]["op_mean_us"]["lora"].get<double>(), 400);
  EXPECT_DOUBLE_EQ(j["serve_step_kinds"][1]["mean_us"].get<double>(), 3000);
  // Training traces: no such table.
  const Trace train = hand_trace().trace();
  EXPECT_TRUE(analyze(train).step_kinds.empty());
  EXPECT_EQ(format_report(train, analyze(train), nullptr, 10).find("serve steps"), std::string::npos);
}

// A class well above its peak (a stale or slow peak, or cached weights) gets a
// note that says so and how to measure again; at the peak, none.
TEST(ProfileReport, ClassesAboveThePeakGetANote) {
  const Trace t = hand_trace().trace();
  const Analysis a = analyze(t);
  PeakTable peak = test_peak();
  const double decode_gbps = a.matmuls[2].gbps();
  peak.gemm[1].gbps = decode_gbps / 1.2;  // the decode class at 120%
  std::string text = format_report(t, a, &peak, 2);
  EXPECT_NE(text.find("(1 above 115% of the peak"), std::string::npos) << text;
  EXPECT_NE(text.find("--remeasure"), std::string::npos) << text;
  peak.gemm[1].gbps = decode_gbps / 1.1;  // 110%: within what a noisy peak gives
  text = format_report(t, a, &peak, 2);
  EXPECT_EQ(text.find("above 115% of the peak"), std::string::npos) << text;
}

}  // namespace
}  // namespace loom

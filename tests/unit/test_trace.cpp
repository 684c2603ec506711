// The profiler's recording (core/trace.h, kernels/profiling_backend.h): phases
// nest, ops carry their phase, layer, shape, FLOPs and the pool's busy time,
// the file is Chrome Trace Event JSON, and nothing is recorded (or counted by
// the pool) while the tracer is off. Results of a profiled backend are the
// inner backend's bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "core/trace.h"
#include "cpu_backend_util.h"
#include "kernels/int_quant.h"
#include "kernels/lora_b16.h"
#include "kernels/profiling_backend.h"
#include "ops_test_util.h"

namespace loom {
namespace {

using test_util::random_vec;

nlohmann::json trace_of(const Tracer& t, const std::string& meta = R"({"command":"test"})") {
  std::ostringstream out;
  t.write_chrome_json(out, meta);
  return nlohmann::json::parse(out.str());  // throws on invalid JSON
}

std::vector<nlohmann::json> complete_events(const nlohmann::json& trace) {
  std::vector<nlohmann::json> out;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") out.push_back(e);
  return out;
}

TEST(Tracer, RecordsNothingWhileOff) {
  Tracer t;
  {
    TraceScope s(&t, "step");
    TraceLayer l(&t, 3);
    EXPECT_EQ(t.layer(), -1);
    EXPECT_EQ(t.phase(), nullptr);
  }
  t.add(TraceEvent{.name = "x", .cat = "op"});
  EXPECT_EQ(t.event_count(), 0u);
  TraceScope null_tracer(nullptr, "step");  // allowed: profiling off
}

TEST(Tracer, PhasesNestAndTheFileIsChromeTraceJson) {
  Tracer t;
  t.start();
  {
    TraceScope step(&t, "step", {{"step", 7}});
    EXPECT_STREQ(t.phase(), "step");
    {
      TraceScope fwd(&t, "forward");
      EXPECT_STREQ(t.phase(), "forward");
      TraceLayer layer(&t, 2);
      EXPECT_EQ(t.layer(), 2);
      TraceEvent op{.name = "matmul", .cat = "op", .ts_ns = t.now_ns(), .dur_ns = 1500};
      op.phase = t.phase();
      op.layer = t.layer();
      op.T = 4, op.N = 8, op.K = 16, op.dtype = "q4_1", op.flops = 1024, op.bytes = 2048, op.threads = 2;
      op.busy_ns = 2500;
      t.add(op);
    }
    EXPECT_EQ(t.layer(), -1);
    step.arg("tokens", 512);
    step.arg("bad", std::numeric_limits<double>::infinity());
  }
  EXPECT_EQ(t.phase(), nullptr);
  t.stop();
  EXPECT_EQ(t.event_count(), 3u);

  const nlohmann::json trace = trace_of(t);
  EXPECT_EQ(trace["displayTimeUnit"], "ms");
  EXPECT_EQ(trace["otherData"]["loom"]["command"], "test");
  EXPECT_EQ(trace["otherData"]["events"], 3);
  EXPECT_EQ(trace["otherData"]["dropped_events"], 0);
  const auto ev = complete_events(trace);
  ASSERT_EQ(ev.size(), 3u);
  // Start order; an enclosing phase before what it encloses.
  EXPECT_EQ(ev[0]["name"], "step");
  EXPECT_EQ(ev[1]["name"], "forward");
  EXPECT_EQ(ev[2]["name"], "matmul");
  for (const auto& e : ev) {
    EXPECT_EQ(e["pid"], 0);
    EXPECT_EQ(e["tid"], 0);
    EXPECT_GE(e["ts"].get<double>(), 0.0);
  }
  EXPECT_EQ(ev[0]["cat"], "phase");
  EXPECT_EQ(ev[0]["args"]["step"], 7);
  EXPECT_EQ(ev[0]["args"]["tokens"], 512);
  EXPECT_EQ(ev[0]["args"]["bad"], 0);  // JSON has no inf
  EXPECT_FALSE(ev[0]["args"].contains("phase"));
  EXPECT_EQ(ev[1]["args"]["phase"], "step");  // a phase's phase: the enclosing one
  // The step encloses the forward.
  EXPECT_LE(ev[0]["ts"].get<double>(), ev[1]["ts"].get<double>());
  EXPECT_GE(ev[0]["ts"].get<double>() + ev[0]["dur"].get<double>(),
            ev[1]["ts"].get<double>() + ev[1]["dur"].get<double>());
  const auto& a = ev[2]["args"];
  EXPECT_EQ(ev[2]["cat"], "op");
  EXPECT_EQ(ev[2]["dur"], 1.5);
  EXPECT_EQ(a["phase"], "forward");
  EXPECT_EQ(a["layer"], 2);
  EXPECT_EQ(a["T"], 4);
  EXPECT_EQ(a["N"], 8);
  EXPECT_EQ(a["K"], 16);
  EXPECT_EQ(a["dtype"], "q4_1");
  EXPECT_EQ(a["flops"], 1024);
  EXPECT_EQ(a["bytes"], 2048);
  EXPECT_EQ(a["threads"], 2);
  EXPECT_EQ(a["busy_us"], 2.5);
  // Thread names for the viewers.
  bool named = false;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["tid"] == 0) named = e["args"]["name"] == "main";
  EXPECT_TRUE(named);
}

TEST(Tracer, StartClearsTheLastRecording) {
  Tracer t;
  t.start();
  { TraceScope s(&t, "step"); }
  t.stop();
  EXPECT_EQ(t.event_count(), 1u);
  t.start();
  EXPECT_EQ(t.event_count(), 0u);
  { TraceScope s(&t, "decode"); }
  t.stop();
  const auto ev = complete_events(trace_of(t));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["name"], "decode");
}

// Busy time of the indices, in-run time of the caller; nothing counted while off.
TEST(ThreadPoolAccounting, CountsWorkOnlyWhileOn) {
  ThreadPool pool(2);
  volatile double sink = 0;
  auto work = [&](int, int) {
    double s = 0;
    for (int i = 0; i < 2'000'000; ++i) s += std::sqrt(static_cast<double>(i));
    sink = s;
  };
  pool.run(work);
  EXPECT_EQ(pool.work_time().busy_ns, 0);
  EXPECT_EQ(pool.work_time().in_run_ns, 0);
  pool.set_accounting(true);
  pool.run(work);
  const ThreadPool::WorkTime w = pool.work_time();
  EXPECT_GT(w.busy_ns, 0);
  EXPECT_GT(w.in_run_ns, 0);
  // Two indices ran inside the caller's run(): their busy time is at most twice its span.
  EXPECT_LE(w.busy_ns, 2 * w.in_run_ns + 1'000'000);
  pool.set_accounting(false);
  pool.run(work);
  EXPECT_EQ(pool.work_time().busy_ns, w.busy_ns);
}

TEST(ProfilingBackend, RecordsOpsAndComputesTheSame) {
  for (int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    test_util::CpuBackend plain(threads), inner(threads);
    Tracer tracer;
    std::unique_ptr<Backend> prof = make_profiling_backend(std::move(inner.backend), tracer, inner.pool);
    EXPECT_EQ(plain.backend->tracer(), nullptr);
    EXPECT_EQ(prof->tracer(), &tracer);
    const int64_t T = 5, N = 24, K = 40;
    std::vector<float> w = random_vec(static_cast<size_t>(N * K), 1), x = random_vec(static_cast<size_t>(T * K), 2);
    const Tensor W = make_tensor(w.data(), DType::f32, {N, K});
    auto ws_plain = plain.backend->make_workspace(), ws_prof = prof->make_workspace();
    std::vector<float> y_plain(static_cast<size_t>(T * N)), y_prof(y_plain.size());

    prof->matmul_dense(*ws_prof, W, x.data(), y_prof.data(), T);  // not recording
    EXPECT_EQ(tracer.event_count(), 0u);
    EXPECT_FALSE(inner.pool.accounting());

    tracer.start();
    {
      TraceScope fwd(prof->tracer(), "forward");
      TraceLayer layer(prof->tracer(), 11);
      prof->matmul_dense(*ws_prof, W, x.data(), y_prof.data(), T);
    }
    tracer.stop();
    plain.backend->matmul_dense(*ws_plain, W, x.data(), y_plain.data(), T);
    EXPECT_EQ(std::memcmp(y_plain.data(), y_prof.data(), y_plain.size() * sizeof(float)), 0);
    const double s = prof->sum_squares(x.data(), x.size());  // after stop: a value, no event
    EXPECT_EQ(s, plain.backend->sum_squares(x.data(), x.size()));
    EXPECT_FALSE(inner.pool.accounting());  // switched off with the recording

    const auto ev = complete_events(trace_of(tracer));
    ASSERT_EQ(ev.size(), 2u);
    const auto& op = ev[1];
    EXPECT_EQ(op["name"], "matmul_dense");
    EXPECT_EQ(op["cat"], "op");
    const auto& a = op["args"];
    EXPECT_EQ(a["phase"], "forward");
    EXPECT_EQ(a["layer"], 11);
    EXPECT_EQ(a["T"], T);
    EXPECT_EQ(a["N"], N);
    EXPECT_EQ(a["K"], K);
    EXPECT_EQ(a["dtype"], "f32");
    EXPECT_EQ(a["flops"], 2 * T * N * K);
    EXPECT_EQ(a["bytes"], 4 * (N * K + T * (N + K)));  // the weight once, x in, y out
    EXPECT_EQ(a["threads"], threads);
    // Busy time: at most every thread for the whole op; one thread is all serial work.
    const double dur = op["dur"].get<double>(), busy = a["busy_us"].get<double>();
    EXPECT_GE(busy, 0.0);
    EXPECT_LE(busy, threads * dur + 1.0);
    if (threads == 1) EXPECT_NEAR(busy, dur, 0.01);
  }
}

}  // namespace
// A lora op's bytes: each factor once per run of rows sharing it (a factor that
// comes back after another row's counts again), the jobs' shared x once, y in
// and out; its dtype is the factors' storage. The results are the inner
// backend's bit for bit.
TEST(ProfilingBackend, LoraOpsCountEachRunsFactorsOnce) {
  test_util::CpuBackend plain(2), inner(2);
  Tracer tracer;
  std::unique_ptr<Backend> prof = make_profiling_backend(std::move(inner.backend), tracer, inner.pool);
  const int64_t T = 5, in = 24, r = 4, out_q = 16, out_k = 8;
  std::vector<float> x = random_vec(static_cast<size_t>(T * in), 3);
  std::vector<float> a1 = random_vec(static_cast<size_t>(r * in), 4),
                     b1 = random_vec(static_cast<size_t>(out_q * r), 5);
  std::vector<float> a2 = random_vec(static_cast<size_t>(r * in), 6),
                     b2 = random_vec(static_cast<size_t>(out_k * r), 7);
  const LoraFactor f1{a1.data(), b1.data(), r, in, out_q, 0.5f, {}, {}};
  const LoraFactor f2{a2.data(), b2.data(), r, in, out_k, 2.0f, {}, {}};
  // Job q: rows 0-1 f1, row 2 none, rows 3-4 f1 again; job k (the same x): row 2 f2 only.
  const LoraFactor* fq[T] = {&f1, &f1, nullptr, &f1, &f1};
  const LoraFactor* fk[T] = {nullptr, nullptr, &f2, nullptr, nullptr};
  const std::vector<int32_t> rows = {0, 1, 2, 3, 4};
  std::vector<float> yq_plain = random_vec(static_cast<size_t>(T * out_q), 8),
                     yk_plain = random_vec(static_cast<size_t>(T * out_k), 9);
  std::vector<float> yq_prof = yq_plain, yk_prof = yk_plain, u(static_cast<size_t>(2 * T * r));
  auto jobs_for = [&](float* yq, float* yk) {
    return std::vector<LoraRowsJob>{{x.data(), in, yq, out_q, out_q, fq},
                                    {x.data(), in, yk, out_k, out_k, fk}};
  };
  auto ws_plain = plain.backend->make_workspace(), ws_prof = prof->make_workspace();
  tracer.start();
  prof->lora_rows(*ws_prof, jobs_for(yq_prof.data(), yk_prof.data()), rows, r, u.data(), T);
  tracer.stop();
  plain.backend->lora_rows(*ws_plain, jobs_for(yq_plain.data(), yk_plain.data()), rows, r, u.data(), T);
  EXPECT_EQ(yq_prof, yq_plain);
  EXPECT_EQ(yk_prof, yk_plain);

  const auto ev = complete_events(trace_of(tracer));
  ASSERT_EQ(ev.size(), 1u);
  const auto& a = ev[0]["args"];
  EXPECT_EQ(ev[0]["name"], "lora");
  EXPECT_EQ(a["dtype"], "f32");
  EXPECT_EQ(a["T"], T);
  EXPECT_EQ(a["flops"], 2 * r * (4 * (in + out_q) + (in + out_k)));
  const int64_t factors = 2 * f1.bytes() + f2.bytes();             // f1's two runs, f2's one
  const int64_t rows_io = 4 * (4 * (in + 2 * out_q) + 2 * out_k);  // job k's row reads the x job q read
  EXPECT_EQ(a["bytes"], factors + rows_io);
  EXPECT_EQ(f1.bytes(), 4 * r * (in + out_q));
}

// LoraFactor::bytes for the forms the server keeps: bf16 (B in its padded
// column blocks) and 4 bits (codes and one f32 scale per group).
TEST(ProfilingBackend, LoraFactorBytesAsKept) {
  const int64_t r = 8, in = 576, out = 100;
  LoraFactor h;
  std::vector<uint16_t> halves(static_cast<size_t>(r * in + lora_b16_elements(out, r)));
  h.a16 = halves.data();
  h.b16 = halves.data() + r * in;
  h.rank = r, h.in = in, h.out = out;
  EXPECT_EQ(h.bytes(), 2.0 * (r * in + 104 * r));  // out padded to 104
  std::vector<float> a = random_vec(static_cast<size_t>(r * in), 1),
                     b = random_vec(static_cast<size_t>(out * r), 2);
  const PackedInt4 qa = pack_int4_rows(a.data(), r, in, 96), qb = pack_int4_rows(b.data(), out, r, r);
  LoraFactor q;
  q.a4 = {qa.codes.data(), qa.scales.data(), qa.group};
  q.b4 = {qb.codes.data(), qb.scales.data(), qb.group};
  q.rank = r, q.in = in, q.out = out;
  EXPECT_EQ(q.bytes(), static_cast<double>(qa.codes.size() + qb.codes.size() +
                                           sizeof(float) * (qa.scales.size() + qb.scales.size())));
}

}  // namespace loom

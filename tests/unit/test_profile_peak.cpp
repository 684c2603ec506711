// The peak microbenchmark at test sizes: every op measured with the op itself,
// each entry what the profiler records for that call; a trace's class gets
// its own op's figure. Its cache: a measurement written and read back for the
// same key, measured again for another key, an older format, a corrupt file or
// --remeasure; the file's fields checked when read.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/trace.h"
#include "expect_error.h"
#include "kernels/backend.h"
#include "kernels/profiling_backend.h"
#include "profile/analysis.h"
#include "profile/peak.h"
#include "profile/report.h"
#include "profile/trace_file.h"
#include "temp_dir.h"

namespace loom {
namespace {

PeakKey test_key(int64_t threads) { return {"Test CPU", threads, "build-1", ""}; }

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const char* const kPrecisions[] = {"exact", "f16", "int8", "bf16"};

// The entries of `op` at `precision`.
std::vector<const GemmPeak*> entries(const PeakTable& t, const std::string& op,
                                     const std::string& precision) {
  std::vector<const GemmPeak*> out;
  for (const GemmPeak& g : t.gemm)
    if (g.op == op && g.precision == precision) out.push_back(&g);
  return out;
}

TEST(ProfilePeak, QuickMeasurementHasEveryOpTypeAndRegime) {
  ThreadPool pool(2);
  const PeakOptions opt = quick_peak_options();
  const PeakTable t = measure_peak(pool, test_key(2), opt);
  EXPECT_GT(t.read_gbps, 0);
  for (const GemmPeak& g : t.gemm) {
    EXPECT_GT(g.gflops, 0) << g.op << " " << g.dtype;
    EXPECT_GT(g.gbps, 0) << g.op << " " << g.dtype;
    EXPECT_GT(g.seconds, 0) << g.op << " " << g.dtype;
    EXPECT_EQ(g.precision.empty(), !op_has_precision(g.op)) << g.op;
  }
  for (const char* dtype : {"f32", "q4_0"})
    for (const char* regime : {"batch", "decode"}) {
      const GemmPeak* p = t.find("matmul", dtype, regime);
      ASSERT_TRUE(p) << dtype << " " << regime;
      EXPECT_EQ(p->T, std::string(regime) == "batch" ? opt.batch_rows : 1);
      EXPECT_EQ(p->K, opt.cols);
    }
  // The decode weight is tiled to about decode_bytes (here more than the batch weight's rows).
  EXPECT_GE(t.find("matmul", "f32", "decode")->N, opt.rows);

  // The input gradient: exact over each type, as the profiler records it (N = W's cols, K = its rows) ...
  for (const char* dtype : {"f32", "q4_0"}) {
    const GemmPeak* p = t.find("linear_backward_input", dtype, "batch", "exact");
    ASSERT_TRUE(p) << dtype;
    EXPECT_EQ(p->T, opt.batch_rows);
    EXPECT_EQ(p->N, opt.train_cols);
    EXPECT_EQ(p->K, opt.train_rows);
  }
  // ... and through W^T at each other precision: q4_0's W^T is f16 (f16), q8_0 (int8: 64 rows,
  // a multiple of 32) and bf16 (bf16, or q4_0 itself where AMX reads W directly).
  EXPECT_TRUE(t.find("linear_backward_input", "f16", "batch", "f16"));
  EXPECT_TRUE(t.find("linear_backward_input", "q8_0", "batch", "int8"));
  EXPECT_TRUE(t.find("linear_backward_input", "bf16", "batch", "bf16") ||
              t.find("linear_backward_input", "q4_0", "batch", "bf16"));
  for (const char* p : kPrecisions) EXPECT_FALSE(entries(t, "linear_backward_input", p).empty()) << p;
  EXPECT_FALSE(t.find("linear_backward_input", "q4_0", "decode", "exact"));  // training ops: batch only

  for (const char* op : {"linear_backward_weight", "matmul_dense"}) {
    const GemmPeak* p = t.find(op, "f32", "batch");
    ASSERT_TRUE(p) << op;
    EXPECT_EQ(p->N, opt.train_rows);
    EXPECT_EQ(p->K, opt.train_cols);
  }
  // The loss over each output type at each precision: [vocab, hidden] (64: q8_0's blocks of 32).
  for (const char* p : kPrecisions) {
    const GemmPeak* l = t.find("loss", "q8_0", "batch", p);
    ASSERT_TRUE(l) << p;
    EXPECT_EQ(l->T, opt.batch_rows);
    EXPECT_EQ(l->N, opt.loss_vocab);
    EXPECT_EQ(l->K, 64);
  }
  EXPECT_LT(t.seconds, 5);
}

// Timed through the profiling backend, every call the peak makes is recorded
// with an entry's op, dtype, shape and FLOPs (gflops x the best call's
// seconds), and every entry was recorded: the peak and a trace's classes count alike.
// The median pass can never read faster than the best one, and both are
// plausible for 16 MiB read by two threads (a cache or DRAM, not a clock error).
TEST(ProfilePeak, ReadBandwidthBestIsAtLeastTheMedianPass) {
  ThreadPool pool(2);
  const ReadBandwidth bw = measure_read_bandwidth(pool, size_t{16} << 20, 0.05);
  EXPECT_GT(bw.median_gbps, 0.1);
  EXPECT_GE(bw.best_gbps, bw.median_gbps);
  EXPECT_LT(bw.best_gbps, 10000.0);
}

TEST(ProfilePeak, EveryEntryIsTheOpAsTheProfilerRecordsIt) {
  ThreadPool pool(2);
  Tracer tracer;
  const std::unique_ptr<Backend> prof = make_profiling_backend(make_backend(kCpu, pool), tracer, pool);
  tracer.start();
  const PeakTable t = measure_peak(pool, test_key(2), quick_peak_options(), nullptr, prof.get());
  tracer.stop();
  std::ostringstream out;
  tracer.write_chrome_json(out, R"({"command":"test"})");
  const Trace trace = parse_trace(out.str(), "peak trace");
  auto same = [](const ProfileEvent& e, const GemmPeak& g) {
    return e.name == g.op && e.dtype == g.dtype && e.T == g.T && e.N == g.N && e.K == g.K &&
           std::string(matmul_regime(e.T)) == g.regime;
  };
  for (const ProfileEvent& e : trace.ops) {
    if (e.flops <= 0) continue;  // prepare_transposed (T = 0)
    bool found = false;
    for (const GemmPeak& g : t.gemm) found = found || same(e, g);
    EXPECT_TRUE(found) << e.name << " " << e.dtype << " T " << e.T << " N " << e.N << " K " << e.K;
  }
  for (const GemmPeak& g : t.gemm) {
    int calls = 0;
    for (const ProfileEvent& e : trace.ops)
      if (same(e, g)) {
        ++calls;
        EXPECT_NEAR(g.gflops * 1e9 * g.seconds, e.flops, 1e-6 * e.flops) << g.op << " " << g.dtype;
      }
    EXPECT_GE(calls, 4) << g.op << " " << g.dtype << " " << g.precision;  // a warm-up and 3 timed
  }
}

PeakTable lookup_peak() {
  PeakTable p;
  p.key = test_key(2);
  p.read_gbps = 20;
  p.gemm = {{"matmul", "bf16", "batch", "", 256, 1024, 2048, 100, 4, 0.01},
            {"matmul", "bf16", "decode", "", 1, 60000, 2048, 20, 15, 0.01},
            {"linear_backward_input", "bf16", "batch", "bf16", 256, 1536, 576, 300, 2, 0.01},
            {"linear_backward_input", "bf16", "batch", "f16", 256, 1536, 576, 250, 2, 0.01},
            {"linear_backward_input", "f32", "batch", "exact", 256, 1536, 576, 150, 2, 0.01},
            {"linear_backward_input", "f32", "batch", "f16", 256, 1536, 576, 220, 2, 0.01},
            {"loss", "q8_0", "batch", "exact", 256, 4096, 576, 140, 1, 0.01},
            {"loss", "q8_0", "batch", "bf16", 256, 4096, 576, 230, 1, 0.01},
            {"linear_backward_weight", "f32", "batch", "", 256, 576, 1536, 190, 3, 0.01}};
  return p;
}

MatmulClass product_class(const std::string& op, const std::string& dtype, double gflops) {
  MatmulClass c;
  c.op = op;
  c.dtype = dtype;
  c.regime = "batch";
  c.count = 1;
  c.us = 1000;
  c.flops = gflops * 1e6;  // over 1000 us
  c.bytes = 1e6;
  c.rows = 256;
  return c;
}

TEST(ProfilePeak, AClassGetsItsOwnOpsPeak) {
  const PeakTable peak = lookup_peak();
  // The backward's bf16 input gradient: its own kernel's 300 GFLOP/s, not matmul bf16's 100.
  const ClassPeak b = class_peak(product_class("linear_backward_input", "bf16", 150), &peak, "bf16");
  ASSERT_TRUE(b.peak);
  EXPECT_EQ(b.peak->op, "linear_backward_input");
  EXPECT_DOUBLE_EQ(b.value, 300);
  EXPECT_DOUBLE_EQ(b.fraction, 0.5);
  EXPECT_DOUBLE_EQ(b.roofline, std::min(300.0, 20 * 150e6 / 1e6));
  // At another precision, that precision's figure.
  EXPECT_DOUBLE_EQ(class_peak(product_class("linear_backward_input", "bf16", 150), &peak, "f16").value, 250);
  // f32 in a LoRA run (class_precision: exact): the factors' exact path; at f16 the f32 W^T's.
  EXPECT_DOUBLE_EQ(class_peak(product_class("linear_backward_input", "f32", 75), &peak, "exact").value, 150);
  EXPECT_DOUBLE_EQ(class_peak(product_class("linear_backward_input", "f32", 75), &peak, "f16").value, 220);
  // A dtype the precision does not make (f32 in bf16 mode): W read as stored, exact's.
  EXPECT_DOUBLE_EQ(class_peak(product_class("linear_backward_input", "f32", 75), &peak, "bf16").value, 150);
  // The forward matmul keeps its own.
  EXPECT_DOUBLE_EQ(class_peak(product_class("matmul", "bf16", 50), &peak, "").value, 100);
  // The loss at the trace's precision only (its logits and dh are one kernel).
  EXPECT_DOUBLE_EQ(class_peak(product_class("loss", "q8_0", 115), &peak, "bf16").value, 230);
  EXPECT_FALSE(class_peak(product_class("loss", "q8_0", 115), &peak, "int8").peak);
  EXPECT_DOUBLE_EQ(class_peak(product_class("linear_backward_weight", "f32", 95), &peak, "").value, 190);
  // Ops not measured there: none, never another op's figure.
  EXPECT_FALSE(class_peak(product_class("matmul_dense", "f32", 10), &peak, "").peak);
  EXPECT_FALSE(class_peak(product_class("embedding", "bf16", 1), &peak, "").peak);
  EXPECT_FALSE(class_peak(product_class("linear_backward_input", "q4_1", 10), &peak, "bf16").peak);
  EXPECT_FALSE(class_peak(product_class("matmul", "q4_1", 10), &peak, "").peak);
  EXPECT_FALSE(class_peak(product_class("matmul", "bf16", 10), nullptr, "").peak);
}

TEST(ProfilePeak, JsonRoundTrip) {
  PeakTable t;
  t.key = test_key(3);
  t.read_gbps = 21.5;
  t.seconds = 12.25;
  t.gemm = {{"matmul", "q4_k", "batch", "", 256, 1024, 2048, 310.5, 12.5, 0.0035},
            {"matmul", "q4_k", "decode", "", 1, 90000, 2048, 30, 15.25, 0.012},
            {"linear_backward_input", "bf16", "batch", "bf16", 256, 1536, 576, 440.5, 1.75, 0.001}};
  const std::string text = peak_to_json(t);
  EXPECT_NE(text.find("\"loom_peak\": 2"), std::string::npos) << text;
  const PeakTable r = peak_from_json(text, "p.json");
  EXPECT_EQ(r.key, t.key);
  EXPECT_EQ(r.read_gbps, 21.5);
  EXPECT_EQ(r.seconds, 12.25);
  ASSERT_EQ(r.gemm.size(), 3u);
  EXPECT_EQ(r.find("matmul", "q4_k", "decode")->gbps, 15.25);
  EXPECT_EQ(r.find("matmul", "q4_k", "batch")->N, 1024);
  const GemmPeak* b = r.find("linear_backward_input", "bf16", "batch", "bf16");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->gflops, 440.5);
  EXPECT_EQ(b->seconds, 0.001);
  EXPECT_FALSE(r.find("matmul", "bf16", "batch"));
}

TEST(ProfilePeak, BadFilesAreRefusedNamingTheField) {
  test_util::expect_error([] { peak_from_json("{oops", "p.json"); }, ErrorKind::invalid_input,
                          {"p.json", "not JSON"});
  test_util::expect_error([] { peak_from_json(R"({"loom_peak": -1e999})", "p.json"); },
                          ErrorKind::invalid_input, {"p.json", "not JSON", "overflow"});
  test_util::expect_error([] { peak_from_json("{}", "p.json"); }, ErrorKind::invalid_input,
                          {"p.json", "format"});
  PeakTable t;
  t.key = test_key(1);
  t.gemm = {{"matmul", "f32", "batch", "", 16, 32, 256, 10, 1, 0.001}};
  std::string text = peak_to_json(t);
  text.replace(text.find("\"gflops\": 10.0"), 14, "\"gflops\": \"x\"");
  test_util::expect_error([&] { peak_from_json(text, "p.json"); }, ErrorKind::invalid_input,
                          {"p.json: gemm[0]", "\"gflops\""});
  std::string no_op = peak_to_json(t);
  no_op.replace(no_op.find("\"op\""), 4, "\"opp\"");
  test_util::expect_error([&] { peak_from_json(no_op, "p.json"); }, ErrorKind::invalid_input,
                          {"p.json: gemm[0]", "\"op\""});
  // An older loom's file (format 1: the forward matmul only) is another format.
  std::string old = peak_to_json(t);
  old.replace(old.find("\"loom_peak\": 2"), 14, "\"loom_peak\": 1");
  test_util::expect_error([&] { peak_from_json(old, "p.json"); }, ErrorKind::invalid_input,
                          {"p.json", "format 1", "format 2"});
}

TEST(ProfilePeak, CacheIsWrittenReadAndRemeasuredWhenItDoesNotFit) {
  test_util::TempDir tmp("profile_peak");
  ThreadPool pool(1);
  const PeakOptions opt = quick_peak_options();
  const std::string path = peak_cache_path((tmp.path / "cache").string(), test_key(1));
  EXPECT_NE(path.find("peak-" + test_key(1).hash() + ".json"), std::string::npos);

  const CachedPeak first = cached_peak(pool, test_key(1), path, false, opt);
  EXPECT_TRUE(first.measured);
  EXPECT_TRUE(first.note.empty()) << first.note;
  ASSERT_TRUE(std::filesystem::exists(path));

  const CachedPeak second = cached_peak(pool, test_key(1), path, false, opt);
  EXPECT_FALSE(second.measured);
  EXPECT_EQ(second.table.read_gbps, first.table.read_gbps);
  EXPECT_EQ(second.table.find("matmul", "q4_0", "batch")->gflops,
            first.table.find("matmul", "q4_0", "batch")->gflops);
  const GemmPeak* loss = second.table.find("loss", "q8_0", "batch", "bf16");
  ASSERT_TRUE(loss);
  EXPECT_EQ(loss->gflops, first.table.find("loss", "q8_0", "batch", "bf16")->gflops);

  // Another key (thread count) in the same file: measured again, said so, and replaced.
  const CachedPeak other = cached_peak(pool, test_key(2), path, false, opt);
  EXPECT_TRUE(other.measured);
  EXPECT_NE(other.note.find("another thread count (1, here 2)"), std::string::npos) << other.note;
  EXPECT_EQ(peak_from_json(slurp(path), path).key.threads, 2);

  // An older loom's file (format 1): measured again, said so, and replaced.
  std::string old = slurp(path);
  old.replace(old.find("\"loom_peak\": 2"), 14, "\"loom_peak\": 1");
  std::ofstream(path) << old;
  const CachedPeak upgraded = cached_peak(pool, test_key(2), path, false, opt);
  EXPECT_TRUE(upgraded.measured);
  EXPECT_NE(upgraded.note.find("format 1"), std::string::npos) << upgraded.note;
  EXPECT_NE(upgraded.note.find("measured again"), std::string::npos) << upgraded.note;
  EXPECT_TRUE(peak_from_json(slurp(path), path).find("linear_backward_input", "q4_0", "batch", "exact"));

  // A corrupt file: measured again with the reason, and a valid file written over it.
  std::ofstream(path) << "{\"loom_peak\": 1, \"key\": ";
  const CachedPeak repaired = cached_peak(pool, test_key(1), path, false, opt);
  EXPECT_TRUE(repaired.measured);
  EXPECT_NE(repaired.note.find(path), std::string::npos) << repaired.note;
  EXPECT_NE(repaired.note.find("measured again"), std::string::npos) << repaired.note;
  EXPECT_EQ(peak_from_json(slurp(path), path).key, test_key(1));

  EXPECT_TRUE(cached_peak(pool, test_key(1), path, /*remeasure=*/true, opt).measured);
}

TEST(ProfilePeak, AnUnwritableCacheIsANoteNotAnError) {
  test_util::TempDir tmp("profile_peak_ro");
  ThreadPool pool(1);
  const std::string blocker = (tmp.path / "file").string();
  std::ofstream(blocker) << "x";  // a file where the cache folder would be
  const CachedPeak c = cached_peak(pool, test_key(1), blocker + "/peak.json", false, quick_peak_options());
  EXPECT_TRUE(c.measured);
  EXPECT_NE(c.note.find("not cached"), std::string::npos) << c.note;
}

}  // namespace
}  // namespace loom

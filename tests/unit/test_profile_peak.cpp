// The peak microbenchmark at test sizes, and its cache: a measurement written
// and read back for the same key, measured again for another key, a corrupt
// file or --remeasure; the file's fields checked when read.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "expect_error.h"
#include "profile/peak.h"
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

TEST(ProfilePeak, QuickMeasurementHasEveryTypeAndRegime) {
  ThreadPool pool(2);
  const PeakOptions opt = quick_peak_options();
  const PeakTable t = measure_peak(pool, test_key(2), opt);
  EXPECT_GT(t.read_gbps, 0);
  ASSERT_EQ(t.gemm.size(), 2 * opt.dtypes.size());
  for (const char* dtype : {"f32", "q4_0"})
    for (const char* regime : {"batch", "decode"}) {
      const GemmPeak* p = t.find(dtype, regime);
      ASSERT_TRUE(p) << dtype << " " << regime;
      EXPECT_GT(p->gflops, 0);
      EXPECT_GT(p->gbps, 0);
      EXPECT_EQ(p->T, std::string(regime) == "batch" ? opt.batch_rows : 1);
      EXPECT_EQ(p->K, opt.cols);
    }
  // The decode weight is tiled to about decode_bytes (here more than the batch weight's rows).
  EXPECT_GE(t.find("f32", "decode")->N, opt.rows);
  EXPECT_LT(t.seconds, 5);
}

TEST(ProfilePeak, JsonRoundTrip) {
  PeakTable t;
  t.key = test_key(3);
  t.read_gbps = 21.5;
  t.seconds = 12.25;
  t.gemm = {{"q4_k", "batch", 256, 1024, 2048, 310.5, 12.5}, {"q4_k", "decode", 1, 90000, 2048, 30, 15.25}};
  const PeakTable r = peak_from_json(peak_to_json(t), "p.json");
  EXPECT_EQ(r.key, t.key);
  EXPECT_EQ(r.read_gbps, 21.5);
  EXPECT_EQ(r.seconds, 12.25);
  ASSERT_EQ(r.gemm.size(), 2u);
  EXPECT_EQ(r.find("q4_k", "decode")->gbps, 15.25);
  EXPECT_EQ(r.find("q4_k", "batch")->N, 1024);
}

TEST(ProfilePeak, BadFilesAreRefusedNamingTheField) {
  test_util::expect_error([] { peak_from_json("{oops", "p.json"); }, ErrorKind::invalid_input,
                          {"p.json", "not JSON"});
  test_util::expect_error([] { peak_from_json("{}", "p.json"); }, ErrorKind::invalid_input,
                          {"p.json", "format"});
  PeakTable t;
  t.key = test_key(1);
  t.gemm = {{"f32", "batch", 16, 32, 256, 10, 1}};
  std::string text = peak_to_json(t);
  text.replace(text.find("\"gflops\": 10.0"), 14, "\"gflops\": \"x\"");
  test_util::expect_error([&] { peak_from_json(text, "p.json"); }, ErrorKind::invalid_input,
                          {"p.json: gemm[0]", "\"gflops\""});
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
  EXPECT_EQ(second.table.find("q4_0", "batch")->gflops, first.table.find("q4_0", "batch")->gflops);

  // Another key (thread count) in the same file: measured again, said so, and replaced.
  const CachedPeak other = cached_peak(pool, test_key(2), path, false, opt);
  EXPECT_TRUE(other.measured);
  EXPECT_NE(other.note.find("another thread count (1, here 2)"), std::string::npos) << other.note;
  EXPECT_EQ(peak_from_json(slurp(path), path).key.threads, 2);

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

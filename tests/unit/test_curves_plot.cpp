// `loom plot`'s pieces: reading metrics_file JSONL (records, duplicates, gaps,
// every bad line named by file:line), axis ticks and their labels, and the
// picture itself (PNG signature and size, one SVG path per curve).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "apps/curves_data.h"
#include "apps/curves_plot.h"
#include "expect_error.h"
#include "temp_dir.h"

namespace loom::app {
namespace {

struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("curves_plot_test") {}
  std::string write(const std::string& name, const std::string& text) const {
    const std::string p = (path / name).string();
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
};

const char* kRun =
    R"({"step":0,"eval_loss":3.5,"eval_accuracy":0.125,"eval_tokens":80,"elapsed_seconds":0.1}
{"step":1,"loss":3.4,"lr":0.0,"grad_norm":2.5,"target_tokens":40}

{"step":2,"loss":3.0,"lr":0.001,"grad_norm":1.5}
{"step":2,"checkpoint":"ckpt-2"}
{"step":3,"loss":null,"lr":0.002,"grad_norm":null}
{"step":2,"loss":2.9,"lr":0.001,"grad_norm":1.25}
{"step":4,"loss":2.5,"lr":0.0015,"grad_norm":1.0}
{"step":4,"eval_loss":2.75,"eval_accuracy":0.25}
)";

TEST(CurvesData, ReadsStepAndEvalRecords) {
  TempDir tmp;
  const MetricsRun r = read_metrics_jsonl(tmp.write("run.jsonl", kRun));
  EXPECT_EQ(r.label, "run.jsonl");
  // Step 2 twice (a rollback): the later record wins; step 3's nulls are gaps.
  ASSERT_EQ(r.loss.size(), 4u);
  EXPECT_EQ(r.loss[0], (std::pair<int64_t, double>{1, 3.4}));
  EXPECT_EQ(r.loss[1], (std::pair<int64_t, double>{2, 2.9}));
  EXPECT_EQ(r.loss[2].first, 3);
  EXPECT_TRUE(std::isnan(r.loss[2].second));
  EXPECT_EQ(r.loss[3], (std::pair<int64_t, double>{4, 2.5}));
  EXPECT_EQ(r.lr[2], (std::pair<int64_t, double>{3, 0.002}));
  EXPECT_EQ(r.grad_norm[1].second, 1.25);
  EXPECT_EQ(r.eval_loss, (Curve{{0, 3.5}, {4, 2.75}}));
  EXPECT_EQ(r.eval_accuracy, (Curve{{0, 0.125}, {4, 0.25}}));
  EXPECT_EQ(r.max_step(), 4);
  EXPECT_FALSE(r.empty());
}

TEST(CurvesData, BadLinesNameFileAndLine) {
  TempDir tmp;
  const std::string good = "{\"step\":1,\"loss\":2}\n";
  auto expect_bad = [&](const std::string& text, int line, const std::string& why) {
    const std::string p = tmp.write("bad.jsonl", text);
    test_util::expect_error([&] { read_metrics_jsonl(p); }, ErrorKind::invalid_input,
                            {p + ":" + std::to_string(line) + ":", why});
  };
  expect_bad(good + "{\"step\":2,\"loss\":\n" + good, 2, "not JSON");
  expect_bad(good + "{\"step\":2,\"loss\":1e999}\n" + good, 2, "not JSON");  // overflows double
  expect_bad(good + good + "[1,2]\n", 3, "array where a JSON object was expected");
  expect_bad(good + "{\"loss\":2}\n", 2, "no \"step\"");
  expect_bad("{\"step\":\"3\",\"loss\":2}\n", 1, "\"step\" must be an integer >= 0, got \"3\"");
  expect_bad("{\"step\":-1,\"loss\":2}\n", 1, "\"step\" must be an integer >= 0");
  expect_bad("{\"step\":1.5,\"loss\":2}\n", 1, "\"step\" must be an integer >= 0");
  expect_bad("{\"step\":1,\"eval_accuracy\":\"50%\"}\n", 1, "\"eval_accuracy\" must be a number or null, got string");
}

TEST(CurvesData, MissingEmptyAndUnplottableFiles) {
  TempDir tmp;
  const std::string missing = (tmp.path / "nope.jsonl").string();
  test_util::expect_error([&] { read_metrics_jsonl(missing); }, ErrorKind::not_found, {missing, "does not exist"});
  const std::string empty = tmp.write("empty.jsonl", "\n \n");
  test_util::expect_error([&] { read_metrics_jsonl(empty); }, ErrorKind::invalid_input, {empty, "is empty"});
  const std::string other = tmp.write("other.jsonl", "{\"step\":1,\"checkpoint\":\"x\"}\n{\"hello\":1}\n");
  test_util::expect_error([&] { read_metrics_jsonl(other); }, ErrorKind::invalid_input,
                          {other, "no step or eval record"});
  test_util::expect_error([&] { read_metrics_jsonl(tmp.path.string()); }, ErrorKind::invalid_input, {"is a folder"});
}

// The line a running trainer is still writing (no newline yet) is skipped with
// a warning; the same text on a finished line is an error.
TEST(CurvesData, IncompleteLastLineOfALiveRun) {
  TempDir tmp;
  std::vector<std::string> warnings;
  const std::string p = tmp.write("live.jsonl", "{\"step\":1,\"loss\":2}\n{\"step\":2,\"lo");
  const MetricsRun r = read_metrics_jsonl(p, &warnings);
  EXPECT_EQ(r.loss.size(), 1u);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(p + ":2: skipped an incomplete last line"), std::string::npos) << warnings[0];
  const std::string q = tmp.write("torn.jsonl", "{\"step\":1,\"loss\":2}\n{\"step\":2,\"lo\n");
  test_util::expect_error([&] { read_metrics_jsonl(q); }, ErrorKind::invalid_input, {q + ":2:", "not JSON"});
}

TEST(CurvesData, NiceTicks) {
  const Ticks a = nice_ticks(0, 180);
  EXPECT_EQ(a.step, 50);
  EXPECT_EQ(a.values, (std::vector<double>{0, 50, 100, 150, 200}));
  EXPECT_EQ(a.lo, 0);
  EXPECT_EQ(a.hi, 200);
  const Ticks b = nice_ticks(0.52, 2.31);
  EXPECT_DOUBLE_EQ(b.step, 0.5);
  ASSERT_EQ(b.values.size(), 5u);
  EXPECT_DOUBLE_EQ(b.values.front(), 0.5);
  EXPECT_DOUBLE_EQ(b.values.back(), 2.5);
  const Ticks c = nice_ticks(0, 0.002);
  EXPECT_DOUBLE_EQ(c.step, 5e-4);
  EXPECT_EQ(c.values.size(), 5u);
  EXPECT_EQ(c.values.front(), 0.0);  // exactly zero, not 1e-20
  const Ticks d = nice_ticks(-0.3, 0.3);  // through zero
  EXPECT_DOUBLE_EQ(d.step, 0.1);
  ASSERT_EQ(d.values.size(), 7u);
  EXPECT_EQ(d.values[3], 0.0);
  const Ticks one = nice_ticks(4, 4);  // one value: a range around it
  EXPECT_LT(one.lo, 4);
  EXPECT_GT(one.hi, 4);
  EXPECT_GE(one.values.size(), 3u);
  const Ticks steps = nice_ticks(0, 4, 6, /*min_step=*/1);  // whole steps only
  EXPECT_EQ(steps.step, 1);
  EXPECT_EQ(steps.values, (std::vector<double>{0, 1, 2, 3, 4}));
  const Ticks zero = nice_ticks(0, 0);
  EXPECT_LT(zero.lo, 0);
  EXPECT_GT(zero.hi, 0);
  for (const Ticks& t : {a, b, c, d, one, steps, zero}) {
    EXPECT_GE(t.values.size(), 3u);
    EXPECT_LE(t.values.size(), 12u);
  }
}

TEST(CurvesData, TickLabels) {
  EXPECT_EQ(format_tick(0, 50), "0");
  EXPECT_EQ(format_tick(150, 50), "150");
  EXPECT_EQ(format_tick(2000, 500), "2000");
  EXPECT_EQ(format_tick(0.3, 0.05), "0.30");
  EXPECT_EQ(format_tick(1.5, 0.5), "1.5");
  EXPECT_EQ(format_tick(-0.2, 0.2), "-0.2");
  EXPECT_EQ(format_tick(5e-4, 5e-4), "5e-4");
  EXPECT_EQ(format_tick(1e-3, 5e-4), "1e-3");
  EXPECT_EQ(format_tick(1.5e-3, 5e-4), "1.5e-3");
  EXPECT_EQ(format_tick(2e6, 1e6), "2e6");
  EXPECT_EQ(format_tick(25, 5), "25");
  // One notation per axis: 5e-3 on an axis up to 0.02 is fixed like its neighbours.
  EXPECT_EQ(format_tick(5e-3, 5e-3, 0.02), "0.005");
  EXPECT_EQ(format_tick(0.015, 5e-3, 0.02), "0.015");
  EXPECT_EQ(format_tick(1e-3, 5e-4, 2e-3), "1e-3");
}

// A count of SVG paths stroked in `c` (cairo writes "stroke:rgb(R%,G%,B%)"
// with a few digits).
int strokes_in(const std::string& svg, Rgb c) {
  const std::regex re(R"(stroke:rgb\(([0-9.]+)%,([0-9.]+)%,([0-9.]+)%\))");
  int n = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), re); it != std::sregex_iterator(); ++it) {
    const double r = std::stod((*it)[1]), g = std::stod((*it)[2]), b = std::stod((*it)[3]);
    n += std::fabs(r - 100 * c.r) < 0.1 && std::fabs(g - 100 * c.g) < 0.1 && std::fabs(b - 100 * c.b) < 0.1;
  }
  return n;
}

TEST(CurvesPlot, OnePathPerCurveInTheRunsColour) {
  TempDir tmp;
  MetricsRun a = read_metrics_jsonl(tmp.write("a.jsonl", kRun));
  // Run b: steps only (no evaluation): its eval curves are absent.
  MetricsRun b = read_metrics_jsonl(tmp.write("b.jsonl", "{\"step\":1,\"loss\":3,\"lr\":1e-3,\"grad_norm\":2}\n"
                                                         "{\"step\":2,\"loss\":2,\"lr\":1e-3,\"grad_norm\":1}\n"));
  const std::string svg = render_curves({a, b}, {}, ImageFormat::svg);
  ASSERT_EQ(svg.rfind("<?xml", 0), 0u) << svg.substr(0, 100);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("width=\"1200px\""), std::string::npos);
  // a: loss, eval loss, accuracy, lr, grad norm + its legend swatch; b: loss, lr, grad norm + swatch.
  EXPECT_EQ(strokes_in(svg, run_colour(0)), 6);
  EXPECT_EQ(strokes_in(svg, run_colour(1)), 4);

  const std::string png = render_curves({a}, {.title = "t", .width = 640, .height = 480}, ImageFormat::png);
  ASSERT_GT(png.size(), 24u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  auto be32 = [&](size_t at) {
    return (static_cast<uint32_t>(static_cast<unsigned char>(png[at])) << 24) |
           (static_cast<uint32_t>(static_cast<unsigned char>(png[at + 1])) << 16) |
           (static_cast<uint32_t>(static_cast<unsigned char>(png[at + 2])) << 8) |
           static_cast<uint32_t>(static_cast<unsigned char>(png[at + 3]));
  };
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  EXPECT_EQ(be32(16), 640u);
  EXPECT_EQ(be32(20), 480u);
}

}  // namespace
}  // namespace loom::app

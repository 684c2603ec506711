// LOOM_FAILPOINTS: grammar, conditions, the actions eval() does itself, and
// bad specs refused with the variable and the bad entry named.
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/failpoints.h"

namespace loom {
namespace {

// The steps 1..n at which `fp` returns something at site "step".
std::vector<int64_t> firing_steps(const Failpoints& fp, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t s = 1; s <= n; ++s)
    if (fp.eval("step", s)) out.push_back(s);
  return out;
}

std::string parse_error(std::string_view spec) {
  try {
    Failpoints::parse(spec);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_input) << spec;
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << spec;
  return "";
}

TEST(Failpoints, EmptyAndNullCostNothing) {
  EXPECT_TRUE(Failpoints::parse("").empty());
  EXPECT_TRUE(Failpoints::parse("  ").empty());
  EXPECT_FALSE(fail_point(nullptr, "step", 1));
  const Failpoints empty;
  EXPECT_FALSE(fail_point(&empty, "step", 1));
}

TEST(Failpoints, StepEqualsFiresOnlyThere) {
  const Failpoints fp = Failpoints::parse("nan_grad@step=12");
  ASSERT_EQ(fp.size(), 1u);
  EXPECT_EQ(firing_steps(fp, 20), (std::vector<int64_t>{12}));
  const auto f = fp.eval("step", 12);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->action, FailAction::nan_grad);
  EXPECT_FALSE(fp.eval("step", -1));  // a site without a step never meets a step condition
}

TEST(Failpoints, RangesOpenRangesAndEveryHit) {
  EXPECT_EQ(firing_steps(Failpoints::parse("nan_loss@step=3..5"), 10), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(firing_steps(Failpoints::parse("inf_grad@step=8.."), 10), (std::vector<int64_t>{8, 9, 10}));
  EXPECT_EQ(firing_steps(Failpoints::parse("nan_grad@step"), 3), (std::vector<int64_t>{1, 2, 3}));
  // The shorthand and the explicit condition are the same entry.
  EXPECT_EQ(firing_steps(Failpoints::parse("nan_grad@step:step=4..6"), 10), (std::vector<int64_t>{4, 5, 6}));
}

TEST(Failpoints, HitCountsTheTimesTheStepConditionHeld) {
  // Step 4 reached three times: only the first two fire.
  const Failpoints fp = Failpoints::parse("nan_grad@step=4:hit=1..2");
  EXPECT_FALSE(fp.eval("step", 3));
  EXPECT_TRUE(fp.eval("step", 4));
  EXPECT_FALSE(fp.eval("step", 5));  // not counted: the step condition did not hold
  EXPECT_TRUE(fp.eval("step", 4));
  EXPECT_FALSE(fp.eval("step", 4));
  // Without a step condition every visit counts.
  EXPECT_EQ(firing_steps(Failpoints::parse("nan_grad@step:hit=3"), 6), (std::vector<int64_t>{3}));
  EXPECT_EQ(firing_steps(Failpoints::parse("nan_grad@step:hit=2.."), 4), (std::vector<int64_t>{2, 3, 4}));
}

TEST(Failpoints, HitCountIsExactAcrossThreads) {
  const Failpoints fp = Failpoints::parse("nan_grad@step:hit=500");
  std::atomic<int> fired{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i)
        if (fp.eval("step", 1)) ++fired;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(fired.load(), 1);
}

TEST(Failpoints, ThrowAndIoErrorAreTypedErrorsNamingTheEntryAndStep) {
  const Failpoints fp = Failpoints::parse("throw@step=7, io_error@step=9");
  EXPECT_FALSE(fp.eval("step", 6));
  try {
    fp.eval("step", 7);
    FAIL() << "throw did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::internal);
    EXPECT_NE(std::string(e.what()).find("throw@step=7"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at step 7"), std::string::npos) << e.what();
  }
  try {
    fp.eval("step", 9);
    FAIL() << "io_error did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::io);
    EXPECT_NE(std::string(e.what()).find("io_error@step=9"), std::string::npos) << e.what();
  }
}

TEST(Failpoints, SleepThenTheSiteActionIsReturned) {
  const Failpoints fp = Failpoints::parse("sleep_ms=30@step,nan_grad@step=2");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(fp.eval("step", 1));  // sleep only: nothing for the site
  const auto f = fp.eval("step", 2);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(ms, 60.0);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->action, FailAction::nan_grad);
}

TEST(Failpoints, FirstSiteActionWins) {
  const Failpoints fp = Failpoints::parse("nan_loss@step=2,nan_grad@step=1..3");
  EXPECT_EQ(fp.eval("step", 1)->action, FailAction::nan_grad);
  EXPECT_EQ(fp.eval("step", 2)->action, FailAction::nan_loss);
}

TEST(FailpointsDeathTest, CrashIsSigkill) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const Failpoints fp = Failpoints::parse("crash@step=2");
  EXPECT_EXIT(
      {
        fp.eval("step", 1);
        fp.eval("step", 2);
        std::exit(0);
      },
      testing::KilledBySignal(SIGKILL), "");
}

TEST(Failpoints, BadSpecsNameTheVariableAndTheEntry) {
  struct Case {
    const char* spec;
    const char* says;
  };
  const Case cases[] = {
      {"nan_grad", "no '@SITE'"},
      {"nan_gradd@step", "unknown action 'nan_gradd'"},
      {"nan_grad@stpe=3", "unknown site 'stpe'"},
      {"sleep_ms@step", "needs a value"},
      {"sleep_ms=x@step", "not a non-negative integer"},
      {"crash=3@step", "takes no value"},
      {"nan_grad@step=x", "step 'x' is not a non-negative integer"},
      {"nan_grad@step=-1", "not a non-negative integer"},
      {"nan_grad@step=5..3", "ends before it starts"},
      {"nan_grad@step:foo=1", "condition 'foo=1'"},
      {"nan_grad@step=1:step=2", "step is given twice"},
      {"nan_grad@step:hit=0", "hit counts from 1"},
      {"return=1@step", "does not take 'return'"},
      {"nan_grad@step=1,,crash@step", "empty entry"},
      {"nan_grad@step=1,", "empty entry"},
  };
  for (const Case& c : cases) {
    const std::string msg = parse_error(c.spec);
    EXPECT_NE(msg.find("LOOM_FAILPOINTS"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.says), std::string::npos) << c.spec << " -> " << msg;
  }
  EXPECT_NE(parse_error("nan_grad@step=1,bogus@step").find("'bogus@step'"), std::string::npos);
}

TEST(Failpoints, DocsListEverySite) {
  std::ifstream f(std::string(LOOM_SOURCE_DIR) + "/docs/training.md");
  ASSERT_TRUE(f) << "docs/training.md";
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string docs = ss.str();
  for (const FailpointSite& s : kFailpointSites)
    EXPECT_NE(docs.find("| `" + std::string(s.name) + "` |"), std::string::npos)
        << "docs/training.md has no row for the failpoint site " << s.name;
}

}  // namespace
}  // namespace loom

// Sampler stages, seeds and parameter validation; stop strings and UTF-8 safe streaming.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "core/error.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

SamplingParams plain(float temp) {
  SamplingParams p;
  p.temperature = temp;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  return p;
}

TEST(Sampler, GreedyPicksFirstMaximum) {
  Sampler s(plain(0), 5);
  const float logits[] = {1, 3, 3, -2, 0};
  EXPECT_EQ(s.sample(logits, {}), 1);
}

TEST(Sampler, GreedyWithPenaltiesPicksThePenalisedMaximum) {
  SamplingParams p = plain(0);
  p.repeat_penalty = 4.0f;
  Sampler s(p, 5);
  const float logits[] = {1, 3, 2.5f, -2, 0};
  EXPECT_EQ(s.sample(logits, {}), 1);                       // no history: the logits as they are
  EXPECT_EQ(s.sample(logits, std::vector<int32_t>{1}), 2);  // 3 / 4 < 2.5
}

TEST(Sampler, SameSeedSameDrawsDifferentSeedDifferentDraws) {
  std::vector<float> logits(100);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i)) * 2;
  auto draw = [&](uint64_t seed) {
    auto p = plain(1.0f);
    p.seed = seed;
    Sampler s(p, 100);
    std::vector<int32_t> out;
    for (int i = 0; i < 50; ++i) out.push_back(s.sample(logits.data(), {}));
    return out;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
}

TEST(Sampler, FrequenciesFollowSoftmaxWithTemperature) {
  const float logits[] = {0.0f, 1.0f, 2.0f};
  auto p = plain(2.0f);
  p.seed = 3;
  Sampler s(p, 3);
  std::map<int32_t, int> count;
  const int n = 60000;
  for (int i = 0; i < n; ++i) count[s.sample(logits, {})]++;
  double z = 0;
  for (float l : logits) z += std::exp(l / 2.0);
  for (int k = 0; k < 3; ++k)
    EXPECT_NEAR(count[k] / static_cast<double>(n), std::exp(logits[k] / 2.0) / z, 0.01) << k;
}

// Speculative sampling with a drafted token: whatever the draft (likely, unlikely, outside top-k), the
// returned token has the plain draw's distribution, within 5 standard errors of 100,000 draws; the draft
// is kept about p(draft) of the time.
TEST(Sampler, DraftedTokenKeepsTheDistribution) {
  const float logits[] = {0.5f, 2.0f, 1.0f, -1.0f, 1.5f};
  for (const int top_k : {0, 3}) {
    auto p = plain(top_k ? 1.2f : 0.8f);
    p.top_k = top_k;
    // The exact distribution: softmax(logit / T) over the top_k largest (all when 0).
    std::vector<double> want(5, 0.0);
    double z = 0;
    for (int k = 0; k < 5; ++k) {
      int above = 0;
      for (float l : logits) above += l > logits[k];
      if (top_k == 0 || above < top_k) want[static_cast<size_t>(k)] = std::exp(logits[k] / p.temperature);
      z += want[static_cast<size_t>(k)];
    }
    for (double& w : want) w /= z;
    for (int32_t draft = 0; draft < 5; ++draft) {
      p.seed = 100 + static_cast<uint64_t>(draft);
      Sampler s(p, 5);
      std::vector<int> count(5, 0);
      const int n = 100000;
      for (int i = 0; i < n; ++i) count[static_cast<size_t>(s.sample(logits, {}, draft))]++;
      for (int k = 0; k < 5; ++k) {
        const double w = want[static_cast<size_t>(k)];
        const double tol = 5 * std::sqrt(w * (1 - w) / n) + 1e-4;
        EXPECT_NEAR(count[static_cast<size_t>(k)] / static_cast<double>(n), w, tol)
            << "top_k " << top_k << ", draft " << draft << ", token " << k;
      }
    }
  }
  Sampler greedy(plain(0), 5);
  EXPECT_EQ(greedy.sample(logits, {}, 3), 1);  // greedy ignores the draft
}

TEST(Sampler, TopKTopPMinPRestrictTheCandidates) {
  const float logits[] = {5.0f, 4.9f, 4.8f, 0.0f, -1.0f};
  {
    auto p = plain(1.0f);
    p.top_k = 2;
    Sampler s(p, 5);
    for (int i = 0; i < 500; ++i) EXPECT_LT(s.sample(logits, {}), 2);
  }
  {
    auto p = plain(1.0f);
    p.top_p = 0.5f;  // the top token alone has ~0.35, the top two ~0.67
    Sampler s(p, 5);
    for (int i = 0; i < 500; ++i) EXPECT_LT(s.sample(logits, {}), 2);
  }
  {
    auto p = plain(1.0f);
    p.min_p = 0.5f;  // keeps tokens with prob >= half the top one: ids 0, 1, 2
    Sampler s(p, 5);
    for (int i = 0; i < 500; ++i) EXPECT_LT(s.sample(logits, {}), 3);
  }
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  const float logits[] = {2.0f, 1.5f, -1.0f};
  auto p = plain(0);
  p.repeat_penalty = 2.0f;
  Sampler s(p, 3);
  const std::vector<int32_t> history = {0, 0};
  EXPECT_EQ(s.sample(logits, history), 1);  // 2/2 = 1 < 1.5
  const float neg[] = {-1.0f, -1.5f, -3.0f};
  const std::vector<int32_t> h2 = {0};
  EXPECT_EQ(s.sample(neg, h2), 1);  // -1*2 = -2 < -1.5
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountTokens) {
  const float logits[] = {3.0f, 2.5f};
  auto p = plain(0);
  p.frequency_penalty = 0.3f;
  Sampler s(p, 2);
  const std::vector<int32_t> once = {0}, twice = {0, 0};
  EXPECT_EQ(s.sample(logits, once), 0);   // 3 - 0.3 > 2.5
  EXPECT_EQ(s.sample(logits, twice), 1);  // 3 - 0.6 < 2.5
}

TEST(Sampler, InvalidParametersAreRejectedByName) {
  auto expect_bad = [](SamplingParams p, const char* name) {
    try {
      validate_sampling(p);
      ADD_FAILURE() << name << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  SamplingParams p;
  p.temperature = -1;
  expect_bad(p, "temperature");
  p = {};
  p.top_p = 0;
  expect_bad(p, "top_p");
  p = {};
  p.top_p = 1.5f;
  expect_bad(p, "top_p");
  p = {};
  p.min_p = -0.1f;
  expect_bad(p, "min_p");
  p = {};
  p.repeat_penalty = 0;
  expect_bad(p, "repeat_penalty");
  p = {};
  p.presence_penalty = 3;
  expect_bad(p, "presence_penalty");
}

TEST(StopStreamer, CutsAtStopStringAcrossPieces) {
  StopStreamer s({"</end>"});
  std::string out;
  for (const char* piece : {"Hello", " wor", "ld</", "en", "d> more"}) out += s.push(piece);
  EXPECT_TRUE(s.stopped());
  out += s.flush();
  EXPECT_EQ(out, "Hello world");
}

TEST(StopStreamer, HoldsOnlyPossiblePrefixesAndFlushesTheRest) {
  StopStreamer s({"STOP"});
  EXPECT_EQ(s.push("abc S"), "abc ");
  EXPECT_EQ(s.push("T"), "");
  EXPECT_EQ(s.push("x"), "STx");
  EXPECT_FALSE(s.stopped());
  EXPECT_EQ(s.push("ST"), "");
  EXPECT_EQ(s.flush(), "ST");
}

TEST(StopStreamer, NeverSplitsUtf8) {
  StopStreamer s({});
  const std::string euro = "\xe2\x82\xac";  // U+20AC in three bytes
  EXPECT_EQ(s.push(euro.substr(0, 1)), "");
  EXPECT_EQ(s.push(euro.substr(1, 1)), "");
  EXPECT_EQ(s.push(euro.substr(2) + "a"), euro + "a");
  EXPECT_EQ(tok::utf8_complete_prefix("ab\xf0\x9f\x98"), 2u);
  EXPECT_EQ(tok::utf8_complete_prefix("ab\xf0\x9f\x98\x80"), 6u);
}

}  // namespace
}  // namespace loom

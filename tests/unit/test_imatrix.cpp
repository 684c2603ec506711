// Importance matrices (quant/imatrix.h) on the tiny model: loom's against
// llama-imatrix's over the same text, chunks and model (fixture from
// scripts/fixtures/make_perplexity_fixtures.sh), both of llama.cpp's file forms
// read alike, the GGUF form written and read back, and bad files refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/mapped_file.h"
#include "expect_error.h"
#include "io/file_write.h"
#include "kernels/backend.h"
#include "model/model.h"
#include "quant/imatrix.h"
#include "temp_dir.h"
#include "tokenizer/tokenizer.h"

namespace loom {
namespace {

using test_util::expect_error;
const std::string kFixtures = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/";

Imatrix compute_tiny(int64_t chunks) {
  ThreadPool pool(2);
  auto backend = make_backend(kCpu, pool);
  auto model = Model::load(kFixtures + "model/tiny-llama.f32.gguf", {.backend = backend.get()});
  const auto tokens = model->tokenizer().encode(read_text_file(kFixtures + "perplexity/text.txt"), true, false);
  InferenceSession s(model->config(), model->weights(), *backend, 64);
  return compute_imatrix(s, model->config(), tokens, {.n_ctx = 64, .max_chunks = chunks}, nullptr);
}

// Tolerance: llama.cpp keeps K/V in f16, so the inputs after the first
// attention differ in the last bits (the worst column sum here is 1.5e-3 off,
// in the last layer's ffn_down); layer 0's attention inputs agree to 1e-5.
TEST(Imatrix, MatchesLlamaImatrixOnTheTinyModel) {
  const Imatrix ours = compute_tiny(4);
  const Imatrix ref = load_imatrix(kFixtures + "perplexity/tiny-llama.imatrix.gguf");
  EXPECT_FALSE(ref.legacy);
  EXPECT_EQ(ref.chunk_count, 4);
  EXPECT_EQ(ours.chunk_count, 4);
  EXPECT_EQ(ours.chunk_size, 64);
  ASSERT_EQ(ours.entries.size(), ref.entries.size());
  double worst_all = 0;
  for (const auto& [name, r] : ref.entries) {
    const auto it = ours.entries.find(name);
    ASSERT_NE(it, ours.entries.end()) << name;
    const Imatrix::Entry& o = it->second;
    ASSERT_EQ(o.sums.size(), r.sums.size()) << name;
    EXPECT_EQ(o.counts, r.counts) << name;
    double worst = 0;
    for (size_t i = 0; i < r.sums.size(); ++i)
      worst = std::max(worst, std::fabs(o.sums[i] - r.sums[i]) / (std::fabs(r.sums[i]) + 1e-6));
    worst_all = std::max(worst_all, worst);
    // Layer 0's q/k/v and gate/up inputs come before any attention: the same bits up to the sum order.
    EXPECT_LT(worst, name.rfind("blk.0.attn_q", 0) == 0 ? 1e-5 : 5e-3) << name;
  }
  std::printf("largest relative difference of a column sum: %.3g\n", worst_all);
}

TEST(Imatrix, LegacyAndGgufFormsGiveTheSameImportance) {
  const auto a = load_imatrix(kFixtures + "perplexity/tiny-llama.imatrix.gguf").importance();
  const Imatrix legacy = load_imatrix(kFixtures + "perplexity/tiny-llama.imatrix.dat");
  EXPECT_TRUE(legacy.legacy);
  const auto b = legacy.importance();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, v] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    const auto& w = b.at(name);
    ASSERT_EQ(v.size(), w.size());
    for (size_t i = 0; i < v.size(); ++i) ASSERT_NEAR(v[i], w[i], 1e-5 * std::fabs(v[i]) + 1e-9) << name;
  }
}

TEST(Imatrix, SavedFileReadsBackAndImportanceIsTheMeanSquare) {
  Imatrix m = compute_tiny(2);
  m.datasets = {"text.txt"};
  test_util::TempDir dir("imatrix");
  const std::string path = dir.str() + "/m.gguf";
  save_imatrix(m, path);
  const Imatrix back = load_imatrix(path);
  EXPECT_EQ(back.datasets, m.datasets);
  EXPECT_EQ(back.chunk_count, 2);
  EXPECT_EQ(back.chunk_size, 64);
  ASSERT_EQ(back.entries.size(), m.entries.size());
  for (const auto& [name, e] : m.entries) {
    EXPECT_EQ(back.entries.at(name).sums, e.sums) << name;
    EXPECT_EQ(back.entries.at(name).counts, std::vector<int64_t>{128}) << name;
  }
  const auto imp = m.importance();
  const auto& q = m.entries.at("blk.0.attn_q.weight");
  EXPECT_FLOAT_EQ(imp.at("blk.0.attn_q.weight")[3], q.sums[3] / 128.0f);
  EXPECT_EQ(imp.at("blk.1.ffn_down.weight").size(), 176u);  // the down projection reads the FFN width
}

TEST(Imatrix, BadFilesAreRefused) {
  test_util::TempDir dir("imatrix_bad");
  const std::string p = dir.str() + "/bad.dat";
  expect_error([&] { load_imatrix(dir.str() + "/none.dat"); }, ErrorKind::not_found, {"none.dat"});
  write_file_atomic(p, std::string("\x02\x00\x00\x00\x05\x00\x00\x00", 8) + "ab");
  expect_error([&] { load_imatrix(p); }, ErrorKind::invalid_input, {p});
  write_file_atomic(p, std::string("\xff\xff\xff\x7f", 4));
  expect_error([&] { load_imatrix(p); }, ErrorKind::invalid_input, {p, "entries"});
}

}  // namespace
}  // namespace loom

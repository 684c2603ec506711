// Tiled training attention (kernels/cpu/attention_train.h) against the double
// references on awkward shapes, for each ISA, and bit-identical across thread
// counts and backward work splits.
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <vector>

#include "grad_test_util.h"
#include "kernels/cpu/attention_train.h"
#include "kernels/cpu/ops_backward.h"
#include "kernels/ref/ops_backward_ref.h"

namespace loom {
namespace {

using testing::expect_near_ref;
using testing::random_doubles;
using testing::to_f32;

struct Case {
  std::string name;
  AttentionShape s;
  std::vector<int64_t> lens;  // packed sample lengths (sum = T); empty: one sample, seq_start nullptr
  int64_t T = 0;
};

Case make_case(std::string name, int64_t H, int64_t G, int64_t d, int64_t pad, std::vector<int64_t> lens,
               int64_t T = 0) {
  Case c{std::move(name), {H, G, d, G * d + pad}, std::move(lens), T};
  if (!c.lens.empty()) {
    c.T = 0;
    for (int64_t n : c.lens) c.T += n;
  }
  return c;
}

std::vector<int32_t> starts(const Case& c) {
  std::vector<int32_t> st;
  int64_t at = 0;
  for (int64_t n : c.lens) {
    for (int64_t i = 0; i < n; ++i) st.push_back(static_cast<int32_t>(at));
    at += n;
  }
  return st;
}

// Lengths 1..37 in a scrambled order.
std::vector<int64_t> many_short() {
  std::vector<int64_t> lens;
  for (int64_t i = 0; i < 37; ++i) lens.push_back((i * 17) % 37 + 1);
  return lens;
}

std::vector<Case> cases() {
  return {
      make_case("d64_gqa3_two_samples", 9, 3, 64, 0, {130, 83}),
      make_case("d80_group1_one_sample", 2, 2, 80, 16, {}, 197),
      make_case("d64_group4_many_short", 8, 2, 64, 0, many_short()),
      make_case("d20_group3_padded", 6, 2, 20, 5, {70, 1, 65, 129}),
      make_case("d13_group1_single_rows", 1, 1, 13, 0, {1, 1, 2, 1, 3}),
  };
}

struct Inputs {
  std::vector<double> q, k, v, c, dq0, dk0, dv0;
  // Double reference: out, lse and the accumulated gradients.
  std::vector<double> out, lse, dq, dk, dv;
};

Inputs make_inputs(const Case& cs, uint32_t seed) {
  const int64_t qn = cs.T * cs.s.n_heads * cs.s.head_dim, kn = cs.T * cs.s.kv_stride;
  Inputs in;
  in.q = random_doubles(qn, seed, 2.0), in.k = random_doubles(kn, seed + 1, 2.0);
  in.v = random_doubles(kn, seed + 2), in.c = random_doubles(qn, seed + 3);
  in.dq0 = random_doubles(qn, seed + 4), in.dk0 = random_doubles(kn, seed + 5), in.dv0 = random_doubles(kn, seed + 6);
  in.out.resize(qn), in.lse.resize(cs.T * cs.s.n_heads);
  in.dq = in.dq0, in.dk = in.dk0, in.dv = in.dv0;
  const auto st = starts(cs);
  const int32_t* sp = st.empty() ? nullptr : st.data();
  ref::attention_forward(in.out.data(), in.lse.data(), in.q.data(), in.k.data(), in.v.data(), cs.s, cs.T, sp);
  ref::attention_backward(in.dq.data(), in.dk.data(), in.dv.data(), in.c.data(), in.q.data(), in.k.data(),
                          in.v.data(), cs.s, cs.T, sp);
  return in;
}

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// `scratch`: reused across calls (null: the overloads that make their own).
Result run_fast(const Case& cs, const Inputs& in, const AttnTrainOptions& opt, int threads,
                AttnTrainScratch* scratch = nullptr) {
  const auto st = starts(cs);
  const int32_t* sp = st.empty() ? nullptr : st.data();
  ThreadPool pool(threads);
  if (scratch) {
    const auto q = to_f32(in.q), k = to_f32(in.k), v = to_f32(in.v), c = to_f32(in.c);
    Result r{std::vector<float>(in.out.size()), std::vector<float>(in.lse.size()), to_f32(in.dq0), to_f32(in.dk0),
             to_f32(in.dv0)};
    attention_forward_train(pool, opt, r.out.data(), r.lse.data(), q.data(), k.data(), v.data(), cs.s, cs.T, sp,
                            *scratch);
    attention_backward(pool, opt, r.dq.data(), r.dk.data(), r.dv.data(), c.data(), q.data(), k.data(), v.data(),
                       r.out.data(), r.lse.data(), cs.s, cs.T, sp, *scratch);
    return r;
  }
  const auto q = to_f32(in.q), k = to_f32(in.k), v = to_f32(in.v), c = to_f32(in.c);
  Result r{std::vector<float>(in.out.size()), std::vector<float>(in.lse.size()), to_f32(in.dq0), to_f32(in.dk0),
           to_f32(in.dv0)};
  attention_forward_train(pool, opt, r.out.data(), r.lse.data(), q.data(), k.data(), v.data(), cs.s, cs.T, sp);
  attention_backward(pool, opt, r.dq.data(), r.dk.data(), r.dv.data(), c.data(), q.data(), k.data(), v.data(),
                     r.out.data(), r.lse.data(), cs.s, cs.T, sp);
  return r;
}

// q and k have scale 2, so raw scores reach ~100: their f32 sums dominate the
// error of out (the f32 rounding of the inputs alone gives ~1e-6).
void expect_matches_reference(const Result& r, const Inputs& in) {
  expect_near_ref(r.out, in.out, 2e-5, "out");
  expect_near_ref(r.lse, in.lse, 1e-5, "lse");
  expect_near_ref(r.dq, in.dq, 1e-5, "dq");
  expect_near_ref(r.dk, in.dk, 1e-5, "dk");
  expect_near_ref(r.dv, in.dv, 1e-5, "dv");
}

void expect_identical(const Result& a, const Result& b, const std::string& what) {
  EXPECT_EQ(a.out, b.out) << what;
  EXPECT_EQ(a.lse, b.lse) << what;
  EXPECT_EQ(a.dq, b.dq) << what;
  EXPECT_EQ(a.dk, b.dk) << what;
  EXPECT_EQ(a.dv, b.dv) << what;
}

std::vector<AttnIsa> isas() {
  std::vector<AttnIsa> v{AttnIsa::avx2};
  if (attention_isa_supported(AttnIsa::avx512)) v.push_back(AttnIsa::avx512);
  return v;
}

const char* isa_name(AttnIsa isa) { return isa == AttnIsa::avx512 ? "avx512" : "avx2"; }

TEST(AttentionTrain, MatchesReferenceOnAwkwardShapes) {
  uint32_t seed = 100;
  for (const Case& cs : cases()) {
    const Inputs in = make_inputs(cs, seed += 10);
    for (AttnIsa isa : isas()) {
      SCOPED_TRACE(cs.name + " " + isa_name(isa));
      expect_matches_reference(run_fast(cs, in, AttnTrainOptions{isa}, 2), in);
    }
  }
}

// Every thread count and every backward split gives the same bits.
TEST(AttentionTrain, BitIdenticalAcrossThreadsAndSplits) {
  uint32_t seed = 200;
  for (const Case& cs : cases()) {
    const Inputs in = make_inputs(cs, seed += 10);
    for (AttnIsa isa : isas()) {
      const Result base = run_fast(cs, in, AttnTrainOptions{isa, 0}, 1);
      for (int threads : {1, 2, 3})
        for (int64_t split : {int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{1000}}) {
          if (threads == 1 && split == 0) continue;
          expect_identical(base, run_fast(cs, in, AttnTrainOptions{isa, split}, threads),
                           cs.name + " " + isa_name(isa) + " threads " + std::to_string(threads) + " split " +
                               std::to_string(split));
        }
    }
  }
}

// The plain entry points use the default ISA and agree with it bit for bit.
TEST(AttentionTrain, PlainEntryPointsUseDefaultIsa) {
  const Case cs = make_case("d64", 9, 3, 64, 0, {100, 40});
  const Inputs in = make_inputs(cs, 300);
  const Result want = run_fast(cs, in, AttnTrainOptions{default_attention_isa()}, 2);
  const auto st = starts(cs);
  ThreadPool pool(2);
  const auto q = to_f32(in.q), k = to_f32(in.k), v = to_f32(in.v), c = to_f32(in.c);
  Result r{std::vector<float>(in.out.size()), std::vector<float>(in.lse.size()), to_f32(in.dq0), to_f32(in.dk0),
           to_f32(in.dv0)};
  attention_forward_train(pool, r.out.data(), r.lse.data(), q.data(), k.data(), v.data(), cs.s, cs.T, st.data());
  attention_backward(pool, r.dq.data(), r.dk.data(), r.dv.data(), c.data(), q.data(), k.data(), v.data(),
                     r.out.data(), r.lse.data(), cs.s, cs.T, st.data());
  expect_identical(want, r, "plain entry points");
}

// A scratch reserved for T rows holds every call of up to T rows, however they
// split into samples (all one-row samples, one long one, mixes), without
// growing, and reusing it gives the bits of a fresh one.
TEST(AttentionTrain, ReservedScratchHoldsEverySplit) {
  for (const auto& [H, G, d] : {std::array<int64_t, 3>{9, 3, 64}, std::array<int64_t, 3>{6, 2, 20}}) {
    const AttentionShape s{H, G, d, G * d};
    const int64_t T = 150;
    std::vector<std::vector<int64_t>> splits = {{150}, std::vector<int64_t>(150, 1), {1, 149}, {15, 1, 16, 118},
                                                {64, 1, 1, 1, 17, 66}, {100}, {3, 1, 2, 40, 7, 1, 1, 95},
                                                {129, 17, 1, 1, 1, 1}, {17, 17, 17, 17, 17, 17, 17, 17, 14}};
    for (int threads : {1, 3})
      for (AttnIsa isa : isas()) {
        AttnTrainScratch scratch;
        const AttnTrainScratchSize size = attention_train_scratch_size(s, T, threads, true, isa);
        attention_train_reserve(scratch, size);
        ASSERT_EQ(scratch.bytes(), size.bytes());
        uint32_t seed = 500;
        for (const auto& lens : splits) {
          Case cs = make_case("split", H, G, d, 0, lens);
          ASSERT_LE(cs.T, T);
          const Inputs in = make_inputs(cs, seed += 10);
          const std::string what = std::string(isa_name(isa)) + " d" + std::to_string(d) + " threads " +
                                   std::to_string(threads) + " samples " + std::to_string(lens.size());
          expect_identical(run_fast(cs, in, AttnTrainOptions{isa}, threads),
                           run_fast(cs, in, AttnTrainOptions{isa}, threads, &scratch), what);
          EXPECT_EQ(scratch.bytes(), size.bytes()) << what;
        }
      }
  }
}

// Padding columns of the kv rows (kv_stride > n_kv_heads * head_dim) are left alone.
TEST(AttentionTrain, KvPaddingUntouched) {
  const Case cs = make_case("padded", 4, 2, 16, 7, {50, 30});
  const Inputs in = make_inputs(cs, 400);
  for (AttnIsa isa : isas()) {
    const Result r = run_fast(cs, in, AttnTrainOptions{isa}, 3);
    for (int64_t t = 0; t < cs.T; ++t)
      for (int64_t i = 32; i < cs.s.kv_stride; ++i) {
        const size_t at = static_cast<size_t>(t * cs.s.kv_stride + i);
        ASSERT_EQ(r.dk[at], static_cast<float>(in.dk0[at])) << isa_name(isa) << " row " << t;
        ASSERT_EQ(r.dv[at], static_cast<float>(in.dv0[at])) << isa_name(isa) << " row " << t;
      }
  }
}

}  // namespace
}  // namespace loom

// Backward kernels: double references against finite differences, then the fast
// f32 kernels against the double references (awkward sizes, packed sequences).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "grad_test_util.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/ops_backward.h"
#include "kernels/ref/dequant_ref.h"
#include "kernels/ref/ops_backward_ref.h"
#include "matmul_test_util.h"

namespace loom {
namespace {

using testing::expect_fd_gradient;
using testing::expect_near_ref;
using testing::random_doubles;
using testing::to_f32;
using testing::to_f64;
using testing::weighted_sum;

TEST(OpsBackward, RmsNormReferenceMatchesFiniteDifferences) {
  const int64_t T = 3, n = 37;
  auto x = random_doubles(T * n, 1, 2.0), w = random_doubles(n, 2), c = random_doubles(T * n, 3);
  std::vector<double> y(T * n), r(T), dx(T * n), dw(n);
  auto loss = [&] {
    ref::rmsnorm_forward(y.data(), r.data(), x.data(), w.data(), T, n, 1e-5);
    return weighted_sum(c, y);
  };
  loss();
  ref::rmsnorm_backward(dx.data(), dw.data(), c.data(), x.data(), w.data(), r.data(), T, n);
  expect_fd_gradient(loss, x, dx, "dx");
  expect_fd_gradient(loss, w, dw, "dw");
}

TEST(OpsBackward, RmsNormFastMatchesReference) {
  for (int64_t n : {1, 7, 64, 577}) {
    const int64_t T = 5;
    auto x = random_doubles(T * n, 4, 3.0), w = random_doubles(n, 5), c = random_doubles(T * n, 6);
    auto dx0 = random_doubles(T * n, 7), dw0 = random_doubles(n, 8);  // accumulate onto these
    std::vector<double> y(T * n), r(T), dx = dx0, dw = dw0;
    ref::rmsnorm_forward(y.data(), r.data(), x.data(), w.data(), T, n, 1e-5);
    ref::rmsnorm_backward(dx.data(), dw.data(), c.data(), x.data(), w.data(), r.data(), T, n);
    auto xf = to_f32(x), wf = to_f32(w), cf = to_f32(c);
    std::vector<float> yf(T * n), rf(T), dxf = to_f32(dx0), dwf = to_f32(dw0);
    rmsnorm_forward_train(yf.data(), rf.data(), xf.data(), wf.data(), T, n, 1e-5f);
    rmsnorm_backward(dxf.data(), dwf.data(), cf.data(), xf.data(), wf.data(), rf.data(), T, n);
    expect_near_ref(yf, y, 1e-5, "out");
    expect_near_ref(rf, r, 1e-5, "rstd");
    expect_near_ref(dxf, dx, 1e-5, "dx");
    expect_near_ref(dwf, dw, 1e-5, "dw");
    // Frozen weight: dx only.
    std::vector<float> dx2 = to_f32(dx0);
    rmsnorm_backward(dx2.data(), nullptr, cf.data(), xf.data(), wf.data(), rf.data(), T, n);
    EXPECT_EQ(dx2, dxf);
  }
}

RopeTable make_rope(int64_t hd, bool interleaved) {
  RopeTable rope;
  rope.head_dim = hd;
  rope.interleaved = interleaved;
  for (int64_t i = 0; i < hd / 2; ++i)
    rope.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / hd)));
  return rope;
}

TEST(OpsBackward, RopeBothLayouts) {
  for (bool inter : {true, false}) {
    const auto rope = make_rope(10, inter);
    const int64_t T = 5, H = 3, n = T * H * 10;
    const std::vector<int32_t> pos = {0, 1, 2, 0, 4097};  // second sample restarts at 0
    auto x = random_doubles(n, 9), c = random_doubles(n, 10);
    auto loss = [&] {
      auto y = x;
      ref::rope_forward(rope, y.data(), T, H, pos.data());
      return weighted_sum(c, y);
    };
    auto dx = c;
    ref::rope_backward(rope, dx.data(), T, H, pos.data());
    expect_fd_gradient(loss, x, dx, "dx");
    auto df = to_f32(c);
    rope_backward(rope, df.data(), T, H, pos.data());
    expect_near_ref(df, dx, 1e-5, "fast dx");
    // The fast backward undoes the fast forward.
    auto xf = to_f32(x), back = xf;
    rope_apply(rope, back.data(), T, H, pos.data());
    rope_backward(rope, back.data(), T, H, pos.data());
    expect_near_ref(back, x, 1e-5, "inverse");
  }
}

TEST(OpsBackward, SwiGlu) {
  const int64_t n = 37;
  auto g = random_doubles(n, 11, 4.0), u = random_doubles(n, 12), c = random_doubles(n, 13);
  g[0] = -90;
  g[1] = 60;
  std::vector<double> y(n), dg(n), du(n);
  auto loss = [&] {
    ref::swiglu_forward(y.data(), g.data(), u.data(), n);
    return weighted_sum(c, y);
  };
  ref::swiglu_backward(dg.data(), du.data(), c.data(), g.data(), u.data(), n);
  expect_fd_gradient(loss, g, dg, "dgate");
  expect_fd_gradient(loss, u, du, "dup");
  auto gf = to_f32(g), uf = to_f32(u), cf = to_f32(c);
  std::vector<float> dgf(n, 7.f), duf(n, 7.f);  // overwritten, not accumulated
  swiglu_backward(dgf.data(), duf.data(), cf.data(), gf.data(), uf.data(), n);
  expect_near_ref(dgf, dg, 1e-5, "fast dgate");
  expect_near_ref(duf, du, 1e-5, "fast dup");
  // In place over gate / up.
  swiglu_backward(gf.data(), uf.data(), cf.data(), gf.data(), uf.data(), n);
  EXPECT_EQ(gf, dgf);
  EXPECT_EQ(uf, duf);
}

struct AttnCase {
  AttentionShape s;
  int64_t T;
  std::vector<int32_t> start;
  int64_t q_size() const { return T * s.n_heads * s.head_dim; }
  int64_t kv_size() const { return T * s.kv_stride; }
};

// Rows [0, 5) are one sample, [5, 9) another.
AttnCase small_packed_case() {
  AttnCase c{{4, 2, 6, 2 * 6 + 3}, 9, {0, 0, 0, 0, 0, 5, 5, 5, 5}};
  return c;
}

TEST(OpsBackward, AttentionReferenceMatchesFiniteDifferences) {
  const auto ac = small_packed_case();
  auto q = random_doubles(ac.q_size(), 14), k = random_doubles(ac.kv_size(), 15), v = random_doubles(ac.kv_size(), 16);
  auto c = random_doubles(ac.q_size(), 17);
  std::vector<double> out(ac.q_size()), dq(q.size()), dk(k.size()), dv(v.size());
  auto loss = [&] {
    ref::attention_forward(out.data(), nullptr, q.data(), k.data(), v.data(), ac.s, ac.T, ac.start.data());
    return weighted_sum(c, out);
  };
  ref::attention_backward(dq.data(), dk.data(), dv.data(), c.data(), q.data(), k.data(), v.data(), ac.s, ac.T,
                          ac.start.data());
  expect_fd_gradient(loss, q, dq, "dq");
  expect_fd_gradient(loss, k, dk, "dk");
  expect_fd_gradient(loss, v, dv, "dv");
  // Padding columns of the kv rows get no gradient.
  EXPECT_EQ(dk[12], 0.0);
  EXPECT_EQ(dv[ac.s.kv_stride + 14], 0.0);
}

TEST(OpsBackward, AttentionPackedSamplesAreIndependent) {
  const auto ac = small_packed_case();
  auto q = random_doubles(ac.q_size(), 18), k = random_doubles(ac.kv_size(), 19), v = random_doubles(ac.kv_size(), 20);
  std::vector<double> packed(ac.q_size()), alone(ac.q_size());
  ref::attention_forward(packed.data(), nullptr, q.data(), k.data(), v.data(), ac.s, ac.T, ac.start.data());
  // The second sample on its own (rows 5..8 shifted to 0..3).
  const int64_t qd = ac.s.n_heads * ac.s.head_dim;
  ref::attention_forward(alone.data(), nullptr, q.data() + 5 * qd, k.data() + 5 * ac.s.kv_stride,
                         v.data() + 5 * ac.s.kv_stride, ac.s, 4, nullptr);
  for (int64_t i = 0; i < 4 * qd; ++i) ASSERT_NEAR(packed[5 * qd + i], alone[i], 1e-12);
  // And the fast forward agrees.
  ThreadPool pool(2);
  auto qf = to_f32(q), kf = to_f32(k), vf = to_f32(v);
  std::vector<float> of(ac.q_size()), lse(ac.T * ac.s.n_heads);
  attention_forward_train(pool, of.data(), lse.data(), qf.data(), kf.data(), vf.data(), ac.s, ac.T, ac.start.data());
  expect_near_ref(of, packed, 1e-5, "fast out");
}

void check_fast_attention(const AttnCase& ac, uint32_t seed) {
  auto q = random_doubles(ac.q_size(), seed, 2.0), k = random_doubles(ac.kv_size(), seed + 1, 2.0);
  auto v = random_doubles(ac.kv_size(), seed + 2), c = random_doubles(ac.q_size(), seed + 3);
  auto dq0 = random_doubles(q.size(), seed + 4), dk0 = random_doubles(k.size(), seed + 5);
  auto dv0 = random_doubles(v.size(), seed + 6);
  std::vector<double> out(ac.q_size()), lse(ac.T * ac.s.n_heads), dq = dq0, dk = dk0, dv = dv0;
  const int32_t* st = ac.start.empty() ? nullptr : ac.start.data();
  ref::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), ac.s, ac.T, st);
  ref::attention_backward(dq.data(), dk.data(), dv.data(), c.data(), q.data(), k.data(), v.data(), ac.s, ac.T, st);
  auto qf = to_f32(q), kf = to_f32(k), vf = to_f32(v), cf = to_f32(c);
  std::vector<float> first[5];
  for (int threads : {1, 3}) {
    ThreadPool pool(threads);
    std::vector<float> of(ac.q_size()), lf(ac.T * ac.s.n_heads), dqf = to_f32(dq0), dkf = to_f32(dk0),
                                                                   dvf = to_f32(dv0);
    attention_forward_train(pool, of.data(), lf.data(), qf.data(), kf.data(), vf.data(), ac.s, ac.T, st);
    attention_backward(pool, dqf.data(), dkf.data(), dvf.data(), cf.data(), qf.data(), kf.data(), vf.data(), of.data(),
                       lf.data(), ac.s, ac.T, st);
    expect_near_ref(of, out, 2e-5, "out");
    expect_near_ref(lf, lse, 2e-5, "lse");
    expect_near_ref(dqf, dq, 1e-4, "dq");
    expect_near_ref(dkf, dk, 1e-4, "dk");
    expect_near_ref(dvf, dv, 1e-4, "dv");
    if (threads == 1) {
      first[0] = of, first[1] = lf, first[2] = dqf, first[3] = dkf, first[4] = dvf;
    } else {  // thread-count independent, bit for bit
      EXPECT_EQ(first[0], of);
      EXPECT_EQ(first[1], lf);
      EXPECT_EQ(first[2], dqf);
      EXPECT_EQ(first[3], dkf);
      EXPECT_EQ(first[4], dvf);
    }
  }
}

TEST(OpsBackward, AttentionFastMatchesReference) {
  check_fast_attention(small_packed_case(), 21);
  // Three samples of 30, 1 and 39 rows; head_dim 20, GQA 6:2, padded kv rows.
  AttnCase big{{6, 2, 20, 2 * 20 + 5}, 70, {}};
  for (int64_t t = 0; t < 70; ++t) big.start.push_back(t < 30 ? 0 : t < 31 ? 30 : 31);
  check_fast_attention(big, 31);
  // No packing, no GQA.
  check_fast_attention(AttnCase{{3, 3, 8, 24}, 17, {}}, 41);
}

TEST(OpsBackward, Embedding) {
  const int64_t T = 6, H = 19, V = 5;
  const std::vector<int32_t> tok = {3, 0, 3, 4, 3, 1};
  auto dout = random_doubles(T * H, 50), dW0 = random_doubles(V * H, 51);
  auto dW = dW0;
  ref::embedding_backward(dW.data(), dout.data(), tok.data(), T, H);
  ThreadPool pool(3);
  auto dWf = to_f32(dW0), df = to_f32(dout);
  embedding_backward(pool, dWf.data(), df.data(), tok.data(), T, V, H);
  expect_near_ref(dWf, dW, 1e-6, "dW");
  const std::vector<int32_t> bad = {0, 5};
  EXPECT_THROW(embedding_backward(pool, dWf.data(), df.data(), bad.data(), 2, V, H), Error);
}

TEST(OpsBackward, LinearReferenceMatchesFiniteDifferences) {
  const int64_t T = 3, N = 5, K = 7;
  auto x = random_doubles(T * K, 60), W = random_doubles(N * K, 61), b = random_doubles(N, 62);
  auto c = random_doubles(T * N, 63);
  std::vector<double> y(T * N), dx(x.size()), dW(W.size()), db(N);
  auto loss = [&] {
    ref::linear_forward(y.data(), x.data(), W.data(), b.data(), T, N, K);
    return weighted_sum(c, y);
  };
  ref::linear_backward(dx.data(), dW.data(), db.data(), c.data(), x.data(), W.data(), T, N, K);
  expect_fd_gradient(loss, x, dx, "dx");
  expect_fd_gradient(loss, W, dW, "dW");
  expect_fd_gradient(loss, b, db, "db");
}

TEST(OpsBackward, LinearF32FastMatchesReference) {
  struct Dims { int64_t T, N, K; };
  for (Dims d : {Dims{1, 1, 1}, Dims{7, 70, 45}, Dims{13, 130, 300}, Dims{37, 9, 17}}) {
    auto x = random_doubles(d.T * d.K, 70), W = random_doubles(d.N * d.K, 71), dy = random_doubles(d.T * d.N, 72);
    auto dx0 = random_doubles(x.size(), 73), dW0 = random_doubles(W.size(), 74), db0 = random_doubles(d.N, 75);
    auto dx = dx0, dW = dW0, db = db0;
    ref::linear_backward(dx.data(), dW.data(), db.data(), dy.data(), x.data(), W.data(), d.T, d.N, d.K);
    auto xf = to_f32(x), Wf = to_f32(W), dyf = to_f32(dy);
    const Tensor Wt = make_tensor(Wf.data(), DType::f32, {d.N, d.K});
    std::vector<float> ref_dx, ref_dW;
    for (int threads : {1, 4}) {
      ThreadPool pool(threads);
      auto dxf = to_f32(dx0), dWf = to_f32(dW0), dbf = to_f32(db0);
      linear_backward_input(pool, Wt, dyf.data(), dxf.data(), d.T);
      linear_backward_weight(pool, dyf.data(), xf.data(), dWf.data(), d.T, d.N, d.K);
      linear_backward_bias(dyf.data(), dbf.data(), d.T, d.N);
      expect_near_ref(dxf, dx, 2e-5, "dx");
      expect_near_ref(dWf, dW, 2e-5, "dW");
      expect_near_ref(dbf, db, 2e-5, "db");
      if (threads == 1) {
        ref_dx = dxf, ref_dW = dWf;
      } else {
        EXPECT_EQ(ref_dx, dxf);
        EXPECT_EQ(ref_dW, dWf);
      }
    }
  }
}

TEST(OpsBackward, LinearInputQuantizedWeightsMatchDequantizedReference) {
  struct Case { DType type; int64_t T, N, K; };
  for (Case c : {Case{DType::q4_1, 13, 130, 96}, Case{DType::q8_0, 6, 65, 320}, Case{DType::f16, 9, 70, 45},
                 Case{DType::bf16, 3, 17, 40}, Case{DType::q4_k, 5, 70, 512}, Case{DType::q6_k, 4, 33, 256}}) {
    SCOPED_TRACE(dtype_name(c.type));
    std::vector<uint8_t> raw;
    if (c.type == DType::f16 || c.type == DType::bf16) {
      auto wf = testing::random_floats(c.N * c.K, 80);
      raw.resize(dtype_row_bytes(c.type, c.K) * c.N);
      auto* p = reinterpret_cast<uint16_t*>(raw.data());
      for (size_t i = 0; i < wf.size(); ++i)
        p[i] = c.type == DType::f16 ? fp32_to_fp16(wf[i]) : static_cast<uint16_t>(float_to_bits(wf[i]) >> 16);
    } else {
      raw = testing::random_weights(c.type, c.N, c.K, 81);
    }
    const Tensor W = make_tensor(raw.data(), c.type, {c.N, c.K});
    std::vector<float> deq(c.N * c.K);
    for (int64_t r = 0; r < c.N; ++r) dequantize_row_ref(c.type, W.row_ptr(r), deq.data() + r * c.K, c.K);
    auto dy = random_doubles(c.T * c.N, 82), dx0 = random_doubles(c.T * c.K, 83);
    auto dx = dx0;
    ref::linear_backward(dx.data(), nullptr, nullptr, dy.data(), nullptr, to_f64(deq).data(), c.T, c.N, c.K);
    ThreadPool pool(3);
    auto dxf = to_f32(dx0), dyf = to_f32(dy);
    linear_backward_input(pool, W, dyf.data(), dxf.data(), c.T);
    expect_near_ref(dxf, dx, 2e-5, "dx");
  }
}

// Not a test of correctness: prints the speed of the input gradient for
// SmolLM2-135M's largest shape (T = 512, W 1536 x 576 q4_1).
}  // namespace
}  // namespace loom

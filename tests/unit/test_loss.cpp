// Chunked fused cross-entropy: double reference against finite differences, the
// fast chunked version against the unchunked reference, grad_scale semantics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "grad_test_util.h"
#include "kernels/cpu/loss.h"
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

TEST(Loss, ReferenceMatchesFiniteDifferences) {
  const int64_t T = 6, V = 11, H = 5;
  const std::vector<int32_t> labels = {3, -100, 10, 0, -100, 3};
  auto h = random_doubles(T * H, 1), W = random_doubles(V * H, 2, 0.7);
  const double scale = 1.0 / 4;  // mean over the 4 unmasked rows
  std::vector<double> dh(h.size()), dW(W.size());
  int64_t count = 0;
  ref::cross_entropy(dh.data(), dW.data(), &count, h.data(), W.data(), labels.data(), T, V, H, scale);
  EXPECT_EQ(count, 4);
  auto loss = [&] {
    return scale * ref::cross_entropy(nullptr, nullptr, nullptr, h.data(), W.data(), labels.data(), T, V, H, scale);
  };
  expect_fd_gradient(loss, h, dh, "dh");
  expect_fd_gradient(loss, W, dW, "dW");
  for (int64_t i = 0; i < H; ++i) EXPECT_EQ(dh[1 * H + i], 0.0);  // masked row
}

std::vector<int32_t> make_labels(int64_t T, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> l(T);
  for (auto& x : l) x = rng() % 4 == 0 ? -100 : static_cast<int32_t>(rng() % V);
  return l;
}

TEST(Loss, ChunkedF32MatchesUnchunkedReference) {
  const int64_t T = 11, V = 301, H = 40;
  auto labels = make_labels(T, V, 3);
  labels[0] = -100;
  labels[T - 1] = 7;
  auto h = random_doubles(T * H, 4), W = random_doubles(V * H, 5, 0.3);
  auto dh0 = random_doubles(h.size(), 6), dW0 = random_doubles(W.size(), 7);
  const double scale = 1.0 / 17;
  auto dh = dh0, dW = dW0;
  int64_t count = 0;
  int64_t correct = 0;
  const double loss =
      ref::cross_entropy(dh.data(), dW.data(), &count, h.data(), W.data(), labels.data(), T, V, H, scale, &correct);

  auto hf = to_f32(h), Wf = to_f32(W);
  const Tensor Wt = make_tensor(Wf.data(), DType::f32, {V, H});
  ThreadPool pool(3);
  const PackedWeight Wp = PackedWeight::pack(Wt, &pool, "output");
  MatmulScratch scratch;
  std::vector<float> first_dh, first_dW;
  for (int64_t chunk : {4, 1, 64}) {
    for (bool packed : {true, false}) {
      auto dhf = to_f32(dh0), dWf = to_f32(dW0);
      ChunkedLossArgs a;
      a.W = &Wt;
      a.W_packed = packed ? &Wp : nullptr;
      a.h = hf.data();
      a.labels = labels.data();
      a.T = T;
      a.grad_scale = static_cast<float>(scale);
      a.dh = dhf.data();
      a.dW = dWf.data();
      a.chunk_rows = chunk;
      a.count_correct = true;
      const LossResult r = chunked_cross_entropy(pool, a, scratch);
      EXPECT_EQ(r.n_tokens, count);
      EXPECT_EQ(r.n_correct, correct);
      EXPECT_NEAR(r.loss_sum, loss, 1e-5 * loss);
      expect_near_ref(dhf, dh, 1e-5, "dh");
      expect_near_ref(dWf, dW, 1e-5, "dW");
      // Chunking, packing and threads do not change a bit.
      if (first_dh.empty()) {
        first_dh = dhf, first_dW = dWf;
      } else {
        EXPECT_EQ(first_dh, dhf);
        EXPECT_EQ(first_dW, dWf);
      }
    }
  }
}

// Two micro-batches with grad_scale = 1 / (all unmasked tokens of the step):
// the summed gradients are those of the step's mean loss.
TEST(Loss, GradScaleIsMeanOverTheWholeStep) {
  const int64_t T = 9, V = 50, H = 16;
  auto la = make_labels(T, V, 8), lb = make_labels(T, V, 9);
  auto h = random_doubles(2 * T * H, 10), W = random_doubles(V * H, 11, 0.5);
  std::vector<int32_t> both = la;
  both.insert(both.end(), lb.begin(), lb.end());
  int64_t n_total = 0;
  for (int32_t l : both) n_total += l != -100;
  std::vector<double> dh(h.size());
  const double mean_loss =
      ref::cross_entropy(dh.data(), nullptr, nullptr, h.data(), W.data(), both.data(), 2 * T, V, H, 1.0 / n_total) /
      n_total;
  auto hf = to_f32(h), Wf = to_f32(W);
  const Tensor Wt = make_tensor(Wf.data(), DType::f32, {V, H});
  ThreadPool pool(2);
  MatmulScratch scratch;
  std::vector<float> dhf(h.size());
  double loss_sum = 0;
  int64_t tokens = 0;
  for (int mb = 0; mb < 2; ++mb) {
    ChunkedLossArgs a;
    a.W = &Wt;
    a.h = hf.data() + mb * T * H;
    a.labels = (mb == 0 ? la : lb).data();
    a.T = T;
    a.grad_scale = 1.0f / static_cast<float>(n_total);
    a.dh = dhf.data() + mb * T * H;
    a.chunk_rows = 5;
    const LossResult r = chunked_cross_entropy(pool, a, scratch);
    loss_sum += r.loss_sum;
    tokens += r.n_tokens;
  }
  EXPECT_EQ(tokens, n_total);
  EXPECT_NEAR(loss_sum / tokens, mean_loss, 1e-5 * mean_loss);
  expect_near_ref(dhf, dh, 1e-5, "dh");
}

// Token accuracy: a row counts when its label is the argmax logit, ties going to
// the lowest index (torch.argmax); ignored rows never count. Rows 4 and 9 of W
// are equal, so a row of h along them ties them exactly (in f32 and double).
TEST(Loss, TokenAccuracyMatchesReferenceWithTiesAndIgnoredLabels) {
  const int64_t T = 8, V = 23, H = 16;
  auto W = random_doubles(V * H, 21, 0.3);
  for (int64_t i = 0; i < H; ++i) W[4 * H + i] = W[9 * H + i] = 3.0 * W[4 * H + i];
  auto h = random_doubles(T * H, 22);
  for (int64_t t = 0; t < 3; ++t) std::copy_n(W.begin() + 4 * H, H, h.begin() + t * H);
  auto argmax = [&](int64_t t) {
    std::vector<double> z(V);
    ref::linear_forward(z.data(), h.data() + t * H, W.data(), nullptr, 1, V, H);
    return static_cast<int32_t>(std::max_element(z.begin(), z.end()) - z.begin());
  };
  ASSERT_EQ(argmax(0), 4);
  // tie won, tie lost, ignored (would be right), right, wrong, ignored, right, wrong
  const std::vector<int32_t> labels = {4, 9, -100, argmax(3), (argmax(4) + 1) % 23, -100, argmax(6),
                                       (argmax(7) + 5) % 23};
  int64_t count = 0, correct = -1;
  ref::cross_entropy(nullptr, nullptr, &count, h.data(), W.data(), labels.data(), T, V, H, 1.0, &correct);
  EXPECT_EQ(count, 6);
  EXPECT_EQ(correct, 3);

  auto hf = to_f32(h), Wf = to_f32(W);
  const Tensor Wt = make_tensor(Wf.data(), DType::f32, {V, H});
  ThreadPool pool(2);
  const PackedWeight Wp = PackedWeight::pack(Wt, &pool, "output");
  MatmulScratch scratch;
  std::vector<float> dh(h.size());
  for (int64_t chunk : {1, 3, 64})
    for (bool packed : {true, false})
      for (bool backward : {false, true}) {
        ChunkedLossArgs a;
        a.W = &Wt;
        a.W_packed = packed ? &Wp : nullptr;
        a.h = hf.data();
        a.labels = labels.data();
        a.T = T;
        a.dh = backward ? dh.data() : nullptr;
        a.chunk_rows = chunk;
        a.count_correct = true;
        const LossResult r = chunked_cross_entropy(pool, a, scratch);
        EXPECT_EQ(r.n_tokens, 6);
        EXPECT_EQ(r.n_correct, correct) << "chunk " << chunk << " packed " << packed << " backward " << backward;
        a.count_correct = false;  // not asked: not counted
        EXPECT_EQ(chunked_cross_entropy(pool, a, scratch).n_correct, 0);
      }
}

TEST(Loss, QuantizedOutputProjection) {
  // Tied q8_0 embeddings as the output projection (SmolLM2); logits see the q8
  // activation rounding, so the tolerance is that of the quantized matmul.
  const int64_t T = 7, V = 203, H = 64;
  auto labels = make_labels(T, V, 12);
  auto raw = testing::random_weights(DType::q8_0, V, H, 13);
  const Tensor Wt = make_tensor(raw.data(), DType::q8_0, {V, H});
  std::vector<float> deq(V * H);
  for (int64_t r = 0; r < V; ++r) dequantize_row_ref(DType::q8_0, Wt.row_ptr(r), deq.data() + r * H, H);
  auto h = random_doubles(T * H, 14);
  std::vector<double> dh(h.size());
  int64_t count = 0;
  int64_t correct = 0;
  const double loss = ref::cross_entropy(dh.data(), nullptr, &count, h.data(), to_f64(deq).data(), labels.data(), T, V,
                                         H, 1.0, &correct);
  ThreadPool pool(2);
  MatmulScratch scratch;
  auto hf = to_f32(h);
  std::vector<float> dhf(h.size());
  ChunkedLossArgs a;
  a.W = &Wt;
  a.h = hf.data();
  a.labels = labels.data();
  a.T = T;
  a.dh = dhf.data();
  a.chunk_rows = 3;
  a.count_correct = true;
  const LossResult r = chunked_cross_entropy(pool, a, scratch);
  EXPECT_EQ(r.n_tokens, count);
  EXPECT_EQ(r.n_correct, correct);  // no near-ties here: the q8 rounding moves no argmax
  EXPECT_NEAR(r.loss_sum, loss, 1e-2 * loss);
  expect_near_ref(dhf, dh, 2e-2, "dh");
  // A trainable output projection must be f32.
  std::vector<float> dW(V * H);
  a.dW = dW.data();
  EXPECT_THROW(chunked_cross_entropy(pool, a, scratch), Error);
}

TEST(Loss, LabelsAreChecked) {
  const int64_t V = 10, H = 8;
  std::vector<float> W(V * H, 0.1f), h(2 * H, 1.0f);
  const Tensor Wt = make_tensor(W.data(), DType::f32, {V, H});
  ThreadPool pool(1);
  MatmulScratch scratch;
  std::vector<int32_t> labels = {-100, -100};
  ChunkedLossArgs a;
  a.W = &Wt;
  a.h = h.data();
  a.labels = labels.data();
  a.T = 2;
  const LossResult none = chunked_cross_entropy(pool, a, scratch);
  EXPECT_EQ(none.n_tokens, 0);
  EXPECT_EQ(none.loss_sum, 0.0);
  // Uniform logits: loss log(V) per token.
  labels = {3, 9};
  a.count_correct = true;
  const LossResult two = chunked_cross_entropy(pool, a, scratch);
  EXPECT_EQ(two.n_tokens, 2);
  EXPECT_NEAR(two.loss_sum, 2 * std::log(10.0), 1e-5);
  EXPECT_EQ(two.n_correct, 0);  // all logits tie: the argmax is token 0
  labels = {0, 9};
  EXPECT_EQ(chunked_cross_entropy(pool, a, scratch).n_correct, 1);
  labels = {3, 10};
  EXPECT_THROW(chunked_cross_entropy(pool, a, scratch), Error);
  labels = {-1, 0};
  EXPECT_THROW(chunked_cross_entropy(pool, a, scratch), Error);
}

}  // namespace
}  // namespace loom

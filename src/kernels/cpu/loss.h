// Causal-LM cross-entropy fused with the output projection, computed a chunk of
// rows at a time so the [T, vocab] logits never exist at once (vocab up to ~150k).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "kernels/shapes.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/matmul.h"

namespace loom {


struct ChunkedLossArgs {
  const Tensor* W = nullptr;            // output projection [V, H], any dtype (read for dh)
  const PackedWeight* W_packed = nullptr;  // the same weight packed for matmul; nullptr: pack per chunk
  // W^T from pack_transposed (kernels/cpu/linear_backward.h): dh through the fast
  // matmul kernels instead of the exact tile path; nullptr: exact; an empty
  // PackedWeight: bf16 products reading W itself (linear_backward_input_bf16_direct).
  const PackedWeight* Wt_packed = nullptr;
  const float* h = nullptr;             // [T, H] final-norm output
  const int32_t* labels = nullptr;      // [T]: target of row t (already shifted), -100 = ignore
  int64_t T = 0;
  // Scale of the gradient: 1 / (unmasked tokens of the whole optimizer step, all
  // micro-batches), so that summing micro-batch gradients gives the gradient of
  // the step's mean loss.
  float grad_scale = 1.0f;
  float* dh = nullptr;   // [T, H] +=; nullptr: loss only (evaluation)
  float* dW = nullptr;   // [V, H] f32 +=; only for a trainable (f32) output projection
  ScratchFloats* dW_scratch = nullptr;  // dW's linear_backward_weight scratch; nullptr: one per chunk
  int64_t chunk_rows = 64;
  // Count the rows whose argmax logit is the label (LossResult::n_correct;
  // ties: the lowest index wins, as torch.argmax). Evaluation only.
  bool count_correct = false;
};

// For every chunk of unmasked rows: logits = h W^T (kernels/cpu/matmul.h), softmax,
// loss (and, if count_correct, whether the label is the argmax), dlogits =
// (softmax - onehot) * grad_scale, dh += dlogits W (linear_backward_input) and,
// if dW, dW += dlogits^T h.
//
// Numerics: with a quantized W the logits carry matmul's q8 activation rounding
// (exactly the logits inference produces), while dh uses the dequantized W
// exactly. The gradient is thus that of the unrounded product (a straight-through
// estimate); the relative mismatch is ~1e-3 of the logits, well below the noise
// of a stochastic gradient. With f32 W both are exact f32 products.
// A NaN logit is never the argmax (the loss is NaN then anyway).
// Deterministic: independent of the thread count. Throws loom::Error(invalid_input)
// for a label outside [0, V) other than -100, or a dW with a non-f32 W.
// Its working memory (a chunk of logits, the unmasked rows, ...): passed in,
// a step's loss reuses the memory of the step before.
struct LossScratch {
  std::vector<int64_t> rows;
  std::vector<float> hc, logits, dhc;
  std::vector<double> row_loss;
  std::vector<uint8_t> row_correct;
  PackedBackwardScratch bwd;
  size_t bytes() const;  // allocated
};
// `reuse`: null allocates a LossScratch for this call.
LossResult chunked_cross_entropy(ThreadPool& pool, const ChunkedLossArgs& a, MatmulScratch& scratch,
                                 LossScratch* reuse = nullptr);

}  // namespace loom

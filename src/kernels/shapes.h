// Device-neutral descriptions that ops of every backend take (kernels/backend.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace loom {

// Rotary embedding tables: inverse frequencies per pair, with Llama-3 scaling
// or per-pair divisors (GGUF rope_freqs) already folded in.
struct RopeTable {
  int64_t head_dim = 0;
  bool interleaved = true;     // pairs (2i, 2i+1) vs (i, i + d/2)
  std::vector<float> inv_freq;  // head_dim / 2 entries
};

// Causal grouped-query attention: n_heads query heads share n_kv_heads K/V heads
// of head_dim; K/V rows are kv_stride floats apart (kv head g at g * head_dim).
struct AttentionShape {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t kv_stride = 0;
};

// A contiguous K/V store (Backend::attention): the key and value of position p
// at row p, AttentionShape::kv_stride elements apart, as f32 or IEEE half (f16
// elements are widened exactly, so the arithmetic is the f32 store's on the
// widened values).
struct KvRows {
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::f32;
};

// The cross-entropy of a batch (Backend::cross_entropy).
struct LossResult {
  double loss_sum = 0;  // sum over unmasked rows of -log softmax(logits)[label]
  int64_t n_tokens = 0;  // unmasked rows
  // Unmasked rows whose largest logit is the label's, ties going to the lowest
  // index (torch.argmax); counted only when LossOp::count_correct, else 0.
  int64_t n_correct = 0;
};

// One layer's keys and values, each [n_blocks][n_kv_heads][block_size][head_dim]
// elements of `dtype` (f32, or f16 read as f32): kv head g of position slot s
// of physical block b starts at element ((b * n_kv_heads + g) * block_size + s)
// * head_dim. (AttentionShape's kv_stride is not used.)
struct PagedKv {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t block_size = 0;
  DType dtype = DType::f32;
};

}  // namespace loom

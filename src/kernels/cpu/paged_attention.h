// Causal grouped-query attention over a paged KV store (the server's KV cache):
// every query row belongs to a sequence with its own block table. The scalar
// twin is kernels/ref/paged_attention_ref.h.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/shapes.h"

namespace loom {

// For t < T query rows:
//   q:   [T, n_heads * head_dim], row t at position pos[t]
//   out: [T, n_heads * head_dim]
//   tables[t]: the block ids of row t's sequence (logical block i holds
//              positions [i * block_size, (i + 1) * block_size))
// Row t attends to its sequence's positions [0, pos[t]]; nothing else of the
// store is read (other slots may hold anything, NaN included).
//
// Each (row, kv head) is one unit of work, computed by one thread in a fixed
// order (an online softmax over tiles of 16 positions counted from position
// 0), so out row t is bit-identical whatever the thread count, the other rows
// of the batch, or the physical blocks are.
void paged_attention(ThreadPool& pool, const AttentionShape& s, const PagedKv& kv, const float* q, float* out,
                     int64_t T, const int32_t* pos, const int32_t* const* tables);

}  // namespace loom

// Causal grouped-query attention over a paged KV store (the server's KV cache):
// every query row belongs to a sequence with its own block table. The scalar
// twin is kernels/ref/paged_attention_ref.h.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/cpu/attention_isa.h"
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
// order. A row longer than `segment` positions (a multiple of 16) is split into
// segments of that many, one unit each, whose partial softmax sums are then
// merged in segment order (flash-decoding's split; vLLM's PagedAttention v2
// partitions of 512): one long sequence then keeps every thread busy instead
// of one per kv head. Adjacent rows with the same table (a prefill chunk)
// share each tile's reads, each row computing it as it would alone. The split
// depends on the row's length alone, so out row t is bit-identical whatever
// the thread count, the other rows of the batch, or the physical blocks are.
//
// Where head_dim is a multiple of 16, each unit scores its positions, takes
// their softmax, then the weighted sums of V: the contiguous cache's kernels
// (attention_rows.h, ops.cpp) on rows located through the block table, on
// AVX-512 or AVX2, with the keys read transposed for units of 16 or more rows
// (a prefill chunk). A row in one segment then gets the bits of the contiguous
// cache's attention (ops.h) on the same keys and values, on either ISA. Other
// head dims keep an AVX2 online softmax over tiles of 16 positions.
inline constexpr int64_t kPagedSegment = 512;
void paged_attention(ThreadPool& pool, const AttentionShape& s, const PagedKv& kv, const float* q, float* out,
                     int64_t T, const int32_t* pos, const int32_t* const* tables,
                     int64_t segment = kPagedSegment, AttnIsa isa = default_attention_isa());

}  // namespace loom

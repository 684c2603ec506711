// Training attention behind attention_forward_train / attention_backward, with the
// ISA and the backward work split exposed for tests and benchmarks.
//
// Flash-attention style: 64 x 64 tiles of (query rows, key rows) per head, blocks
// starting at each sample's first row, so fully masked tiles (other samples, the
// causal upper triangle) are never visited and only diagonal tiles are masked.
// The forward keeps an online softmax per query row; the backward recomputes P
// from lse once per tile (one exp per score when fused). Work units are fixed by
// the shapes alone and each output element is summed by one thread in a fixed
// order, so results never depend on the thread count. AVX2 and AVX-512 differ in
// their lane reductions (row max, row sums), so their results may differ slightly.
#pragma once

#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/attention_isa.h"
#include "kernels/cpu/attention_train_tiles.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/scratch.h"

namespace loom {

struct AttnTrainOptions {
  AttnIsa isa = default_attention_isa();  // throws Error(unsupported) if the CPU lacks it
  // Backward work split. A unit is (sample, kv head): run fused, one thread owns
  // its dk, dv and the dq of the group's query heads. The `split_units` costliest
  // units are instead cut into dq pieces (one per query block and head) and dk/dv
  // pieces (one per key block), which recompute the probabilities once more but
  // spread over more threads. -1: chosen from the thread count. Every value gives
  // bit-identical results (same per-element summation order).
  int64_t split_units = -1;
};

// Working memory of the training attention: the samples and the task plan,
// K^T / V^T (and zero-padded copies when head_dim is not a whole number of
// vectors), and one slab of tiles per thread. Kept across calls (a backend
// Workspace holds one) it grows to the largest call, then allocates nothing.
struct AttnTrainScratch {
  std::vector<attn::Sample> samples;
  std::vector<attn::PackBlock> blocks;
  std::vector<attn::Task> tasks;
  std::vector<attn::PlannedTask> units, trial;  // the backward's plan
  std::vector<double> free_at;                  // its list-schedule simulation
  ScratchFloats floats;
  size_t bytes() const;  // held now
};

// What an AttnTrainScratch holds after attention_train_reserve: enough for
// every forward (and, with `backward`, backward) call of up to T rows, however
// they split into samples, on `threads` threads with the kernels of `isa`.
struct AttnTrainScratchSize {
  size_t samples = 0, blocks = 0, tasks = 0, units = 0, trial = 0, free_at = 0, floats = 0;
  size_t bytes() const;
};
AttnTrainScratchSize attention_train_scratch_size(const AttentionShape& s, int64_t T, int threads, bool backward,
                                                  AttnIsa isa = default_attention_isa());
void attention_train_reserve(AttnTrainScratch& scratch, const AttnTrainScratchSize& size);

// Same contracts as the overloads in kernels/ops_backward.h; `scratch` is
// reused (those overloads make one per call).
void attention_forward_train(ThreadPool& pool, const AttnTrainOptions& opt, float* out, float* lse, const float* q,
                             const float* k, const float* v, const AttentionShape& s, int64_t T,
                             const int32_t* seq_start, AttnTrainScratch& scratch);
void attention_backward(ThreadPool& pool, const AttnTrainOptions& opt, float* dq, float* dk, float* dv,
                        const float* dout, const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& s, int64_t T, const int32_t* seq_start,
                        AttnTrainScratch& scratch);
// The same with a scratch of their own (tests, benchmarks).
void attention_forward_train(ThreadPool& pool, const AttnTrainOptions& opt, float* out, float* lse, const float* q,
                             const float* k, const float* v, const AttentionShape& s, int64_t T,
                             const int32_t* seq_start);
void attention_backward(ThreadPool& pool, const AttnTrainOptions& opt, float* dq, float* dk, float* dv,
                        const float* dout, const float* q, const float* k, const float* v, const float* out,
                        const float* lse, const AttentionShape& s, int64_t T, const int32_t* seq_start);

}  // namespace loom

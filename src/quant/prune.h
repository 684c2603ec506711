// Unstructured and N:M pruning of the decoder's linear weights (q, k, v, o,
// gate, up and down of every layer; embeddings, norms and the output head are
// kept, as Wanda and SparseGPT keep them). Each weight gets a score:
//   magnitude  |W_ij|
//   wanda      |W_ij| * ||X_j||_2 (Sun et al. 2023, "A Simple and Effective
//              Pruning Approach for LLMs"): X_j is input channel j over the
//              calibration tokens (quant/calibration.h's sum of squares)
// and the lowest scores are set to zero within each comparison group:
//   row     each output row (Wanda's choice: its scores only compare within a row)
//   matrix  each weight matrix (the Wanda paper's magnitude baseline)
//   global  every matrix of the model together
// or, with an N:M pattern (2:4, 4:8), the M - N lowest of every M consecutive
// inputs of a row. Equal scores are pruned in position order (row-major, then
// layer and target order), so the count is exact and the result deterministic.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/weights.h"
#include "quant/calibration.h"

namespace loom {

enum class PruneMethod { magnitude, wanda };
enum class PruneScope { row, matrix, global };
PruneMethod prune_method_from_name(const std::string& name);  // throws invalid_input
const char* prune_method_name(PruneMethod m);
PruneScope prune_scope_from_name(const std::string& name);  // throws invalid_input
const char* prune_scope_name(PruneScope s);

struct PruneSpec {
  PruneMethod method = PruneMethod::magnitude;
  double sparsity = 0.5;  // the fraction set to zero (unstructured)
  int n = 0, m = 0;       // an N:M pattern when m > 0 (sparsity and scope then unused)
  PruneScope scope = PruneScope::row;
  bool pattern() const { return m > 0; }
  // "50% per row" or "2:4".
  std::string describe() const;
};

// One pruned matrix: its zeros after pruning (those it had before included).
struct PruneReport {
  int64_t layer = 0;
  LoraTarget target = LoraTarget::q;
  int64_t zeros = 0, total = 0;
};

// Zeroes w's linear weights in place. They must be f32 (make_weights_mutable).
// `stats` gives wanda's activation norms (null for magnitude). Throws
// invalid_input for a sparsity outside [0, 1), a pattern that is not
// 0 < N < M or whose M does not divide every matrix's rows, or wanda without
// statistics.
std::vector<PruneReport> prune_weights(ThreadPool& pool, ModelWeights& w, const ModelConfig& c, const PruneSpec& spec,
                                       const CalibrationStats* stats);

// The building blocks, for tests.
// Zeroes w[i] for the k lowest scores[i] of a row of n, equal scores in index order.
void prune_lowest_in_row(const float* scores, float* w, int64_t n, int64_t k);
// Zeroes the M - N lowest of every M consecutive elements (n a multiple of M).
void prune_n_of_m_in_row(const float* scores, float* w, int64_t n, int N, int M);

// Fills out[0, n) with the scores of elements [i0, i0 + n) of segment s.
using ScoreFill = std::function<void(int64_t s, int64_t i0, int64_t n, float* out)>;
// Zeroes segments[s][i] for the k lowest scores over all segments together
// (ties in segment, then index order). A radix select over the scores' bits in
// a few passes, so nothing of the scores' size is held (global scope of a 70B
// model). Scores must not be negative.
void prune_lowest_over_segments(ThreadPool& pool, std::span<float* const> segments, std::span<const int64_t> sizes,
                                const ScoreFill& fill, int64_t k);

}  // namespace loom

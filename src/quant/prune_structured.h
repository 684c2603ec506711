// Structured pruning: removing whole units so that the model gets smaller and
// faster, with a config that says so (transformers and llama.cpp load it as an
// ordinary, smaller Llama):
//   heads     query heads, the same number from every layer. With grouped
//             query attention the groups must stay equal: the same number is
//             removed from each KV group, or, when the count asked is a
//             multiple of the group size and not of the group count, whole KV
//             groups (a KV head with its query heads) go;
//   channels  SwiGLU channels (rows of gate and up, columns of down), the same
//             number from every layer, the kept count a multiple of 32 so the
//             rows still split into quantization blocks;
//   layers    whole decoder layers.
// What is removed is the least important by the calibration text (FLAP- and
// Wanda-style scores of a unit's output, ShortGPT's for layers):
//   head h     ||X_o[h]||_2 * ||W_o[:, h]||_F: the head's slice of o's input
//              over the calibration tokens, times o's columns that read it;
//   channel k  ||X_down[k]||_2 * ||W_down[:, k]||_2;
//   layer l    Block Influence, 1 - mean cos(residual in, residual out).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"
#include "quant/calibration.h"

namespace loom {

struct StructuredSpec {
  double heads = 0;     // fraction of query heads to remove
  double channels = 0;  // fraction of SwiGLU channels to remove
  int64_t layers = 0;   // decoder layers to remove
  bool any() const { return heads > 0 || channels > 0 || layers > 0; }
};

struct StructuredReport {
  int64_t heads_before = 0, heads_after = 0, kv_heads_before = 0, kv_heads_after = 0;
  int64_t intermediate_before = 0, intermediate_after = 0;
  std::vector<int64_t> removed_layers;  // original indices, ascending
  // Per original layer, the query heads and SwiGLU channels kept (original
  // indices, ascending; empty when that kind was not pruned).
  std::vector<std::vector<int64_t>> kept_heads, kept_channels;
  std::string heads_how;                // "1 of 3 per KV group", "1 whole KV group", or empty
};

// How many query heads per KV group and whole KV groups remove a fraction
// `heads` of n_heads: {per_group, groups}, at most one of them non-zero (the
// nearest count the grouping allows, at least one head when heads > 0).
// Throws invalid_input when nothing but every head would do.
std::pair<int64_t, int64_t> head_removal_plan(const ModelConfig& c, double heads);

// Removes the least important units from `w` (its seven matrices f32, as
// make_weights_mutable leaves them) and updates `c` to the new shapes. The new
// matrices and vectors live in w.owned. Throws invalid_input for fractions
// outside [0, 1), too many layers, or statistics that do not fit.
StructuredReport prune_structure(ModelWeights& w, ModelConfig& c, const StructuredSpec& spec,
                                 const CalibrationStats& stats);

}  // namespace loom

// Pipeline parallelism's cut of a model: stage s of S holds the decoder layers
// [s L / S, (s+1) L / S); stage 0 also the token embedding, the last stage the
// final norm and the output matrix (with tied embeddings that is the token
// embedding again). Whatever a stage does not hold is unbound (empty views):
// never quantized, dequantized, prepared for a backend or transposed, so only
// the file pages of the stage's own tensors are ever read.
#pragma once

#include <cstdint>
#include <string>

#include "model/weights.h"

namespace loom {

struct PipelineStage {
  int index = 0;  // s
  int count = 1;  // S
};

// The decoder layers [first, last) of a stage.
struct LayerSpan {
  int64_t first = 0, last = 0;
};

// Stage s's layers of a model of `n_layers`. Throws invalid_input when the
// stage count is below 1 or above the layer count (a stage without a layer).
LayerSpan pipeline_stage_layers(int64_t n_layers, PipelineStage s);

// Unbinds what stage `s` does not hold (`w` bound, nothing prepared yet).
// Throws invalid_input naming `source` (the model) when the stages outnumber its layers.
void keep_stage_weights(ModelWeights& w, PipelineStage s, const std::string& source);

}  // namespace loom

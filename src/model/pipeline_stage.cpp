// Cutting a bound model down to one pipeline stage's weights.
#include "model/pipeline_stage.h"

#include "core/error.h"

namespace loom {

LayerSpan pipeline_stage_layers(int64_t n_layers, PipelineStage s) {
  if (s.count < 1 || s.count > n_layers)
    fail(ErrorKind::invalid_input,
         "pipeline parallel: {} stages for a model of {} layers (each stage needs a layer)", s.count,
         n_layers);
  LOOM_ASSERT(0 <= s.index && s.index < s.count);
  return {s.index * n_layers / s.count, (s.index + 1) * n_layers / s.count};
}

void keep_stage_weights(ModelWeights& w, PipelineStage s, const std::string& source) {
  LOOM_ASSERT(w.prepared.empty());  // before prepare_weights
  const auto L = static_cast<int64_t>(w.layers.size());
  if (s.count > L)
    fail(ErrorKind::invalid_input,
         "{}: {} pipeline stages for a model of {} layers (each stage needs a layer)", source, s.count, L);
  const LayerSpan span = pipeline_stage_layers(L, s);
  for (int64_t l = 0; l < L; ++l)
    if (l < span.first || l >= span.last) w.layers[static_cast<size_t>(l)] = LayerWeights{};
  if (span.first > 0) w.token_embd = Tensor{};
  if (span.last < L) {
    w.output = Tensor{};
    w.output_norm = nullptr;
  }
}

}  // namespace loom

// Full fine-tuning under pipeline parallel (dist.pp, model/pipeline_stage.h):
// each stage trains, and keeps AdamW's moments for, only the f32 tensors it
// holds. A tied embedding is held twice (the first stage embeds, the last
// projects onto it): the two copies sum their gradients so that they take the
// same updates. At the end rank 0 puts the whole model together to write it.
#pragma once

#include <span>
#include <vector>

#include "dist/communicator.h"
#include "model/config.h"
#include "model/weights.h"

namespace loom {

// The first and the last stage of `pp` add each other's `tied` gradients (the
// stage's copy of a tied embedding; empty on the other stages, which return
// at once): both end with first + last, the same bits. Every stage calls it.
void sum_tied_embedding_grads(Communicator& pp, std::span<float> tied);

// Rank 0 of `pp` (stage 0) binds the tensors the other stages hold (their
// layers, the final norm, the output matrix unless tied to the embedding) to
// f32 copies of their values, received into `store`, so that `w` is the whole
// model's; the other stages send theirs. A collective of every stage of `pp`.
void gather_full_pipeline(Communicator& pp, ModelWeights& w, const ModelConfig& c,
                          std::vector<std::vector<float>>& store);

}  // namespace loom

// Applying a PEFT LoRA adapter at load by merging W' = W + scale * B A into f32
// copies of the adapted matrices only (`--adapter` of generate and chat, `loom
// merge`; export is model/hf_export.h).
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "model/config.h"
#include "model/peft_adapter.h"
#include "model/weights.h"

namespace loom {

// Replaces the view of every adapted matrix of `w` by an f32 copy (held in
// w.owned) with scale * B A added; other matrices stay as they are. Call before
// pack_weights. `permute_qk`: the model stores q/k rows in RoPE-interleaved
// order (GGUF llama, lora_needs_qk_permutation), so the HF-order B of q and k is
// row-permuted first. Throws invalid_input naming `what` and the tensor when the
// adapter does not fit the model. A model with unstructured pruning
// (c.unstructured_pruning) keeps its zeros: they stay zero in the merged weights.
void merge_adapter(ModelWeights& w, const ModelConfig& c, const peft::AdapterTensors& a, bool permute_qk,
                   std::string_view what = "adapter");

// w [out, in] += scale * B A, each element summed in double over k in order
// and rounded once: the one merge arithmetic, so that a merged weight has the
// same bits wherever it is made (loom merge / export, quantization-aware
// training). Returns the first row with a non-finite value, or -1.
int64_t merge_lora_rows(float* w, const float* b, const float* a, int64_t out, int64_t r, int64_t in, double scale);

// A Model::LoadOptions::before_pack hook that reads the adapter folder `dir`
// (when the model is loaded) and merges it; errors name the folder.
std::function<void(ModelWeights&, const ModelConfig&)> adapter_merge_hook(std::string dir);

}  // namespace loom

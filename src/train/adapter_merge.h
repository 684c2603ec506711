// Applying a PEFT LoRA adapter at load by merging W' = W + scale * B A into f32
// copies of the adapted matrices only, and exporting a loaded (possibly merged)
// model as a Hugging Face folder (`loom merge`).
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "io/file_write.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "train/peft_adapter.h"

namespace loom {

class Model;

// Replaces the view of every adapted matrix of `w` by an f32 copy (held in
// w.owned) with scale * B A added; other matrices stay as they are. Call before
// pack_weights. `permute_qk`: the model stores q/k rows in RoPE-interleaved
// order (GGUF llama, lora_needs_qk_permutation), so the HF-order B of q and k is
// row-permuted first. Throws invalid_input naming `what` and the tensor when the
// adapter does not fit the model.
void merge_adapter(ModelWeights& w, const ModelConfig& c, const peft::AdapterTensors& a, bool permute_qk,
                   std::string_view what = "adapter");

// A Model::LoadOptions::before_pack hook that reads the adapter folder `dir`
// (when the model is loaded) and merges it; errors name the folder.
std::function<void(ModelWeights&, const ModelConfig&)> adapter_merge_hook(std::string dir);

// Writes the folder `out_dir` as a whole (write_folder_atomic, io/file_write.h:
// a crash leaves the old folder or the new one; a non-empty folder that is not
// a loom/PEFT output is refused unless opt.overwrite) as a Hugging Face folder: config.json,
// generation_config.json, model.safetensors (every tensor dequantized, HF
// names, HF q/k row order; `dtype` F32, BF16 or F16), and copies
// tokenizer.json / tokenizer_config.json when the model is an HF folder, or
// writes them from a GGUF model's tokenizer (tokenizer/tokenizer_export.h).
// The model must have been loaded unpacked or packed, either is fine.
// Throws unsupported for what a config.json cannot express (e.g. a GGUF
// rope_freqs table that does not match the config's RoPE frequencies).
void write_hf_folder(const Model& model, const std::string& out_dir, safetensors::StDType dtype,
                     const FolderWriteOptions& opt = {});

}  // namespace loom

// Exporting a loaded (possibly adapter-merged or fully fine-tuned) model as a
// Hugging Face folder: `loom merge` and `loom train` with method: full.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/file_write.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"

namespace loom {

class Model;

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

// What a quantized export changes (quant/: compressed-tensors folders).
struct HfExportHooks {
  // Called for the seven linear weights of every layer with the module's HF
  // name ("model.layers.0.self_attn.q_proj") and its f32 values in HF row
  // order; adds the module's tensors (e.g. "<module>.weight" as int8 and
  // "<module>.weight_scale") to `st` in place of the plain weight.
  std::function<void(const std::string& module, std::vector<float>& w, int64_t rows, int64_t cols,
                     safetensors::Writer& st)> linear;
  // Added to config.json as "quantization_config" when not null.
  nlohmann::ordered_json quantization_config;
};
void write_hf_folder(const Model& model, const std::string& out_dir, safetensors::StDType dtype,
                     const FolderWriteOptions& opt, const HfExportHooks& hooks);

}  // namespace loom

// Hugging Face folders that NVIDIA ModelOpt exported in NVFP4 (quant_algo
// "NVFP4" or "W4A16_NVFP4": config.json's quantization_config with quant_method
// "modelopt", or, in older exports, hf_quant_config.json with producer
// "modelopt"). Each quantized linear layer is stored as
//   <module>.weight          U8 [out, in / 2]: E2M1 codes, two per byte (the
//                            even column in the low nibble)
//   <module>.weight_scale    F8_E4M3 [out, in / 16]: one scale per 16 columns
//   <module>.weight_scale_2  F32 (one value): the per-tensor scale
//   <module>.input_scale     F32: the activations' FP4 scale (not used: loom's
//                            activations are 8-bit integers, as llama.cpp's)
// so that a weight is e2m1 * e4m3 * weight_scale_2. The codes and block scales
// are repacked, bit for bit, into loom's nvfp4 blocks (GGUF's NVFP4 layout, as
// llama.cpp's convert_hf_to_gguf.py repacks them), and weight_scale_2 becomes
// the projection's output scale (LayerWeights::out_scale). Modules the export
// left unquantized (exclude_modules: lm_head, ...) are read as they are.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace loom {

class HfFolder;

struct ModelOptQuantConfig {
  std::string quant_algo;  // "NVFP4" or "W4A16_NVFP4"
  std::string source;      // the file that said so, for errors
};

// nullopt when the folder is not a ModelOpt export. Another ModelOpt algorithm
// (FP8, INT4_AWQ, mixed precision, ...) or a group size other than 16 raises
// unsupported naming the file and key.
std::optional<ModelOptQuantConfig> modelopt_quant_config(const nlohmann::json& config,
                                                         const std::string& config_path,
                                                         const std::string& dir);

// Every NVFP4 weight of the folder (U8 "<module>.weight" with a
// "<module>.weight_scale" beside it) as an nvfp4 Tensor [out, in] whose blocks
// live in `store`. Errors name the shard file and tensor (wrong dtypes or
// shapes, a row width that is not a multiple of 64, the block of 64 NVFP4 is
// stored in).
std::map<std::string, Tensor, std::less<>> load_modelopt_weights(const HfFolder& hf,
                                                                 const ModelOptQuantConfig& qc,
                                                                 std::vector<std::vector<uint8_t>>& store);

}  // namespace loom

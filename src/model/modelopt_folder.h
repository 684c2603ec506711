// Hugging Face folders that NVIDIA ModelOpt exported in NVFP4 (quant_algo
// "NVFP4" or "W4A16_NVFP4") or FP8 ("FP8"): config.json's quantization_config
// with quant_method "modelopt", or, in older exports, hf_quant_config.json with
// producer "modelopt". An NVFP4 linear layer is stored as
//   <module>.weight          U8 [out, in / 2]: E2M1 codes, two per byte (the
//                            even column in the low nibble)
//   <module>.weight_scale    F8_E4M3 [out, in / 16]: one scale per 16 columns
//   <module>.weight_scale_2  F32 (one value): the per-tensor scale
//   <module>.input_scale     F32: the activations' FP4 scale (not used: loom's
//                            activations are 8-bit integers, as llama.cpp's)
// so that a weight is e2m1 * e4m3 * weight_scale_2. The codes and block scales
// are repacked, bit for bit, into loom's nvfp4 blocks (GGUF's NVFP4 layout, as
// llama.cpp's convert_hf_to_gguf.py repacks them), and weight_scale_2 becomes
// the projection's output scale (LayerWeights::out_scale). An FP8 one is
//   <module>.weight          F8_E4M3 [out, in]
//   <module>.weight_scale    F32 (one value): weight = e4m3 * weight_scale
//   <module>.input_scale     F32 (not used)
// widened to f16 (every E4M3 value is an f16, so the matrix is exact; twice the
// bytes of the file), weight_scale its output scale. Modules the export left
// unquantized (exclude_modules: lm_head, ...) are read as they are.
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
  std::string quant_algo;  // "NVFP4", "W4A16_NVFP4" or "FP8"
  std::string source;      // the file that said so, for errors
  bool fp8() const { return quant_algo == "FP8"; }
};

// nullopt when the folder is not a ModelOpt export. Another ModelOpt algorithm
// (INT4_AWQ, W4A8_AWQ, mixed precision, ...) or an NVFP4 group size other than
// 16 raises unsupported naming the file and key.
std::optional<ModelOptQuantConfig> modelopt_quant_config(const nlohmann::json& config,
                                                         const std::string& config_path,
                                                         const std::string& dir);

// Every quantized weight of the folder ("<module>.weight" with a
// "<module>.weight_scale" beside it): NVFP4 as an nvfp4 Tensor [out, in], FP8
// as an f16 one (exact), their bytes in `store`; and beside each its per-tensor
// scale as "<module>.output_scale", a one-element f32 tensor, which the binder
// makes the projection's output scale (model/weights.h). Errors name the shard
// file and tensor (wrong dtypes or shapes, an NVFP4 row width that is not a
// multiple of 64, the block of 64 NVFP4 is stored in; per-channel FP8 scales;
// an FP8 NaN).
std::map<std::string, Tensor, std::less<>> load_modelopt_weights(const HfFolder& hf,
                                                                 const ModelOptQuantConfig& qc,
                                                                 std::vector<std::vector<uint8_t>>& store);

}  // namespace loom
